"""tpcore: tensor-parallel inference for Hugging Face transformers models, on GPUs or CPU ranks.

The one line, ``tpcore.parallelize(model, num_gpus=N)``, and its SPMD counterpart
:class:`ParallelEngine`; and everything a policy author writes with (:class:`Policy`, :class:`Layer`
and its :class:`Style`, per-rank counts, the shared block shapes, the parallel layers a policy may
name, :data:`hookimpl`, the errors), so that a plugin imports only ``from tpcore import ...``.

Every name is imported on first use (PEP 562), so ``import tpcore`` and ``tpcore --version`` cost
no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tpcore import log  # noqa: F401  (the tpcore logger's level, TPCORE_LOG_LEVEL, and its stderr fallback)
from tpcore.version import __version__ as __version__

#: each public name, by the module that defines it
_EXPORTS = {
    "COLUMN": "tpcore.authoring",
    "NORM": "tpcore.authoring",
    "PER_HEAD": "tpcore.authoring",
    "ROW": "tpcore.authoring",
    "IfHeld": "tpcore.authoring",
    "Layer": "tpcore.authoring",
    "PerRank": "tpcore.authoring",
    "Policy": "tpcore.authoring",
    "QuantizedFormat": "tpcore.authoring",
    "Style": "tpcore.authoring",
    "divide": "tpcore.authoring",
    "hookimpl": "tpcore.authoring",
    "local_config": "tpcore.authoring",
    "share": "tpcore.authoring",
    "Attention": "tpcore.authoring.blocks",
    "BertLayoutPolicy": "tpcore.authoring.blocks",
    "BlockPolicy": "tpcore.authoring.blocks",
    "DecoderBlockPolicy": "tpcore.authoring.blocks",
    "EncoderBlockPolicy": "tpcore.authoring.blocks",
    "bert_attention": "tpcore.authoring.blocks",
    "depthwise_conv": "tpcore.authoring.blocks",
    "keeping_local_attributes": "tpcore.authoring.blocks",
    "linear": "tpcore.authoring.blocks",
    "local_heads": "tpcore.authoring.blocks",
    "subclassing": "tpcore.authoring.blocks",
    "transformers_class": "tpcore.authoring.blocks",
    "ParallelEngine": "tpcore.engine",
    "destroy_process_group": "tpcore.ranks.distributed",
    "PluginConflictError": "tpcore.errors",
    "PluginLoadWarning": "tpcore.errors",
    "ShardingError": "tpcore.errors",
    "UnsupportedModelError": "tpcore.errors",
    "WorkerDiedError": "tpcore.errors",
    "WorkerError": "tpcore.errors",
    "all_gather": "tpcore.parallel.comm",
    "all_reduce": "tpcore.parallel.comm",
    "ColumnSplitGatedRMSNorm": "tpcore.parallel.gated_norm",
    "gated_norm_class": "tpcore.parallel.gated_norm",
    "ColumnSplitRMSNorm": "tpcore.parallel.layers",
    "RowParallelLinear": "tpcore.parallel.layers",
    "column_split_norm_class": "tpcore.parallel.layers",
    "reduce_partial_sums": "tpcore.parallel.layers",
    "local_width_class": "tpcore.parallel.reshapes",
    "BlockFP8Linear": "tpcore.parallel.quantized_linear",
    "QuantizedLayer": "tpcore.parallel.quantized_linear",
    "PackedIntLinear": "tpcore.parallel.packed_int_linear",
    "Int8Linear": "tpcore.parallel.int8_linear",
    "LLMInt8Linear": "tpcore.parallel.llm_int8_linear",
    "FourBitLinear": "tpcore.parallel.four_bit_linear",
    "GPTQLinear": "tpcore.parallel.gptq_linear",
    "AWQLinear": "tpcore.parallel.gptq_linear",
    "QuantizedExperts": "tpcore.parallel.quantized_experts",
    "quantized_experts_class": "tpcore.parallel.quantized_experts",
    "BlockFP8Experts": "tpcore.parallel.fp8_experts",
    "Mxfp4Experts": "tpcore.parallel.mxfp4_experts",
    "parallelize": "tpcore.api",
    "AutoPolicy": "tpcore.select",
    "experts_arguments": "tpcore.select.tp_plan",
    "TensorReplacer": "tpcore.compat.parallelformers",
}

__all__ = [
    "AWQLinear",
    "Attention",
    "AutoPolicy",
    "BertLayoutPolicy",
    "BlockFP8Experts",
    "BlockFP8Linear",
    "BlockPolicy",
    "COLUMN",
    "ColumnSplitGatedRMSNorm",
    "ColumnSplitRMSNorm",
    "DecoderBlockPolicy",
    "EncoderBlockPolicy",
    "FourBitLinear",
    "GPTQLinear",
    "IfHeld",
    "Int8Linear",
    "LLMInt8Linear",
    "Layer",
    "Mxfp4Experts",
    "NORM",
    "PER_HEAD",
    "PackedIntLinear",
    "ParallelEngine",
    "PerRank",
    "PluginConflictError",
    "PluginLoadWarning",
    "Policy",
    "QuantizedExperts",
    "QuantizedFormat",
    "QuantizedLayer",
    "ROW",
    "RowParallelLinear",
    "ShardingError",
    "Style",
    "TensorReplacer",
    "UnsupportedModelError",
    "WorkerDiedError",
    "WorkerError",
    "all_gather",
    "all_reduce",
    "bert_attention",
    "column_split_norm_class",
    "depthwise_conv",
    "destroy_process_group",
    "divide",
    "experts_arguments",
    "gated_norm_class",
    "hookimpl",
    "keeping_local_attributes",
    "linear",
    "local_config",
    "local_heads",
    "local_width_class",
    "parallelize",
    "quantized_experts_class",
    "reduce_partial_sums",
    "share",
    "subclassing",
    "transformers_class",
]  # the names of _EXPORTS (tests/architecture/test_architecture.py)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from tpcore.api import parallelize
    from tpcore.authoring import (
        COLUMN,
        NORM,
        PER_HEAD,
        ROW,
        IfHeld,
        Layer,
        PerRank,
        Policy,
        Style,
        divide,
        hookimpl,
        local_config,
        share,
    )
    from tpcore.authoring.blocks import (
        Attention,
        BertLayoutPolicy,
        BlockPolicy,
        DecoderBlockPolicy,
        EncoderBlockPolicy,
        bert_attention,
        depthwise_conv,
        keeping_local_attributes,
        linear,
        local_heads,
        subclassing,
        transformers_class,
    )
    from tpcore.compat.parallelformers import TensorReplacer
    from tpcore.engine import ParallelEngine
    from tpcore.errors import (
        PluginConflictError,
        PluginLoadWarning,
        ShardingError,
        UnsupportedModelError,
        WorkerDiedError,
        WorkerError,
    )
    from tpcore.parallel.comm import all_gather, all_reduce
    from tpcore.parallel.gated_norm import ColumnSplitGatedRMSNorm, gated_norm_class
    from tpcore.parallel.layers import (
        ColumnSplitRMSNorm,
        RowParallelLinear,
        column_split_norm_class,
        reduce_partial_sums,
    )
    from tpcore.parallel.reshapes import local_width_class
    from tpcore.ranks.distributed import destroy_process_group
    from tpcore.select import AutoPolicy
    from tpcore.select.tp_plan import experts_arguments
