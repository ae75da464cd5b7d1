"""CPU ranks forked from the caller's zygote (:mod:`tpcore.ranks.zygote`): one warm interpreter serves every pool of
an environment; its ranks are what fresh ones are (own session, the pool's environment, exit codes as
``subprocess`` gives them); a zygote that is killed, a caller that is killed, a changed environment, and
``TPCORE_RANK_START``."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import rank_helpers
from process_probes import children, gone, is_zygote, parent_of

from tpcore.ranks import zygote
from tpcore.ranks.process import RankPool, WorkerDiedError

#: how long a process may take to end once it should: generous, only a broken end waits it out
GONE_WITHIN_S = 60.0


def wait_gone(*pids: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while not all(gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def rank_pids(pool: RankPool) -> list[int]:
    return [pid for *_, pid in pool.run(rank_helpers.whoami)]


def test_pools_of_one_environment_are_forked_by_one_zygote_into_sessions_of_their_own(monkeypatch):
    monkeypatch.delenv(zygote.START_ENV, raising=False)
    with RankPool(2, "gloo") as first:
        pids = rank_pids(first)
        forker = parent_of(pids[0])
        assert is_zygote(forker) and parent_of(pids[1]) == forker and parent_of(forker) == os.getpid()
        assert pids == first.pids
        sessions = {os.getsid(pid) for pid in pids}
        assert os.getsid(0) not in sessions and os.getsid(forker) not in sessions and len(sessions) == 2
        assert min(first.run(rank_helpers.frozen_objects)) > 100_000  # the zygote's imports, frozen before the fork
    assert wait_gone(*pids) and not gone(forker)  # the zygote stays for the next pool
    monkeypatch.setattr(logging.getLogger("tpcore"), "level", logging.DEBUG)  # a per-pool variable: the same zygote
    with RankPool(3, "gloo") as second:
        assert {parent_of(pid) for pid in rank_pids(second)} == {forker}
        assert second.run(rank_helpers.environment_variable, "TPCORE_LOG_LEVEL") == [str(logging.DEBUG)] * 3
        assert second.run(rank_helpers.environment_variable, "TPCORE_WORKER_AUTHKEY") == [None] * 3


def test_a_pool_s_preloads_are_imported_by_the_zygote_once_for_every_later_rank(tmp_path, monkeypatch):
    """A module a pool preloads (a model's modeling module, a format's kernel library) is imported in the zygote, not
    in each rank; a module that fails to import is left for the rank's own code to report."""
    monkeypatch.delenv(zygote.START_ENV, raising=False)
    (tmp_path / "preloaded_here.py").write_text("import os\nPID = os.getpid()\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks' PYTHONPATH: a zygote of its own
    preload = ("preloaded_here", "tpcore_no_such_module")
    for _ in range(2):
        with RankPool(2, "gloo", preload=preload) as pool:
            imported = pool.run(rank_helpers.importing_pid, "preloaded_here")
            forker = parent_of(imported[0][1])
            assert is_zygote(forker) and [by for by, _ in imported] == [forker, forker]


def test_a_changed_environment_gets_a_zygote_of_its_own_and_the_old_one_ends_after_its_ranks(monkeypatch):
    monkeypatch.delenv(zygote.START_ENV, raising=False)
    monkeypatch.setenv("TPCORE_TEST_MARK", "old")  # a zygote serving this test's first pool alone
    old_pool = RankPool(2, "gloo")
    old = parent_of(old_pool.pids[0])
    monkeypatch.setenv("TPCORE_TEST_MARK", "read at import")
    with RankPool(2, "gloo") as pool:
        new = parent_of(pool.pids[0])
        assert is_zygote(new) and new != old
        assert pool.run(rank_helpers.environment_variable, "TPCORE_TEST_MARK") == ["read at import"] * 2
        assert old_pool.run(rank_helpers.all_reduce_sum, 1) == [3.0, 3.0]  # the old zygote's ranks serve on
        assert not gone(old)
        old_pids = old_pool.pids
        old_pool.close()
        assert wait_gone(old, *old_pids)
        assert set(pool.pids) <= children() and not set(old_pids) & children()


def test_a_forked_rank_writes_to_the_caller_s_stderr_as_it_is_at_the_pool_s_start(capfd, monkeypatch):
    """A zygote started while stderr went elsewhere (here: capture off): its later ranks write to the caller's
    stderr as it is when their pool starts (here: captured)."""
    monkeypatch.delenv(zygote.START_ENV, raising=False)
    monkeypatch.setenv("TPCORE_TEST_MARK", "a zygote of this test's own")
    with capfd.disabled(), RankPool(1, "gloo") as pool:
        forker = parent_of(pool.pids[0])
    with RankPool(2, "gloo") as pool:
        assert {parent_of(pid) for pid in pool.pids} == {forker}
        pool.run(rank_helpers.write_to_stderr, "written")
    err = capfd.readouterr().err
    assert "written from rank 0" in err and "written from rank 1" in err


def test_a_forked_rank_starts_in_the_caller_s_working_directory_of_the_moment(tmp_path, monkeypatch):
    monkeypatch.delenv(zygote.START_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with RankPool(2, "gloo") as pool:
        assert pool.run(rank_helpers.working_directory) == [str(tmp_path)] * 2


def test_a_killed_rank_and_a_killed_zygote_are_reported_as_the_ranks_ending(monkeypatch):
    monkeypatch.delenv(zygote.START_ENV, raising=False)
    pool = RankPool(2, "gloo")
    pids = pool.pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        pool.run(rank_helpers.whoami)
    assert pool._procs == [] and wait_gone(*pids)
    with RankPool(2, "gloo") as pool:
        forker = parent_of(pool.pids[0])
        os.kill(forker, signal.SIGKILL)  # its ranks end by their watch of their parent
        assert wait_gone(forker, *pool.pids)
        with pytest.raises(WorkerDiedError):
            pool.run(rank_helpers.whoami)
    with RankPool(2, "gloo") as pool:  # a new zygote
        assert parent_of(pool.pids[0]) != forker and pool.run(rank_helpers.all_reduce_sum, 1) == [3.0, 3.0]


def test_the_exit_code_of_a_forked_rank_is_the_one_subprocess_gives():
    rank = zygote.ForkedRank(zygote_pid=1)
    assert rank.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(0.01)
    rank.kill()  # before it is forked: killed once it is
    rank.exited(-signal.SIGKILL)
    assert rank.wait(0) == -9 and rank.poll() == -9 and rank.pid is None


CALLER = textwrap.dedent(
    """
    import json, os, sys, time
    from tpcore.ranks.process import RankPool
    pool = RankPool(2, "gloo")
    print(json.dumps(pool.pids), flush=True)
    time.sleep(600)
    """
)


def test_a_killed_caller_leaves_neither_its_zygote_nor_its_ranks(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop(zygote.START_ENV, None)
    caller = subprocess.Popen([sys.executable, "-c", CALLER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = json.loads(caller.stdout.readline())
        forker = parent_of(pids[0])
        assert is_zygote(forker) and parent_of(forker) == caller.pid
    finally:
        caller.kill()
        caller.wait()
    assert wait_gone(forker, *pids)


def test_rank_start_spawn_starts_fresh_interpreters_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv(zygote.START_ENV, "spawn")
    with RankPool(2, "gloo") as pool:
        assert {parent_of(pid) for pid in pool.pids} == {os.getpid()}
        assert pool.run(rank_helpers.all_reduce_sum, 1) == [3.0, 3.0]
    monkeypatch.setenv(zygote.START_ENV, "thread")
    before = children()
    with pytest.raises(ValueError, match="TPCORE_RANK_START='thread': 'fork' .* or 'spawn'"):
        RankPool(2, "gloo")
    assert children() <= before
