"""The rank side of a :class:`~tpcore.ranks.process.RankPool`: one rank's process, from its command line to its exit.

A rank is a fresh interpreter (:func:`worker_command`), or a fork of the zygote, one that has made a rank's imports
(:mod:`tpcore.ranks.zygote`). It watches its caller (or the zygote) from its first line
(:data:`WORKER_CODE`), connects back to it
(:mod:`tpcore.ranks.handshake`), binds its device, joins the group, then serves calls until told to stop: each
call is ``(fn, args, kwargs, log level)``, run as ``fn(context, *args, **kwargs)`` with a :class:`RankContext`
and answered ``("ok", result)`` or ``("error", describe(exception))`` (:mod:`tpcore.ranks.failures`).

After its answer a rank runs the work the call left for its idle time (:attr:`RankContext.idle_work`: the served
model's guessed next step, ``tpcore.served.lookahead``), then waits for the next call.

Before its answer a rank may send events, which the caller handles and keeps waiting: ``("log", record)``
for each ``tpcore`` record at the caller's level (:mod:`tpcore.log`), ``("progress", count)`` for a running
count (:meth:`RankContext.report_progress`). One lock orders every send, since records may come from any thread.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tpcore import log
from tpcore.ranks.failures import describe
from tpcore.ranks.handshake import connect
from tpcore.ranks.wire import byte_view, recv, send

__all__ = [
    "AUTHKEY_ENV",
    "PARENT_ENV",
    "PARENT_WATCH_CODE",
    "WORKER_CODE",
    "RankContext",
    "synchronize",
    "worker_command",
    "worker_entry",
]

#: the environment variables a rank finds its caller's control-channel key and process id in (and removes)
AUTHKEY_ENV = "TPCORE_WORKER_AUTHKEY"
PARENT_ENV = "TPCORE_WORKER_PARENT"
#: how often a rank looks whether its caller is still there
PARENT_WATCH_INTERVAL_S = 0.1
#: the watch that ends a rank once its parent is gone (re-parented: killed, even while the rank sits in a collective);
#: a rank that ends so removes the caller's control socket and its directory, which a caller killed during the start
#: leaves behind. Text, so that it runs before the seconds that importing tpcore and torch take.
PARENT_WATCH_CODE = f"""\
import os, sys, threading, time

def _watch_parent(parent, control_socket):
    while os.getppid() == parent:
        time.sleep({PARENT_WATCH_INTERVAL_S})
    if control_socket:
        for remove, path in ((os.unlink, control_socket), (os.rmdir, os.path.dirname(control_socket))):
            try:
                remove(path)
            except OSError:
                pass
    os._exit(1)

def _start_watch(parent, control_socket):
    watch = threading.Thread(target=_watch_parent, args=(parent, control_socket), name="tpcore-parent-watch")
    watch.daemon = True
    watch.start()
"""
#: what ``python -c`` runs in a rank: the watch of its caller from its first lines, then :func:`worker_entry` with the
#: arguments :func:`worker_command` appends.
WORKER_CODE = f"""\
{PARENT_WATCH_CODE}
_start_watch(int(os.environ.pop("{PARENT_ENV}")), sys.argv[1])
from tpcore.ranks.worker import worker_entry
worker_entry(sys.argv[1:])
"""

logger = logging.getLogger("tpcore.worker")


def worker_command(
    address, rank, world_size, backend, device_kind, master_addr, master_port, threads, preload=()
) -> list[str]:
    """The command line of a rank: this interpreter, connecting to the control socket at ``address``,
    importing the modules ``preload`` names, and meeting the other ranks in the store at ``master_addr:master_port``."""
    argv = [address, rank, world_size, backend, device_kind, master_addr, master_port, threads, ",".join(preload)]
    return [sys.executable, "-c", WORKER_CODE, *map(str, argv)]


@dataclass
class RankContext:
    """What a function running on a rank gets as its first argument."""

    rank: int
    world_size: int
    backend: str
    #: the tensor-parallel group: every rank of the pool
    tp_group: Any
    device: Any
    #: per-rank storage that lives as long as the worker (models kept between calls)
    store: dict = field(default_factory=dict)
    connection: Any = field(default=None, repr=False)
    channel: Channel | None = field(default=None, repr=False)
    #: work a call leaves to run once its reply is sent, before the rank waits for the next call (one call's
    #: worth: taken, then cleared); what it raises is logged, not sent: the call was already answered
    idle_work: Callable[[], None] | None = field(default=None, repr=False)

    def receive_tensors(self, metas: list[tuple[tuple[int, ...], Any]]) -> list:
        """The raw tensors :meth:`RankPool.scatter` streams after this call: ``(shape, dtype)``
        each, read straight into their own storage (no pickle, no extra copy)."""
        import torch

        tensors = []
        for shape, dtype in metas:
            tensor = torch.empty(shape, dtype=dtype)
            if tensor.numel():
                self.connection.recv_bytes_into(byte_view(tensor))
            else:
                self.connection.recv_bytes()
            tensors.append(tensor)
        return tensors

    def run_idle_work(self) -> None:
        """Run and clear :attr:`idle_work`, if a call left any."""
        work, self.idle_work = self.idle_work, None
        if work is None:
            return
        try:
            work()
        except Exception:
            logger.exception("work left by the last call failed")

    def report_progress(self, count: int) -> None:
        """Tell the caller this rank's running count (of bytes loaded, say); the call's ``on_progress`` gets it."""
        if self.channel is not None:
            self.channel.send(("progress", count))


class Channel:
    """The rank's sending end of its connection: whole messages, one at a time, from any thread.

    A send started while this thread is already sending (a record logged from inside a send) raises
    ``RuntimeError`` rather than wait for itself."""

    def __init__(self, connection):
        self.connection = connection
        self._lock = threading.Lock()
        self._sender: int | None = None

    def send(self, message) -> None:
        if self._sender == threading.get_ident():
            raise RuntimeError("a send is already under way on this thread")
        with self._lock:
            self._sender = threading.get_ident()
            try:
                send(self.connection, message)
            finally:
                self._sender = None


def synchronize(device) -> None:
    """Wait for the kernels queued on a CUDA ``device``, so that a kernel's error is raised by the call
    that queued it (and a rank replies only once its work is done); nothing to wait for on the CPU."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _worker_main(
    address, rank, world_size, backend, device_kind, master_addr, master_port, threads, preload=()
) -> None:
    """A rank: connect to the caller, import what it will need, bind its device, join the group, then serve
    calls until told to stop."""
    started = time.monotonic()
    conn = connect(address, bytes.fromhex(os.environ.pop(AUTHKEY_ENV)), rank)
    channel = Channel(conn)
    # every tpcore record goes to the caller; restored should this function return (a failed start)
    with log.records_forwarded(lambda record: channel.send(("log", record)), log.caller_level()):
        try:
            import torch
            import torch.distributed as dist

            _import_quietly(preload)

            from tpcore.parallel import shm
            from tpcore.ranks.distributed import bind_device, device_for, init_process_group

            torch.set_num_threads(threads)
            device = device_for(backend, rank, device_kind)
            bind_device(device)  # before the group: NCCL (and CUDA's context) on this rank's GPU, not cuda:0
            store = dist.TCPStore(master_addr, master_port, world_size, False, timeout=datetime.timedelta(minutes=5))
            init_process_group(backend, rank, world_size, store, device=device)
            shm.attach(dist.group.WORLD)
            context = RankContext(rank, world_size, backend, dist.group.WORLD, device, connection=conn, channel=channel)
            logger.info(
                "joined the %s group on %s (pid %d) in %.1f s", backend, device, os.getpid(), time.monotonic() - started
            )
            channel.send(("ok", str(device)))
        except BaseException as error:  # report, do not hang the caller
            channel.send(("error", describe(error)))
            return
        while True:
            try:
                message = recv(conn)
            except (EOFError, OSError):  # the caller is gone
                break
            if message is None:
                break
            _answer(context, channel, message)
            message = None  # a call's inputs (and through them its outputs) are not kept until the next call
            context.run_idle_work()
        dist.destroy_process_group()
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown: gloo threads may abort in static destructors


def _answer(context: RankContext, channel: Channel, message) -> None:
    """Run one call ``(fn, args, kwargs, log level)`` and send its reply."""
    try:
        fn, args, kwargs, level = message
        log.set_rank_level(level)
        result = fn(context, *args, **kwargs)
        synchronize(context.device)
        reply = ("ok", result)
    except BaseException as error:
        reply = ("error", describe(error))
    try:
        channel.send(reply)
    except Exception as error:  # e.g. an unpicklable result
        channel.send(("error", describe(error)))


def _import_quietly(modules) -> None:
    """Import ``modules`` ahead of need; one that fails is left for the code that needs it to report."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            pass


def worker_entry(argv: list[str]) -> None:
    """``python -c`` entry point of a rank (see :data:`WORKER_CODE`)."""
    address, rank, world_size, backend, device_kind, master_addr, master_port, threads, preload = argv
    preloaded = tuple(name for name in preload.split(",") if name)
    _worker_main(
        address,
        int(rank),
        int(world_size),
        backend,
        device_kind,
        master_addr,
        int(master_port),
        int(threads),
        preloaded,
    )
