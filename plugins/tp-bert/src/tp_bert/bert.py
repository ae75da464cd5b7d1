"""BERT's layer layout and the families that keep it or add to it: BertPolicy and the policies that only
name their layer class, BigBird, LUKE, MPNet; DistilBERT; the helpers the other modules share."""

from __future__ import annotations

from tpcore import Layer, Policy, keeping_local_attributes, linear, local_heads

_MODELS = "transformers.models"


_HEADS = "num_attention_heads"


def _qkv(prefix: str, optional: bool = False) -> list[Layer]:
    return [linear(f"{prefix}.self.{name}", optional=optional, heads=_HEADS) for name in ("query", "key", "value")]


def _out(prefix: str, optional: bool = False) -> list[Layer]:
    return [linear(f"{prefix}.output.dense", optional=optional, heads=_HEADS)]


def _head_arguments(owner: str, config, world_size: int) -> dict:
    """Per-rank ``num_attention_heads`` and ``all_head_size`` of the attention module at ``owner``."""
    heads = local_heads(config, world_size, _HEADS)
    head_size = config.hidden_size // config.num_attention_heads
    return {f"{owner}.num_attention_heads": heads, f"{owner}.all_head_size": heads * head_size}


def _has_cross_attention(config) -> bool:
    return bool(getattr(config, "is_decoder", False) and getattr(config, "add_cross_attention", False))


class BertPolicy(Policy):
    """BERT layer: self-attention (and cross-attention in a decoder), then the MLP."""

    layer_class = f"{_MODELS}.bert.modeling_bert.BertLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        arguments = _head_arguments("attention.self", config, world_size)
        if _has_cross_attention(config):
            arguments.update(_head_arguments("crossattention.self", config, world_size))
        return arguments

    @staticmethod
    def attn_qkv():
        return _qkv("attention") + _qkv("crossattention", optional=True)

    @staticmethod
    def attn_out():
        return _out("attention") + _out("crossattention", optional=True)

    @staticmethod
    def mlp_in():
        return [linear("intermediate.dense")]

    @staticmethod
    def mlp_out():
        return [linear("output.dense")]


class RobertaPolicy(BertPolicy):
    layer_class = f"{_MODELS}.roberta.modeling_roberta.RobertaLayer"


class XLMRobertaPolicy(BertPolicy):
    layer_class = f"{_MODELS}.xlm_roberta.modeling_xlm_roberta.XLMRobertaLayer"


class CamembertPolicy(BertPolicy):
    layer_class = f"{_MODELS}.camembert.modeling_camembert.CamembertLayer"


class ElectraPolicy(BertPolicy):
    layer_class = f"{_MODELS}.electra.modeling_electra.ElectraLayer"


class Data2VecTextPolicy(BertPolicy):
    layer_class = f"{_MODELS}.data2vec.modeling_data2vec_text.Data2VecTextLayer"


class ErniePolicy(BertPolicy):
    layer_class = f"{_MODELS}.ernie.modeling_ernie.ErnieLayer"


class RobertaPreLayerNormPolicy(BertPolicy):
    layer_class = f"{_MODELS}.roberta_prelayernorm.modeling_roberta_prelayernorm.RobertaPreLayerNormLayer"


class XLMRobertaXLPolicy(BertPolicy):
    layer_class = f"{_MODELS}.xlm_roberta_xl.modeling_xlm_roberta_xl.XLMRobertaXLLayer"


class MegatronBertPolicy(BertPolicy):
    layer_class = f"{_MODELS}.megatron_bert.modeling_megatron_bert.MegatronBertLayer"


class LayoutLMPolicy(BertPolicy):
    layer_class = f"{_MODELS}.layoutlm.modeling_layoutlm.LayoutLMLayer"


class MarkupLMPolicy(BertPolicy):
    layer_class = f"{_MODELS}.markuplm.modeling_markuplm.MarkupLMLayer"


class SplinterPolicy(BertPolicy):
    layer_class = f"{_MODELS}.splinter.modeling_splinter.SplinterLayer"


class RemBertPolicy(BertPolicy):
    layer_class = f"{_MODELS}.rembert.modeling_rembert.RemBertLayer"


class BertGenerationPolicy(BertPolicy):
    layer_class = f"{_MODELS}.bert_generation.modeling_bert_generation.BertGenerationLayer"


class RoCBertPolicy(BertPolicy):
    layer_class = f"{_MODELS}.roc_bert.modeling_roc_bert.RoCBertLayer"


class XmodPolicy(BertPolicy):
    layer_class = f"{_MODELS}.xmod.modeling_xmod.XmodLayer"


class EsmPolicy(BertPolicy):
    layer_class = f"{_MODELS}.esm.modeling_esm.EsmLayer"


class RoFormerPolicy(BertPolicy):
    """RoFormer: BERT's layout; its rotary position embeddings turn each head's query and key."""

    layer_class = f"{_MODELS}.roformer.modeling_roformer.RoFormerLayer"


class TapasPolicy(BertPolicy):
    layer_class = f"{_MODELS}.tapas.modeling_tapas.TapasLayer"


class VisualBertPolicy(BertPolicy):
    layer_class = f"{_MODELS}.visual_bert.modeling_visual_bert.VisualBertLayer"


#: BigBird's attention builds its ``self`` anew from the config when it switches between block-sparse and full
_KEEPS_LOCAL_HEADS = keeping_local_attributes("set_attention_type", "self", (_HEADS, "all_head_size"))


class BigBirdPolicy(BertPolicy):
    """BigBird: BERT's layout, its self-attention block sparse (``attention.self.{query,key,value}``).
    In eval mode its random blocks are the same for every head, so a rank's heads attend as they do
    unsplit; an input too short for blocks switches the model to full attention, which rebuilds the
    attention from the config: the rank's head counts are carried over
    (:func:`tpcore.blocks.keeping_local_attributes`)."""

    layer_class = f"{_MODELS}.big_bird.modeling_big_bird.BigBirdLayer"

    @staticmethod
    def replace_modules():
        return {"attention": _KEEPS_LOCAL_HEADS, "crossattention": _KEEPS_LOCAL_HEADS}


class LukePolicy(BertPolicy):
    """LUKE layer: BERT's, plus queries for word-to-entity, entity-to-word and entity-to-entity
    attention (present when ``config.use_entity_aware_attention``)."""

    layer_class = f"{_MODELS}.luke.modeling_luke.LukeLayer"

    @staticmethod
    def attn_qkv():
        entity_queries = ("w2e_query", "e2w_query", "e2e_query")
        entity = [linear(f"attention.self.{name}", optional=True, heads=_HEADS) for name in entity_queries]
        return _qkv("attention") + entity


class DistilBertPolicy(Policy):
    """DistilBERT ``TransformerBlock``: ``attention.{q,k,v,out}_lin``, ``ffn.lin1``/``ffn.lin2``."""

    layer_class = f"{_MODELS}.distilbert.modeling_distilbert.TransformerBlock"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, "n_heads")
        return {"attention.n_heads": heads, "attention.dim": heads * (config.dim // config.n_heads)}

    @staticmethod
    def attn_qkv():
        return [linear(f"attention.{name}_lin", heads="n_heads") for name in "qkv"]

    @staticmethod
    def attn_out():
        return [linear("attention.out_lin", heads="n_heads")]

    @staticmethod
    def mlp_in():
        return [linear("ffn.lin1")]

    @staticmethod
    def mlp_out():
        return [linear("ffn.lin2")]


class MPNetPolicy(BertPolicy):
    """MPNet layer: ``attention.attn.{q,k,v}`` and ``attention.attn.o``, then BERT's MLP."""

    layer_class = f"{_MODELS}.mpnet.modeling_mpnet.MPNetLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        return _head_arguments("attention.attn", config, world_size)

    @staticmethod
    def attn_qkv():
        return [linear(f"attention.attn.{name}", heads=_HEADS) for name in "qkv"]

    @staticmethod
    def attn_out():
        return [linear("attention.attn.o", heads=_HEADS)]


class MPNetEncoderPolicy(Policy):
    """MPNet encoder: its relative position bias ``Embedding(buckets, heads)``, computed once and
    added to every layer's attention scores, keeps this rank's heads (dim 1, hence ``reversed``)."""

    layer_class = f"{_MODELS}.mpnet.modeling_mpnet.MPNetEncoder"

    @staticmethod
    def replace_arguments(config, world_size):
        return {"n_heads": local_heads(config, world_size, _HEADS)}

    @staticmethod
    def attn_qkv():
        return [Layer(weight="relative_attention_bias.weight", transposed=True, heads=_HEADS)]
