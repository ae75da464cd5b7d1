"""LXMERT: language, vision and cross-modality layers."""

from __future__ import annotations

from tpcore import BlockPolicy, bert_attention, transformers_class


def _lxmert_attention(path: str, inner: str = "self"):
    """BERT's attention, its width attribute named ``head_size``."""
    return bert_attention(path, inner=inner, widths=(f"{inner}.head_size",))


class LxmertLayerPolicy(BlockPolicy):
    """A LXMERT language or vision layer: BERT's, its width attribute named ``head_size``."""

    layer_class = transformers_class("lxmert", "LxmertLayer")
    attentions = (_lxmert_attention("attention"),)
    mlp_inputs = ("intermediate.dense",)
    mlp_outputs = ("output.dense",)


class LxmertXLayerPolicy(BlockPolicy):
    """A LXMERT cross-modality layer: one cross-attention that both streams run (language to vision
    and back), a self-attention and a feed-forward per stream."""

    layer_class = transformers_class("lxmert", "LxmertXLayer")
    attentions = (
        _lxmert_attention("visual_attention", inner="att"),
        _lxmert_attention("lang_self_att"),
        _lxmert_attention("visn_self_att"),
    )
    mlp_inputs = ("lang_inter.dense", "visn_inter.dense")
    mlp_outputs = ("lang_output.dense", "visn_output.dense")
