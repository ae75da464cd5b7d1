"""tpcore: tensor-parallel inference for Hugging Face transformers models, on GPUs or CPU ranks."""

from tpcore import log  # noqa: F401  (first: the tpcore logger's level, TPCORE_LOG_LEVEL, and its stderr fallback)
from tpcore.select.auto import AutoPolicy, UnsupportedModelError
from tpcore.engine import ParallelEngine
from tpcore.authoring.hookspecs import hookimpl
from tpcore.parallelize import parallelize
from tpcore.select.plugins import PluginConflictError, PluginLoadWarning
from tpcore.authoring.policy import Layer, PerRank, Policy, ShardingError, divide, share
from tpcore.ranks.process import WorkerDiedError, WorkerError
from tpcore.compat import TensorReplacer

__all__ = [
    "AutoPolicy",
    "Layer",
    "PerRank",
    "ParallelEngine",
    "PluginConflictError",
    "PluginLoadWarning",
    "Policy",
    "ShardingError",
    "TensorReplacer",
    "UnsupportedModelError",
    "WorkerDiedError",
    "WorkerError",
    "divide",
    "hookimpl",
    "parallelize",
    "share",
]

__version__ = "0.1.0"
