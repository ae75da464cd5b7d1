"""Where ranks run: the default backend, each rank's device, refusals before any rank starts, and
binding the device before the process group exists.

No GPU is needed: CUDA and NCCL are faked (``torch.cuda.is_available``/``device_count``,
``dist.is_nccl_available``) to exercise the decisions, never a kernel; what only a GPU can show is
left to ``nox -s gpu_equivalence``.
"""

from __future__ import annotations

import pytest
import rank_helpers
import torch
import torch.distributed as dist

import tpcore
from tpcore import engine
from tpcore.ranks import distributed, process, worker
from tpcore.testing import tiny_bert


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(n, nccl=True)``: this process sees ``n`` CUDA devices (none: no CUDA) and NCCL or not."""

    def fake(count: int, nccl: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


# -- the default backend and each rank's device ---------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "nccl", "ranks", "backend"),
    [
        (0, True, 1, "gloo"),  # no CUDA
        (0, True, 4, "gloo"),
        (1, True, 1, "nccl"),
        (1, True, 2, "gloo"),  # fewer GPUs than ranks: gloo, not two NCCL ranks on one GPU
        (2, True, 2, "nccl"),
        (2, True, 3, "gloo"),
        (8, True, 4, "nccl"),
        (4, False, 2, "gloo"),  # CUDA without NCCL
    ],
)
def test_the_default_backend_is_nccl_only_with_a_gpu_per_rank(fake_gpus, gpus, nccl, ranks, backend):
    fake_gpus(gpus, nccl)
    assert distributed.default_backend(ranks) == backend


@pytest.mark.parametrize(
    ("backend", "device", "gpus", "rank", "expected"),
    [
        ("gloo", None, 2, 1, "cpu"),
        ("gloo", "cpu", 2, 1, "cpu"),
        ("gloo", "cuda", 1, 0, "cuda:0"),
        ("gloo", "cuda", 1, 1, "cuda:0"),  # gloo ranks share one GPU
        ("gloo", "cuda", 2, 3, "cuda:1"),
        ("nccl", None, 2, 1, "cuda:1"),
        ("nccl", "cuda", 4, 2, "cuda:2"),
    ],
)
def test_each_rank_gets_its_device(fake_gpus, backend, device, gpus, rank, expected):
    fake_gpus(gpus)
    assert distributed.device_for(backend, rank, device) == torch.device(expected)


def test_an_nccl_rank_without_a_gpu_of_its_own_is_refused(fake_gpus):
    fake_gpus(2)
    with pytest.raises(RuntimeError, match=r"local rank 2 has no CUDA device of its own: 2 are visible"):
        distributed.device_for("nccl", 2)


# -- refusals, naming the counts ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "ranks", "device", "gpus", "expected"),
    [
        ("gloo", 4, None, 0, "cpu"),
        ("gloo", 4, "cuda", 1, "cuda"),
        ("nccl", 2, None, 2, "cuda"),
        ("nccl", 2, "cuda", 8, "cuda"),
    ],
)
def test_placements_that_can_run_are_accepted(fake_gpus, backend, ranks, device, gpus, expected):
    fake_gpus(gpus)
    assert distributed.check_placement(backend, ranks, device) == expected


@pytest.mark.parametrize(
    ("backend", "ranks", "device", "gpus", "visible", "error", "match"),
    [
        ("nccl", 3, None, 2, "0,1", RuntimeError, r"3 NCCL ranks .* 2 are visible \(CUDA_VISIBLE_DEVICES='0,1'\)"),
        ("nccl", 2, None, 1, None, RuntimeError, r"2 NCCL ranks .* 1 is visible \(CUDA_VISIBLE_DEVICES unset\)"),
        ("nccl", 1, None, 0, "", RuntimeError, r"no CUDA device is visible \(CUDA_VISIBLE_DEVICES=''\)"),
        ("gloo", 2, "cuda", 0, None, RuntimeError, r"device 'cuda' \(backend 'gloo'\): no CUDA device"),
        ("nccl", 1, "cpu", 1, None, ValueError, r"'nccl' moves CUDA tensors only"),
        ("gloo", 1, "tpu", 0, None, ValueError, r"device must be one of \('cuda', 'cpu'\) or None, got 'tpu'"),
    ],
)
def test_impossible_placements_are_refused_naming_the_counts(
    fake_gpus, monkeypatch, backend, ranks, device, gpus, visible, error, match
):
    fake_gpus(gpus)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(error, match=match):
        distributed.check_placement(backend, ranks, device)


def test_the_refusal_of_nccl_suggests_gloo(fake_gpus):
    fake_gpus(1)
    with pytest.raises(RuntimeError, match=r"backend='gloo' \(with device='cuda' gloo ranks share the GPUs\)"):
        distributed.check_placement("nccl", 2)


def test_nccl_missing_from_torch_is_refused(fake_gpus):
    fake_gpus(2, nccl=False)
    with pytest.raises(RuntimeError, match="no NCCL"):
        distributed.check_placement("nccl", 2)


@pytest.fixture
def no_rank_may_start(monkeypatch):
    """Starting a rank process fails the test; ``spawned`` lists the attempts."""
    spawned = []

    def refuse(command, **kwargs):
        spawned.append(command)
        raise AssertionError("a rank was started")

    monkeypatch.setattr(process.subprocess, "Popen", refuse)
    return spawned


@pytest.mark.parametrize(
    ("start", "match"),
    [
        (lambda: process.RankPool(2, "nccl"), "2 NCCL ranks on this node need one CUDA device each: 1 is visible"),
        (lambda: process.RankPool(2, "gloo", device="tpu"), "device must be one of"),
        (lambda: tpcore.parallelize(tiny_bert(), num_gpus=2, backend="nccl"), "2 NCCL ranks"),
        (lambda: tpcore.parallelize(tiny_bert(), num_gpus=2, device="cuda", backend="nccl"), "2 NCCL ranks"),
    ],
)
def test_refused_before_any_rank_starts(fake_gpus, no_rank_may_start, start, match):
    fake_gpus(1)
    with pytest.raises((RuntimeError, ValueError), match=match):
        start()
    assert no_rank_may_start == []


def test_gloo_on_cuda_without_cuda_is_refused_before_any_rank_starts(fake_gpus, no_rank_may_start):
    fake_gpus(0)
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        tpcore.parallelize(tiny_bert(), num_gpus=2, backend="gloo", device="cuda")
    assert no_rank_may_start == []


@pytest.mark.slow  # starts a world of its own
def test_the_default_backend_of_a_pool_with_more_ranks_than_gpus_is_gloo_on_the_cpu(fake_gpus):
    fake_gpus(1)
    with process.RankPool(2) as pool:
        assert (pool.backend, pool.device) == ("gloo", "cpu")
        assert [r[:2] for r in pool.run(rank_helpers.whoami)] == [(0, 2), (1, 2)]


# -- ParallelEngine (SPMD): LOCAL_RANK picks the GPU; bind, then join, then slice ------------------


def test_the_engine_refuses_more_nccl_ranks_on_this_node_than_gpus_before_joining(fake_gpus, monkeypatch):
    fake_gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")

    def join(*args, **kwargs):
        raise AssertionError("joined a process group")

    monkeypatch.setattr(engine, "tensor_parallel_group", join)
    with pytest.raises(RuntimeError, match=r"4 NCCL ranks on this node need one CUDA device each: 2 are visible"):
        tpcore.ParallelEngine(4, "nccl").parallelize(tiny_bert())
    with pytest.raises(RuntimeError, match=r"4 NCCL ranks"):
        tpcore.ParallelEngine(4, "nccl").create_process_group()
    assert tpcore.ParallelEngine(4).backend == "gloo"  # the default: not NCCL with too few GPUs


@pytest.mark.parametrize(
    ("backend", "device", "local_rank", "expected"), [("nccl", None, "1", "cuda:1"), ("gloo", "cuda", "3", "cuda:1")]
)
def test_local_rank_picks_the_engine_s_device(fake_gpus, monkeypatch, backend, device, local_rank, expected):
    fake_gpus(2)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("RANK", "7")  # the global rank is not the node's
    assert tpcore.ParallelEngine(2, backend, device=device).device == torch.device(expected)


def test_the_engine_binds_its_device_then_joins_the_group_then_slices(fake_gpus, monkeypatch):
    fake_gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    calls = []

    class Joined(Exception):
        pass

    def join(num_gpus, backend, device):
        calls.append(("join", backend, device))
        raise Joined

    monkeypatch.setattr(engine, "bind_device", lambda device: calls.append(("bind", device)))
    monkeypatch.setattr(engine, "tensor_parallel_group", join)
    model = tiny_bert()
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(Joined):
        tpcore.ParallelEngine(2, "nccl").parallelize(model)
    cuda1 = torch.device("cuda", 1)
    assert calls == [("bind", cuda1), ("join", "nccl", cuda1)]
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # nothing sliced yet


# -- a rank of a pool: bind, then init_process_group(device_id=) -----------------------------------


def test_a_rank_binds_its_gpu_before_it_joins_the_group_and_names_it_to_nccl(fake_gpus, monkeypatch):
    """``_worker_main`` in this process, up to joining its group (faked, then failing, so the rank returns)."""
    fake_gpus(2)
    calls, replies = [], []

    class Joined(Exception):
        pass

    def join(backend, rank, world_size, store, device=None):
        calls.append(("join", backend, rank, device))
        raise Joined

    monkeypatch.setattr(worker, "connect", lambda *args: "connection")
    monkeypatch.setattr(worker, "send", lambda conn, message: replies.append(message))
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: "store")
    monkeypatch.setattr(distributed, "bind_device", lambda device: calls.append(("bind", device)))
    monkeypatch.setattr(distributed, "init_process_group", join)
    monkeypatch.setenv(worker.AUTHKEY_ENV, "00")
    threads = torch.get_num_threads()
    worker._worker_main("address", 1, 2, "nccl", "cuda", "127.0.0.1", 1, threads)
    assert calls == [("bind", torch.device("cuda", 1)), ("join", "nccl", 1, torch.device("cuda", 1))]
    assert replies[0][0] == "error" and replies[0][1][0].endswith("Joined")  # reported to the caller


@pytest.mark.parametrize(
    ("backend", "device", "supported", "device_id"),
    [
        ("nccl", torch.device("cuda", 1), True, torch.device("cuda", 1)),
        ("nccl", torch.device("cuda", 1), False, None),  # a torch without device_id=
        ("gloo", torch.device("cuda", 1), True, None),
        ("gloo", torch.device("cpu"), True, None),
        ("nccl", None, True, None),
    ],
)
def test_nccl_groups_are_created_with_their_device_where_torch_takes_it(
    monkeypatch, backend, device, supported, device_id
):
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **options: seen.update(options))
    monkeypatch.setattr(distributed, "_INIT_TAKES_DEVICE_ID", supported)
    distributed.init_process_group(backend, 0, 2, store="store", device=device)
    assert seen.get("device_id") == device_id
    assert (seen["store"], seen["rank"], seen["world_size"]) == ("store", 0, 2)


def test_this_torch_takes_device_id():
    assert distributed._INIT_TAKES_DEVICE_ID  # torch 2.3 on; the check exists for older ones


# -- gloo groups: tensors not on the CPU bypass the shared-memory collectives ----------------------


def test_tensors_off_the_cpu_go_through_torch_distributed_not_shared_memory(rank_pools):
    for attached, routed in rank_pools.get(2).run(rank_helpers.collective_routes):
        assert attached
        assert routed == {"all_reduce": ["meta"], "all_gather": ["meta"]}
