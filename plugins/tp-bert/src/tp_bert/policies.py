"""Policies for the BERT family of encoders (transformers 5.x).

Most of the family shares BERT's layer layout (``attention.self.{query,key,value}``,
``attention.output.dense``, ``intermediate.dense``, ``output.dense``, and an optional
``crossattention`` of the same shape): their policies subclass :class:`BertPolicy` and only name
their layer class. That covers BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, Data2VecText,
ERNIE, RoBERTa-PreLayerNorm, XLM-RoBERTa-XL, Megatron-BERT, LayoutLM, MarkupLM, Splinter, RemBERT,
BertGeneration, RoCBert, X-MOD and ESM. Where these differ from BERT nothing more needs a split:
LayerNorms (pre- or post-), X-MOD's language adapters and the embeddings (LayoutLM's boxes,
MarkupLM's xpaths, RoCBert's shapes and pronunciations) see whole hidden states, and ESM's rotary
embeddings act within each head.

The others have their own policies:

- DistilBERT: ``attention.{q,k,v,out}_lin`` and ``ffn.lin1``/``ffn.lin2``.
- LUKE: BERT's layout plus the entity-aware queries ``w2e_query``, ``e2w_query``, ``e2e_query``.
- MPNet: ``attention.attn.{q,k,v,o}``, and a relative position bias ``Embedding(buckets, heads)``
  owned by ``MPNetEncoder`` and shared by all layers, which is split along its heads.
- NomicBERT and EuroBERT: Llama's layout (``self_attn.{q,k,v,o}_proj``, a gated MLP
  ``mlp.{gate,up,down}_proj``); EuroBERT's key/value heads (GQA) must split evenly too.
- ModernBERT: a fused ``attn.Wqkv`` (q|k|v) and a fused ``mlp.Wi`` (input|gate).

Every attention here infers its head count from the projection's output (``view(..., -1,
head_dim)``); the head-count attributes that some forwards still read (``all_head_size`` in
Megatron-BERT, RemBERT, LUKE and MPNet, ``num_attention_heads`` in LUKE) are rewritten per rank.
"""

from __future__ import annotations

from tpcore import Layer, Policy, divide

_MODELS = "transformers.models"


def _qkv(prefix: str, optional: bool = False) -> list[Layer]:
    return [
        Layer(weight=f"{prefix}.self.{name}.weight", bias=f"{prefix}.self.{name}.bias", ignore_checker=optional)
        for name in ("query", "key", "value")
    ]


def _out(prefix: str, optional: bool = False) -> list[Layer]:
    return [Layer(weight=f"{prefix}.output.dense.weight", bias=f"{prefix}.output.dense.bias", ignore_checker=optional)]


def _linear(path: str, n_fused: int = 1, optional: bool = False) -> Layer:
    """The weight and bias of the ``nn.Linear`` at ``path`` (a missing bias module attribute is ``None``)."""
    return Layer(weight=f"{path}.weight", bias=f"{path}.bias", n_fused=n_fused, ignore_checker=optional)


def _local_heads(config, world_size: int, name: str = "num_attention_heads") -> int:
    return divide(getattr(config, name), world_size, name)


def _head_arguments(owner: str, config, world_size: int) -> dict[str, int]:
    """Per-rank ``num_attention_heads`` and ``all_head_size`` of the attention module at ``owner``."""
    heads = _local_heads(config, world_size)
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
        return [_linear("intermediate.dense")]

    @staticmethod
    def mlp_out():
        return [_linear("output.dense")]


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


class LukePolicy(BertPolicy):
    """LUKE layer: BERT's, plus queries for word-to-entity, entity-to-word and entity-to-entity
    attention (present when ``config.use_entity_aware_attention``)."""

    layer_class = f"{_MODELS}.luke.modeling_luke.LukeLayer"

    @staticmethod
    def attn_qkv():
        entity_queries = ("w2e_query", "e2w_query", "e2e_query")
        return _qkv("attention") + [_linear(f"attention.self.{name}", optional=True) for name in entity_queries]


class DistilBertPolicy(Policy):
    """DistilBERT ``TransformerBlock``: ``attention.{q,k,v,out}_lin``, ``ffn.lin1``/``ffn.lin2``."""

    layer_class = f"{_MODELS}.distilbert.modeling_distilbert.TransformerBlock"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = _local_heads(config, world_size, "n_heads")
        return {"attention.n_heads": heads, "attention.dim": heads * (config.dim // config.n_heads)}

    @staticmethod
    def attn_qkv():
        return [_linear(f"attention.{name}_lin") for name in "qkv"]

    @staticmethod
    def attn_out():
        return [_linear("attention.out_lin")]

    @staticmethod
    def mlp_in():
        return [_linear("ffn.lin1")]

    @staticmethod
    def mlp_out():
        return [_linear("ffn.lin2")]


class MPNetPolicy(BertPolicy):
    """MPNet layer: ``attention.attn.{q,k,v}`` and ``attention.attn.o``, then BERT's MLP."""

    layer_class = f"{_MODELS}.mpnet.modeling_mpnet.MPNetLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        return _head_arguments("attention.attn", config, world_size)

    @staticmethod
    def attn_qkv():
        return [_linear(f"attention.attn.{name}") for name in "qkv"]

    @staticmethod
    def attn_out():
        return [_linear("attention.attn.o")]


class MPNetEncoderPolicy(Policy):
    """MPNet encoder: its relative position bias ``Embedding(buckets, heads)``, computed once and
    added to every layer's attention scores, keeps this rank's heads (dim 1, hence ``reversed``)."""

    layer_class = f"{_MODELS}.mpnet.modeling_mpnet.MPNetEncoder"

    @staticmethod
    def replace_arguments(config, world_size):
        return {"n_heads": _local_heads(config, world_size)}

    @staticmethod
    def attn_qkv():
        return [Layer(weight="relative_attention_bias.weight", reversed=True)]


class _LlamaLayoutPolicy(Policy):
    """``self_attn.{q,k,v,o}_proj`` and a gated MLP ``mlp.{gate,up,down}_proj``; no head attribute
    is read in forward, so only the head counts are checked."""

    @staticmethod
    def replace_arguments(config, world_size):
        _local_heads(config, world_size)
        if getattr(config, "num_key_value_heads", None) is not None:
            _local_heads(config, world_size, "num_key_value_heads")
        return {}

    @staticmethod
    def attn_qkv():
        return [_linear(f"self_attn.{name}_proj") for name in "qkv"]

    @staticmethod
    def attn_out():
        return [_linear("self_attn.o_proj")]

    @staticmethod
    def mlp_in():
        return [_linear("mlp.gate_proj"), _linear("mlp.up_proj")]

    @staticmethod
    def mlp_out():
        return [_linear("mlp.down_proj")]


class NomicBertPolicy(_LlamaLayoutPolicy):
    layer_class = f"{_MODELS}.nomic_bert.modeling_nomic_bert.NomicBertLayer"


class EuroBertPolicy(_LlamaLayoutPolicy):
    layer_class = f"{_MODELS}.eurobert.modeling_eurobert.EuroBertDecoderLayer"


class ModernBertPolicy(Policy):
    """ModernBERT layer: fused ``attn.Wqkv`` (q|k|v) and ``mlp.Wi`` (input|gate), outputs ``Wo``."""

    layer_class = f"{_MODELS}.modernbert.modeling_modernbert.ModernBertEncoderLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        _local_heads(config, world_size)
        return {}

    @staticmethod
    def attn_qkv():
        return [_linear("attn.Wqkv", n_fused=3)]

    @staticmethod
    def attn_out():
        return [_linear("attn.Wo")]

    @staticmethod
    def mlp_in():
        return [_linear("mlp.Wi", n_fused=2)]

    @staticmethod
    def mlp_out():
        return [_linear("mlp.Wo")]


POLICIES = (
    BertPolicy,
    RobertaPolicy,
    XLMRobertaPolicy,
    CamembertPolicy,
    ElectraPolicy,
    DistilBertPolicy,
    Data2VecTextPolicy,
    ErniePolicy,
    RobertaPreLayerNormPolicy,
    XLMRobertaXLPolicy,
    MegatronBertPolicy,
    LayoutLMPolicy,
    MarkupLMPolicy,
    SplinterPolicy,
    RemBertPolicy,
    BertGenerationPolicy,
    RoCBertPolicy,
    XmodPolicy,
    EsmPolicy,
    LukePolicy,
    MPNetPolicy,
    MPNetEncoderPolicy,
    NomicBertPolicy,
    EuroBertPolicy,
    ModernBertPolicy,
)
