"""RankPool: N local ranks joined in one process group, running functions sent to them.

Ranks are fresh interpreters (``python -c`` running :func:`worker_entry`), not forks or ``multiprocessing``
spawns: they never re-import the caller's ``__main__``, so scripts need no ``if __name__ ==
"__main__"`` guard and notebooks work. Messages are cloudpickled by value: functions and classes
defined in ``__main__`` travel with them, and no tensor goes through shared memory. Large CPU
tensors in a message (inputs, logits) travel out of band, as raw frames after the pickled rest.

The caller never blocks without a bound: every wait watches the ranks' connections (a dead rank
closes its end at once) and a deadline. A rank that raises sends back the exception, its type,
message and traceback. If every rank answered, the pool stays usable and the error is raised as
:class:`WorkerError`; if some rank gave no answer (it may be stuck in a collective with the failed
one), the pool is torn down first.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Listener, wait
from typing import Any

try:
    import cloudpickle
except ImportError:  # an offline machine without it: code from __main__ cannot travel, the rest works
    cloudpickle = pickle

__all__ = ["RankContext", "RankPool", "WorkerDiedError", "WorkerError"]

START_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 600.0
#: after one rank fails, how long the others get to answer before the pool is presumed stuck
ERROR_GRACE_S = 3.0
#: CPU tensors from this size on travel as raw frames beside the pickled message
RAW_TENSOR_BYTES = 64 * 2**10
AUTHKEY_ENV = "TPCORE_WORKER_AUTHKEY"
PARENT_ENV = "TPCORE_WORKER_PARENT"


class WorkerError(RuntimeError):
    """A rank raised. ``exception`` is the original exception when it could be sent back."""

    def __init__(self, rank: int, type_name: str, message: str, remote_traceback: str, exception=None):
        super().__init__(
            f"rank {rank} raised {type_name}: {message}\n\n--- rank {rank} traceback ---\n{remote_traceback}"
        )
        self.rank = rank
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.exception = exception
        #: every rank answered, so the pool is still usable
        self.pool_consistent = False


class WorkerDiedError(RuntimeError):
    """A rank's process ended without answering, or the pool is closed."""


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
    connection: Any = field(default=None, repr=False)

    def receive_tensors(self, metas: list[tuple[tuple[int, ...], Any]]) -> list:
        """The raw tensors :meth:`RankPool.scatter` streams after this call: ``(shape, dtype)``
        each, read straight into their own storage (no pickle, no extra copy)."""
        import torch

        tensors = []
        for shape, dtype in metas:
            tensor = torch.empty(shape, dtype=dtype)
            if tensor.numel():
                self.connection.recv_bytes_into(_byte_view(tensor))
            else:
                self.connection.recv_bytes()
            tensors.append(tensor)
        return tensors


def _byte_view(tensor):
    """A writable/readable numpy view of a contiguous CPU tensor's bytes (any dtype, bf16 too)."""
    return tensor.reshape(-1).view(_uint8()).numpy()


def _uint8():
    import torch

    return torch.uint8


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with large plain CPU tensors sent out of band: their bytes follow the message
    as raw frames (no copy into the pickle, no torch serialization)."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor and _raw_sendable(obj):
            data = obj.detach().contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy()
            return _tensor_from_buffer, (pickle.PickleBuffer(raw), data.dtype, tuple(data.shape))
        parent = getattr(super(), "reducer_override", None)  # plain pickle (no cloudpickle) has none
        return parent(obj) if parent is not None else NotImplemented


def _raw_sendable(tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout is _strided()
        and not tensor.requires_grad
        and not tensor.is_quantized
        and tensor.numel() * tensor.element_size() >= RAW_TENSOR_BYTES
    )


def _strided():
    import torch

    return torch.strided


def _tensor_from_buffer(buffer, dtype, shape):
    import torch

    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def _encode(message) -> list:
    """A message as frames: the pickled message with the sizes of the raw frames, then each raw frame."""
    buffers: list = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(message)
    raws = [buffer.raw() for buffer in buffers]
    return [pickle.dumps((stream.getvalue(), [raw.nbytes for raw in raws]), protocol=5), *raws]


def _send(conn, message) -> None:
    for frame in _encode(message):
        conn.send_bytes(frame)


def _recv(conn):
    payload, sizes = pickle.loads(conn.recv_bytes())
    buffers = []
    for size in sizes:
        buffer = bytearray(size)
        conn.recv_bytes_into(buffer)
        buffers.append(buffer)
    return pickle.loads(payload, buffers=buffers)


def _describe(error: BaseException) -> tuple:
    """``(type name, message, traceback, exception or None)``, the exception only if it pickles."""
    text = "".join(traceback.format_exception(error))
    try:
        pickle.loads(cloudpickle.dumps(error))
        original = error
    except Exception:
        original = None
    return type(error).__qualname__, str(error), text, original


_live_pools: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    """On the caller's exit (normal, by exception or Ctrl-C), stop every rank it still has."""
    for pool in list(_live_pools):
        pool.close(timeout=3.0)


class RankPool:
    """``world_size`` local ranks in one process group (gloo on CPU, NCCL on GPUs).

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"`` (``None``: NCCL when CUDA is there).
        master_addr: rendezvous address, loopback by default.
        master_port: rendezvous port; ``None`` picks a free one. A port something listens on
            already is refused before any rank starts.
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
        from tpcore.distributed import check_port_free, default_backend, free_port

        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend or default_backend()
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        if master_port:
            check_port_free(master_addr, master_port)
        port = master_port or free_port(master_addr)
        #: the rendezvous port rank 0 listens on
        self.master_port = port
        self._lock = threading.Lock()
        _live_pools.add(self)
        self._conns: list = []
        self._procs: list[subprocess.Popen] = []
        authkey = secrets.token_bytes(32)
        env = dict(os.environ)
        env[AUTHKEY_ENV] = authkey.hex()
        env[PARENT_ENV] = str(os.getpid())
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the caller's imports resolve
        with Listener(family="AF_UNIX", authkey=authkey) as listener:
            for rank in range(world_size):
                argv = [listener.address, rank, world_size, self.backend, master_addr, port, threads]
                command = [sys.executable, "-c", _WORKER_COMMAND, *map(str, argv)]
                self._procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
            try:
                self._conns = self._accept(listener, start_timeout)
                self._collect(start_timeout, "start")
            except BaseException:
                self.close(timeout=3.0)
                raise

    def _accept(self, listener: Listener, timeout: float) -> list:
        """One connection per rank, in rank order; fails fast if a rank exits first."""
        accepted: dict[int, Any] = {}
        result: list = []

        def accept_all():
            try:
                while len(accepted) < self.world_size:
                    conn = listener.accept()
                    accepted[_recv(conn)] = conn
            except Exception as error:  # listener closed or bad handshake
                result.append(error)

        thread = threading.Thread(target=accept_all, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive():
            thread.join(0.1)
            for rank, proc in enumerate(self._procs):
                if rank not in accepted and proc.poll() is not None:
                    self._conns = list(accepted.values())
                    raise WorkerDiedError(f"start: rank {rank} exited (code {proc.returncode}) before connecting")
            if time.monotonic() > deadline:
                self._conns = list(accepted.values())
                raise TimeoutError(f"start: ranks did not connect within {timeout:.0f} s")
        if result:
            raise result[0]
        return [accepted[rank] for rank in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(proc.poll() is None for proc in self._procs)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def run(self, fn: Callable[..., Any], *args, timeout: float = CALL_TIMEOUT_S, **kwargs) -> list[Any]:
        """Call ``fn(context, *args, **kwargs)`` on every rank; return the results in rank order.

        Calls from several threads are serialized. Raises :class:`WorkerError` if a rank raised
        (the pool is closed unless every rank answered), :class:`WorkerDiedError` if a rank died
        and ``TimeoutError`` past ``timeout`` seconds (both close the pool).
        """
        with self._lock:
            if not self.alive:
                raise WorkerDiedError("this RankPool is closed or lost a rank; create a new one")
            try:
                frames = _encode((fn, args, kwargs))
                for conn in self._conns:
                    for frame in frames:
                        conn.send_bytes(frame)
                del frames
                return self._collect(timeout, getattr(fn, "__qualname__", repr(fn)))
            except WorkerError as error:
                if not error.pool_consistent:
                    self.close(timeout=3.0)
                raise
            except BaseException:
                self.close(timeout=3.0)  # a dead or stuck rank: the others may hang in a collective
                raise

    def scatter(
        self,
        fn: Callable[..., Any],
        args_for: Callable[[int], tuple],
        tensors_for: Callable[[int], Any] | None = None,
        *,
        timeout: float = CALL_TIMEOUT_S,
    ):
        """Call ``fn(context, *args_for(rank))`` on every rank, one rank at a time.

        ``tensors_for(rank)`` may yield CPU tensors to stream to that rank right after the call
        message, as raw bytes; ``fn`` reads them with ``context.receive_tensors``. The caller thus
        holds one rank's share of one tensor at a time, and a rank only its own tensors.
        """
        with self._lock:
            if not self.alive:
                raise WorkerDiedError("this RankPool is closed or lost a rank; create a new one")
            try:
                for rank, conn in enumerate(self._conns):
                    _send(conn, (fn, args_for(rank), {}))
                    for tensor in tensors_for(rank) if tensors_for else ():
                        conn.send_bytes(_byte_view(tensor.detach().contiguous()) if tensor.numel() else b"")
                return self._collect(timeout, getattr(fn, "__qualname__", repr(fn)))
            except BaseException:
                self.close(timeout=3.0)
                raise

    def _collect(self, timeout: float, what: str) -> list[Any]:
        """One reply per rank, watching replies, deaths and the deadline."""
        results: dict[int, Any] = {}
        errors: list[WorkerError] = []
        deadline = time.monotonic() + timeout
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if errors:
                    break
                raise TimeoutError(f"{what}: ranks {sorted(waiting.values())} gave no answer within {timeout:.0f} s")
            for ready in wait(list(waiting), timeout=remaining):
                rank = waiting.pop(ready)
                try:
                    status, payload = _recv(ready)
                except (EOFError, OSError):
                    raise self._died(rank, what) from None
                if status == "error":
                    errors.append(WorkerError(rank, *payload))
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                else:
                    results[rank] = payload
        if errors:
            first = errors[0]
            first.pool_consistent = not waiting
            raise first
        return [results[rank] for rank in range(self.world_size)]

    def _died(self, rank: int, what: str) -> WorkerDiedError:
        process = self._procs[rank]
        try:
            process.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
        return WorkerDiedError(f"{what}: rank {rank} died (exit code {process.returncode}) without answering")

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank (politely, then by force) and release their connections. Idempotent."""
        for conn in self._conns:
            try:
                _send(conn, None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_procs", None):
            self.close(timeout=1.0)


def _exit_with_parent(parent_pid: int, interval: float = 0.5) -> None:
    """End this rank soon after the caller dies, even while it is stuck in a collective."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="tpcore-parent-watch", daemon=True).start()


def _worker_main(address, rank, world_size, backend, master_addr, master_port, threads) -> None:
    """A rank: connect to the caller, join the group, then serve calls until told to stop."""
    _exit_with_parent(int(os.environ.pop(PARENT_ENV)))
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    _send(conn, rank)
    try:
        import torch
        import torch.distributed as dist

        from tpcore import shm
        from tpcore.distributed import device_for, init_process_group

        torch.set_num_threads(threads)
        init_process_group(backend, rank, world_size, master_addr, master_port)
        shm.attach(dist.group.WORLD)
        device = device_for(backend, rank)
        context = RankContext(rank, world_size, backend, dist.group.WORLD, device, connection=conn)
        _send(conn, ("ok", None))
    except BaseException as error:  # report, do not hang the caller
        _send(conn, ("error", _describe(error)))
        return
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):  # the caller is gone
            break
        if message is None:
            break
        try:
            fn, args, kwargs = message
            reply = ("ok", fn(context, *args, **kwargs))
        except BaseException as error:
            reply = ("error", _describe(error))
        try:
            _send(conn, reply)
        except Exception as error:  # e.g. an unpicklable result
            _send(conn, ("error", _describe(error)))
    dist.destroy_process_group()
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads may abort in static destructors


def worker_entry(argv: list[str]) -> None:
    """``python -c`` entry point of a rank (see ``_WORKER_COMMAND``)."""
    address, rank, world_size, backend, master_addr, master_port, threads = argv
    _worker_main(address, int(rank), int(world_size), backend, master_addr, int(master_port), int(threads))


_WORKER_COMMAND = "import sys; from tpcore.process import worker_entry; worker_entry(sys.argv[1:])"
