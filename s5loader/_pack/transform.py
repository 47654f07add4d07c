"""``pack(transform=fn)``: a user function run on each sample while it is packed, in worker
processes, its output written into the shard in the plan's order.

``fn`` takes the sample as a dict (``{"__key__": "train/0001", "jpg": b"...", "cls": b"3"}``:
the fields' bytes as the shard would hold them) and returns the fields to write instead (``{"jpg":
b"...", "txt": "a caption", "cls": 3}``: bytes, ``str`` as UTF-8, ``int``/``float`` as their
decimal text). It runs in a pool of processes forked before the pack's transfers begin; each
sample is sent to them with ``fn`` by name, so ``fn`` must be importable (a module-level
function, as for a DataLoader with ``spawn``); it is forked from the process that calls
``pack()``, so a process whose other threads hold locks the function needs (a logging handler,
an OpenMP pool) should call ``pack()`` before starting them. Per shard being built (two at
once), at most twice as many groups of samples as processes are in flight (a group: up to 16
samples or 4 MiB), each held in memory only: the
staged files of a sample are deleted as soon as it is read, so the disk holds what it holds
without a transform. The function's name (module and
qualified name) is part of the pack's plan: a rerun with the same function continues the pack
and makes the same shards, byte for byte, where the function is deterministic; another function
is another pack.
"""

from __future__ import annotations

import collections
import importlib
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from .._util.platform import die_with_parent
from ..exceptions import ConfigError

Transform = Callable[[dict[str, Any]], dict[str, Any]]

GROUP = 16  # samples sent to a worker in one task, at most ...
GROUP_BYTES = 4 << 20  # ... or about this many of their bytes


def transform_name(fn: Transform) -> str:
    """``module:qualname`` of ``fn``, which names it in the plan and in worker processes.

    Raises:
        ConfigError: ``fn`` is not a function a worker process can import by name (a lambda,
            a nested function, a bound method of an object, a callable instance).
    """
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not callable(fn) or not module or not qual or "<" in qual:
        raise ConfigError(
            f"transform must be a module-level function (it runs in worker processes, which import "
            f"it by name), got {fn!r}"
        )
    return f"{module}:{qual}"


def load_transform(spec: str) -> Transform:
    """The function ``module:function`` (the CLI's ``--transform``), imported.

    Raises:
        ConfigError: no such module or function, or not callable.
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"--transform takes MODULE:FUNCTION (such as mypkg.prep:resize), got {spec!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--transform {spec}: {exc} (is its module on PYTHONPATH?)") from exc
    if not callable(obj):
        raise ConfigError(f"--transform {spec}: {obj!r} is not callable")
    return obj  # type: ignore[no-any-return]


def _as_bytes(value: Any, key: str, field: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value).encode()
    raise ConfigError(
        f"the transform returned {type(value).__name__} for the field {field!r} of sample {key!r}: "
        "fields are bytes, str, int or float"
    )


def apply(fn: Transform, sample: dict[str, Any]) -> list[tuple[str, bytes]]:
    """``fn(sample)`` as ``(field, bytes)`` pairs in field order (in a worker process).

    Raises:
        ConfigError: ``fn`` returned no dict, a field name that is not a non-empty string, or
            a value that is not bytes, str, int or float.
    """
    key = sample["__key__"]
    out = fn(sample)
    if not isinstance(out, dict):
        raise ConfigError(f"the transform returned {type(out).__name__} for sample {key!r}: a dict of fields")
    fields = []
    for field, value in out.items():
        if field == "__key__":
            continue  # the key is the plan's: a sample keeps its place and name
        if not isinstance(field, str) or not field:
            raise ConfigError(f"the transform returned the field name {field!r} for sample {key!r}")
        fields.append((field, _as_bytes(value, key, field)))
    if not fields:
        raise ConfigError(f"the transform returned no field for sample {key!r}")
    return sorted(fields)


def apply_all(fn: Transform, samples: list[dict[str, Any]]) -> list[list[tuple[str, bytes]] | BaseException]:
    """:func:`apply` on each of ``samples`` (in a worker process): its fields, or the exception
    it raised, so that the others of the group still come back."""
    out: list[list[tuple[str, bytes]] | BaseException] = []
    for sample in samples:
        try:
            out.append(apply(fn, sample))
        except Exception as exc:  # noqa: BLE001 - raised again in the pack, naming the sample
            out.append(exc)
    return out


def _ready() -> bool:  # pragma: no cover - runs in a worker
    return True


def _die_with(parent: int) -> None:  # pragma: no cover - runs in a worker as it starts
    """A worker ends with the pack that forked it, killed included (``PR_SET_PDEATHSIG``)."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the pack ended before the line above
        os._exit(0)


class SampleTransform:
    """A pool of ``processes`` worker processes that run ``fn`` on samples, in order.

    Made before the pack starts its threads: the workers are forked at once (a fork costs
    milliseconds where a fresh interpreter would import s5loader and torch again), from a
    process that runs no transfer yet. :meth:`close` stops them; safe to call twice.
    """

    def __init__(self, fn: Transform, processes: int) -> None:
        self.fn = fn
        self.name = transform_name(fn)
        self.processes = max(1, processes)
        self._owner = os.getpid()
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            self.processes,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_die_with,
            initargs=(os.getpid(),),
        )
        self._pool.submit(_ready).result()  # every worker forked now (Python forks them together)

    def _get(self) -> ProcessPoolExecutor:
        if self._pool is None:
            raise RuntimeError("the transform's workers were stopped")
        return self._pool

    def run(
        self, samples: Iterable[tuple[Any, dict[str, Any]]]
    ) -> Iterator[tuple[Any, list[tuple[str, bytes]]]]:
        """``(tag, fn(sample))`` for each ``(tag, sample)``, in order. Samples go to the workers
        in groups of up to :data:`GROUP` samples or :data:`GROUP_BYTES` (one task each: a task's
        round trip costs about as much as a small sample's work), at most twice as many groups
        in flight as there are processes. An exception of ``fn`` is raised here with a note that
        names the sample."""
        pool = self._get()
        pending: collections.deque[tuple[list[tuple[Any, str]], Future[list[Any]]]] = collections.deque()
        group: list[tuple[Any, dict[str, Any]]] = []
        size = 0

        def send() -> None:
            nonlocal group, size
            tags = [(tag, sample["__key__"]) for tag, sample in group]
            pending.append((tags, pool.submit(apply_all, self.fn, [sample for _, sample in group])))
            group, size = [], 0

        def first() -> Iterator[tuple[Any, list[tuple[str, bytes]]]]:
            tags, fut = pending.popleft()
            for (tag, key), got in zip(tags, fut.result(), strict=True):
                if isinstance(got, BaseException):
                    if hasattr(got, "add_note"):
                        got.add_note(f"in the pack's transform {self.name} of sample {key!r}")
                    raise got
                yield tag, got

        try:
            for tag, sample in samples:
                group.append((tag, sample))
                size += sum(len(v) for v in sample.values() if isinstance(v, (bytes, bytearray)))
                if len(group) >= GROUP or size >= GROUP_BYTES:
                    send()
                    if len(pending) >= 2 * self.processes:
                        yield from first()
            if group:
                send()
            while pending:
                yield from first()
        finally:
            for _, fut in pending:
                fut.cancel()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and os.getpid() == self._owner:
            pool.shutdown(wait=True, cancel_futures=True)
