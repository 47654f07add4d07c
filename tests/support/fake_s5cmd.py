"""A stand-in for the s5cmd binary over a local folder (``$FAKE_S3_ROOT/BUCKET/KEY``), for unit
and property tests of the engine without a server. It speaks the same command-file syntax and
``--json`` output as s5cmd for what s5loader uses: ``ls``, ``run`` with ``cp [--raw]``."""

import glob
import json
import os
import shlex
import shutil
import sys

ROOT = os.environ["FAKE_S3_ROOT"]


def local(uri: str) -> str:
    return os.path.join(ROOT, uri[5:])


def cp(args: list[str]) -> bool:
    raw = "--raw" in args
    if "--exclude" in args:
        i = args.index("--exclude")
        args = args[:i] + args[i + 2 :]
    src, dst = [a for a in args if a != "--raw"]
    if raw or "*" not in src:
        matches = [local(src)] if os.path.isfile(local(src)) else []
        targets = [dst]
    else:
        base = src[: src.rfind("/", 0, src.index("*")) + 1]
        matches = sorted(p for p in glob.glob(local(src), recursive=False) if os.path.isfile(p))
        matches += [p for p in glob.glob(local(src) + "/**", recursive=True) if os.path.isfile(p)]
        targets = [os.path.join(dst, p[len(local(base)) :]) for p in matches]
    if not matches:
        print(
            json.dumps(
                {
                    "operation": "cp",
                    "command": f"cp {src} {dst}",
                    "error": "NoSuchKey: not found status code: 404",
                }
            ),
            file=sys.stderr,
        )
        return False
    for m, t in zip(matches, targets, strict=True):
        os.makedirs(os.path.dirname(t), exist_ok=True)
        shutil.copyfile(m, t + ".tmp")
        os.rename(t + ".tmp", t)
        print(
            json.dumps(
                {"operation": "cp", "success": True, "source": "s3://" + m[len(ROOT) + 1 :], "destination": t}
            )
        )
    return True


def main(argv: list[str]) -> int:
    while argv and argv[0].startswith("--"):
        argv = (
            argv[2:]
            if argv[0]
            in (
                "--retry-count",
                "--endpoint-url",
                "--numworkers",
                "--profile",
                "--credentials-file",
                "--request-payer",
            )
            else argv[1:]
        )
    cmd, rest = argv[0], argv[1:]
    if cmd == "ls":
        prefix = local(rest[0].rstrip("*"))
        found = sorted(p for p in glob.glob(prefix + "**", recursive=True) if os.path.isfile(p))
        for p in found:
            print(
                json.dumps(
                    {
                        "key": "s3://" + p[len(ROOT) + 1 :],
                        "type": "file",
                        "size": os.path.getsize(p),
                        "etag": "",
                    }
                )
            )
        if not found:
            print(json.dumps({"operation": "ls", "error": "no object found"}), file=sys.stderr)
            return 1
        return 0
    if cmd == "run":
        ok = True
        with open(rest[0]) as f:
            for line in f:
                args = shlex.split(line)
                if args and args[0] == "cp":
                    ok = cp(args[1:]) and ok
        return 0 if ok else 1
    return 2


sys.exit(main(sys.argv[1:]))
