"""A rank's first lines (``tpcore.ranks.worker.WORKER_CODE``), run in bare interpreters: no world, no torch.

A stand-in ``tpcore`` on ``PYTHONPATH`` takes the place of the real imports, which take a rank seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from process_probes import gone

from tpcore.ranks import worker

#: starts one rank the way RankPool does, prints its pid once the rank is inside its imports, and ends, leaving it
CALLER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    code, parent_variable, control, importing = sys.argv[1:]
    env = {**os.environ, parent_variable: str(os.getpid())}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # the test reads the caller to its end
    rank = subprocess.Popen([sys.executable, "-c", code, control, "0"], env=env, start_new_session=True, **quiet)
    while not os.path.exists(importing):
        time.sleep(0.01)
    print(rank.pid, flush=True)
    """
)


def stand_in_tpcore(root, init_code: str, worker_code: str | None = None):
    """A ``tpcore`` package under ``root`` whose ``__init__`` runs ``init_code`` (and with ``tpcore.ranks.worker``
    defined by ``worker_code``); ``root`` goes first on the rank's ``PYTHONPATH``."""
    (root / "tpcore" / "ranks").mkdir(parents=True)
    (root / "tpcore" / "__init__.py").write_text(init_code)
    (root / "tpcore" / "ranks" / "__init__.py").write_text("")
    (root / "tpcore" / "ranks" / "worker.py").write_text(worker_code or "")
    return {**os.environ, "PYTHONPATH": str(root)}


def test_a_rank_watches_its_caller_from_inside_its_imports_and_removes_the_control_socket_once_it_is_gone(tmp_path):
    """The caller ends while its rank is inside ``import tpcore`` (here an import that never ends): the rank ends
    all the same, and removes the caller's control socket and its directory, which a killed caller leaves."""
    importing = tmp_path / "importing"
    env = stand_in_tpcore(
        tmp_path / "imports", f"import time\nopen({str(importing)!r}, 'w').close()\ntime.sleep(600)\n"
    )
    control = tmp_path / "tpcore-control"
    control.mkdir(mode=0o700)
    (control / "control").touch()
    args = [worker.WORKER_CODE, worker.PARENT_ENV, str(control / "control"), str(importing)]
    caller = subprocess.run(
        [sys.executable, "-c", CALLER, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert caller.returncode == 0, caller.stderr
    rank, caller_ended = int(caller.stdout), time.monotonic()
    try:
        while not gone(rank) and time.monotonic() - caller_ended < 60:
            time.sleep(0.01)
        assert gone(rank), "the rank outlived its caller"
    finally:
        if not gone(rank):
            os.kill(rank, signal.SIGKILL)
    print(f"\nthe rank ended {time.monotonic() - caller_ended:.2f} s after its caller")
    assert not control.exists()


def test_a_rank_whose_caller_is_alive_goes_on_to_its_entry_point(tmp_path):
    """While its caller lives, the watch leaves the rank alone: through several polls, into ``worker_entry``, which
    gets the arguments; the caller's pid is taken out of the environment."""
    entry = "import os, time\ndef worker_entry(argv):\n    time.sleep(0.5)\n    print(argv, os.environ.get({!r}))\n"
    env = stand_in_tpcore(tmp_path / "imports", "", entry.format(worker.PARENT_ENV))
    env[worker.PARENT_ENV] = str(os.getpid())
    rank = subprocess.run(
        [sys.executable, "-c", worker.WORKER_CODE, "address", "0"],
        env=env,
        cwd=tmp_path,  # "" comes first on the rank's sys.path: the checkout's own tpcore must not be there
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (rank.returncode, rank.stdout) == (0, "['address', '0'] None\n"), rank.stderr
