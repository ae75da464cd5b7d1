"""Every error tpcore raises of its own, in one leaf module that imports nothing of tpcore.

=============================  ===================================================================
error                          raised when
=============================  ===================================================================
:class:`ShardingError`         a model cannot be split the way its policies ask (sizes that do not
                               cut into whole units, missing modules), before anything is changed
:class:`UnsupportedModelError` no installed policy and no transformers tp plan covers a model
:class:`PluginConflictError`   two plugins claim one policy name or layer class
:class:`PluginLoadWarning`     an installed plugin could not be loaded (a warning; the others load)
:class:`WorkerError`           a rank raised; ``reraise`` gives it its own type back
:class:`WorkerDiedError`       a rank ended without answering, or its pool is closed
=============================  ===================================================================
"""

from __future__ import annotations

__all__ = [
    "PluginConflictError",
    "PluginLoadWarning",
    "ShardingError",
    "UnsupportedModelError",
    "WorkerDiedError",
    "WorkerError",
]


class ShardingError(ValueError):
    """A model cannot be split the way a policy asks (sizes, missing modules)."""


class UnsupportedModelError(LookupError):
    """No installed policy covers any layer of a model."""


class PluginConflictError(RuntimeError):
    """A plugin registers a policy whose name or layer class another loaded plugin already claims."""


class PluginLoadWarning(UserWarning):
    """An installed plugin could not be loaded; the others were."""


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
