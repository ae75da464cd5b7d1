"""RankPool: N spawned local ranks joined in one process group, running functions sent to them.

The parent never blocks without a bound: every wait watches the workers' replies, their process
sentinels (a killed worker is noticed at once) and a deadline. A worker that raises sends back the
exception's type, message and traceback; since its peers may then be stuck in a collective, the
pool is torn down and the error re-raised in the caller as :class:`WorkerError`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

__all__ = ["RankContext", "RankPool", "WorkerDiedError", "WorkerError"]

START_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 600.0


class WorkerError(RuntimeError):
    """A rank raised; carries the remote exception type name and traceback."""

    def __init__(self, rank: int, type_name: str, message: str, remote_traceback: str):
        super().__init__(
            f"rank {rank} raised {type_name}: {message}\n\n--- rank {rank} traceback ---\n{remote_traceback}"
        )
        self.rank = rank
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback


class WorkerDiedError(RuntimeError):
    """A rank's process ended without answering."""


@dataclass
class RankContext:
    """What a function running on a rank gets as its first argument."""

    rank: int
    world_size: int
    backend: str
    group: Any
    device: Any
    #: per-rank storage that lives as long as the worker (models kept between calls)
    store: dict = field(default_factory=dict)


def _worker_main(rank, world_size, backend, master_addr, master_port, threads, conn):
    """Entry point of a spawned rank: join the group, then serve calls until told to stop."""
    try:
        import torch
        import torch.distributed as dist

        from tpcore.distributed import device_for, init_process_group

        torch.set_num_threads(threads)
        init_process_group(backend, rank, world_size, master_addr, master_port)
        context = RankContext(rank, world_size, backend, dist.group.WORLD, device_for(backend, rank))
        _send(conn, ("ready", None))
    except BaseException as error:  # report, do not hang the parent
        _send(conn, ("error", _describe(error)))
        return
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            reply = ("ok", fn(context, *args, **kwargs))
        except BaseException as error:
            reply = ("error", _describe(error))
        try:
            _send(conn, reply)
        except Exception as error:  # e.g. an unpicklable result
            _send(conn, ("error", _describe(error)))
    dist.destroy_process_group()
    conn.close()
    os._exit(0)  # skip interpreter teardown: gloo threads may abort in static destructors


def _send(conn, message) -> None:
    """Plain pickle by value: no tensor goes through shared memory, so nothing is left behind."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _describe(error: BaseException) -> tuple[str, str, str]:
    return type(error).__qualname__, str(error), "".join(traceback.format_exception(error))


class RankPool:
    """``world_size`` spawned ranks in one process group (gloo on CPU, NCCL on GPUs).

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"`` (``None``: NCCL when CUDA is there).
        master_addr: rendezvous address, loopback by default.
        master_port: rendezvous port; ``None`` picks a free one.
        threads_per_rank: torch intra-op threads per rank; default splits the cores evenly.
        start_timeout: seconds to wait for every rank to join.
    """

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        *,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        threads_per_rank: int | None = None,
        start_timeout: float = START_TIMEOUT_S,
    ):
        from tpcore.distributed import default_backend, free_port

        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend or default_backend()
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        port = master_port or free_port(master_addr)
        context = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent_end, child_end = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(rank, world_size, self.backend, master_addr, port, threads, child_end),
                name=f"tpcore-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(proc)
        try:
            self._collect(start_timeout, "start")
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(proc.is_alive() for proc in self._procs)

    def run(self, fn: Callable[..., Any], *args, timeout: float = CALL_TIMEOUT_S, **kwargs) -> list[Any]:
        """Call ``fn(context, *args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be importable by the workers (a module-level function). Calls from several
        threads are serialized. If any rank raises or dies, the pool is closed and the error raised.
        """
        with self._lock:
            if not self.alive:
                raise WorkerDiedError("this RankPool is closed or lost a rank; create a new one")
            try:
                for conn in self._conns:
                    _send(conn, (fn, args, kwargs))
                return self._collect(timeout, getattr(fn, "__qualname__", repr(fn)))
            except BaseException:
                self.close(timeout=3.0)  # peers of a failed rank may be stuck in a collective
                raise

    def _collect(self, timeout: float, what: str) -> list[Any]:
        """One reply per rank, watching replies, deaths and the deadline."""
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what}: ranks {sorted(waiting.values())} gave no answer within {timeout:.0f} s")
            for ready in wait([*waiting, *sentinels], timeout=remaining):
                if ready in waiting:
                    rank = waiting.pop(ready)
                    try:
                        status, payload = _recv(ready)
                    except (EOFError, OSError):
                        raise self._died(rank, what) from None
                    if status == "error":
                        raise WorkerError(rank, *payload)
                    results[rank] = payload
                else:
                    rank = sentinels.pop(ready)
                    conn = self._conns[rank]
                    if conn in waiting and not conn.poll():  # dead, and no reply left in the pipe
                        raise self._died(rank, what)
        return [results[rank] for rank in range(self.world_size)]

    def _died(self, rank: int, what: str) -> WorkerDiedError:
        process = self._procs[rank]
        process.join(1.0)
        return WorkerDiedError(f"{what}: rank {rank} died (exit code {process.exitcode}) without answering")

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank (politely, then by force) and release their pipes. Idempotent."""
        for conn in self._conns:
            try:
                _send(conn, None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
