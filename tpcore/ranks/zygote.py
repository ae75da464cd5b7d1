"""CPU ranks forked from a warm interpreter: what every rank imports (torch, transformers' modeling, tpcore's rank
side: about three seconds a rank) is imported once per caller, by a *zygote*, and each rank is a fork of it.

The zygote is a fresh interpreter (:data:`ZYGOTE_CODE`) that the caller starts at its first pool of CPU ranks and
keeps for the next ones. It imports :data:`WARM_MODULES`, then reads requests on a Unix socket of messages shared
with the caller, one JSON message each (``{"token", "argv", "env", "stdio", "warm"}``: a rank's
:func:`~tpcore.ranks.worker.worker_command` arguments, its environment, the caller's stdout and stderr as they are
at the request, passed along as descriptors, and the modules the rank preloads), forks a rank for each and sends
back its pid, and, as each rank ends, its exit code. It imports a request's preloads itself before forking
(:func:`_warmed`), so that they cost the first pool that names them (a model's modeling module, a format's kernel
library: bitsandbytes takes a second) and not every later rank. A forked rank is what a fresh one is: its own
session, stdin on ``/dev/null``, its pool's environment, the caller's current stdout and stderr, the watch that
ends it once its parent is gone (the zygote, which itself ends once the caller is gone, so a killed caller still
leaves no rank). The zygote only imports: no
OpenMP region has run in it, so a rank's first product starts a thread pool of its own. Its objects are then
frozen (``gc.freeze``): a rank's garbage collections pass over what it inherits, so that a full collection during
a load takes milliseconds, not a fifth of a second, and leaves the inherited pages shared.

A zygote serves the environment it was started with (less the per-pool variables, :data:`POOL_VARIABLES`): a
pool whose environment differs (a variable read at import, ``OMP_NUM_THREADS`` say) gets a new zygote, and the old
one ends once its last rank has. ``TPCORE_RANK_START=spawn`` starts every rank as a fresh interpreter instead, as
CUDA ranks, and ranks off Linux, always are.

Caller side, :func:`fork_rank` returns a :class:`ForkedRank`: the part of ``subprocess.Popen``'s interface that a
:class:`~tpcore.ranks.process.RankPool` uses (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``), fed by the
zygote's reports since the rank is not the caller's child.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

from tpcore import log
from tpcore.ranks.worker import AUTHKEY_ENV, PARENT_ENV, PARENT_WATCH_CODE

__all__ = ["START_ENV", "WARM_MODULES", "ZYGOTE_CODE", "ForkedRank", "fork_rank", "forks_ranks", "serve_forks"]

#: the environment variable that chooses how CPU ranks start: ``fork`` (from the zygote, the default) or ``spawn``
START_ENV = "TPCORE_RANK_START"
#: what the zygote imports once, before it forks: the imports every rank makes before its first call
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "tpcore.ranks.worker",
    "tpcore.ranks.distributed",
    "tpcore.parallel.shm",
    "tpcore.served.rank_side",
    "transformers.modeling_utils",
    "transformers.modeling_layers",
    "transformers.generation",
)
#: how long a forked rank's pid is waited for (the zygote's imports take seconds; it never forks only if it hangs)
FORK_WAIT_S = 120.0
#: variables that differ between pools and are read only once a rank runs: no new zygote for them
POOL_VARIABLES = (AUTHKEY_ENV, PARENT_ENV, log.LEVEL_ENV)
#: ``python -c`` of the zygote: watched from its first lines, as a rank is; then imports, then :func:`serve_forks`.
#: Arguments: the descriptor of its end of the caller's socket, the modules to import, the caller's pid.
ZYGOTE_CODE = f"""\
# tpcore rank zygote
{PARENT_WATCH_CODE}
_start_watch(int(sys.argv[3]), None)
import importlib
for _name in sys.argv[2].split(","):
    try:
        importlib.import_module(_name)
    except Exception:
        pass
from tpcore.ranks.zygote import serve_forks
import gc
gc.freeze()  # the imports' objects: no rank's collection scans them (nor writes to their pages)
serve_forks(int(sys.argv[1]), _start_watch)
"""


def forks_ranks(device: str, env: dict[str, str]) -> bool:
    """Whether ranks on ``device`` with environment ``env`` are forked from the zygote (CPU ranks on Linux, unless
    ``TPCORE_RANK_START=spawn``; macOS's system libraries are not safe to use after a fork)."""
    how = env.get(START_ENV, "fork").strip().lower() or "fork"
    if how not in ("fork", "spawn"):
        raise ValueError(f"{START_ENV}={env[START_ENV]!r}: 'fork' (the default) or 'spawn'")
    return how == "fork" and device == "cpu" and sys.platform.startswith("linux")  # macOS: fork is unsafe there


class ForkedRank:
    """A rank the zygote forked, seen from the caller: its pid once forked, its exit code once reaped."""

    def __init__(self, zygote_pid: int):
        self.zygote_pid = zygote_pid
        self.returncode: int | None = None
        self._pid: int | None = None
        self._known = threading.Event()  # forked (or never will be)
        self._ended = threading.Event()
        self._kill_once_forked = False
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The rank's pid, waited for while the zygote still imports (:data:`FORK_WAIT_S` at most); ``None`` if it
        was not forked by then."""
        self._known.wait(FORK_WAIT_S)
        return self._pid

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank forked by pid {self.zygote_pid}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            if self._pid is None:
                self._kill_once_forked = True
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)

    def forked(self, pid: int) -> None:
        with self._lock:
            self._pid = pid
            self._known.set()
            if self._kill_once_forked:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def exited(self, code: int) -> None:
        with self._lock:
            self.returncode = code
            self._known.set()
            self._ended.set()


class Zygote:
    """The caller's end of a zygote: a Unix socket of messages (``SOCK_SEQPACKET``) that carries each request, with
    the caller's stdout and stderr as they are now, and the zygote's reports, which a thread reads."""

    def __init__(self, environment: dict[str, str]):
        self.environment = environment
        self.owner = os.getpid()
        self._channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [sys.executable, "-c", ZYGOTE_CODE, str(theirs.fileno()), ",".join(WARM_MODULES), str(self.owner)]
        try:
            self.process = subprocess.Popen(
                command, env=environment, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True
            )
        except BaseException:
            self._channel.close()
            raise
        finally:
            theirs.close()
        self._retired = False
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._unforked: dict[int, ForkedRank] = {}
        self._running: dict[int, ForkedRank] = {}
        threading.Thread(target=self._read, name="tpcore-zygote", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._retired and self.process.poll() is None

    def fork(self, argv: list[str], env: dict[str, str], warm: Sequence[str] = ()) -> ForkedRank:
        """Ask for a rank running :func:`~tpcore.ranks.worker.worker_entry` on ``argv`` in environment ``env``, its
        stdout and stderr this process's, once the zygote has imported the modules ``warm`` names."""
        rank = ForkedRank(self.process.pid)
        stdio = [fd for fd in (1, 2) if _is_open(fd)]
        with self._lock:
            token = next(self._tokens)
            self._unforked[token] = rank
            request = {"token": token, "argv": argv, "env": env, "stdio": stdio, "cwd": _working_directory(),
                       "warm": list(warm)}  # fmt: skip
            try:
                socket.send_fds(self._channel, [json.dumps(request).encode()], stdio)
            except OSError:
                del self._unforked[token]
                raise OSError(f"the zygote (pid {self.process.pid}) is gone") from None
        return rank

    def retire(self) -> None:
        """No more requests: the zygote ends once its ranks have."""
        with self._lock, contextlib.suppress(OSError):
            self._retired = True
            self._channel.shutdown(socket.SHUT_WR)

    def _read(self) -> None:
        with self._channel:
            while report := _received(self._channel):
                if "pid" in report:
                    with self._lock:
                        forked = self._unforked.pop(report["token"])
                        self._running[report["pid"]] = forked
                    forked.forked(report["pid"])
                    continue
                with self._lock:
                    ended = self._running.pop(report["exit"], None)
                if ended is not None:
                    ended.exited(report["code"])
        with self._lock:
            left = [*self._unforked.values(), *self._running.values()]
            self._unforked, self._running = {}, {}
        for rank in left:  # the zygote is gone: its ranks end by their watch, as a killed caller's do
            rank.exited(1)
        self.process.wait()


def _received(channel: socket.socket) -> dict | None:
    """The next report from the zygote; ``None`` once it is gone."""
    try:
        message = channel.recv(1 << 16)
    except OSError:
        return None
    return json.loads(message) if message else None


def _working_directory() -> str | None:
    """This process's working directory (``None`` if it was removed: the rank keeps the zygote's)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


_zygote: list[Zygote] = []  # this process's current zygote, if any
_zygote_lock = threading.Lock()


def fork_rank(argv: list[str], env: dict[str, str], warm: Sequence[str] = ()) -> ForkedRank:
    """A rank forked by this process's zygote for ``env`` (started here, the first time, or for a new environment),
    the modules ``warm`` names imported there first."""
    environment = {name: value for name, value in env.items() if name not in POOL_VARIABLES}
    with _zygote_lock:
        zygote = _zygote[0] if _zygote else None
        if zygote is None or zygote.owner != os.getpid() or zygote.environment != environment or not zygote.alive:
            if zygote is not None and zygote.owner == os.getpid():
                zygote.retire()
            zygote = _started(environment)
        try:
            return zygote.fork(argv, env, warm)
        except OSError:  # it died since it was last asked: once more, from a new one
            return _started(environment).fork(argv, env, warm)


def _started(environment: dict[str, str]) -> Zygote:
    """A new zygote for ``environment``, this process's current one from now on (under ``_zygote_lock``)."""
    _zygote[:] = [zygote := Zygote(environment)]
    return zygote


def serve_forks(channel: int, start_watch: Callable[[int, str | None], None]) -> None:
    """The zygote's loop: fork a rank for each request on the socket ``channel``, report each fork and each exit on
    it; return once the caller has shut its end and every rank has ended. ``start_watch(parent, control socket)`` is
    :data:`~tpcore.ranks.worker.PARENT_WATCH_CODE`'s, given to each rank."""
    import warnings

    warnings.filterwarnings("ignore", message=".*use of fork.*", category=DeprecationWarning)  # no lock is held
    requests = socket.socket(fileno=channel)
    wake, wake_end = os.pipe()
    os.set_blocking(wake, False)
    os.set_blocking(wake_end, False)
    signal.set_wakeup_fd(wake_end)  # a child's exit wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ranks: set[int] = set()
    reading = True
    while reading or ranks:
        watched: list = [requests, wake] if reading else [wake]
        ready, _, _ = select.select(watched, [], [])
        if wake in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake, 512):
                    pass
        if requests in ready:
            message, stdio, _, _ = socket.recv_fds(requests, 1 << 20, 2)
            reading = bool(message)
            if reading:
                request = json.loads(message)
                _warmed(request.get("warm", ()))
                pid = _fork(
                    request,
                    dict(zip(request["stdio"], stdio, strict=True)),
                    (channel, wake, wake_end),
                    start_watch,
                )
                ranks.add(pid)
                _report(requests, {"token": request["token"], "pid": pid})
            for fd in stdio:
                os.close(fd)
        for pid, code in _reaped(ranks):
            _report(requests, {"exit": pid, "code": code})


def _warmed(modules: list[str]) -> None:
    """In the zygote: import the ``modules`` not yet imported (one that fails is left for the rank to report), and
    freeze what they made, as the zygote's first imports are."""
    import gc
    import importlib

    missing = [name for name in modules if name not in sys.modules]
    for name in missing:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    if missing:
        gc.freeze()


def _fork(request: dict, stdio: dict[int, int], zygote_fds: tuple[int, ...], start_watch) -> int:
    """Fork the rank a request asks for (see the module's docstring), in the caller's working directory, with
    ``stdio`` (``{1: fd, 2: fd}``, the caller's at the request) as its stdout and stderr; in the zygote, return its
    pid."""
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in zygote_fds:
            os.close(fd)
        for target, fd in stdio.items():
            os.dup2(fd, target)
            os.close(fd)
        os.setsid()
        if request["cwd"] is not None:
            with contextlib.suppress(OSError):  # removed meanwhile: as a fresh rank started there would, it goes on
                os.chdir(request["cwd"])
        argv = request["argv"]
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.pop(PARENT_ENV, None)
        sys.argv = ["-c", *argv]
        start_watch(zygote, argv[0])
        log.configure_from_environment()
        from tpcore.ranks.worker import worker_entry

        worker_entry(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reaped(ranks: set[int]) -> list[tuple[int, int]]:
    """The ranks that ended since the last look, with their exit codes as ``subprocess`` gives them."""
    ended = []
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        ranks.discard(pid)
        ended.append((pid, os.waitstatus_to_exitcode(status)))
    return ended


def _report(channel: socket.socket, report: dict) -> None:
    """Send one report (a caller whose end is closed is gone: the watch ends this process)."""
    with contextlib.suppress(OSError):
        channel.send(json.dumps(report).encode())
