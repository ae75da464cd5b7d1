"""The ``tpcore`` logger: what a load is doing, for a user who asks, and the records of the ranks.

Records go to loggers under ``"tpcore"`` whose names say what speaks and stay put when modules move:
``tpcore.process`` (the ranks' start, stop and deaths), ``tpcore.worker`` (a rank joining), ``tpcore.auto``
(the policies chosen), ``tpcore.plan`` (bytes per rank, what stays whole), ``tpcore.parallelize`` (a rank's
reads), ``tpcore.precision`` (the half dtype chosen). As with transformers' logger,
warnings show and info does not by default; ``TPCORE_LOG_LEVEL`` (a name such as ``INFO``, or a number)
sets the ``tpcore`` logger's level when tpcore is imported (``logging.getLogger("tpcore").setLevel``
any time later). The root logger is never configured: a record goes wherever the application's logging
sends it, and only where no handler would take it does tpcore's own print it on stderr, so it shows once.

A rank of a :class:`~tpcore.ranks.process.RankPool` forwards its ``tpcore`` records to the caller
(:func:`records_forwarded`) at the caller's level, which every call carries (:func:`caller_level`); the
caller re-emits each through its logger of the same name (:func:`emit_rank_record`), with
``record.rank`` set and ``"rank 1: "`` before the message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from tpcore.progress import tqdm_lock_leaving_the_start_method

__all__ = [
    "LEVEL_ENV",
    "caller_level",
    "configure_from_environment",
    "emit_rank_record",
    "records_forwarded",
    "set_rank_level",
]

#: the environment variable that sets the ``tpcore`` logger's level (a level name or number)
LEVEL_ENV = "TPCORE_LOG_LEVEL"
#: how tpcore's own stderr handler prints a record
FORMAT = "%(levelname)s %(name)s: %(message)s"

logger = logging.getLogger("tpcore")


class _StderrUnlessHandled(logging.Handler):
    """Prints a record on the current ``sys.stderr`` unless another handler on its way to the root takes it
    (the application configured logging, or a test captures it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if self._handled_elsewhere(record):
            return
        try:
            bars = sys.modules.get("tqdm")  # a load bar may be on screen: the line goes above it, the bar stays
            if bars is not None:
                tqdm_lock_leaving_the_start_method()
                bars.tqdm.write(self.format(record), file=sys.stderr)
            else:
                sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)

    def _handled_elsewhere(self, record: logging.LogRecord) -> bool:
        current: logging.Logger | None = logging.getLogger(record.name)
        while current is not None:
            if any(handler is not self for handler in current.handlers):
                return True
            if not current.propagate:
                return False
            current = current.parent
        return False


class _Forwarder(logging.Handler):
    """On a rank: sends each record to the caller as a plain dict (:func:`portable`); a record that cannot be
    sent (the caller is gone, or a send is already under way on this thread) is dropped."""

    def __init__(self, send: Callable[[dict], None]):
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(portable(record))
        except Exception:
            pass


def level_of(value: str) -> int:
    """The logging level ``value`` names (``"INFO"``, ``"info"``) or numbers (``"20"``); ``ValueError`` otherwise."""
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise ValueError(f"{LEVEL_ENV}={value!r} is neither a logging level name nor a number")
    return level


def configure_from_environment() -> None:
    """Give the ``tpcore`` logger its stderr fallback (once) and the level ``TPCORE_LOG_LEVEL`` names: at import,
    and again in a rank forked from a warm interpreter (:mod:`tpcore.ranks.zygote`), whose environment is its own."""
    if not any(isinstance(handler, _StderrUnlessHandled) for handler in logger.handlers):
        logger.addHandler(_StderrUnlessHandled())
    value = os.environ.get(LEVEL_ENV, "")
    if value.strip():
        try:
            logger.setLevel(level_of(value))
        except ValueError as error:
            logger.warning("%s; the level stays as it was", error)


def caller_level() -> int:
    """The level the ``tpcore`` logger lets through in this process (what a call tells its ranks)."""
    return logger.getEffectiveLevel()


def portable(record: logging.LogRecord) -> dict:
    """``record`` as a dict of plain values that pickles anywhere: the message formatted, a traceback as text."""
    data: dict[str, Any] = {k: v for k, v in vars(record).items() if isinstance(v, (str, int, float, bool))}
    data["msg"], data["args"] = record.getMessage(), None
    if record.exc_info and not record.exc_text:
        data["exc_text"] = logging.Formatter().formatException(record.exc_info)
    return data


@contextlib.contextmanager
def records_forwarded(send: Callable[[dict], None], level: int) -> Iterator[None]:
    """On a rank, while inside: every ``tpcore`` record at ``level`` or above goes to ``send`` (the caller)
    instead of this process's handlers; the logger is as it was afterwards."""
    handlers, propagate, own_level = list(logger.handlers), logger.propagate, logger.level
    forwarder = _Forwarder(send)
    for handler in handlers:
        logger.removeHandler(handler)
    logger.addHandler(forwarder)
    logger.propagate = False
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(forwarder)
        for handler in handlers:
            logger.addHandler(handler)
        logger.propagate = propagate
        logger.setLevel(own_level)


def set_rank_level(level: int) -> None:
    """On a rank: follow the caller's level (each call carries it)."""
    if logger.level != level:
        logger.setLevel(level)


def emit_rank_record(rank: int, data: dict) -> None:
    """In the caller: re-emit a record rank ``rank`` forwarded, through the logger of its name, if that
    logger lets its level through here."""
    target = logging.getLogger(data.get("name", "tpcore"))
    if not target.isEnabledFor(int(data.get("levelno", logging.WARNING))):
        return
    record = logging.makeLogRecord(data)
    record.rank = rank
    record.msg = f"rank {rank}: {record.msg}"
    target.handle(record)


configure_from_environment()
