"""Policies for the BART family of encoder-decoder models (transformers 5.x).

Every model here has encoder blocks (self-attention, MLP) and decoder blocks (self-attention,
cross-attention, MLP); a policy applies to each block class and names its attentions
(:class:`tpcore.Attention`) and its MLP (:class:`tpcore.EncoderBlockPolicy`,
:class:`tpcore.DecoderBlockPolicy`):

- each attention's query, key and value projections column parallel, its output projection row
  parallel, heads dealt whole (:func:`tpcore.share`: 6 heads over 4 ranks as 2, 2, 1, 1), the
  attributes holding its head count (and, where a forward reads it, its width) set per rank;
- ``fc1`` column parallel, ``fc2`` row parallel.

The encoder's heads are ``encoder_attention_heads``, the decoder's (self- and cross-attention)
``decoder_attention_heads``. BART, mBART, Marian, Pegasus, Blenderbot, BlenderbotSmall, M2M100 (and
NLLB, which is M2M100) and PLBart need nothing else: their attention merges heads with
``reshape(..., -1)``. The others differ in their attentions:

- FSMT, LED, ProphetNet and Pegasus-X's encoder merge heads into the width they read from their
  input (``view(seq, batch, hidden)``): those attentions get :func:`tpcore.local_width_class`.
- LED's encoder attention is Longformer's: ``longformer_self_attn.{query,key,value}`` and the global
  ``{query,key,value}_global`` column parallel, ``output`` row parallel.
- BigBirdPegasus' encoder attention is block sparse (``self.{query,key,value}``, ``output``); its
  random blocks are a constant in eval mode, the same for every head, so a rank's heads attend as
  they do unsplit. An input too short for blocks switches the encoder to full attention, which
  builds new attention modules from the config; ``keeps_local_heads``
  (:func:`tpcore.keeping_local_attributes`) carries the rank's head counts over to them.
- ProphetNet (``{query,key,value}_proj``, ``out_proj``, ``feed_forward.{intermediate,output}``): its
  encoder and decoder stacks build attention masks for the config's head counts and read a per-rank
  config copy; the n-gram self-attention's relative position projection stays whole
  (:func:`ngram_attention_class` says why).

Word embeddings (plain or scaled, ``*ScaledWordEmbedding``) and the LM head they are tied to are
split over the vocabulary by tpcore's core, together; ``final_logits_bias`` is added to the gathered
logits, whole.
"""

from __future__ import annotations

import functools

from torch import nn

from tpcore import (
    Attention,
    DecoderBlockPolicy,
    EncoderBlockPolicy,
    Policy,
    keeping_local_attributes,
    local_config,
    local_width_class,
    share,
    transformers_class,
)

# -- BART's own layout ------------------------------------------------------------------------------


class BartEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("bart", "BartEncoderLayer")


class BartDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("bart", "BartDecoderLayer")


class MBartEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("mbart", "MBartEncoderLayer")


class MBartDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("mbart", "MBartDecoderLayer")


class MarianEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("marian", "MarianEncoderLayer")


class MarianDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("marian", "MarianDecoderLayer")


class PegasusEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("pegasus", "PegasusEncoderLayer")


class PegasusDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("pegasus", "PegasusDecoderLayer")


class BlenderbotEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("blenderbot", "BlenderbotEncoderLayer")


class BlenderbotDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("blenderbot", "BlenderbotDecoderLayer")


class BlenderbotSmallEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("blenderbot_small", "BlenderbotSmallEncoderLayer")


class BlenderbotSmallDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("blenderbot_small", "BlenderbotSmallDecoderLayer")


class M2M100EncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("m2m_100", "M2M100EncoderLayer")


class M2M100DecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("m2m_100", "M2M100DecoderLayer")


class PLBartEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("plbart", "PLBartEncoderLayer")


class PLBartDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("plbart", "PLBartDecoderLayer")


# -- attentions that merge heads into their input's width -------------------------------------------


class PegasusXEncoderLayerPolicy(EncoderBlockPolicy):
    """Global-local self-attention over the tokens and the global tokens, one set of projections."""

    layer_class = transformers_class("pegasus_x", "PegasusXEncoderLayer")
    attentions = (Attention("self_attn", reshaping=""),)


class PegasusXDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("pegasus_x", "PegasusXDecoderLayer")


class FSMTEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("fsmt", "EncoderLayer")
    attentions = (Attention("self_attn", reshaping=""),)


class FSMTDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("fsmt", "DecoderLayer")
    attentions = (Attention("self_attn", reshaping=""), Attention("encoder_attn", reshaping=""))


_LONGFORMER = tuple(f"longformer_self_attn.{name}" for name in ("query", "key", "value"))


class LEDEncoderLayerPolicy(EncoderBlockPolicy):
    """Longformer self-attention: sliding-window ``query``/``key``/``value`` and the global tokens'
    ``*_global`` projections, one ``output``."""

    layer_class = transformers_class("led", "LEDEncoderLayer")
    attentions = (
        Attention(
            "self_attn",
            projections=_LONGFORMER + tuple(f"{name}_global" for name in _LONGFORMER),
            output="output",
            counts=("longformer_self_attn.num_heads",),
            reshaping="longformer_self_attn",
        ),
    )


class LEDDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("led", "LEDDecoderLayer")
    attentions = (Attention("self_attn", reshaping=""), Attention("encoder_attn", reshaping=""))


# -- block-sparse attention -------------------------------------------------------------------------


#: BigBirdPegasus' encoder attention rebuilds its ``self`` when it switches between block-sparse and full attention
keeps_local_heads = keeping_local_attributes("set_attention_type", "self", ("num_attention_heads", "all_head_size"))


class BigBirdPegasusEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("bigbird_pegasus", "BigBirdPegasusEncoderLayer")
    attentions = (
        Attention(
            "self_attn",
            projections=("self.query", "self.key", "self.value"),
            output="output",
            counts=("self.num_attention_heads",),
            widths=("self.all_head_size",),
        ),
    )

    @staticmethod
    def replace_modules():
        return {"self_attn": keeps_local_heads}


class BigBirdPegasusDecoderLayerPolicy(DecoderBlockPolicy):
    layer_class = transformers_class("bigbird_pegasus", "BigBirdPegasusDecoderLayer")


# -- ProphetNet ---------------------------------------------------------------------------------------


def _prophetnet_attention(path: str, optional: bool = False) -> Attention:
    return Attention(
        path,
        projections=("query_proj", "key_proj", "value_proj"),
        counts=("num_attn_heads",),
        reshaping="",
        optional=optional,
    )


def ngram_attention_class(module: nn.Module | None) -> type[nn.Module] | None:
    """For ProphetNet's n-gram self-attention: its :func:`~tpcore.local_width_class`, whose
    relative position lookups run over all ``full_heads`` heads and keep the rank's heads (from
    ``first_head``). The predict stream's lookup pairs the projection's rows (batch, position,
    stream, head) with the bucket rows (stream, batch, head, position) one to one, so which head's
    projection a head's output reads depends on the whole head count: the projection stays whole
    (``Linear(hidden, buckets * heads)``, small) and each rank reads its heads out of the whole lookup."""
    return None if module is None else _whole_lookup_subclass(local_width_class(module))


@functools.cache
def _whole_lookup_subclass(cls: type[nn.Module]) -> type[nn.Module]:
    def with_all_heads(self, lookup, *args):
        local = self.num_attn_heads
        self.num_attn_heads = self.full_heads
        try:
            return lookup(self, *args)
        finally:
            self.num_attn_heads = local

    def get_main_relative_pos_embeddings(self, hidden_states, attn_weights, position_ids, buckets):
        batch, _, target, source = attn_weights.shape  # the lookup reads its head count from this shape
        all_heads = attn_weights[:, :1].expand(batch, self.full_heads, target, source)
        whole = with_all_heads(
            self, cls.get_main_relative_pos_embeddings, hidden_states, all_heads, position_ids, buckets
        )
        return whole[:, self.first_head : self.first_head + self.num_attn_heads]  # [batch, heads, target, source]

    def get_predict_relative_pos_embeddings(self, hidden_states, attn_weights, position_ids, buckets):
        lookup = cls.get_predict_relative_pos_embeddings
        whole = with_all_heads(self, lookup, hidden_states, attn_weights, position_ids, buckets)
        return whole[:, :, self.first_head : self.first_head + self.num_attn_heads]  # [batch, ngram, heads, t, s]

    namespace = {
        "__module__": __name__,
        "__doc__": ngram_attention_class.__doc__,
        "full_heads": None,
        "first_head": None,
        "get_main_relative_pos_embeddings": get_main_relative_pos_embeddings,
        "get_predict_relative_pos_embeddings": get_predict_relative_pos_embeddings,
    }
    return type(f"WholeLookup{cls.__name__}", (cls,), namespace)


class ProphetNetEncoderLayerPolicy(EncoderBlockPolicy):
    layer_class = transformers_class("prophetnet", "ProphetNetEncoderLayer")
    heads = "num_encoder_attention_heads"
    attentions = (_prophetnet_attention("self_attn"),)
    mlp_inputs = ("feed_forward.intermediate",)
    mlp_outputs = ("feed_forward.output",)


class ProphetNetDecoderLayerPolicy(ProphetNetEncoderLayerPolicy):
    """N-gram self-attention (main and predict streams; see :func:`ngram_attention_class`), and
    cross-attention where the decoder has an encoder."""

    layer_class = transformers_class("prophetnet", "ProphetNetDecoderLayer")
    heads = "num_decoder_attention_heads"
    attentions = (_prophetnet_attention("self_attn"), _prophetnet_attention("cross_attn", optional=True))

    @classmethod
    def replace_arguments(cls, config, world_size):
        heads = getattr(config, cls.heads)
        lookup = {"full_heads": heads, "first_head": share(heads, world_size, cls.heads, first=True)}
        return super().replace_arguments(config, world_size) | {f"self_attn.{k}": v for k, v in lookup.items()}

    @classmethod
    def replace_modules(cls):
        return super().replace_modules() | {"self_attn": ngram_attention_class}


class ProphetNetEncoderPolicy(Policy):
    """The encoder stack expands its attention mask to ``config.num_encoder_attention_heads``: it
    reads a config copy holding the rank's count."""

    layer_class = transformers_class("prophetnet", "ProphetNetEncoder")
    heads = "num_encoder_attention_heads"

    @classmethod
    def replace_arguments(cls, config, world_size):
        return {
            "config": local_config(
                config, world_size, **{cls.heads: share(getattr(config, cls.heads), world_size, cls.heads)}
            )
        }


class ProphetNetDecoderPolicy(ProphetNetEncoderPolicy):
    """The decoder stack builds its causal, n-gram and cross-attention masks for
    ``config.num_decoder_attention_heads``."""

    layer_class = transformers_class("prophetnet", "ProphetNetDecoder")
    heads = "num_decoder_attention_heads"


POLICIES = (
    BartEncoderLayerPolicy,
    BartDecoderLayerPolicy,
    MBartEncoderLayerPolicy,
    MBartDecoderLayerPolicy,
    MarianEncoderLayerPolicy,
    MarianDecoderLayerPolicy,
    PegasusEncoderLayerPolicy,
    PegasusDecoderLayerPolicy,
    PegasusXEncoderLayerPolicy,
    PegasusXDecoderLayerPolicy,
    BlenderbotEncoderLayerPolicy,
    BlenderbotDecoderLayerPolicy,
    BlenderbotSmallEncoderLayerPolicy,
    BlenderbotSmallDecoderLayerPolicy,
    M2M100EncoderLayerPolicy,
    M2M100DecoderLayerPolicy,
    PLBartEncoderLayerPolicy,
    PLBartDecoderLayerPolicy,
    FSMTEncoderLayerPolicy,
    FSMTDecoderLayerPolicy,
    LEDEncoderLayerPolicy,
    LEDDecoderLayerPolicy,
    BigBirdPegasusEncoderLayerPolicy,
    BigBirdPegasusDecoderLayerPolicy,
    ProphetNetEncoderLayerPolicy,
    ProphetNetDecoderLayerPolicy,
    ProphetNetEncoderPolicy,
    ProphetNetDecoderPolicy,
)
