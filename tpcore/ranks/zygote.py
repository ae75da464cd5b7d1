"""CPU ranks forked from a warm interpreter: what every rank imports (torch, transformers' modeling, tpcore's rank
side: about three seconds a rank) is imported once per caller, by a *zygote*, and each rank is a fork of it.

The zygote is a fresh interpreter (:data:`ZYGOTE_CODE`) that the caller starts at its first pool of CPU ranks and
keeps for the next ones. It imports :data:`WARM_MODULES`, then reads requests on its stdin, one JSON line each
(``{"token", "argv", "env"}``: a rank's :func:`~tpcore.ranks.worker.worker_command` arguments and environment),
forks a rank for each and writes its pid, and, as each rank ends, its exit code, on a pipe of its own. A forked rank
is what a fresh one is: its own session, stdin on ``/dev/null``, its pool's environment, the caller's stdout and
stderr, the watch that ends it once its parent is gone (the zygote, which itself ends once the caller is gone, so a
killed caller still leaves no rank). The zygote only imports: no OpenMP region has run in it, so a rank's first
product starts a thread pool of its own.

A zygote serves the environment it was started with (less the per-pool variables, :data:`POOL_VARIABLES`): a
pool whose environment differs (a variable read at import, ``OMP_NUM_THREADS`` say) gets a new zygote, and the old
one ends once its last rank has. ``TPCORE_RANK_START=spawn`` starts every rank as a fresh interpreter instead, as
CUDA ranks always are.

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
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable

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
#: Arguments: the reply pipe's descriptor, the modules to import, the caller's pid.
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
serve_forks(int(sys.argv[1]), _start_watch)
"""


def forks_ranks(device: str, env: dict[str, str]) -> bool:
    """Whether ranks on ``device`` with environment ``env`` are forked from the zygote (CPU ranks, where ``fork``
    exists, unless ``TPCORE_RANK_START=spawn``)."""
    how = env.get(START_ENV, "fork").strip().lower() or "fork"
    if how not in ("fork", "spawn"):
        raise ValueError(f"{START_ENV}={env[START_ENV]!r}: 'fork' (the default) or 'spawn'")
    return how == "fork" and device == "cpu" and hasattr(os, "fork")


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
    """The caller's end of a zygote: the requests it writes, a thread reading the zygote's reports."""

    def __init__(self, environment: dict[str, str]):
        self.environment = environment
        self.owner = os.getpid()
        replies, replies_end = os.pipe()
        command = [sys.executable, "-c", ZYGOTE_CODE, str(replies_end), ",".join(WARM_MODULES), str(self.owner)]
        try:
            self.process = subprocess.Popen(
                command, env=environment, stdin=subprocess.PIPE, pass_fds=(replies_end,), start_new_session=True
            )
        except BaseException:
            os.close(replies)
            raise
        finally:
            os.close(replies_end)
        assert self.process.stdin is not None
        self._requests = self.process.stdin
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._unforked: dict[int, ForkedRank] = {}
        self._running: dict[int, ForkedRank] = {}
        reader = threading.Thread(
            target=self._read, args=(os.fdopen(replies, "rb"),), name="tpcore-zygote", daemon=True
        )
        reader.start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and not self._requests.closed

    def fork(self, argv: list[str], env: dict[str, str]) -> ForkedRank:
        """Ask for a rank running :func:`~tpcore.ranks.worker.worker_entry` on ``argv`` in environment ``env``."""
        rank = ForkedRank(self.process.pid)
        with self._lock:
            token = next(self._tokens)
            self._unforked[token] = rank
            try:
                self._requests.write(json.dumps({"token": token, "argv": argv, "env": env}).encode() + b"\n")
                self._requests.flush()
            except (OSError, ValueError):
                del self._unforked[token]
                raise OSError(f"the zygote (pid {self.process.pid}) is gone") from None
        return rank

    def retire(self) -> None:
        """No more requests: the zygote ends once its ranks have."""
        with self._lock, contextlib.suppress(OSError):
            self._requests.close()

    def _read(self, replies) -> None:
        with replies:
            for line in replies:
                report = json.loads(line)
                rank: ForkedRank | None
                with self._lock:
                    if "pid" in report:
                        rank = self._unforked.pop(report["token"])
                        self._running[report["pid"]] = rank
                    else:
                        rank = self._running.pop(report["exit"]) if report["exit"] in self._running else None
                if rank is not None and "pid" in report:
                    rank.forked(report["pid"])
                elif rank is not None:
                    rank.exited(report["code"])
        with self._lock:
            left = [*self._unforked.values(), *self._running.values()]
            self._unforked, self._running = {}, {}
        for rank in left:  # the zygote is gone: its ranks end by their watch, as a killed caller's do
            rank.exited(1)
        self.process.wait()


_zygote: list[Zygote] = []  # this process's current zygote, if any
_zygote_lock = threading.Lock()


def fork_rank(argv: list[str], env: dict[str, str]) -> ForkedRank:
    """A rank forked by this process's zygote for ``env`` (started here, the first time, or for a new environment)."""
    environment = {name: value for name, value in env.items() if name not in POOL_VARIABLES}
    with _zygote_lock:
        zygote = _zygote[0] if _zygote else None
        if zygote is None or zygote.owner != os.getpid() or zygote.environment != environment or not zygote.alive:
            if zygote is not None and zygote.owner == os.getpid():
                zygote.retire()
            zygote = Zygote(environment)
            _zygote[:] = [zygote]
    return zygote.fork(argv, env)


def serve_forks(replies: int, start_watch: Callable[[int, str | None], None]) -> None:
    """The zygote's loop: fork a rank for each request on stdin, report each fork and each exit on ``replies``;
    return once stdin is closed and every rank has ended. ``start_watch(parent, control socket)`` is
    :data:`~tpcore.ranks.worker.PARENT_WATCH_CODE`'s, given to each rank."""
    import warnings

    warnings.filterwarnings("ignore", message=".*use of fork.*", category=DeprecationWarning)  # no lock is held
    wake, wake_end = os.pipe()
    os.set_blocking(wake, False)
    os.set_blocking(wake_end, False)
    signal.set_wakeup_fd(wake_end)  # a child's exit wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ranks: set[int] = set()
    pending, reading = b"", True
    while reading or ranks:
        ready, _, _ = select.select([0, wake] if reading else [wake], [], [])
        if wake in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake, 512):
                    pass
        if 0 in ready:
            chunk = os.read(0, 1 << 16)
            reading = bool(chunk)
            *requests, pending = (pending + chunk).split(b"\n")
            for line in requests:
                request = json.loads(line)
                pid = _fork(request["argv"], request["env"], (replies, wake, wake_end), start_watch)
                ranks.add(pid)
                _report(replies, {"token": request["token"], "pid": pid})
        for pid, code in _reaped(ranks):
            _report(replies, {"exit": pid, "code": code})


def _fork(argv: list[str], env: dict[str, str], zygote_fds: tuple[int, ...], start_watch) -> int:
    """Fork a rank (see the module's docstring); in the zygote, return its pid."""
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
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.setsid()
        os.environ.clear()
        os.environ.update(env)
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


def _report(replies: int, report: dict) -> None:
    """Write one report line (a caller that closed its end is gone: the watch ends this process)."""
    with contextlib.suppress(OSError):
        os.write(replies, json.dumps(report).encode() + b"\n")
