"""Collecting the ranks' replies to one call, in the caller: replies, the events before them, deaths, a deadline.

A rank may send events before its reply (:mod:`tpcore.ranks.worker`): each ``tpcore`` log record, re-emitted here
with the rank (:mod:`tpcore.log`), and running counts, given to the call's ``on_progress``; events do not move the
deadline. A rank that raised replies with its error; the others then get :data:`ERROR_GRACE_S` to answer, and the
first error is raised, marked ``pool_consistent`` when every rank answered. A rank whose connection closes died
(:class:`~tpcore.errors.WorkerDiedError`); no reply by the deadline is a ``TimeoutError``.
"""

from __future__ import annotations

import math
import select
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from tpcore import log
from tpcore.ranks.failures import WorkerError
from tpcore.ranks.rank_processes import rank_died
from tpcore.ranks.wire import recv

__all__ = ["ERROR_GRACE_S", "Readable", "Replies"]

#: after one rank fails, how long the others get to answer before the pool is presumed stuck
ERROR_GRACE_S = 3.0
#: what a rank may send before its reply: a log record, a running count
EVENTS = ("log", "progress")


class Replies:
    """The replies to one call named ``what`` from the ranks on ``connections`` (their ``processes`` named when one
    dies); each rank that answers joins ``answered``; ``on_progress(rank, count)`` gets the running counts."""

    def __init__(
        self,
        connections: list,
        processes: list,
        what: str,
        answered: set[int],
        on_progress: Callable[[int, int], None] | None = None,
    ):
        self.connections, self.processes, self.what = connections, processes, what
        self.answered, self.on_progress = answered, on_progress
        self.results: dict[int, Any] = {}
        self.errors: list[WorkerError] = []

    def collect(
        self, timeout: float, ranks: list[int] | None = None, wanted: list[int] | None = None
    ) -> dict[int, Any]:
        """A reply from each of ``ranks`` (all by default), by rank. With ``wanted``, it returns once those ranks have
        answered (unless one failed: then every rank gets its grace), leaving the others' replies to be read."""
        deadline = time.monotonic() + timeout
        waiting = {self.connections[rank]: rank for rank in (range(len(self.connections)) if ranks is None else ranks)}
        wanted_connections = [self.connections[rank] for rank in wanted] if wanted is not None else list(waiting)
        readable = Readable(waiting)
        while waiting and (self.errors or any(conn in waiting for conn in wanted_connections)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if self.errors:
                    break
                raise TimeoutError(
                    f"{self.what}: ranks {sorted(waiting.values())} gave no answer within {timeout:.0f} s"
                )
            for ready in readable.wait(remaining):
                rank = waiting.pop(ready)
                status = self._read(ready, rank)
                if status in EVENTS:
                    waiting[ready] = rank  # the reply is still to come
                    continue
                readable.forget(ready)
                if status == "error":
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if self.errors:
            first = self.errors[0]
            first.pool_consistent = not waiting
            raise first
        return self.results

    def _read(self, connection: Any, rank: int) -> str:
        """Read one message of ``rank`` and handle it; its status: an event of :data:`EVENTS`, ``"ok"`` or
        ``"error"`` (the reply)."""
        try:
            status, payload = recv(connection)
        except (EOFError, OSError):
            raise rank_died(self.processes[rank], rank, self.what) from None
        if status in EVENTS:
            if status == "log":
                log.emit_rank_record(rank, payload)
            elif self.on_progress is not None:
                self.on_progress(rank, payload)
            return status
        self.answered.add(rank)
        if status == "error":
            self.errors.append(WorkerError(rank, *payload))
        else:
            self.results[rank] = payload
        return status


class Readable:
    """The connections one collection of replies waits on, in one ``poll`` set made for it (a served call
    waits once or twice: ``multiprocessing.connection.wait`` builds a selector each time, tens of
    microseconds on caches the ranks' step left cold). Where the system has no ``poll``, that ``wait``."""

    def __init__(self, connections):
        self._by_fd = {conn.fileno(): conn for conn in connections}
        self._poll = select.poll() if hasattr(select, "poll") else None
        for fd in self._by_fd if self._poll is not None else ():
            self._poll.register(fd, select.POLLIN)

    def wait(self, timeout: float) -> list:
        """The connections that can be read (a reply, an event, or a closed end) within ``timeout`` seconds."""
        if self._poll is None:
            return wait(list(self._by_fd.values()), timeout=timeout)
        return [self._by_fd[fd] for fd, _ in self._poll.poll(math.ceil(timeout * 1000))]

    def forget(self, conn) -> None:
        """Stop waiting on ``conn`` (its reply is read)."""
        if self._by_fd.pop(conn.fileno(), None) is not None and self._poll is not None:
            self._poll.unregister(conn.fileno())
