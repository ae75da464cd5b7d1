"""RankPool: results, fault injection (raise, kill, hang), threads, clean shutdown."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import rank_helpers
import torch
from process_probes import children, gone

from tpcore.distributed import free_port
from tpcore.process import RankPool, WorkerDiedError, WorkerError


@pytest.fixture
def pool():
    with RankPool(2, "gloo") as pool:
        yield pool


def test_runs_on_every_rank_and_reduces(pool):
    assert [r[:2] for r in pool.run(rank_helpers.whoami)] == [(0, 2), (1, 2)]
    assert pool.run(rank_helpers.all_reduce_sum, 10) == [21.0, 21.0]
    assert pool.run(rank_helpers.all_reduce_sum, value=1) == [3.0, 3.0]  # pool stays usable


def test_worker_exception_comes_back_with_type_message_and_traceback(pool):
    with pytest.raises(WorkerError) as caught:
        pool.run(rank_helpers.raise_on, 1, "no such tensor")
    error = caught.value
    assert (error.rank, error.type_name) == (1, "KeyError")
    assert isinstance(error.exception, KeyError) and "no such tensor" in str(error)
    assert "raise_on" in error.remote_traceback
    assert error.pool_consistent and pool.alive  # every rank answered: the pool stays usable
    assert pool.run(rank_helpers.all_reduce_sum, 1) == [3.0, 3.0]


def test_a_rank_that_fails_while_others_wait_in_a_collective_tears_the_pool_down(pool):
    pids = pool.pids
    started = time.monotonic()
    with pytest.raises(WorkerError, match="bad input on one rank") as caught:
        pool.run(rank_helpers.raise_or_reduce, 0)
    assert time.monotonic() - started < 15
    assert not caught.value.pool_consistent
    assert not pool.alive and all(gone(pid) for pid in pids)
    with pytest.raises(WorkerDiedError, match="closed"):
        pool.run(rank_helpers.whoami)


def test_killed_worker_is_detected_within_seconds(pool):
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        pool.run(rank_helpers.kill_on, 1)
    assert time.monotonic() - started < 5
    assert not pool.alive


def test_every_wait_has_a_timeout(pool):
    pids = pool.pids
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer within 1 s"):
        pool.run(rank_helpers.sleep, 30, timeout=1)
    assert time.monotonic() - started < 10
    assert all(gone(pid) for pid in pids)


def test_calls_from_threads_are_serialized_and_each_gets_its_own_result(pool):
    results = {}

    def call(value):
        results[value] = pool.run(rank_helpers.all_reduce_sum, value)

    threads = [threading.Thread(target=call, args=(value,)) for value in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {value: [2.0 * value + 1] * 2 for value in range(8)}


def test_close_leaves_no_process_and_frees_the_port():
    port = free_port()
    pool = RankPool(2, "gloo", master_port=port)
    pids = [pid for *_, pid in pool.run(rank_helpers.whoami)]
    pool.close()
    pool.close()  # idempotent
    assert all(gone(pid) for pid in pids)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # fails while anything still listens there


def test_a_rank_that_cannot_start_fails_fast_and_leaves_nothing():
    before = children()
    started = time.monotonic()
    with pytest.raises(WorkerError, match="(?i)nccl|cuda"):
        RankPool(2, "nccl", start_timeout=60)
    assert time.monotonic() - started < 60
    assert children() <= before


def test_functions_and_classes_defined_in_main_travel_by_value(pool, monkeypatch):
    """As in a notebook: the ranks cannot import ``__main__``, so cloudpickle sends code by value."""
    import __main__

    def answer(context, offset):
        return context.rank + offset

    answer.__module__ = "__main__"
    monkeypatch.setattr(__main__, "answer", answer, raising=False)
    assert pool.run(answer, 40) == [40, 41]


def test_large_tensors_travel_out_of_band_and_come_back_exact_and_writable(pool):
    import pickle

    from tpcore.process import RAW_TENSOR_BYTES, _encode

    tensors = [
        torch.randn(3, 128, 1000),  # logits-sized: raw frame
        torch.randn(400, 300).T,  # non-contiguous
        torch.ones(70_000, dtype=torch.bfloat16),  # a dtype numpy lacks
        torch.arange(5),  # small: stays in the pickle
    ]
    frames = _encode(tensors)
    assert len(frames) == 1 + sum(t.numel() * t.element_size() >= RAW_TENSOR_BYTES for t in tensors) == 4
    assert len(pickle.loads(frames[0])[0]) < 4096  # the big bytes are not in the pickled frame
    back = pool.run(rank_helpers.echo, *tensors)[0]
    for original, received in zip(tensors, back, strict=True):
        assert received.dtype == original.dtype and torch.equal(received, original)
    back[0].add_(1)  # its own writable storage
