"""A tensor-parallel group of threads in one process, for proving a split on a tiny model without starting ranks.

Each of ``N`` threads runs one rank's shard; :class:`ThreadGroup`'s collectives meet at a barrier, where the
last thread to arrive sums (or concatenates) every rank's tensor and every thread takes the result. The
layers' collectives (:mod:`tpcore.parallel.comm`) use it where their ``tp_group`` is one, so a split model
runs as it does on real ranks: the same sums, in rank order, in one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["ThreadGroup", "run_ranks"]

#: seconds a thread waits at a collective for the others (a rank that raised breaks the barrier at once)
TIMEOUT_S = 120.0


class ThreadGroup:
    """``world_size`` threads acting as ranks; each thread's rank is the one :func:`run_ranks` gave it."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._local = threading.local()
        self._barrier = threading.Barrier(world_size, timeout=TIMEOUT_S)
        self._slots: list[Any] = [None] * world_size

    @property
    def rank(self) -> int:
        return self._local.rank

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks (in rank order) in place and return it."""
        parts = self._exchange(tensor.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor``, concatenated along ``dim`` in rank order."""
        return torch.cat(self._exchange(tensor.clone()), dim=dim)

    def _exchange(self, value: torch.Tensor) -> list[torch.Tensor]:
        self._slots[self.rank] = value
        self._barrier.wait()  # every rank's value is in place
        parts = list(self._slots)
        self._barrier.wait()  # every rank has read them before any writes its next one
        return parts

    def abort(self) -> None:
        self._barrier.abort()


def run_ranks(group: ThreadGroup, work: Callable[[int], Any]) -> Sequence[Any]:
    """``[work(0), ..., work(N - 1)]``, each in its own thread as that rank of ``group``; the first rank's
    exception (by rank) is raised here after every thread ends."""
    results: list[Any] = [None] * group.world_size
    errors: list[BaseException | None] = [None] * group.world_size

    def main(rank: int) -> None:
        group._local.rank = rank
        try:
            results[rank] = work(rank)
        except BaseException as error:  # noqa: BLE001  (re-raised in the caller)
            errors[rank] = error
            group.abort()  # the others stop waiting for this rank

    threads = [threading.Thread(target=main, args=(rank,), daemon=True) for rank in range(group.world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((error for error in errors if error is not None and not _broken(error)), None)
    first = first or next((error for error in errors if error is not None), None)
    if first is not None:
        raise first
    return results


def _broken(error: BaseException) -> bool:
    """A rank stopped only because another rank failed first."""
    return isinstance(error, threading.BrokenBarrierError)
