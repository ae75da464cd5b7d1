"""The caller's intra-op threads while CPU ranks compute (tpcore.served.caller_threads)."""

from __future__ import annotations

import threading

import torch

from tpcore.served.caller_threads import OneThreadWhileServing


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
