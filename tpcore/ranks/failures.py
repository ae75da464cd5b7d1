"""A rank's failures as the caller sees them, and the error reply a rank sends to make them.

A rank that raises replies ``("error", describe(exception))``; the caller turns that payload into a
:class:`WorkerError` for the rank that sent it. A rank that ends without answering is a
:class:`WorkerDiedError`.
"""

from __future__ import annotations

import traceback
from typing import NoReturn

from tpcore.errors import WorkerDiedError, WorkerError
from tpcore.ranks.wire import picklable

__all__ = ["WorkerDiedError", "WorkerError", "describe", "reraise"]


def reraise(error: WorkerError) -> NoReturn:
    """Raise a rank's exception as its own type, with the :class:`WorkerError` (and so the rank's
    traceback) as its ``__cause__``; the :class:`WorkerError` itself if the exception did not pickle."""
    if error.exception is not None:
        raise error.exception from error
    raise error


def describe(error: BaseException) -> tuple:
    """``(type name, message, traceback, exception or None)``, the exception only if it pickles:
    the arguments of :class:`WorkerError` after the rank."""
    text = "".join(traceback.format_exception(error))
    return type(error).__qualname__, str(error), text, error if picklable(error) else None
