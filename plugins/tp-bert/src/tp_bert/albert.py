"""ALBERT: one layer instance that every depth runs, split once."""

from __future__ import annotations

from tp_bert.bert import _HEADS, _MODELS
from tpcore import Attention, BlockPolicy


class AlbertPolicy(BlockPolicy):
    """ALBERT's one layer, which every depth runs again: ``attention.{query,key,value}``,
    ``attention.dense``, ``ffn``/``ffn_output``. The factorized embedding (``embedding_size``) and its
    mapping to the hidden width stay whole."""

    layer_class = f"{_MODELS}.albert.modeling_albert.AlbertLayer"
    attentions = (
        Attention(
            "attention",
            projections=("query", "key", "value"),
            output="dense",
            counts=(_HEADS,),
            widths=("all_head_size",),
        ),
    )
    mlp_inputs = ("ffn",)
    mlp_outputs = ("ffn_output",)
