"""Longformer: sliding-window and global projections."""

from __future__ import annotations

from tp_bert.bert import _MODELS
from tpcore import Attention, BlockPolicy

_LONGFORMER = ("query", "key", "value", "query_global", "key_global", "value_global")


class LongformerPolicy(BlockPolicy):
    """Longformer: sliding-window ``attention.self.{query,key,value}`` and the global tokens'
    ``*_global`` projections, by heads; the attention merges heads into its input's width
    (:func:`tpcore.reshapes.local_width_class`)."""

    layer_class = f"{_MODELS}.longformer.modeling_longformer.LongformerLayer"
    attentions = (
        Attention(
            "attention",
            projections=tuple(f"self.{name}" for name in _LONGFORMER),
            output="output.dense",
            counts=("self.num_heads",),
            reshaping="self",
        ),
    )
    mlp_inputs = ("intermediate.dense",)
    mlp_outputs = ("output.dense",)
