"""The caller's intra-op threads while CPU ranks compute (tpcore.served.caller_threads)."""

from __future__ import annotations

import sys
import threading

import torch

from tpcore.served.caller_threads import OneThreadWhileServing, release_openmp_workers


def test_one_thread_inside_and_the_setting_found_before_after_concurrent_callers():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    one_thread = OneThreadWhileServing(enabled=True)
    inside, release = threading.Event(), threading.Event()

    def other_caller():
        with one_thread():
            inside.set()
            release.wait(10)

    try:
        worker = threading.Thread(target=other_caller)
        worker.start()
        inside.wait(10)
        with one_thread():
            assert torch.get_num_threads() == 1
        release.set()
        worker.join(10)
        assert torch.get_num_threads() == 2
        with OneThreadWhileServing(enabled=False)():  # GPU ranks: the caller's threads are left alone
            assert torch.get_num_threads() == 2
    finally:
        release.set()
        torch.set_num_threads(before)


def test_released_openmp_workers_come_back_with_the_next_parallel_region():
    """The calling thread's OpenMP pool is freed (torch's Linux wheels load GNU OpenMP, which has OpenMP 5.0's
    ``omp_pause_resource_all``), and the next product is computed as before on the same threads."""
    a, b = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)), torch.randn(512, 128)
    before = a @ b
    released = release_openmp_workers()
    assert released or sys.platform != "linux"
    torch.testing.assert_close(a @ b, before, rtol=0, atol=0)
