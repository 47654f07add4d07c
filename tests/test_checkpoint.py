"""Checkpoints to and from S3: byte-exact round trips, streaming when staging has no room,
interrupted saves that leave nothing behind, and torch.distributed.checkpoint over two ranks.

A private module (``s5loader._largeobj``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest
import torch
from support.faults import FaultProxy, Rule
from support.stores import Store, free_port, mount_tmpfs
from support.waits import wait_for

from s5loader import ObjectNotFoundError, S3URIError, StagingSpaceError, checkpoint

MiB = 1024**2


def state_dict(scale: int = 1) -> dict:
    g = torch.Generator().manual_seed(scale)
    return {
        "model": {
            "w": torch.randn(512, 1024 * scale, generator=g),  # 2 MiB per scale
            "b": torch.randn(1024, generator=g).to(torch.bfloat16),
            "idx": torch.randint(0, 1 << 40, (4096,), generator=g),
            "mask": torch.rand(333, generator=g) > 0.5,
        },
        "optim": {"step": 1000, "lr": [0.1, 0.01]},
        "name": "run1",
    }


def assert_same(a: object, b: object) -> None:
    """Tensor by tensor: dtype, shape and every byte."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def pending_uploads(store: Store, key: str) -> list[str]:
    ups = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=key).get("Uploads", [])
    return [u["UploadId"] for u in ups if u["Key"] == key]


def object_exists(store: Store, key: str) -> bool:
    return store.client.list_objects_v2(Bucket=store.bucket, Prefix=key).get("KeyCount", 0) > 0


@contextlib.contextmanager
def failing_part(store: Store, number: int) -> Iterator[None]:
    """Multipart uploads to ``store`` break off at part ``number`` inside the block."""
    from s5loader._largeobj.multipart import transfer_client

    events = transfer_client(store.endpoint).meta.events

    def fail(request: object, **kwargs: object) -> None:
        if getattr(request, "url", "").endswith(f"partNumber={number}"):
            raise ConnectionAbortedError(f"part {number} broke off")

    events.register("before-send.s3.UploadPart", fail)
    try:
        yield
    finally:
        events.unregister("before-send.s3.UploadPart", fail)


@pytest.fixture
def small_fs() -> Iterator[str]:
    """A 4 MiB tmpfs made for the test."""
    with mount_tmpfs("4m", "s5loader-smallfs-") as d:
        yield d


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_is_byte_exact(store: Store, tmp_path, stream: bool) -> None:
    sd = state_dict(scale=3)  # about 6.5 MiB: two 5 MiB parts, a multipart upload
    uri = store.uri("run1/step-1000.pt")
    stage = str(tmp_path / "stage")
    checkpoint.save(sd, uri, endpoint_url=store.endpoint, staging_dir=stage, stream=stream, part_size="5MiB")
    head = store.client.head_object(Bucket=store.bucket, Key=store.prefix + "run1/step-1000.pt")
    assert head["ETag"].strip('"').endswith("-2")  # went up in parallel parts
    for load_stream in (False, True):
        got = checkpoint.load(uri, endpoint_url=store.endpoint, staging_dir=stage, stream=load_stream)
        assert_same(sd, got)
    assert os.listdir(stage) == []  # staged files and directories removed
    assert pending_uploads(store, store.prefix + "run1/step-1000.pt") == []


def test_load_options_and_errors(moto: Store, tmp_path) -> None:
    uri = moto.uri("ck.pt")
    checkpoint.save({"t": torch.arange(6).reshape(2, 3)}, uri, endpoint_url=moto.endpoint)
    got = checkpoint.load(uri, map_location="cpu", endpoint_url=moto.endpoint, staging_dir=str(tmp_path))
    assert torch.equal(got["t"], torch.arange(6).reshape(2, 3))
    checkpoint.save({"obj": ValueError("boom")}, uri, endpoint_url=moto.endpoint)
    with pytest.raises(Exception, match="Weights only load failed"):  # torch's default safety kept
        checkpoint.load(uri, endpoint_url=moto.endpoint)
    assert isinstance(checkpoint.load(uri, weights_only=False, endpoint_url=moto.endpoint)["obj"], ValueError)
    with pytest.raises(ObjectNotFoundError, match=moto.uri("missing.pt")):
        checkpoint.load(moto.uri("missing.pt"), endpoint_url=moto.endpoint)
    with pytest.raises(S3URIError, match="names no object"):
        checkpoint.save({}, "s3://data/prefix/", endpoint_url=moto.endpoint)


def test_streams_when_staging_has_no_room(
    moto: Store, small_fs: str, caplog: pytest.LogCaptureFixture
) -> None:
    sd = state_dict(scale=2)
    uri = moto.uri("big.pt")
    with caplog.at_level("INFO", logger="s5loader"):
        checkpoint.save(sd, uri, endpoint_url=moto.endpoint, staging_dir=small_fs, part_size="5MiB")
    assert "streaming" in caplog.text
    with pytest.raises(StagingSpaceError, match=r"needs [\d.]+ MiB .* free in " + small_fs) as e:
        checkpoint.save(sd, uri, endpoint_url=moto.endpoint, staging_dir=small_fs, stream=False)
    assert uri in str(e.value)
    assert_same(
        sd, checkpoint.load(uri, endpoint_url=moto.endpoint, staging_dir=small_fs)
    )  # read into memory
    with pytest.raises(StagingSpaceError, match=r"loading this checkpoint needs [\d.]+ MiB") as e:
        checkpoint.load(uri, endpoint_url=moto.endpoint, staging_dir=small_fs, stream=False)
    assert uri in str(e.value)
    assert os.listdir(small_fs) == []


def test_disk_filling_up_while_staging_is_a_space_error(moto: Store, small_fs: str) -> None:
    # Plain Python numbers: the size estimate sees almost nothing, torch.save writes ~7 MB.
    obj = {"numbers": list(range(1_500_000))}
    with pytest.raises(StagingSpaceError, match=moto.uri("py.pt")):
        checkpoint.save(
            obj, moto.uri("py.pt"), endpoint_url=moto.endpoint, staging_dir=small_fs, stream=False
        )
    assert os.listdir(small_fs) == []
    assert not object_exists(moto, moto.prefix + "py.pt")
    # streamed (the default), the estimate only sizes the parts: ~7 MB in two 5 MiB parts
    checkpoint.save(obj, moto.uri("py.pt"), endpoint_url=moto.endpoint, staging_dir=small_fs)
    assert checkpoint.load(moto.uri("py.pt"), endpoint_url=moto.endpoint) == obj
    assert os.listdir(small_fs) == []


def test_streamed_save_in_many_parts_and_parallel_ranged_load(store: Store) -> None:
    from s5loader._largeobj.multipart import transfer_client

    sd = state_dict(scale=8)  # about 16.5 MiB: four 5 MiB parts up, four ranged GETs down
    uri = store.uri("many-parts.pt")
    sent: list[dict[str, str]] = []

    def headers(request: object, **kwargs: object) -> None:
        sent.append(
            {
                k.lower(): v.decode() if isinstance(v, bytes) else str(v)
                for k, v in getattr(request, "headers", {}).items()
            }
        )

    events = transfer_client(store.endpoint).meta.events
    events.register("before-send.s3.UploadPart", headers)
    try:
        checkpoint.save(sd, uri, endpoint_url=store.endpoint, part_size="5MiB", concurrency=3)
    finally:
        events.unregister("before-send.s3.UploadPart", headers)
    assert len(sent) == 4
    # the parts' bytes are not read again to sign or checksum them (the store accepts that)
    assert all(h["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD" for h in sent)
    assert not any(k.startswith("x-amz-checksum") for h in sent for k in h)
    head = store.client.head_object(Bucket=store.bucket, Key=store.prefix + "many-parts.pt")
    assert head["ETag"].strip('"').endswith("-4")
    assert_same(sd, checkpoint.load(uri, endpoint_url=store.endpoint, part_size="5MiB", concurrency=3))
    assert pending_uploads(store, store.prefix + "many-parts.pt") == []


def test_parallel_ranged_read_is_byte_exact_and_checks_the_etag(store: Store) -> None:
    from s5loader._largeobj.parts import plan_parts
    from s5loader._largeobj.ranged import read_into
    from s5loader.exceptions import FetchError

    data = os.urandom(11 * MiB + 12345)
    key = store.prefix + "raw.bin"
    store.client.put_object(Bucket=store.bucket, Key=key, Body=data)
    etag = store.client.head_object(Bucket=store.bucket, Key=key)["ETag"].strip('"')
    plan = plan_parts(len(data), part_size=5 * MiB, concurrency=3)
    assert (plan.parts, plan.concurrency) == (3, 3)
    buf = memoryview(bytearray(len(data)))
    read_into(store.uri("raw.bin"), store.endpoint, buf, etag=etag, plan=plan)
    assert buf == data
    # an ETag that is not the object's: the object changed since the HEAD
    with pytest.raises(FetchError, match="changed while it was read"):
        read_into(
            store.uri("raw.bin"), store.endpoint, memoryview(bytearray(len(data))), etag="0" * 32, plan=plan
        )


def _mapped_checkpoints() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:s5loader-checkpoint" in line for line in f)


def test_mapped_load_is_byte_exact_and_freed_with_its_tensors(store: Store, tmp_path) -> None:
    sd = state_dict(scale=3)
    uri = store.uri("mapped.pt")
    checkpoint.save(sd, uri, endpoint_url=store.endpoint, part_size="5MiB")
    before = _mapped_checkpoints()
    got = checkpoint.load(uri, endpoint_url=store.endpoint, part_size="5MiB", stream=True, mmap=True)
    assert_same(sd, got)
    # the tensors are views of one in-memory file, not copies; it goes with the last of them
    assert _mapped_checkpoints() == before + 1
    got["model"]["w"].add_(1)  # a private mapping: writes stay in this process's tensors
    assert_same(sd, checkpoint.load(uri, endpoint_url=store.endpoint, mmap=True))
    del got
    gc.collect()
    assert _mapped_checkpoints() == before
    stage = str(tmp_path / "stage")  # staged: torch maps the staging file, removed at once
    assert_same(
        sd, checkpoint.load(uri, endpoint_url=store.endpoint, stream=False, staging_dir=stage, mmap=True)
    )
    assert os.listdir(stage) == []


def test_torch_reads_parts_as_they_arrive_and_a_failed_read_is_its_own_error(
    moto: Store, monkeypatch
) -> None:
    from s5loader._largeobj import transfer as _transfer
    from s5loader.exceptions import AccessDeniedError, FetchError

    sd = state_dict(scale=8)  # about 16 MiB: four 5 MiB parts
    uri = moto.uri("arriving.pt")
    checkpoint.save(sd, uri, endpoint_url=moto.endpoint, part_size="5MiB")
    size = moto.client.head_object(Bucket=moto.bucket, Key=moto.prefix + "arriving.pt")["ContentLength"]
    proxy = FaultProxy(moto.endpoint, [Rule("arriving.pt", "truncate", times=2)])
    try:  # bodies cut short are read again; torch waited for each part it read
        assert_same(sd, checkpoint.load(uri, endpoint_url=proxy.endpoint, part_size="5MiB", concurrency=1))
        ranges = [r[2]["range"] for r in proxy.requests if r[0] == "GET" and "arriving.pt" in r[1]]
        last = f"bytes={15 * MiB}-{size - 1}"  # the zip's directory first, then from the front
        assert ranges == [last] * 3 + [f"bytes={lo}-{lo + 5 * MiB - 1}" for lo in (0, 5 * MiB, 10 * MiB)]
        assert_same(sd, checkpoint.load(uri, endpoint_url=proxy.endpoint, part_size="5MiB", concurrency=4))
        # a part refused while torch.load reads (others under way): the read's error, naming the
        # object, mapped or not
        for mapped in (False, True):
            proxy.rules[:] = [Rule("arriving.pt", "pass", times=2), Rule("arriving.pt", "403")]
            with pytest.raises(AccessDeniedError, match=uri):
                checkpoint.load(
                    uri, endpoint_url=proxy.endpoint, part_size="5MiB", concurrency=2, mmap=mapped
                )
    finally:
        proxy.close()
    # an object replaced after its HEAD: each GET is conditional on the ETag it had
    real = _transfer.head_size
    monkeypatch.setattr(_transfer, "head_size", lambda u, a: (real(u, a)[0], "0" * 32))
    with pytest.raises(FetchError, match="changed while it was read"):
        checkpoint.load(uri, endpoint_url=moto.endpoint, part_size="5MiB")


LOADER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even in the background
from s5loader import checkpoint
uri, endpoint, mapped = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
checkpoint.load(uri, endpoint_url=endpoint, part_size="5MiB", concurrency=2, mmap=mapped)
print("finished")
"""


@pytest.mark.parametrize("mapped", [False, True])
def test_ctrl_c_while_a_load_waits_for_a_part_is_a_keyboard_interrupt(
    moto: Store, tmp_path, mapped: bool
) -> None:
    uri = moto.uri("interrupted-load.pt")
    checkpoint.save(state_dict(scale=8), uri, endpoint_url=moto.endpoint, part_size="5MiB")
    # the first part asked for arrives, the others are held: torch.load waits for one of them
    proxy = FaultProxy(
        moto.endpoint, [Rule("interrupted-load.pt", "pass", times=1), Rule("interrupted-load.pt", "hold")]
    )
    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    proc = subprocess.Popen(
        [sys.executable, str(script), uri, proxy.endpoint, "1" if mapped else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.wait_held("interrupted-load.pt", 1, timeout=60), proc.communicate()
        proc.send_signal(signal.SIGINT)  # a real Ctrl-C, delivered to a process that waits
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    assert "finished" not in out
    assert err.strip().splitlines()[-1] == "KeyboardInterrupt" and proc.returncode == -signal.SIGINT, err
    assert "RuntimeError" not in err and "AttributeError" not in err, err


def test_a_corrupted_whole_object_fails_its_checksum(moto: Store) -> None:
    import io

    from s5loader.exceptions import FetchError

    raw = io.BytesIO()
    torch.save({"t": torch.arange(1000)}, raw)
    # stored with a checksum (boto3's default) and read in one part: the GET of the whole
    # object carries the checksum, which botocore checks as the body ends
    moto.client.put_object(Bucket=moto.bucket, Key=moto.prefix + "corrupt.pt", Body=raw.getvalue())
    uri = moto.uri("corrupt.pt")
    proxy = FaultProxy(moto.endpoint, [Rule("corrupt.pt", "corrupt")])
    try:
        with pytest.raises(FetchError, match="checksum"):
            checkpoint.load(uri, endpoint_url=proxy.endpoint)
    finally:
        proxy.close()


def test_ranged_reads_reuse_their_connections(store: Store) -> None:
    from s5loader._largeobj.multipart import transfer_client
    from s5loader._largeobj.parts import plan_parts
    from s5loader._largeobj.ranged import read_into

    data = os.urandom(11 * MiB)
    store.client.put_object(Bucket=store.bucket, Key=store.prefix + "reuse.bin", Body=data)
    etag = store.client.head_object(Bucket=store.bucket, Key=store.prefix + "reuse.bin")["ETag"].strip('"')
    pools = transfer_client(store.endpoint)._endpoint.http_session._manager.pools

    def opened() -> int:
        return sum(pools[k].num_connections for k in pools.keys())

    buf = memoryview(bytearray(len(data)))
    read_into(
        store.uri("reuse.bin"), store.endpoint, buf, etag=etag, plan=plan_parts(len(data), concurrency=1)
    )
    first = opened()
    for _ in range(3):  # three parts each, read straight from the socket, one connection throughout
        read_into(
            store.uri("reuse.bin"), store.endpoint, buf, etag=etag, plan=plan_parts(len(data), concurrency=1)
        )
    assert buf == data
    assert opened() == first


def test_failed_part_leaves_no_object_and_no_upload(moto: Store) -> None:
    from s5loader.exceptions import FetchError

    key = moto.prefix + "failing.pt"
    moto.client.put_object(Bucket=moto.bucket, Key=key, Body=b"the previous checkpoint")
    with failing_part(moto, 3), pytest.raises(FetchError, match=moto.uri("failing.pt")):
        checkpoint.save(
            state_dict(scale=8),
            moto.uri("failing.pt"),
            endpoint_url=moto.endpoint,
            part_size="5MiB",
            concurrency=2,
        )
    assert pending_uploads(moto, key) == []
    assert moto.client.get_object(Bucket=moto.bucket, Key=key)["Body"].read() == b"the previous checkpoint"


def test_a_part_failing_in_the_middle_of_a_tensor_is_the_error_raised(moto: Store) -> None:
    """A part that fails while torch is writing one large tensor stops the save with the
    upload's own error, naming the object, not torch's report of the write it broke off."""
    from s5loader.exceptions import FetchError

    key = moto.prefix + "one-big-tensor.pt"
    sd = {"w": torch.randn(40 * 1024 * 1024 // 4, generator=torch.Generator().manual_seed(0))}  # 40 MiB
    with failing_part(moto, 1), pytest.raises(FetchError, match=moto.uri("one-big-tensor.pt")) as err:
        checkpoint.save(
            sd, moto.uri("one-big-tensor.pt"), endpoint_url=moto.endpoint, part_size="5MiB", concurrency=1
        )
    assert "part 1 broke off" in str(err.value)
    assert pending_uploads(moto, key) == []
    assert "Contents" not in moto.client.list_objects_v2(Bucket=moto.bucket, Prefix=key)


SAVER = """
import signal, sys, threading, torch
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even in the background
from s5loader import checkpoint
from s5loader._largeobj.multipart import transfer_client
uri, endpoint, stream = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if stream:  # the first part goes up, the others hang: the save is stopped midway
    def hang(request, **kwargs):
        if not request.url.endswith("partNumber=1"):
            threading.Event().wait()
    transfer_client(endpoint).meta.events.register("before-send.s3.UploadPart", hang)
sd = {"w": torch.randn(60 * 1024 * 1024 // 4, generator=torch.Generator().manual_seed(0))}  # 60 MiB
checkpoint.save(sd, uri, endpoint_url=endpoint, stream=stream, concurrency=1 + stream, part_size="5MiB")
print("finished")
"""


def stored_parts(store: Store, key: str) -> int:
    ups = pending_uploads(store, key)
    if not ups:
        return 0
    return len(store.client.list_parts(Bucket=store.bucket, Key=key, UploadId=ups[0]).get("Parts", []))


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,stream",
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True), (signal.SIGTERM, True)],
)
def test_interrupted_save_leaves_nothing(moto: Store, tmp_path, sig: int, stream: bool) -> None:
    key = moto.prefix + "interrupted.pt"
    moto.client.put_object(Bucket=moto.bucket, Key=key, Body=b"the previous checkpoint")
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    # Staged: s5cmd uploads through a proxy that holds every part, so the save cannot finish
    # before the signal lands; the saver must kill s5cmd and abort the upload.
    # Streamed: the saver itself hangs every part after the first (see SAVER).
    proxy = FaultProxy(moto.endpoint, [] if stream else [Rule("partNumber=", "hold", method="PUT")])
    proc = subprocess.Popen(
        [sys.executable, str(script), moto.uri("interrupted.pt"), proxy.endpoint, "1" if stream else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    s5: list[psutil.Process] = []
    try:
        if stream:  # wait for a stored part: the save is midway, serialising, parts in flight

            def a_part_stored() -> object:
                assert proc.poll() is None, proc.communicate()
                return stored_parts(moto, key)

            wait_for(a_part_stored, 60, "a stored part")
        else:  # wait for s5cmd's first part to be held, then freeze s5cmd as well
            assert proxy.wait_held("partNumber=", 1, timeout=60), proc.communicate()
            assert pending_uploads(moto, key), "no multipart upload started"
            s5 = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == "s5cmd"]
            assert s5, "s5cmd is not running"
            for c in s5:
                c.send_signal(signal.SIGSTOP)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    assert "finished" not in out
    assert proc.returncode != 0, err
    if sig == signal.SIGINT:  # Ctrl-C is a KeyboardInterrupt, wherever torch was when it came
        assert err.strip().splitlines()[-1] == "KeyboardInterrupt" and proc.returncode == -signal.SIGINT, err
        assert "enforce fail" not in err and "RuntimeError" not in err, err
    assert pending_uploads(moto, key) == []  # the multipart upload was aborted
    body = moto.client.get_object(Bucket=moto.bucket, Key=key)["Body"].read()
    assert body == b"the previous checkpoint"  # no partial object under the final name
    _, alive = psutil.wait_procs(s5, timeout=10)
    assert not alive  # no uploader outlives the save


DCP_SCRIPT = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
from s5loader.dcp import S5StorageReader, S5StorageWriter

def main(rank, world, port, endpoint, uri, stage):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", list(range(world)))
    full = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))  # 1 MiB, half per rank
    emb = torch.arange(64 * 48, dtype=torch.float64).reshape(64, 48)
    sd = {"w": distribute_tensor(full, mesh, [Shard(0)]), "emb": distribute_tensor(emb, mesh, [Shard(1)]),
          "b": torch.arange(5) * 1.5, "step": 7}
    writer = S5StorageWriter(uri, endpoint_url=endpoint, staging_dir=stage, part_size="5MiB")
    dcp.save(sd, storage_writer=writer)
    dist.barrier()
    out = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
           "emb": distribute_tensor(torch.zeros_like(emb), mesh, [Shard(1)]), "b": torch.zeros(5), "step": 0}
    dcp.load(out, storage_reader=S5StorageReader(uri, endpoint_url=endpoint, staging_dir=stage))
    assert torch.equal(out["w"].full_tensor(), full), "w differs"
    assert torch.equal(out["w"].to_local(), sd["w"].to_local()), "local shard differs"
    assert torch.equal(out["emb"].full_tensor(), emb), "emb differs"
    assert torch.equal(out["b"], sd["b"]) and out["step"] == 7, out
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(main, args=(2, int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]), nprocs=2)
    print("both ranks ok")
"""


@pytest.mark.slow
def test_distributed_checkpoint_two_gloo_ranks(seaweed: Store, tmp_path) -> None:
    script = tmp_path / "dcp_two_ranks.py"
    script.write_text(DCP_SCRIPT)
    stage = tmp_path / "stage"
    uri = seaweed.uri("dcp/step-10")
    r = subprocess.run(
        [sys.executable, str(script), str(free_port()), seaweed.endpoint, uri, str(stage)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "both ranks ok" in r.stdout
    listed = seaweed.client.list_objects_v2(Bucket=seaweed.bucket, Prefix=seaweed.prefix + "dcp/step-10/")
    names = sorted(o["Key"].rsplit("/", 1)[1] for o in listed.get("Contents", []))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own file
    assert os.listdir(stage) == []  # every rank's staged files removed


def test_distributed_writer_streams_and_a_failed_part_leaves_no_checkpoint(moto: Store) -> None:
    import torch.distributed.checkpoint as dcp

    from s5loader.dcp import S5StorageReader, S5StorageWriter

    sd = {"w": torch.randn(3 * 1024 * 1024, generator=torch.Generator().manual_seed(2)), "step": 3}  # 12 MiB
    dcp.save(
        sd, storage_writer=S5StorageWriter(moto.uri("ok/"), endpoint_url=moto.endpoint, part_size="5MiB")
    )
    head = moto.client.head_object(Bucket=moto.bucket, Key=moto.prefix + "ok/__0_0.distcp")
    assert head["ETag"].strip('"').endswith("-3")  # streamed in three parts
    out = {"w": torch.zeros_like(sd["w"]), "step": 0}
    dcp.load(out, storage_reader=S5StorageReader(moto.uri("ok/"), endpoint_url=moto.endpoint))
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3

    with (
        failing_part(moto, 2),
        pytest.raises(BaseException, match="part 2 broke off"),
    ):  # torch: CheckpointException
        dcp.save(
            sd, storage_writer=S5StorageWriter(moto.uri("bad/"), endpoint_url=moto.endpoint, part_size="5MiB")
        )
    assert not object_exists(moto, moto.prefix + "bad/")  # neither the file nor .metadata
    assert pending_uploads(moto, moto.prefix + "bad/__0_0.distcp") == []


def test_a_part_failing_in_the_middle_of_a_distributed_tensor_is_the_error_raised(moto: Store) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from s5loader.dcp import S5StorageWriter
    from s5loader.exceptions import FetchError

    sd = {"w": torch.randn(40 * 1024 * 1024 // 4, generator=torch.Generator().manual_seed(3))}  # 40 MiB
    with failing_part(moto, 1), pytest.raises(CheckpointException) as err:
        dcp.save(
            sd,
            storage_writer=S5StorageWriter(
                moto.uri("mid/"), endpoint_url=moto.endpoint, part_size="5MiB", concurrency=1
            ),
        )
    ((exc, _),) = err.value.failures.values()
    assert isinstance(exc, FetchError) and "part 1 broke off" in str(exc), exc
    assert moto.uri("mid/__0_0.distcp") in str(exc)
    assert not object_exists(moto, moto.prefix + "mid/")
    assert pending_uploads(moto, moto.prefix + "mid/__0_0.distcp") == []


def test_distributed_reader_without_metadata(moto: Store) -> None:
    from s5loader.dcp import S5StorageReader

    with pytest.raises(ObjectNotFoundError, match="nothing/.metadata"):
        S5StorageReader(moto.uri("nothing"), endpoint_url=moto.endpoint).read_metadata()
