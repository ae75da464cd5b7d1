"""Longformer: sliding-window and global projections."""

from __future__ import annotations

from tpcore import BertLayoutPolicy, bert_attention, transformers_class


class LongformerPolicy(BertLayoutPolicy):
    """Longformer: sliding-window ``attention.self.{query,key,value}`` and the global tokens'
    ``*_global`` projections, by heads; the attention merges heads into its input's width
    (:func:`tpcore.local_width_class`)."""

    layer_class = transformers_class("longformer", "LongformerLayer")
    attentions = (
        bert_attention(
            "attention",
            ("query", "key", "value", "query_global", "key_global", "value_global"),
            counts=("self.num_heads",),
            widths=(),
            reshaping="self",
        ),
    )
