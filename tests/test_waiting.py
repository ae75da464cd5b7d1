"""How a rank waits for its next call (``tpcore.ranks.waiting``): rank 0 polls only while calls come soon."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tpcore.ranks.process import RankPool
from tpcore.ranks.waiting import DEFAULT_POLL_MS, POLL_ENV, CallWaiter, poll_window_s


def test_rank_0_polls_for_the_window_the_environment_sets_and_the_other_ranks_block():
    assert poll_window_s(0, {}) == DEFAULT_POLL_MS / 1e3
    assert poll_window_s(0, {POLL_ENV: " 2.5 "}) == 0.0025
    assert poll_window_s(0, {POLL_ENV: "0"}) == 0.0
    assert poll_window_s(1, {}) == 0.0
    assert poll_window_s(3, {POLL_ENV: "20"}) == 0.0


@pytest.mark.parametrize("value", ["fast", "-1", "1001", "nan", "inf"])
def test_a_window_that_is_not_a_number_of_milliseconds_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=POLL_ENV):
        poll_window_s(0, {POLL_ENV: value})


def test_a_pool_refuses_a_bad_window_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv(POLL_ENV, "soon")
    with pytest.raises(ValueError, match=POLL_ENV):
        RankPool(2, "gloo")


def _wait(waiter: CallWaiter, write_fd: int, after: float) -> tuple[bool, float]:
    """Whether one ``waiter.wait()`` polled, and the waiting thread's CPU seconds in it; the call written
    ``after`` seconds in."""
    result = []

    def wait() -> None:
        start = time.thread_time()
        polled = waiter.wait()
        result.append((polled, time.thread_time() - start))

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(after)
    os.write(write_fd, b"x")
    thread.join(timeout=60)
    assert not thread.is_alive(), "the wait did not end once the call was readable"
    return result[0]


def test_a_waiter_polls_while_calls_come_within_its_window_and_blocks_after_a_longer_wait():
    """Only upper bounds on CPU: a loaded machine gives a polling thread less CPU, never more."""
    read_fd, write_fd = os.pipe()
    try:
        window = 0.2
        waiter = CallWaiter(read_fd, window)
        blocked = (False, pytest.approx(0, abs=0.05))  # blocked: (nearly) no CPU while it waits
        assert _wait(waiter, write_fd, after=0.5) == blocked  # the first wait blocks
        os.read(read_fd, 1)
        # that wait took longer than the window: the next blocks too
        assert _wait(waiter, write_fd, after=0.5) == blocked
        os.read(read_fd, 1)
        os.write(write_fd, b"x")  # a call already there: the wait ends at once, and was short
        assert waiter.wait() is False
        os.read(read_fd, 1)
        # after a short wait the next polls: for the window at most, then blocks
        polled, cpu = _wait(waiter, write_fd, after=0.8)
        assert polled and cpu < window + 0.1
        os.read(read_fd, 1)
        assert _wait(waiter, write_fd, after=0.5) == blocked  # and after that long wait, blocks again
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_polling_waiter_ends_at_once_when_its_call_comes():
    read_fd, write_fd = os.pipe()
    try:
        waiter = CallWaiter(read_fd, window=60.0)
        os.write(write_fd, b"x")
        waiter.wait()  # short: the next wait polls, for up to a minute
        os.read(read_fd, 1)
        started = time.monotonic()
        polled, _ = _wait(waiter, write_fd, after=0.05)
        assert polled and time.monotonic() - started < 30  # far below the window: the poll saw the call
    finally:
        os.close(read_fd)
        os.close(write_fd)
