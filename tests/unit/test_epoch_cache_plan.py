"""The epoch cache's choices without a server: the keep-set, the shares of a node's ranks,
admission, the index fingerprint and the cache folder's identity.

Private modules (``s5loader._index``, ``s5loader._sampling``, ``s5loader._util``,
``s5loader._daemon``, ``s5loader._staging``) are imported on purpose: their own behaviour is what
these tests check."""

from __future__ import annotations

import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s5loader import StagingOptions
from s5loader._index.sample import Field, Sample
from s5loader._sampling.cacheplan import Admission, keep_set, node_ranks, rank_capacity
from s5loader._staging.area import choose_root
from s5loader._staging.epochcache import EpochCache, entry_problem, index_fingerprint
from s5loader._staging.layout import StagingLayout
from s5loader.exceptions import ConfigError


def test_keep_set_is_the_start_of_the_order_while_it_fits() -> None:
    sizes = [10] * 10
    plan = keep_set([[5, 3, 9, 0, 1]], sizes, 35)
    assert plan.keep == {5, 3, 9} and plan.total == 30 and plan.per_rank == (30,)


def test_keep_set_stops_at_the_first_sample_that_does_not_fit() -> None:
    sizes = [10, 100, 1, 1]
    plan = keep_set([[0, 1, 2, 3]], sizes, 50)
    assert plan.keep == {0}  # not 2 and 3 after the big one: the cache is the epoch's start


def test_keep_set_interleaves_local_ranks_by_position() -> None:
    sizes = [10] * 8
    plan = keep_set([[0, 1, 2, 3], [4, 5, 6, 7]], sizes, 50)
    assert plan.keep == {0, 4, 1, 5, 2}
    assert plan.per_rank == (30, 20)


def test_keep_set_counts_a_repeated_index_once() -> None:
    plan = keep_set([[0, 1], [2, 0]], [10, 10, 10], 100)
    assert plan.keep == {0, 1, 2} and plan.total == 30 and plan.per_rank == (20, 10)


def test_a_cache_that_holds_everything_keeps_everything() -> None:
    order = list(range(20))
    assert keep_set([order], [7] * 20, 140).keep == set(order)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    ranks=st.integers(1, 4),
    capacity=st.integers(0, 800),
    seed=st.randoms(use_true_random=False),
)
def test_rank_shares_never_add_up_to_more_than_the_cache(sizes, ranks, capacity, seed) -> None:
    idx = list(range(len(sizes)))
    seed.shuffle(idx)
    orders = [idx[r::ranks] for r in range(ranks)]
    plan = keep_set(orders, sizes, capacity)
    assert plan.total <= capacity and sum(sizes[i] for i in plan.keep) == plan.total
    shares = [rank_capacity(plan, r, capacity) for r in range(ranks)]
    assert sum(shares) <= capacity
    assert all(shares[r] >= plan.per_rank[r] for r in range(ranks))  # each holds what it finds


def test_admission_refuses_what_does_not_fit() -> None:
    a = Admission(100, held=60)
    assert a.admit(40) and a.held == 100
    assert not a.admit(1) and a.held == 100  # refused: only a future miss
    a.remove(50)
    assert a.admit(30) and a.held == 80


def test_node_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_ranks(3, 8) == [3]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_ranks(5, 8) == [4, 5, 6, 7]
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert node_ranks(5, 8) == [4, 5, 6, 7]
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert node_ranks(1, 8) == [1]  # does not describe this job's node: no sharing


LAUNCHER_VARIABLES = (
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "SLURM_LOCALID",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NODEID",
    "RANK",
    "WORLD_SIZE",
)


@pytest.mark.parametrize(
    ("env", "local"),
    [
        ({"SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}, (2, 4)),
        ({"SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4,3", "SLURM_NODEID": "1"}, (1, 3)),
        ({"SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"}, (3, 4)),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (1, 4)),
        ({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (0, 2)),
        # torchrun's describe its own processes, also when it runs under srun
        (
            {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1"},
            (1, 2),
        ),
        ({"SLURM_LOCALID": "0"}, None),
        ({}, None),
    ],
)
def test_the_node_is_found_from_every_launchers_variables(
    env: dict[str, str], local: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s5loader._util.dist import local_rank_info

    for var in LAUNCHER_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert local_rank_info() == local


def test_srun_and_mpirun_ranks_share_a_node_and_a_batch_scripts_process_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from s5loader._util.dist import local_world_size

    for var in LAUNCHER_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert node_ranks(5, 8) == [4, 5, 6, 7]
    # a lone process in a batch script sees the allocation's tasks: no node of ranks for it
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert node_ranks(0, 1) == [0] and local_world_size() == 1
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert local_world_size() == 4
    for var in ("SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert node_ranks(6, 8) == [4, 5, 6, 7] and local_world_size() == 4


def test_an_opener_and_a_sweep_wait_for_each_other(tmp_path) -> None:
    import fcntl
    import threading

    from s5loader._staging.epochcache import node_lock

    other = EpochCache(str(tmp_path), "other", "fp")
    with node_lock(str(tmp_path)):  # another process of the node opening or leaving a cache
        opened = threading.Thread(target=other.open)
        opened.start()
        opened.join(0.5)
        assert opened.is_alive() and not os.path.exists(other.path)  # it waits for the lock
    opened.join(10)
    assert os.path.isdir(os.path.join(other.path, ".users")) and other._fd is not None
    fd = os.open(str(tmp_path), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and let it go
    finally:
        os.close(fd)
    other.close()
    assert os.listdir(tmp_path) == []


def sample(key: str, size: int, etag: str = "") -> Sample:
    return Sample(key, (Field("image", f"s3://b/{key}.image", size, etag),))


def test_the_fingerprint_changes_with_an_object() -> None:
    a = [sample("k0", 3, "e0"), sample("k1", 4, "e1")]
    assert index_fingerprint(a) == index_fingerprint(list(a))
    assert index_fingerprint(a) != index_fingerprint([a[0], sample("k1", 4, "e2")])  # ETag
    assert index_fingerprint(a) != index_fingerprint([a[0], sample("k1", 5, "e1")])  # size


def test_a_cache_of_another_index_is_emptied(tmp_path) -> None:
    c = EpochCache(str(tmp_path), "abc", "fp1")
    c.open()
    os.makedirs(c.entry(3))
    c.close()
    assert not os.path.exists(c.path)  # the last user removed it
    c = EpochCache(str(tmp_path), "abc", "fp1", keep=True)
    c.open()
    os.makedirs(c.entry(3))
    c.close()
    assert EpochCache(str(tmp_path), "abc", "fp1").names() == [3]  # kept
    other = EpochCache(str(tmp_path), "abc", "fp2")
    other.open()
    assert other.names() == []  # another index: no entry may read as a hit
    other.close()


def test_a_live_user_keeps_the_cache(tmp_path) -> None:
    a, b = EpochCache(str(tmp_path), "x", "fp"), EpochCache(str(tmp_path), "x", "fp")
    a.open()
    b.open()
    a.close()
    assert os.path.isdir(b.path)
    b.close()
    assert not os.path.exists(b.path)


def test_take_checks_sizes_and_md5(tmp_path) -> None:
    data = b"hello"
    etag = "5d41402abc4b2a76b9719d911017c592"
    s = sample("k", len(data), etag)
    c = EpochCache(str(tmp_path), "x", "fp")
    c.open()
    layout = StagingLayout(str(tmp_path / "pass"))
    os.makedirs(layout.folder)
    for content, md5, ok in (
        (data, True, True),
        (b"hellO", False, True),
        (b"hellO", True, False),
        (b"hi", False, False),
    ):
        os.makedirs(c.entry(1))
        with open(os.path.join(c.entry(1), "image"), "wb") as fh:
            fh.write(content)
        assert c.take(1, layout.sample_dir(1), s, md5) is ok
        assert os.path.isdir(layout.sample_dir(1)) is ok
        assert not os.path.exists(c.entry(1))
        shutil.rmtree(layout.sample_dir(1), ignore_errors=True)
    assert entry_problem(layout.sample_dir(9), s, False)  # no entry at all
    c.close()


def test_epoch_cache_option() -> None:
    assert StagingOptions(epoch_cache="1MiB").epoch_cache == 1 << 20
    assert StagingOptions().epoch_cache == 0
    with pytest.raises(ConfigError, match="epoch_cache"):
        StagingOptions(epoch_cache="lots")
    with pytest.raises(ConfigError, match="keep_staged"):
        StagingOptions(epoch_cache="1MiB", keep_staged=True)


def test_the_space_check_counts_the_cache_once_per_node(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from s5loader._staging import area
    from s5loader.exceptions import BudgetError

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(area, "free_bytes", lambda path: 1000)
    assert choose_root(str(tmp_path), 100, shared=600)[1] == 100  # 4 x 100 + 600 fit
    with pytest.raises(BudgetError, match="epoch cache"):
        choose_root(str(tmp_path), 100, shared=601)


def test_a_stale_cache_goes_when_another_opens(tmp_path) -> None:
    dead = EpochCache(str(tmp_path), "old", "fp")
    dead.open()
    os.makedirs(dead.entry(1))
    assert dead._fd is not None
    os.close(dead._fd)  # as a killed run leaves it: its lock is gone, its file stays
    dead._fd, dead._user = None, None
    kept = EpochCache(str(tmp_path), "kept", "fp", keep=True)
    kept.open()
    kept.close()
    live = EpochCache(str(tmp_path), "live", "fp")
    live.open()
    fresh = EpochCache(str(tmp_path), "new", "fp")
    fresh.open()
    assert not os.path.exists(dead.path)  # nobody used it
    assert os.path.isdir(kept.path) and os.path.isdir(live.path)  # kept on purpose; in use
    again = EpochCache(str(tmp_path), "old", "fp")
    assert again.names() == []
    fresh.close()
    live.close()


def test_the_daemon_option(tmp_path) -> None:
    from s5loader._daemon import PrefetchOptions, build_parser, options_from_args

    args = build_parser().parse_args(
        [
            "s3://b/train/",
            "--cache",
            str(tmp_path),
            "--budget",
            "1MiB",
            "--epochs",
            "3",
            "--epoch-cache",
            "4MiB",
        ]
    )
    opts = options_from_args(args)
    assert opts.staging.epoch_cache == 4 << 20 and opts.budget == 1 << 20
    # over tar shards too, as the sampler's
    assert PrefetchOptions.of("s3://b/s/", str(tmp_path), 1 << 20, shards=True, epoch_cache=1 << 20).shards
    with pytest.raises(ConfigError, match="staging_dir: not options of s5loader prefetch"):
        PrefetchOptions.of("s3://b/s/", str(tmp_path), 1 << 20, staging_dir="/tmp")


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 90),
    nodes=st.integers(2, 4),
    local=st.integers(1, 3),
    drop_last=st.booleans(),
    seed=st.integers(0, 50),
)
def test_a_pinned_order_keeps_each_nodes_share_and_deals_every_sample(
    n: int, nodes: int, local: int, drop_last: bool, seed: int
) -> None:
    from collections import Counter

    from s5loader._sampling.order import Order
    from s5loader._sampling.pieces import part_len

    ranks = nodes * local
    per = part_len(n, ranks, drop_last)
    shares = []
    for epoch in (0, 1, 2):
        orders = [Order(True, seed, ranks, r, drop_last, (nodes, ranks)) for r in range(ranks)]
        parts = [o.indices(n, epoch) for o in orders]
        assert all(len(p) == per for p in parts)  # every rank the same count, as DistributedSampler
        got = Counter(i for p in parts for i in p)
        if drop_last:
            assert len(got) == per * ranks and max(got.values(), default=1) == 1
        else:
            assert set(got) == set(range(n)) and sum(got.values()) == per * ranks  # padding repeats
        nodes_parts = [parts[k * local : (k + 1) * local] for k in range(nodes)]
        shares.append([Counter(i for p in node for i in p) for node in nodes_parts])
    assert shares[0] == shares[1] == shares[2]  # a node reads the same share every epoch


def test_the_pin_needs_a_cache_several_nodes_and_shuffle_true(monkeypatch: pytest.MonkeyPatch) -> None:
    from s5loader._sampling.cacheplan import pin_to_nodes
    from s5loader._sampling.order import Order

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    o = Order(True, 0, 8, 5, False)
    assert pin_to_nodes(o, True).pin == (4, 8)
    assert pin_to_nodes(o, False) == o  # no cache
    block = Order("block", 0, 8, 5, False)
    assert pin_to_nodes(block, True) == block
    one = Order(True, 0, 2, 1, False)
    assert pin_to_nodes(one, True) == one  # one node: DistributedSampler's order
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NODEID", "1")
    six = Order(True, 0, 6, 5, False)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3)")
    assert pin_to_nodes(six, True).pin == (3, 6)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4,2")  # this node's 2 divide 6, the other's 4 do not
    assert pin_to_nodes(six, True) == six


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=14),
    nodes=st.integers(2, 3),
    local=st.integers(1, 2),
    seed=st.integers(0, 20),
)
def test_a_pinned_shard_order_keeps_each_nodes_shards(
    sizes: list[int], nodes: int, local: int, seed: int
) -> None:
    from collections import Counter

    from s5loader._sampling.order import Order
    from s5loader._sampling.pieces import part_len

    units, at = [], 0
    for k in sizes:
        units.append(list(range(at, at + k)))
        at += k
    ranks, n = nodes * local, at
    per = part_len(n, ranks, False)
    seen = []
    for epoch in (0, 1):
        parts = [
            Order(True, seed, ranks, r, False, (nodes, ranks)).shard_order(n, epoch, 0, units, 2)
            for r in range(ranks)
        ]
        assert all(len(p) == per for p in parts)
        assert set(i for p in parts for i in p) == set(range(n)) and sum(map(len, parts)) == per * ranks
        seen.append([Counter(i for p in parts[k * local : (k + 1) * local] for i in p) for k in range(nodes)])
    assert seen[0] == seen[1]  # each node reads the same samples every epoch
