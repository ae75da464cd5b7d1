"""Fixtures shared by the core tests: a record of fault-injection timings, printed after the run.

Fault-injection tests prove a failure is *detected* (its error type, its message) rather than waited
out; how long detection took is measured, never asserted (a loaded machine would break a bound),
and listed in the terminal summary.
"""

from __future__ import annotations

import pytest

_TIMES_TO_ERROR: dict[str, float] = {}


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
