"""ALBERT: one layer instance that every depth runs, split once."""

from __future__ import annotations

from tpcore import BlockPolicy, bert_attention, transformers_class


class AlbertPolicy(BlockPolicy):
    """ALBERT's one layer, which every depth runs again: ``attention.{query,key,value}``,
    ``attention.dense``, ``ffn``/``ffn_output``. The factorized embedding (``embedding_size``) and its
    mapping to the hidden width stay whole."""

    layer_class = transformers_class("albert", "AlbertLayer")
    attentions = (bert_attention("attention", inner="", output="dense"),)
    mlp_inputs = ("ffn",)
    mlp_outputs = ("ffn_output",)
