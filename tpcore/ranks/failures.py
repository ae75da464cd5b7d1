"""A rank's failures as the caller sees them, and the error reply a rank sends to make them.

A rank that raises replies ``("error", describe(exception))``; the caller turns that payload into a
:class:`WorkerError` for the rank that sent it. A rank that ends without answering is a
:class:`WorkerDiedError`.
"""

from __future__ import annotations

import traceback

from tpcore.ranks.wire import picklable

__all__ = ["WorkerDiedError", "WorkerError", "describe", "reraise"]


class WorkerError(RuntimeError):
    """A rank raised. ``exception`` is the original exception when it could be sent back."""

    def __init__(self, rank: int, type_name: str, message: str, remote_traceback: str, exception=None):
        super().__init__(
            f"rank {rank} raised {type_name}: {message}\n\n--- rank {rank} traceback ---\n{remote_traceback}"
        )
        self.rank = rank
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.exception = exception
        #: every rank answered, so the pool is still usable
        self.pool_consistent = False


class WorkerDiedError(RuntimeError):
    """A rank's process ended without answering, or the pool is closed."""


def reraise(error: WorkerError):
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
