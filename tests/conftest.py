"""Fixtures shared by the core tests: the processes a test starts, and a record of fault-injection timings.

Fault-injection tests prove a failure is *detected* (its error type, its message) rather than waited
out; how long detection took is measured, never asserted (a loaded machine would break a bound),
and listed in the terminal summary.
"""

from __future__ import annotations

import subprocess

import pytest

_TIMES_TO_ERROR: dict[str, float] = {}


@pytest.fixture
def spawned(monkeypatch) -> list:
    """The commands of the processes started while the test runs (a rank is one): ``[]`` proves none was."""
    commands, real_popen = [], subprocess.Popen

    def spy(*args, **kwargs):
        commands.append(args)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    return commands


@pytest.fixture
def time_to_error(request):
    """``time_to_error(case, seconds)`` records how long a fault took to surface, for the summary."""

    def record(case: str, seconds: float) -> None:
        _TIMES_TO_ERROR[f"{request.node.name}: {case}"] = seconds

    return record


def pytest_terminal_summary(terminalreporter):
    if _TIMES_TO_ERROR:
        terminalreporter.section("fault injection: time to error")
        for case, seconds in _TIMES_TO_ERROR.items():
            terminalreporter.write_line(f"{seconds:7.2f} s  {case}")
