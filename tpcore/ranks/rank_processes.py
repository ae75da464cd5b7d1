"""The ranks' processes, as the caller of a :class:`~tpcore.ranks.process.RankPool` starts, watches and stops them.

Each rank is a fresh interpreter (CPU ranks: forked from the caller's zygote, :mod:`tpcore.ranks.zygote`) in a
session of its own, with the caller's environment less an outer launcher's
world. A rank that ends early is named with how it ended; stopping asks each rank politely, then kills and reaps
those left. Records go to the pool's logger, ``tpcore.process``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from tpcore import log
from tpcore.ranks.failures import WorkerDiedError
from tpcore.ranks.wire import send
from tpcore.ranks.worker import AUTHKEY_ENV, PARENT_ENV, worker_command
from tpcore.ranks.zygote import ForkedRank, fork_rank, forks_ranks

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = [
    "raise_if_exited",
    "rank_died",
    "spawn_ranks",
    "starting_text",
    "stop_ranks",
    "stopping_thread",
]

logger = logging.getLogger("tpcore.process")


def spawn_ranks(
    address: str,
    authkey: bytes,
    world_size: int,
    backend: str,
    device: str,
    master_addr: str,
    master_port: int,
    threads: int,
    preload: Sequence[str],
) -> Iterator[subprocess.Popen | ForkedRank]:
    """Start every rank's interpreter (CPU ranks: forked from this process's zygote, :mod:`tpcore.ranks.zygote`),
    yielding each as it starts (a start that fails leaves those before it to
    stop): it connects back to ``address`` with ``authkey`` and meets the others in the store at
    ``master_addr:master_port``, in its own session (a terminal's Ctrl-C, sent to the foreground process group,
    spares the ranks)."""
    env = _rank_environment(master_addr, backend)
    env[AUTHKEY_ENV] = authkey.hex()
    forked = forks_ranks(device, env)
    for rank in range(world_size):
        command = worker_command(address, rank, world_size, backend, device, master_addr, master_port, threads, preload)
        if forked:
            yield fork_rank(command[3:], env, preload)
        else:
            yield subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def starting_text(procs: Sequence[subprocess.Popen | ForkedRank]) -> str:
    """The ranks just started, in words, without waiting for a forked one's pid: ``"pids 12, 13"`` or
    ``"forked by pid 11"``."""
    zygotes = {proc.zygote_pid for proc in procs if isinstance(proc, ForkedRank)}
    if zygotes:
        return f"forked by pid {', '.join(map(str, sorted(zygotes)))}"
    return f"pids {', '.join(str(proc.pid) for proc in procs)}"


def _rank_environment(master_addr: str, backend: str) -> dict[str, str]:
    """The ranks' environment: the caller's, less an outer launcher's world, with the caller's imports,
    and collectives' sockets on the rendezvous address's interface unless the user chose one."""
    from tpcore.ranks.distributed import LAUNCHER_VARIABLES, interface_of

    env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    env[PARENT_ENV] = str(os.getpid())
    env[log.LEVEL_ENV] = str(log.caller_level())  # a rank's records start at the caller's level
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the caller's imports resolve
    interface = interface_of(master_addr)
    socket_variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if interface is not None and socket_variable not in env:
        env[socket_variable] = interface  # gloo would otherwise listen where the host name resolves
    return env


def raise_if_exited(procs: list[subprocess.Popen], connected: set[int]) -> None:
    """Raise :class:`WorkerDiedError` if a rank that has not connected yet (not in ``connected``) has exited."""
    for rank, process in enumerate(procs):
        if rank not in connected and process.poll() is not None:
            message = f"start: rank {rank} (pid {process.pid}) {_ending(process.returncode)} before connecting"
            logger.error("%s", message)
            raise WorkerDiedError(message)


def rank_died(process: subprocess.Popen, rank: int, what: str) -> WorkerDiedError:
    """The error for ``rank`` (its ``process``) found gone during ``what``, logged once its exit code is in (a
    second at most)."""
    try:
        process.wait(1.0)
    except subprocess.TimeoutExpired:
        pass
    logger.error("rank %d (pid %d) %s during %s", rank, process.pid, _ending(process.returncode), what)
    return WorkerDiedError(f"{what}: rank {rank} died (exit code {process.returncode}) without answering")


def _ending(returncode: int | None) -> str:
    """How a rank's process ended, in words: ``"was killed by SIGKILL"``, ``"exited with code 1"``."""
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def stop_ranks(procs: list[subprocess.Popen], conns: list, grace: float, backend: str, store: TCPStore | None) -> None:
    """Ask each rank to stop, give them ``grace`` seconds, kill those left, reap every one and close the
    connections; then ``store`` (the rendezvous, or ``None``) is released with the last reference to it."""
    for conn in conns:
        try:
            send(conn, None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                logger.error("rank pid %d did not end within 5 s of SIGKILL", proc.pid)
    for conn in conns:
        conn.close()
    if procs:
        codes = ", ".join(str(proc.returncode) for proc in procs)
        logger.info("stopped %d %s ranks (exit codes %s)", len(procs), backend, codes)


def stopping_thread(
    procs: list[subprocess.Popen], conns: list, grace: float, backend: str, store: TCPStore | None
) -> threading.Thread:
    """A thread, not started yet, that runs :func:`stop_ranks` (join it to wait until the ranks are reaped)."""
    return threading.Thread(target=stop_ranks, args=(procs, conns, grace, backend, store), name="tpcore-rank-stop")
