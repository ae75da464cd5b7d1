"""A log line per minute of throughput while the server is busy."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["Throughput"]


class Throughput:
    """Counts ``unit`` (tokens, inputs); logs their rates once a ``period`` while busy."""

    def __init__(self, logger: logging.Logger, unit: str, period: float = 60.0):
        self.logger, self.unit, self.period = logger, unit, period
        self.count = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.count += count
        self._report_if_due()

    def idle(self) -> None:
        self._report_if_due()

    def _report_if_due(self) -> None:
        elapsed = time.monotonic() - self.started
        if elapsed < self.period:
            return
        with self._lock:
            count, self.count, self.started = self.count, 0, time.monotonic()
        if count:
            self.logger.info("throughput: %.1f %s/s over the last %.0f s", count / elapsed, self.unit, elapsed)
