"""The bar a user watches while a model loads: one, over the bytes every rank has loaded.

transformers' own tqdm draws it (``transformers.utils.logging.tqdm``), so transformers' switches turn it
off (``transformers.utils.logging.disable_progress_bar()``, ``HF_HUB_DISABLE_PROGRESS_BARS=1``), and
tqdm's ``disable=None`` leaves it out where stderr is no terminal (CI logs); a notebook gets its widget.
The bar leaves the global ``multiprocessing`` start method unset (:func:`tqdm_lock_leaving_the_start_method`).

A rank counts the bytes it has read (:class:`ByteCounter`) and reports its running count at most every
:data:`REPORT_INTERVAL_S` and once at the end; the caller's :class:`LoadBar` adds up the ranks' counts.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable

__all__ = ["REPORT_INTERVAL_S", "ByteCounter", "LoadBar", "tqdm_lock_leaving_the_start_method"]

#: how often at most a rank reports its running count of bytes loaded
REPORT_INTERVAL_S = 0.1


class LoadBar:
    """A bar over ``total`` bytes, labelled ``label``: fed bytes as they are sent (:meth:`add`) or each rank's
    running count (:meth:`rank_loaded`). Its clock restarts when loading begins (:meth:`loading`), so the
    rate shown is the load's, not the start's. A context manager: closed on the way out."""

    def __init__(self, total: int, label: str):
        from transformers.utils import logging as transformers_logging

        tqdm_lock_leaving_the_start_method()
        self.total = total
        self._bar = transformers_logging.tqdm(
            total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, disable=None
        )
        self._loaded = 0
        self._by_rank: dict[int, int] = {}

    def loading(self, label: str) -> None:
        """Loading begins: relabel the bar and restart its clock."""
        self._bar.set_description_str(label, refresh=False)
        self._bar.reset(total=self.total)

    def add(self, nbytes: int) -> None:
        self._loaded += nbytes
        self._bar.update(nbytes)

    def rank_loaded(self, rank: int, count: int) -> None:
        """Rank ``rank`` has loaded ``count`` bytes so far."""
        self.add(count - self._by_rank.get(rank, 0))
        self._by_rank[rank] = count

    def done(self, label: str) -> None:
        """Loading finished: the bar shows the whole total under ``label``."""
        self._bar.set_description_str(label, refresh=False)
        self.add(self.total - self._loaded)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> LoadBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tqdm_lock_leaving_the_start_method() -> None:
    """Make tqdm's process lock before tqdm does, of the same kind, but leaving the start method unset; call it
    before tpcore's first use of tqdm (a bar, ``tqdm.write``).

    tqdm's first bar (shown or not) or ``tqdm.write`` makes it with ``multiprocessing.RLock()``, which fixes the
    default context: ``multiprocessing.set_start_method()`` would then raise ``RuntimeError: context has already
    been set``. Here it comes from the context of the method set, or else of the default one, without fixing it.
    """
    try:
        from tqdm.std import TqdmDefaultWriteLock  # type: ignore[import-untyped]
    except ImportError:
        return
    if hasattr(TqdmDefaultWriteLock, "mp_lock"):
        return  # made already, by an earlier bar or here
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    try:
        TqdmDefaultWriteLock.mp_lock = multiprocessing.get_context(method).RLock()
    except (ImportError, OSError):  # as tqdm: no working semaphores here, a thread lock alone
        TqdmDefaultWriteLock.mp_lock = None


class ByteCounter:
    """On a rank: counts bytes loaded and calls ``report(count)`` with the running count at most every
    ``interval`` seconds, and at :meth:`close` with the final one."""

    def __init__(self, report: Callable[[int], None], interval: float = REPORT_INTERVAL_S):
        self._report = report
        self._interval = interval
        self.count = 0
        self._reported = 0
        self._reported_at = time.monotonic()

    def __call__(self, nbytes: int) -> None:
        self.count += nbytes
        if time.monotonic() - self._reported_at >= self._interval:
            self._send()

    def close(self) -> None:
        if self.count != self._reported:
            self._send()

    def _send(self) -> None:
        self._report(self.count)
        self._reported, self._reported_at = self.count, time.monotonic()
