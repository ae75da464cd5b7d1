"""Every fixture the tests use, in one place.

From tpcore's pytest plugin (``tpcore/pytest_plugin.py``, loaded through the ``pytest11`` entry point,
so ``tests/`` and every ``plugins/*/tests`` share them, as a third-party plugin's tests would):

- ``rank_pools``: the session's gloo worlds by size (:class:`tpcore.testing.PoolCache`), started on
  first use and shared by every test that checks equivalence, core or plugin;
- ``nccl_rank_pools``: the same on CUDA devices (tests marked ``gpu``);
- ``tp_check``: :func:`tpcore.testing.check_model` on ``rank_pools``.

Defined here, for the core tests in every folder below (one per layer or concern of tpcore: ``cut/``,
``parallel/``, ``plan/``, ``served/``, ..., and ``user_path/`` for the end-to-end tests through
``tpcore.parallelize()``): ``spawned``, ``time_to_error``, ``fresh_plugins``. Fixtures that build one module's
models stay in that module (``masked_lm`` in user_path/test_parallelize.py, ``gpt2_dir`` in
load/test_checkpoint.py, ...); the tiny models themselves come from :mod:`tpcore.testing.tiny_models`. The helper
modules that tests import (``rank_helpers``, ``process_probes``, ...) sit beside this file, on pytest's
``pythonpath``, where the ranks import them too. ``pytest --fixtures`` lists every fixture with its docs.

Fault-injection tests prove a failure is *detected* (its error type, its message) rather than waited
out; how long detection took is measured, never asserted (a loaded machine would break a bound),
and listed in the terminal summary. Tests that start many worlds or run long are marked ``slow``
(``nox -s quick`` leaves them out).
"""

from __future__ import annotations

import subprocess

import pytest
from process_probes import children

from tpcore.ranks import rank_processes, zygote
from tpcore.select.plugins import DISABLE_AUTOLOAD_ENV, ONLY_PLUGINS_ENV, reset_plugins

_TIMES_TO_ERROR: dict[str, float] = {}


@pytest.fixture
def spawned(monkeypatch) -> list:
    """The ranks started while the test runs, each as its command's arguments (a fresh interpreter's, or a rank
    forked by the zygote, :mod:`tpcore.ranks.zygote`), and any other process: ``[]`` proves none was."""
    commands, real_popen, real_fork = [], subprocess.Popen, rank_processes.fork_rank

    def popen(*args, **kwargs):
        if zygote.ZYGOTE_CODE not in args[0]:  # the zygote itself is no rank (it is kept for the next pools)
            commands.append(args)
        return real_popen(*args, **kwargs)

    def fork(argv, env, warm=()):
        commands.append((argv,))
        return real_fork(argv, env, warm)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(rank_processes, "fork_rank", fork)
    return commands


@pytest.fixture
def no_process_starts(spawned):
    """The test may start no child process (a rank is one)."""
    kids = children()
    yield
    assert spawned == [] and children() <= kids


@pytest.fixture
def time_to_error(request):
    """``time_to_error(case, seconds)`` records how long a fault took to surface, for the summary."""

    def record(case: str, seconds: float) -> None:
        _TIMES_TO_ERROR[f"{request.node.name}: {case}"] = seconds

    return record


@pytest.fixture
def fresh_plugins(monkeypatch):
    """The test starts and ends with an unloaded plugin registry and no tpcore env switches set
    (``TPCORE_DISABLE_PLUGIN_AUTOLOAD``, ``TPCORE_PLUGINS``)."""
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    monkeypatch.delenv(ONLY_PLUGINS_ENV, raising=False)
    reset_plugins()
    yield
    reset_plugins()


def pytest_terminal_summary(terminalreporter):
    if _TIMES_TO_ERROR:
        terminalreporter.section("fault injection: time to error")
        for case, seconds in _TIMES_TO_ERROR.items():
            terminalreporter.write_line(f"{seconds:7.2f} s  {case}")
