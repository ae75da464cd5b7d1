"""BERT's layer layout and the families that keep it or add to it: :class:`BertPolicy` and the
policies of :data:`SAME_LAYOUT`, BigBird, LUKE, MPNet; DistilBERT."""

from __future__ import annotations

from tpcore import (
    PER_HEAD,
    Attention,
    BertLayoutPolicy,
    BlockPolicy,
    Layer,
    Policy,
    bert_attention,
    keeping_local_attributes,
    share,
    transformers_class,
)


class BertPolicy(BertLayoutPolicy):
    """BERT layer: self-attention (and cross-attention in a decoder), then the MLP."""

    layer_class = transformers_class("bert", "BertLayer")


#: the families whose layer is BERT's, by the name of their policy (a :class:`BertPolicy` that names
#: only its layer class): where transformers defines the layer (module, class, file of another name)
SAME_LAYOUT = {
    "RobertaPolicy": ("roberta", "RobertaLayer"),
    "XLMRobertaPolicy": ("xlm_roberta", "XLMRobertaLayer"),
    "CamembertPolicy": ("camembert", "CamembertLayer"),
    "ElectraPolicy": ("electra", "ElectraLayer"),
    "Data2VecTextPolicy": ("data2vec", "Data2VecTextLayer", "data2vec_text"),
    "ErniePolicy": ("ernie", "ErnieLayer"),
    "RobertaPreLayerNormPolicy": ("roberta_prelayernorm", "RobertaPreLayerNormLayer"),
    "XLMRobertaXLPolicy": ("xlm_roberta_xl", "XLMRobertaXLLayer"),
    "MegatronBertPolicy": ("megatron_bert", "MegatronBertLayer"),
    "LayoutLMPolicy": ("layoutlm", "LayoutLMLayer"),
    "MarkupLMPolicy": ("markuplm", "MarkupLMLayer"),
    "SplinterPolicy": ("splinter", "SplinterLayer"),
    "RemBertPolicy": ("rembert", "RemBertLayer"),
    "BertGenerationPolicy": ("bert_generation", "BertGenerationLayer"),
    "RoCBertPolicy": ("roc_bert", "RoCBertLayer"),
    "XmodPolicy": ("xmod", "XmodLayer"),
    "EsmPolicy": ("esm", "EsmLayer"),
    "RoFormerPolicy": ("roformer", "RoFormerLayer"),  # its rotary embeddings turn each head's query and key
    "TapasPolicy": ("tapas", "TapasLayer"),
    "VisualBertPolicy": ("visual_bert", "VisualBertLayer"),
}

# each a class of this module, importable by its name
globals().update(
    (name, type(name, (BertPolicy,), {"__module__": __name__, "layer_class": transformers_class(*where)}))
    for name, where in SAME_LAYOUT.items()
)


#: BigBird's attention builds its ``self`` anew from the config when it switches between block-sparse and full
keeps_local_heads = keeping_local_attributes("set_attention_type", "self", ("num_attention_heads", "all_head_size"))


class BigBirdPolicy(BertPolicy):
    """BigBird: BERT's layout, its self-attention block sparse (``attention.self.{query,key,value}``).
    In eval mode its random blocks are the same for every head, so a rank's heads attend as they do
    unsplit; an input too short for blocks switches the model to full attention, which rebuilds the
    attention from the config: the rank's head counts are carried over (:data:`keeps_local_heads`)."""

    layer_class = transformers_class("big_bird", "BigBirdLayer")

    @staticmethod
    def replace_modules():
        return {"attention": keeps_local_heads, "crossattention": keeps_local_heads}


class LukePolicy(BertPolicy):
    """LUKE layer: BERT's, plus queries for word-to-entity, entity-to-word and entity-to-entity
    attention (present when ``config.use_entity_aware_attention``)."""

    layer_class = transformers_class("luke", "LukeLayer")
    attentions = (bert_attention("attention", optional_projections=("w2e_query", "e2w_query", "e2e_query")),)


class DistilBertPolicy(BlockPolicy):
    """DistilBERT ``TransformerBlock``: ``attention.{q,k,v,out}_lin``, ``ffn.lin1``/``ffn.lin2``."""

    layer_class = transformers_class("distilbert", "TransformerBlock")
    heads = "n_heads"
    attentions = (
        Attention(
            "attention", projections=("q_lin", "k_lin", "v_lin"), output="out_lin", counts=("n_heads",), widths=("dim",)
        ),
    )
    mlp_inputs = ("ffn.lin1",)
    mlp_outputs = ("ffn.lin2",)


class MPNetPolicy(BertPolicy):
    """MPNet layer: ``attention.attn.{q,k,v}`` and ``attention.attn.o``, then BERT's MLP."""

    layer_class = transformers_class("mpnet", "MPNetLayer")
    attentions = (
        Attention(
            "attention.attn",
            projections=("q", "k", "v"),
            output="o",
            counts=("num_attention_heads",),
            widths=("all_head_size",),
        ),
    )


class MPNetEncoderPolicy(Policy):
    """MPNet encoder: its relative position bias ``Embedding(buckets, heads)``, computed once and
    added to every layer's attention scores, keeps this rank's heads (its columns, dim 1)."""

    layer_class = transformers_class("mpnet", "MPNetEncoder")

    @staticmethod
    def replace_arguments(config, world_size):
        return {"n_heads": share(config.num_attention_heads, world_size, "num_attention_heads")}

    @staticmethod
    def layers():
        return [Layer(weight="relative_attention_bias.weight", style=PER_HEAD, dim=1, heads="num_attention_heads")]
