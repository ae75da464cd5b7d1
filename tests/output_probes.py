"""What a user sees, from tests: a stderr that is a terminal (where tqdm draws its bars) with transformers' progress
bars on, the records a logger lets through, and a bar's successive states.

These are context managers for the test's body (or a module fixture's), not fixtures: pytest puts its own
stderr back as each phase of a test begins.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
from collections.abc import Iterator


class Terminal(io.StringIO):
    """A stderr that says it is a terminal, keeping what is written to it."""

    def isatty(self) -> bool:
        return True


@contextlib.contextmanager
def progress_bars_on() -> Iterator[None]:
    """transformers' progress bars on while inside (another test may have switched them off), as they were after."""
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()
    try:
        yield
    finally:
        if not enabled:
            transformers_logging.disable_progress_bar()


@contextlib.contextmanager
def records_of(name: str, level: int) -> Iterator[list[logging.LogRecord]]:
    """The records logger ``name`` lets through at ``level`` while inside (its level as it was after)."""
    logger, records = logging.getLogger(name), []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@contextlib.contextmanager
def on_terminal() -> Iterator[Terminal]:
    """While inside, stderr is a :class:`Terminal` and transformers' progress bars are on; yields the terminal."""
    screen, stderr = Terminal(), sys.stderr
    with progress_bars_on():
        sys.stderr = screen
        try:
            yield screen
        finally:
            sys.stderr = stderr


def bar_states(text: str, label: str) -> list[str]:
    """The states of the bar labelled ``label`` (``"tpcore: 2 ranks loading"``) that ``text`` shows, in order."""
    return [state.strip() for state in re.split(r"[\r\n]", text) if state.strip().startswith(label + ":")]
