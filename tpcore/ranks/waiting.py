"""How a rank waits for its next call: rank 0 polls its connection for a short while before it blocks.

A served decode step is one call per token: the caller sends it, rank 0 computes and replies, the caller runs
generate's own work between two steps (a millisecond or a few) and sends the next. A rank blocked in ``recv``
is woken by the kernel when the call arrives, on whichever core the scheduler picks, with its caches cold; rank 0
polling instead starts the step at once. It polls only while calls keep coming that soon: after a wait longer
than the window (the caller idle, a server between requests), it blocks straight away at the next wait, so an
idle pool spends no CPU. The other ranks block: on a host with few cores a second polling rank takes the core
the caller needs for its own work (``bench/README.md`` gives the figures).

``TPCORE_RANK_POLL_MS`` sets the window (a number of milliseconds; ``0`` turns polling off).
"""

from __future__ import annotations

import os
import select
import time

__all__ = ["DEFAULT_POLL_MS", "POLL_ENV", "CallWaiter", "poll_window_s"]

POLL_ENV = "TPCORE_RANK_POLL_MS"
#: covers the caller's work between two decode steps of a small model on a CPU (about 1.5-4 ms at batch 1-8)
DEFAULT_POLL_MS = 5.0


def poll_window_s(rank: int, environ=os.environ) -> float:
    """How long ``rank`` polls for its next call, in seconds: rank 0 ``TPCORE_RANK_POLL_MS`` (default
    :data:`DEFAULT_POLL_MS`), any other rank 0. A value that is not a number from 0 to 1000 raises ``ValueError``."""
    text = environ.get(POLL_ENV, "").strip()
    try:
        window_ms = float(text) if text else DEFAULT_POLL_MS
    except ValueError:
        window_ms = -1.0
    if not 0 <= window_ms <= 1000:  # NaN fails too
        raise ValueError(f"{POLL_ENV}={text!r}: give the milliseconds rank 0 polls for its next call, 0 to 1000")
    return window_ms / 1e3 if rank == 0 else 0.0


class CallWaiter:
    """Waits until a call is readable on ``fd``: polling for up to ``window`` seconds when the previous wait
    ended within the window, then blocking (the caller reads the call itself)."""

    def __init__(self, fd: int, window: float) -> None:
        self.window = window
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._last_wait = float("inf")  # the first wait blocks

    def wait(self) -> bool:
        """Return once the next call (or the end of the connection) can be read: whether this wait polled."""
        started = time.monotonic()
        polls = self._last_wait < self.window
        if polls:
            deadline = started + self.window
            while not self._poller.poll(0):
                if time.monotonic() >= deadline:
                    break
        self._poller.poll()  # at once when the call is there; else blocks until it comes
        self._last_wait = time.monotonic() - started
        return polls
