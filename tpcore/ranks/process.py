"""RankPool: N local ranks joined in one process group, running functions sent to them (the caller side).

Ranks are fresh interpreters (``python -c`` into :mod:`tpcore.ranks.worker`, which holds the rank side; CPU ranks
forked from one that has done a rank's imports once, :mod:`tpcore.ranks.zygote`), never forks of the caller or
``multiprocessing`` spawns: they never re-import the caller's ``__main__``, so scripts need
no ``if __name__ == "__main__"`` guard and notebooks work. They run in their own session, so a
terminal's Ctrl-C reaches the caller only, and they end soon after the caller does, however it ends.
Messages (:mod:`tpcore.ranks.wire`) travel over Unix sockets the ranks authenticate on (:mod:`tpcore.ranks.handshake`);
the ranks meet in a TCP store that the caller serves on the rendezvous address alone (loopback by default). How
their processes start and stop: :mod:`tpcore.ranks.rank_processes`.

The caller never blocks without a bound: every wait watches the ranks' connections (a dead rank
closes its end at once) and a deadline. A rank that raises sends back the exception, its type,
message and traceback. If every rank answered, the pool stays usable and the error is raised as
:class:`WorkerError`; if some rank gave no answer (it may be stuck in a collective with the failed
one), the pool is torn down: the error is raised at once, the ranks that owe an answer are killed, and the
others are stopped in the background (:meth:`RankPool.close` and the interpreter's exit wait for that).

Only the process that started the ranks stops them. A child forked from it (a preloading server's worker, a
``DataLoader`` worker, a ``fork`` start method) inherits the pool, its connections and the exit hook; there
they release the child's own copies and leave the ranks to the parent.

While it waits for the replies of a call, the caller handles the events a rank sends before its reply
(:mod:`tpcore.ranks.worker`): the rank's ``tpcore`` log records, re-emitted here with the rank (:mod:`tpcore.log`),
and running counts, given to the call's ``on_progress``. Events do not move the deadline. The pool logs
its ranks' start and stop, and a rank's death, to ``tpcore.process``.

This module is also the public place of the names a function sent to the ranks and its caller use:
:class:`RankContext`, :class:`WorkerError`, :class:`WorkerDiedError` and :func:`reraise`.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import pickle
import secrets
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tpcore import log
from tpcore.ranks.failures import WorkerDiedError, WorkerError, reraise
from tpcore.ranks.handshake import ControlListener
from tpcore.ranks.rank_processes import (
    raise_if_exited,
    rank_died,
    spawn_ranks,
    starting_text,
    stop_ranks,
    stopping_thread,
)
from tpcore.ranks.replies import Replies
from tpcore.ranks.wire import byte_view, encode
from tpcore.ranks.worker import RankContext
from tpcore.ranks.zygote import ForkedRank

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["RankContext", "RankPool", "WorkerDiedError", "WorkerError", "reraise"]

START_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 600.0
#: how long the ranks a failed call leaves idle get to stop politely before they are killed
STOP_GRACE_S = 3.0

logger = logging.getLogger("tpcore.process")

_live_pools: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    """On the caller's exit (normal, by exception or Ctrl-C), stop every rank it still has (in a forked
    child, which inherits this hook, :meth:`RankPool.close` leaves the parent's ranks alone)."""
    for pool in list(_live_pools):
        pool.close(timeout=STOP_GRACE_S)


class RankPool:
    """``world_size`` local ranks in one process group (gloo on CPU, NCCL on GPUs).

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"`` (``None``: NCCL when there is a CUDA device per rank, else gloo).
        device: ``"cuda"`` or ``"cpu"``; ``None`` is CUDA for NCCL, the CPU for gloo. NCCL rank ``r``
            uses ``cuda:r``, gloo rank ``r`` with ``"cuda"`` uses ``cuda:(r % devices)`` (ranks may share a GPU).
        master_addr: rendezvous address, loopback by default.
        master_port: rendezvous port; ``None`` picks a free one.
        threads_per_rank: torch intra-op threads per rank; default splits the cores evenly.
        start_timeout: seconds to wait for every rank to join.
        preload: modules each rank imports while it starts (those the functions sent to it will need, such
            as a model's modeling code), so that the import overlaps the caller's own work.
        wait: wait here until every rank has joined; with ``False`` the ranks start in the background and
            the pool finishes starting in :meth:`wait_started` (or its first call).
    """

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        *,
        device: str | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        threads_per_rank: int | None = None,
        start_timeout: float = START_TIMEOUT_S,
        preload: Sequence[str] = (),
        wait: bool = True,
    ):
        from tpcore.ranks.distributed import check_placement, default_backend, listening_store

        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend or default_backend(world_size)
        #: ``"cuda"`` or ``"cpu"``: what the ranks compute on (refused here, before any rank starts, if impossible)
        self.device = check_placement(self.backend, world_size, device)
        self._deadline = time.monotonic() + start_timeout
        self._owner_pid = _process_id()  # the one process that may stop the ranks (a forked child inherits the pool)
        self._lock = threading.Lock()
        self._conns: list = []
        self._procs: list[subprocess.Popen | ForkedRank] = []
        self._answered: set[int] = set()  # the ranks that answered the current call
        #: the ranks whose answer to the last call (a :meth:`run_first`) is still to be read, and that call's name
        self._owed: tuple[list[int], str] = ([], "")
        self._stopping: threading.Thread | None = None  # the ranks of a failed call, being stopped
        #: each rank's device (``"cpu"``, ``"cuda:0"``), as the rank names it once it has joined
        self.devices: list[str] = []
        self._listener: ControlListener | None = None
        # The ranks meet in a store served here, listening on master_addr alone (a busy port fails now).
        store = listening_store(master_addr, master_port or 0, datetime.timedelta(seconds=start_timeout))
        self._store: TCPStore | None = store
        _live_pools.add(self)
        self._authkey = secrets.token_bytes(32)
        try:
            listener = self._listener = ControlListener()
            threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
            spawned = spawn_ranks(
                listener.address,
                self._authkey,
                world_size,
                self.backend,
                self.device,
                master_addr,
                store.port,
                threads,
                preload,
            )
            for process in spawned:  # one at a time: if one fails to start, those before it are stopped
                self._procs.append(process)
        except BaseException:
            self.close(timeout=0.0)
            raise
        logger.info("starting %d %s ranks (%s)", world_size, self.backend, starting_text(self._procs))
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait until every rank has connected and joined the group (at once if they have). If one fails to,
        the pool is closed and the error raised: :class:`WorkerError` for a rank's exception,
        :class:`WorkerDiedError` for a rank that exited, ``TimeoutError`` past the start timeout."""
        if self._listener is None:
            return
        try:
            self._conns = self._listener.accept_ranks(
                self._authkey,
                self.world_size,
                self._deadline,
                lambda connected: raise_if_exited(self._procs, connected),
            )
            started = self._collect(max(0.0, self._deadline - time.monotonic()), "start")
            self.devices = [started[rank] for rank in range(self.world_size)]
            logger.info("%r: every rank joined", self)
        except BaseException:
            self.close(timeout=3.0)
            raise
        finally:
            self._close_listener()

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(proc.poll() is None for proc in self._procs)

    @property
    def master_port(self) -> int | None:
        """The port of the rendezvous store this process serves for the ranks (``None`` once closed)."""
        return self._store.port if self._store is not None else None

    @property
    def pids(self) -> list[int | None]:
        return [proc.pid for proc in self._procs]

    def run(
        self,
        fn: Callable[..., Any],
        *args,
        timeout: float = CALL_TIMEOUT_S,
        on_progress: Callable[[int, int], None] | None = None,
        **kwargs,
    ) -> list[Any]:
        """Call ``fn(context, *args, **kwargs)`` on every rank; return the results in rank order.
        ``on_progress(rank, count)`` gets each running count a rank reports (``context.report_progress``).

        Calls from several threads are serialized. Raises :class:`WorkerError` if a rank raised
        (the pool is torn down unless every rank answered), :class:`WorkerDiedError` if a rank died
        and ``TimeoutError`` past ``timeout`` seconds (both tear the pool down: :meth:`_tear_down`).
        """
        return self._run(fn, args, kwargs, timeout, on_progress=on_progress)

    def run_first(self, fn: Callable[..., Any], *args, timeout: float = CALL_TIMEOUT_S, **kwargs) -> Any:
        """:meth:`run`, returning rank 0's result as soon as it is here: the other ranks' answers are read
        at the start of the next call (or a failure meanwhile, at once), which raises a rank's error then.

        For a call whose other results are not wanted (a served forward: rank 0 holds the output): a reply that
        comes after rank 0's is not waited for (a wake-up of the caller's process, on a host whose cores the
        ranks hold), but read when the next call starts."""
        return self.run_some(fn, *args, ranks=[0], timeout=timeout, **kwargs)[0]

    def run_some(
        self, fn: Callable[..., Any], *args, ranks: Sequence[int], timeout: float = CALL_TIMEOUT_S, **kwargs
    ) -> list[Any]:
        """:meth:`run_first` for the results of ``ranks`` (in their order), the others' answers read later."""
        results = self._run(fn, args, kwargs, timeout, wanted=list(ranks))
        return [results[rank] for rank in ranks]

    def _run(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        timeout: float,
        wanted: list[int] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[Any]:
        self._refuse_foreign_process()
        with self._lock:
            self._ready()
            self._settle(timeout)
            what = getattr(fn, "__qualname__", repr(fn))
            message = _encoded((fn, args, kwargs, log.caller_level()), what)  # large tensors: one segment for all
            with self._torn_down_on_failure(keep_if_consistent=True):
                with message:
                    for rank, conn in enumerate(self._conns):
                        self._send(rank, what, message.send, conn)
                results = self._collect(timeout, what, wanted=wanted, on_progress=on_progress)
                self._owed = ([rank for rank in range(self.world_size) if rank not in results], what)
                return [results.get(rank) for rank in range(self.world_size)]

    def _settle(self, timeout: float) -> None:
        """Read the answers the last call left owed (:meth:`run_first`); a failed one raises its error here."""
        ranks, what = self._owed
        if not ranks:
            return
        self._owed = ([], "")
        with self._torn_down_on_failure(keep_if_consistent=True):
            self._collect(timeout, what, ranks=ranks)

    def scatter(
        self,
        fn: Callable[..., Any],
        args_for: Callable[[int], tuple],
        tensors_for: Callable[[int], Any] | None = None,
        *,
        timeout: float = CALL_TIMEOUT_S,
        on_progress: Callable[[int, int], None] | None = None,
    ):
        """Call ``fn(context, *args_for(rank))`` on every rank, one rank at a time.

        ``tensors_for(rank)`` may yield CPU tensors to stream to that rank right after the call
        message, as raw bytes; ``fn`` reads them with ``context.receive_tensors``. The caller thus
        holds one rank's share of one tensor at a time, and a rank only its own tensors.
        ``on_progress(rank, count)`` gets each running count a rank reports (``context.report_progress``).
        Any failure tears the pool down.
        """
        self._refuse_foreign_process()
        with self._lock:
            self._ready()
            self._settle(timeout)
            what = getattr(fn, "__qualname__", repr(fn))
            with self._torn_down_on_failure(keep_if_consistent=False):
                for rank, conn in enumerate(self._conns):
                    with encode((fn, args_for(rank), {}, log.caller_level())) as message:
                        self._send(rank, what, message.send, conn)
                    for tensor in tensors_for(rank) if tensors_for else ():
                        frame = byte_view(tensor.detach().contiguous()) if tensor.numel() else b""
                        self._send(rank, what, conn.send_bytes, frame)
                results = self._collect(timeout, what, on_progress=on_progress)
                return [results[rank] for rank in range(self.world_size)]

    def _refuse_foreign_process(self) -> None:
        """Refuse a call from a forked child: the ranks and their connections are its parent's."""
        if _process_id() != self._owner_pid:
            raise WorkerDiedError(
                f"this RankPool's ranks belong to process {self._owner_pid}, which this process was forked from; "
                "parallelize again here to use a model in this process"
            )

    @contextlib.contextmanager
    def _torn_down_on_failure(self, keep_if_consistent: bool):
        """A call: if it fails, the pool is torn down before the error goes on (unless ``keep_if_consistent``
        and the error is a :class:`WorkerError` every rank answered)."""
        self._answered = set()
        try:
            yield
        except WorkerError as error:
            if not (keep_if_consistent and error.pool_consistent):
                self._tear_down()
            raise
        except BaseException:
            self._tear_down()  # a dead or stuck rank: the others may hang in a collective
            raise

    def _tear_down(self) -> None:
        """After a failed call, before its error is raised: the pool reads as closed from here on, the ranks that
        owe an answer are killed now (stuck in the call, or in a collective with a failed rank, they would never
        read a stop), and all of them are stopped and reaped by a thread that :meth:`close` and the interpreter's
        exit wait for (reaping a killed rank that held much memory, or a GPU, can take seconds)."""
        procs, conns, store = self._procs, self._conns, self._store
        self._procs, self._conns, self._store = [], [], None
        for rank, proc in enumerate(procs):
            if rank not in self._answered:
                proc.kill()
        self._stopping = stopping_thread(procs, conns, STOP_GRACE_S, self.backend, store)
        self._stopping.start()

    def _ready(self) -> None:
        """Finish starting (a pool made with ``wait=False``); refuse a pool that is closed or lost a rank (one that
        died since the last call is found by the send to it: its end of the connection is closed)."""
        self.wait_started()
        if not self._procs:
            raise WorkerDiedError("this RankPool is closed or lost a rank; create a new one")

    def _send(self, rank: int, what: str, send: Callable[..., None], *args) -> None:
        """``send(*args)`` to ``rank``; a rank whose end is gone is reported as dead, not as an ``OSError``."""
        try:
            send(*args)
        except OSError as error:
            raise rank_died(self._procs[rank], rank, what) from error

    def _collect(
        self,
        timeout: float,
        what: str,
        ranks: list[int] | None = None,
        wanted: list[int] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[int, Any]:
        """The replies of ``ranks`` (all by default) to the call ``what`` (:class:`~tpcore.ranks.replies.Replies`;
        those that answer join ``self._answered``)."""
        replies = Replies(self._conns, self._procs, what, self._answered, on_progress)
        return replies.collect(timeout, ranks, wanted)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank (politely, then by force), release their connections and the rendezvous port, and wait
        until the ranks of a failed call are stopped. Idempotent.

        Ranks that never connected (a failed start) cannot be asked and are killed at once. In a process forked
        from the one that started the ranks, only this process's copies of the connections are closed: the
        ranks serve their parent on.
        """
        if _process_id() != self._owner_pid:
            self._release_inherited()
            return
        procs, conns, store = self._procs, self._conns, self._store
        self._procs, self._conns, self._store = [], [], None
        self._close_listener()
        stop_ranks(procs, conns, timeout if conns else 0.0, self.backend, store)
        if self._stopping is not None:
            self._stopping.join()  # bounded: STOP_GRACE_S, then killed
            self._stopping = None

    def _release_inherited(self) -> None:
        """In a forked child: close this process's copies of the connections and of the listener (its socket file
        stays), and forget the ranks, which the parent still serves with and alone stops."""
        for conn in self._conns:
            conn.close()
        self._close_listener()
        if self._procs:
            logger.debug("leaving the ranks of process %d (pids %s) to it", self._owner_pid, self.pids)
        self._procs, self._conns, self._store, self._stopping = [], [], None, None
        _live_pools.discard(self)

    def __repr__(self) -> str:
        placement = ranks_text(self.world_size, self.backend, self.devices or [self.device])
        if not self._procs:
            return f"RankPool({placement}, closed)"
        return f"RankPool({placement}, pids {', '.join(map(str, self.pids))})"

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_procs", None):
            self.close(timeout=1.0)


def _process_id() -> int:
    """This process's id, as of the last fork (``os.getpid`` is a system call, made here once per process)."""
    return _pid[0]


_pid = [os.getpid()]
if hasattr(os, "register_at_fork"):  # elsewhere (Windows) no process is forked
    os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def _encoded(message: Any, what: str):
    """``message`` encoded for the ranks; one that cannot travel (a lock, a thread, an open file among the
    arguments) raises ``TypeError`` here, before anything is sent, and the pool stays as it was."""
    try:
        return encode(message)
    except (TypeError, AttributeError, pickle.PicklingError) as error:
        raise TypeError(f"the arguments of {what} cannot be sent to the ranks: {error}") from error


def ranks_text(world_size: int, backend: str, devices: Sequence[str]) -> str:
    """``"2 gloo ranks on cpu"``, ``"2 nccl ranks on cuda:0, cuda:1"``: each device once, in rank order."""
    return f"{world_size} {backend} rank{'s' if world_size != 1 else ''} on {', '.join(dict.fromkeys(devices))}"
