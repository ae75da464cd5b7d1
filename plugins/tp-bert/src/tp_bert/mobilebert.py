"""MobileBERT: attention and feed-forwards at the bottleneck width; its LM head."""

from __future__ import annotations

import torch

from tp_bert.bert import BertPolicy
from tpcore import BlockPolicy, Policy, bert_attention, share, subclassing, transformers_class


class MobileBertPolicy(BertPolicy):
    """MobileBERT: attention and feed-forward at the bottleneck width ``true_hidden_size``; the
    bottleneck projections in and out of it, and the NoNorms, stay whole."""

    layer_class = transformers_class("mobilebert", "MobileBertLayer")
    attentions = (bert_attention("attention"),)

    @classmethod
    def replace_arguments(cls, config, world_size):
        heads = share(config.num_attention_heads, world_size, cls.heads)
        width = heads * (config.true_hidden_size // config.num_attention_heads)
        return {"attention.self.num_attention_heads": heads, "attention.self.all_head_size": width}


class MobileBertFFNPolicy(BlockPolicy):
    """One of MobileBERT's extra feed-forwards (``num_feedforward_networks - 1`` per layer)."""

    layer_class = transformers_class("mobilebert", "FFNLayer")
    attentions = ()
    mlp_inputs = ("intermediate.dense",)
    mlp_outputs = ("output.dense",)


@subclassing("DecoderCalled")
def decoder_called_lm_head(base: type) -> dict:
    """For MobileBERT's LM head, which multiplies by ``cat([decoder.weight.t(), dense.weight])`` itself:
    a subclass whose forward calls ``decoder`` (so a decoder split over the vocabulary gathers its
    logits). The same sum: ``decoder(h[..., :E]) + h[..., E:] @ dense.weight``, ``E`` the embedding size."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = self.transform(hidden_states)
        embedding_size = self.decoder.in_features
        return self.decoder(hidden[..., :embedding_size]) + hidden[..., embedding_size:] @ self.dense.weight

    return {"forward": forward}


class MobileBertLMHeadPolicy(Policy):
    """MobileBERT's LM head: its decoder (tied to the word embeddings) is split over the vocabulary by
    tpcore's core once the head calls it (:func:`decoder_called_lm_head`)."""

    layer_class = transformers_class("mobilebert", "MobileBertLMPredictionHead")

    @staticmethod
    def replace_modules():
        return {"": decoder_called_lm_head}
