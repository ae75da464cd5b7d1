"""What a policy author writes with: :class:`Policy`, :class:`Layer` and its :class:`Style`, per-rank
counts, the shared block shapes, and the plugin hook marker. All of it is importable from ``tpcore``."""

from tpcore.authoring.counts import PerRank, divide, local_config, share
from tpcore.authoring.hookspecs import hookimpl
from tpcore.authoring.layer import COLUMN, NORM, PER_HEAD, ROW, Layer, Style
from tpcore.authoring.policy import IfHeld, Policy
from tpcore.authoring.quantized_format import QuantizedFormat

__all__ = [
    "COLUMN",
    "NORM",
    "PER_HEAD",
    "ROW",
    "IfHeld",
    "Layer",
    "PerRank",
    "Policy",
    "QuantizedFormat",
    "Style",
    "divide",
    "hookimpl",
    "local_config",
    "share",
]
