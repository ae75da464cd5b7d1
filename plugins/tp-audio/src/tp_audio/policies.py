"""Policies for speech models (transformers 5.x).

Every model here is a convolutional front end (waveform feature encoder, or convolutions over
log-mel features), whole, before a stack of transformer blocks split as
:class:`tpcore.BlockPolicy` splits them: each attention's query, key and value projections
column parallel and its output projection row parallel, heads dealt whole (6 heads over 4 ranks as
2, 2, 1, 1); the feed-forward's input projection column parallel, its output projection row
parallel. The feature projection, the positional convolution, the norms, the quantizer and the
task heads (CTC, classifiers, x-vector TDNNs) stay whole. What differs:

- Wav2Vec2 (post- and pre-norm, "stable layer norm", blocks), Hubert, Data2VecAudio, UniSpeech,
  UniSpeech-SAT, SEW: ``attention.{q,k,v,out}_proj``, ``feed_forward.{intermediate,output}_dense``.
  A pre-norm block's attention adapter (``adapter_layer``) stays whole.
- WavLM: the same layout, and a relative position bias per head: the bucket embedding
  ``rel_attn_embed`` ``(buckets, heads)`` and the gate's ``gru_rel_pos_const`` ``(1, heads, 1, 1)``
  are split by heads; its attention runs :func:`local_heads_wavlm_attention`.
- Wav2Vec2-Conformer: ``self_attn.linear_{q,k,v}``, ``linear_out``, two feed-forwards (``ffn1``,
  ``ffn2``). Relative position embeddings: ``linear_pos`` column parallel, ``pos_bias_u``/``pos_bias_v``
  ``(heads, head_dim)`` split by heads; rotary embeddings rotate the block's input in all heads
  (:func:`whole_rotary_attention`). The convolution module stays whole. Wav2Vec2-BERT's blocks are
  Conformer blocks.
- SEW-D: DeBERTa-v2's blocks, BERT's layout (:class:`tpcore.BertLayoutPolicy`) with disentangled
  attention: ``attention.self.{query,key,value}_proj`` and, when not shared, ``pos_{key,query}_proj``
  over the encoder's relative embeddings, which stay whole.
- Whisper and Speech2Text: BART's encoder and decoder blocks (:class:`tpcore.EncoderBlockPolicy`,
  :class:`tpcore.DecoderBlockPolicy`);
  the decoder's token embedding and the LM head tied to it are split over the vocabulary by
  tpcore's core.
"""

from __future__ import annotations

import torch
from torch import nn

from tpcore import (
    PER_HEAD,
    Attention,
    BertLayoutPolicy,
    BlockPolicy,
    DecoderBlockPolicy,
    EncoderBlockPolicy,
    Layer,
    bert_attention,
    share,
    subclassing,
    transformers_class,
)


class SpeechEncoderLayerPolicy(BlockPolicy):
    """A wav2vec 2.0 block: ``attention.{q,k,v,out}_proj``, ``feed_forward.{intermediate,output}_dense``."""

    attentions = (Attention("attention"),)
    mlp_inputs = ("feed_forward.intermediate_dense",)
    mlp_outputs = ("feed_forward.output_dense",)


class Wav2Vec2EncoderLayerPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("wav2vec2", "Wav2Vec2EncoderLayer")


class Wav2Vec2EncoderLayerStableLayerNormPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("wav2vec2", "Wav2Vec2EncoderLayerStableLayerNorm")


class HubertEncoderLayerPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("hubert", "HubertEncoderLayer")


class HubertEncoderLayerStableLayerNormPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("hubert", "HubertEncoderLayerStableLayerNorm")


class Data2VecAudioEncoderLayerPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("data2vec", "Data2VecAudioEncoderLayer", "data2vec_audio")


class UniSpeechEncoderLayerPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("unispeech", "UniSpeechEncoderLayer")


class UniSpeechEncoderLayerStableLayerNormPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("unispeech", "UniSpeechEncoderLayerStableLayerNorm")


class UniSpeechSatEncoderLayerPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("unispeech_sat", "UniSpeechSatEncoderLayer")


class UniSpeechSatEncoderLayerStableLayerNormPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("unispeech_sat", "UniSpeechSatEncoderLayerStableLayerNorm")


class SEWEncoderLayerPolicy(SpeechEncoderLayerPolicy):
    layer_class = transformers_class("sew", "SEWEncoderLayer")


# -- WavLM: a gated relative position bias per head ------------------------------------------------------


@subclassing("LocalHeads")
def local_heads_wavlm_attention(base: type) -> dict:
    """For WavLM's attention, which runs ``torch.nn.functional.multi_head_attention_forward`` on its
    projections' weights (square, the whole width, the output projection without its all-reduce) and
    gates the position bias of head ``h`` by the ``h``-th ``head_dim`` slice of its input: a subclass
    whose forward computes the rank's ``num_heads`` heads (from ``first_head`` of ``full_heads``)
    through the projection modules. Math as unsplit, per head ``h``::

        gate_h   = a_h * (b_h * gru_rel_pos_const_h - 1) + 2,   (a_h, b_h) = sigmoid(sum4(gru_rel_pos_linear(x_h)))
        scores_h = q_h k_h^T / sqrt(head_dim) + gate_h * bias_h   (keys where attention_mask is 0: -inf)
        out      = out_proj(concat_h softmax(scores_h) v_h)

    ``bias_h`` is the bucket embedding's column ``h`` (the rank's columns). The attention weights it
    returns are the rank's heads' own; the unsplit module returns their mean over all heads."""

    def forward(self, hidden_states, attention_mask=None, position_bias=None, index=0, **kwargs):
        batch, length, _ = hidden_states.shape
        heads = self.num_heads
        if position_bias is None:  # the first block: [batch * heads, length, length], passed on to the others
            bias = self.compute_bias(length, length)  # [heads, length, length]
            position_bias = bias.unsqueeze(0).repeat(batch, 1, 1, 1).view(batch * heads, length, length)
        own = hidden_states.view(batch, length, self.full_heads, self.head_dim)
        own = own[:, :, self.first_head : self.first_head + heads].permute(0, 2, 1, 3)  # [batch, heads, length, d]
        gate_a, gate_b = torch.sigmoid(self.gru_rel_pos_linear(own).view(*own.shape[:-1], 2, 4).sum(-1)).chunk(2, -1)
        gate = gate_a * (gate_b * self.gru_rel_pos_const - 1.0) + 2.0  # [batch, heads, length, 1]
        scores_bias = (gate.view(batch * heads, -1, 1) * position_bias).view(batch, heads, length, length)

        def split(projection):  # [batch, heads, length, head_dim]
            return projection(hidden_states).view(batch, length, heads, self.head_dim).transpose(1, 2)

        query, key, value = split(self.q_proj), split(self.k_proj), split(self.v_proj)
        scores = torch.baddbmm(
            scores_bias.flatten(0, 1), (query * self.scaling).flatten(0, 1), key.flatten(0, 1).transpose(1, 2)
        ).view(batch, heads, length, length)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask.ne(1)[:, None, None, :], float("-inf"))
        probs = nn.functional.dropout(scores.softmax(-1), p=self.dropout, training=self.training)
        context = (probs @ value).transpose(1, 2).reshape(batch, length, heads * self.head_dim)
        return self.out_proj(context), probs, position_bias

    return {"forward": forward, "full_heads": None, "first_head": None}


class WavLMEncoderLayerPolicy(SpeechEncoderLayerPolicy):
    """The first block holds the bucket embedding; every block gates it by its own heads."""

    layer_class = transformers_class("wavlm", "WavLMEncoderLayer")

    @classmethod
    def replace_arguments(cls, config, world_size):
        heads = getattr(config, cls.heads)
        first = share(heads, world_size, cls.heads, first=True)
        return super().replace_arguments(config, world_size) | {
            "attention.full_heads": heads,
            "attention.first_head": first,
        }

    @classmethod
    def replace_modules(cls):
        return {"attention": local_heads_wavlm_attention}

    @classmethod
    def layers(cls):
        per_head = [
            Layer(weight="attention.rel_attn_embed.weight", style=PER_HEAD, dim=-1, heads=cls.heads, optional=True),
            Layer(weight="attention.gru_rel_pos_const", style=PER_HEAD, dim=1, heads=cls.heads),
        ]
        return [*super().layers(), *per_head]


class WavLMEncoderLayerStableLayerNormPolicy(WavLMEncoderLayerPolicy):
    layer_class = transformers_class("wavlm", "WavLMEncoderLayerStableLayerNorm")


# -- Conformer ----------------------------------------------------------------------------------------------


@subclassing("WholeRotary")
def whole_rotary_attention(base: type) -> dict:
    """For a Conformer self-attention, which rotates its input (the whole width, before the
    projections) head by head: a subclass whose ``_apply_rotary_embedding`` views the input in all
    ``full_heads`` heads. Relative and no position embeddings do not reach it."""

    def _apply_rotary_embedding(self, hidden_states, relative_position_embeddings):
        local, self.num_heads = self.num_heads, self.full_heads
        try:
            return base._apply_rotary_embedding(self, hidden_states, relative_position_embeddings)
        finally:
            self.num_heads = local

    return {"_apply_rotary_embedding": _apply_rotary_embedding, "full_heads": None}


class Wav2Vec2ConformerEncoderLayerPolicy(BlockPolicy):
    """A Conformer block: half-step feed-forwards ``ffn1`` and ``ffn2`` around the self-attention
    and the convolution module (whole)."""

    layer_class = transformers_class("wav2vec2_conformer", "Wav2Vec2ConformerEncoderLayer")
    attentions = (
        Attention(
            "self_attn",
            projections=("linear_q", "linear_k", "linear_v"),
            output="linear_out",
            optional_projections=("linear_pos",),  # relative position embeddings only
        ),
    )
    mlp_inputs = ("ffn1.intermediate_dense", "ffn2.intermediate_dense")
    mlp_outputs = ("ffn1.output_dense", "ffn2.output_dense")

    @classmethod
    def replace_arguments(cls, config, world_size):
        return super().replace_arguments(config, world_size) | {"self_attn.full_heads": getattr(config, cls.heads)}

    @classmethod
    def replace_modules(cls):
        return {"self_attn": whole_rotary_attention}

    @classmethod
    def layers(cls):
        biases = ("self_attn.pos_bias_u", "self_attn.pos_bias_v")  # relative position embeddings only
        per_head = [Layer(weight=path, style=PER_HEAD, heads=cls.heads, optional=True) for path in biases]
        return [*super().layers(), *per_head]


class Wav2Vec2BertEncoderLayerPolicy(Wav2Vec2ConformerEncoderLayerPolicy):
    """w2v-BERT 2.0's Conformer block over log-mel features; its default relative-key position
    embedding (``distance_embedding``, ``(distances, head_dim)``) is shared by the heads and stays whole."""

    layer_class = transformers_class("wav2vec2_bert", "Wav2Vec2BertEncoderLayer")


# -- SEW-D: disentangled attention ----------------------------------------------------------------------------


class SEWDLayerPolicy(BertLayoutPolicy):
    """DeBERTa-v2's block: ``attention.self.{query,key,value}_proj`` and, unless ``share_att_key``,
    the relative position projections ``pos_key_proj``/``pos_query_proj``, all by heads;
    ``attention.output.dense`` row parallel; ``intermediate.dense``, ``output.dense`` the MLP."""

    layer_class = transformers_class("sew_d", "SEWDLayer")
    attentions = (
        bert_attention(
            "attention",
            ("query_proj", "key_proj", "value_proj"),
            optional_projections=("pos_key_proj", "pos_query_proj"),
        ),
    )


# -- speech to text: BART's blocks ------------------------------------------------------------------------------


class WhisperEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("whisper", "WhisperEncoderLayer")


class WhisperDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("whisper", "WhisperDecoderLayer")


class Speech2TextEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("speech_to_text", "Speech2TextEncoderLayer")


class Speech2TextDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("speech_to_text", "Speech2TextDecoderLayer")


POLICIES = (
    Wav2Vec2EncoderLayerPolicy,
    Wav2Vec2EncoderLayerStableLayerNormPolicy,
    HubertEncoderLayerPolicy,
    HubertEncoderLayerStableLayerNormPolicy,
    Data2VecAudioEncoderLayerPolicy,
    UniSpeechEncoderLayerPolicy,
    UniSpeechEncoderLayerStableLayerNormPolicy,
    UniSpeechSatEncoderLayerPolicy,
    UniSpeechSatEncoderLayerStableLayerNormPolicy,
    SEWEncoderLayerPolicy,
    WavLMEncoderLayerPolicy,
    WavLMEncoderLayerStableLayerNormPolicy,
    Wav2Vec2ConformerEncoderLayerPolicy,
    Wav2Vec2BertEncoderLayerPolicy,
    SEWDLayerPolicy,
    WhisperEncoderLayerPolicy,
    WhisperDecoderLayerPolicy,
    Speech2TextEncoderLayerPolicy,
    Speech2TextDecoderLayerPolicy,
)
