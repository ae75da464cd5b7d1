"""Policies for the BERT family of encoders (transformers 5.x).

Most of the family shares BERT's layer layout (``attention.self.{query,key,value}``,
``attention.output.dense``, ``intermediate.dense``, ``output.dense``, and an optional
``crossattention`` of the same shape): their policies subclass :class:`BertPolicy` and only name
their layer class. That covers BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, Data2VecText,
ERNIE, RoBERTa-PreLayerNorm, XLM-RoBERTa-XL, Megatron-BERT, LayoutLM, MarkupLM, Splinter, RemBERT,
BertGeneration, RoCBert, X-MOD, ESM, RoFormer, TAPAS and VisualBERT. Where these differ from BERT
nothing more needs a split: LayerNorms (pre- or post-), X-MOD's language adapters and the embeddings (LayoutLM's boxes,
MarkupLM's xpaths, RoCBert's shapes and pronunciations, TAPAS' table positions, VisualBERT's visual
embeddings) see whole hidden states, and ESM's and RoFormer's rotary embeddings act within each head.

The others have their own policies:

- DistilBERT: ``attention.{q,k,v,out}_lin`` and ``ffn.lin1``/``ffn.lin2``.
- LUKE: BERT's layout plus the entity-aware queries ``w2e_query``, ``e2w_query``, ``e2e_query``.
- MPNet: ``attention.attn.{q,k,v,o}``, and a relative position bias ``Embedding(buckets, heads)``
  owned by ``MPNetEncoder`` and shared by all layers, which is split along its heads.
- NomicBERT and EuroBERT: Llama's layout (``self_attn.{q,k,v,o}_proj``, a gated MLP
  ``mlp.{gate,up,down}_proj``); EuroBERT's key/value heads (GQA) must split evenly too.
- ModernBERT: a fused ``attn.Wqkv`` (q|k|v) and a fused ``mlp.Wi`` (input|gate).
- BigBird: BERT's layout, block-sparse attention; the switch to full attention for short inputs
  rebuilds the attention, keeping the rank's head counts.
- ConvBERT: attention heads (``num_attention_heads // head_ratio``) and the span-based dynamic
  convolution's heads split alike; the kernel generator, which reads every head, runs row parallel
  and keeps the rank's kernels (:class:`LocalHeadsKernels`).
- ALBERT: one layer instance that every depth runs (``attention.{query,key,value,dense}``,
  ``ffn``/``ffn_output``), split once.
- DeBERTa: ``in_proj`` packing each head's q, k and v together, per-head ``q_bias``/``v_bias``,
  relative position projections by heads; DeBERTa-v2/v3: separate projections, position
  projections of their own or shared with the content ones.
- Longformer: sliding-window and global (``*_global``) projections; its attention merges heads into
  its input's width (:func:`tpcore.reshapes.local_width_class`).
- LXMERT: language and vision layers (BERT's, the width attribute ``head_size``) and
  cross-modality layers (one cross-attention both streams run, a self-attention and a
  feed-forward per stream).
- MobileBERT: attention and feed-forwards at the bottleneck width (every extra ``FFNLayer`` too);
  its LM head calls its decoder (:func:`decoder_called_lm_head`) so the vocabulary split applies.
- I-BERT: ``QuantLinear`` layers; in integer mode a row layer quantizes each weight row by its range
  over every rank (:func:`row_parallel_quant_linear`).
- Reformer: LSH attention, whose random rotations are drawn for every head and kept for the
  rank's (:func:`rank_rotations_lsh_attention`), or local attention; reversible layers.
- XLM: no layer class; policies for its attention (``{q,k,v,out}_lin``) and feed-forward classes.
- XLNet: 3-D projection parameters cut on their heads dimension, the output's sum over the heads
  all-reduced (:func:`reduced_output_attention`).
- Funnel: ``{q,k,v}_head``, ``post_proj`` and the relative attention's per-head terms by heads;
  the attention reads ``n_head`` from a per-rank config copy.

Every attention here infers its head count from the projection's output (``view(..., -1,
head_dim)``); the head-count attributes that some forwards still read (``all_head_size`` in
Megatron-BERT, RemBERT, LUKE and MPNet, ``num_attention_heads`` in LUKE) are rewritten per rank.
Heads are dealt whole (:func:`tpcore.share`): 12 heads over 5 ranks give three ranks 3 heads and two
ranks 2, every attention projection naming its head count (``Layer(heads=...)``) so that its rows
follow; EuroBERT's query heads stay with their key/value heads (``groups``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tpcore import (
    Attention,
    BlockPolicy,
    IfHeld,
    Layer,
    Policy,
    RowParallelLinear,
    ShardingError,
    all_gather,
    keeping_local_attributes,
    linear,
    local_config,
    local_heads,
    reduce_partial_sums,
    share,
    subclassing,
)

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


def _convbert_heads(config) -> int:
    """ConvBERT's attention heads: ``num_attention_heads // head_ratio`` (at least 1); the span-based
    convolution takes the other half of the width in as many heads."""
    return max(1, config.num_attention_heads // config.head_ratio)


class LocalHeadsKernels(RowParallelLinear):
    """ConvBERT's ``conv_kernel_layer``, ``Linear(all heads' features, heads x kernel)``: every head's
    kernel reads every head's features, so it runs row parallel over the rank's features (all-reduced:
    every head's kernel) and the rank keeps its own heads' kernels, ``num_heads`` from ``first_head``."""

    kernel_size: int = 0
    first_head: int = 0
    num_heads: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = super().forward(x).unflatten(-1, (-1, self.kernel_size))  # [..., all heads, kernel]
        return kernels[..., self.first_head : self.first_head + self.num_heads, :].flatten(-2)


#: a ConvBERT layer's attentions: its self-attention, and a decoder's cross-attention
_CONVBERT_ATTENTIONS = (("attention", False), ("crossattention", True))


class ConvBertPolicy(Policy):
    """ConvBERT: its attention heads (:func:`_convbert_heads`) split as BERT's, the span-based dynamic
    convolution by the same heads (the key convolution's pointwise part and ``conv_out_layer`` column
    parallel, the kernel generator :class:`LocalHeadsKernels`); the output projection reads the
    attention's heads then the convolution's, two parts cut alike. The grouped feed-forward
    (``num_groups > 1``) is refused."""

    layer_class = f"{_MODELS}.convbert.modeling_convbert.ConvBertLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        if config.num_groups > 1 and world_size > 1:
            raise ShardingError(
                f"ConvBERT's grouped feed-forward (num_groups={config.num_groups}) is not split by tp-bert"
            )
        heads = _convbert_heads(config)
        local = share(heads, world_size, "num_attention_heads // head_ratio")
        first = share(heads, world_size, "num_attention_heads // head_ratio", first=True)
        width = local * ((config.hidden_size // heads) // 2)
        arguments = {}
        for attention, _ in _CONVBERT_ATTENTIONS:
            kernels = f"{attention}.self.conv_kernel_layer"
            values = {"self.num_attention_heads": local, "self.all_head_size": width}
            values |= {"self.conv_kernel_layer.num_heads": local, "self.conv_kernel_layer.first_head": first}
            values["self.conv_kernel_layer.kernel_size"] = config.conv_kernel_size
            arguments |= {f"{attention}.{path}": IfHeld(value, kernels) for path, value in values.items()}
        return arguments

    @staticmethod
    def replace_modules():  # the row-parallel class its Layer gives it, declaring the attributes set above
        return {
            f"{attention}.self.conv_kernel_layer": lambda module: None if module is None else LocalHeadsKernels
            for attention, _ in _CONVBERT_ATTENTIONS
        }

    @staticmethod
    def attn_qkv():
        layers = []
        for attention, optional in _CONVBERT_ATTENTIONS:
            path, heads = f"{attention}.self", {"optional": optional, "heads": _convbert_heads}
            names = ("query", "key", "value", "conv_out_layer")
            layers += [linear(f"{path}.{name}", **heads) for name in names]
            for name in ("key_conv_attn_layer.pointwise.weight", "key_conv_attn_layer.bias"):  # [features, ...]
                layers.append(Layer(weight=f"{path}.{name}", dim=0, heads=_convbert_heads, optional=optional))
        return layers

    @staticmethod
    def attn_out():
        layers = []
        for attention, optional in _CONVBERT_ATTENTIONS:
            heads = {"optional": optional, "heads": _convbert_heads}
            layers.append(linear(f"{attention}.self.conv_kernel_layer", replace=LocalHeadsKernels, **heads))
            layers.append(linear(f"{attention}.output.dense", n_fused=2, **heads))  # [attention heads | conv heads]
        return layers

    @staticmethod
    def mlp_in():
        return [linear("intermediate.dense")]

    @staticmethod
    def mlp_out():
        return [linear("output.dense")]


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


#: relative position projections: content to position (keys), position to content (queries)
_DEBERTA_POSITIONS = ("pos_proj", "pos_q_proj")
_DEBERTA_V2_POSITIONS = ("pos_key_proj", "pos_query_proj")


class DebertaPolicy(BertPolicy):
    """DeBERTa's disentangled attention: ``in_proj`` packs each head's query, key and value one head
    after another (``[q0 k0 v0 | q1 k1 v1 | ...]``), with per-head ``q_bias``/``v_bias``; the relative
    position projections ``pos_proj`` (content to position) and ``pos_q_proj`` (position to content)
    split by heads over the encoder's relative embeddings, which stay whole. Talking heads
    (``talking_head``) mix every head's scores and are refused."""

    layer_class = f"{_MODELS}.deberta.modeling_deberta.DebertaLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        if getattr(config, "talking_head", False) and world_size > 1:
            raise ShardingError(
                "DeBERTa with talking_head=True mixes the scores of all heads (head_logits_proj), "
                "so its heads cannot be split over ranks"
            )
        return _head_arguments("attention.self", config, world_size)

    @staticmethod
    def attn_qkv():
        packed = Layer(weight="attention.self.in_proj.weight", n_fused=3, interleaved=True, heads=_HEADS)
        biases = [Layer(weight=f"attention.self.{name}", dim=0, heads=_HEADS) for name in ("q_bias", "v_bias")]
        positions = [linear(f"attention.self.{name}", optional=True, heads=_HEADS) for name in _DEBERTA_POSITIONS]
        return [packed, *biases, *positions]

    @staticmethod
    def attn_out():
        return _out("attention")


class DebertaV2Policy(BertPolicy):
    """DeBERTa-v2 (and v3 checkpoints): ``attention.self.{query,key,value}_proj`` and, unless
    ``share_att_key``, the relative position projections ``pos_key_proj``/``pos_query_proj``, all by
    heads; the encoder's relative embeddings and its convolution stay whole."""

    layer_class = f"{_MODELS}.deberta_v2.modeling_deberta_v2.DebertaV2Layer"

    @staticmethod
    def attn_qkv():
        content = [linear(f"attention.self.{name}_proj", heads=_HEADS) for name in ("query", "key", "value")]
        positions = [linear(f"attention.self.{name}", optional=True, heads=_HEADS) for name in _DEBERTA_V2_POSITIONS]
        return content + positions

    @staticmethod
    def attn_out():
        return _out("attention")


_LONGFORMER = ("query", "key", "value", "query_global", "key_global", "value_global")


class LongformerPolicy(BlockPolicy):
    """Longformer: sliding-window ``attention.self.{query,key,value}`` and the global tokens'
    ``*_global`` projections, by heads; the attention merges heads into its input's width
    (:func:`tpcore.reshapes.local_width_class`)."""

    layer_class = f"{_MODELS}.longformer.modeling_longformer.LongformerLayer"
    attentions = (
        Attention(
            "attention",
            projections=tuple(f"self.{name}" for name in _LONGFORMER),
            output="output.dense",
            counts=("self.num_heads",),
            reshaping="self",
        ),
    )
    mlp_inputs = ("intermediate.dense",)
    mlp_outputs = ("output.dense",)


def _lxmert_attention(path: str, inner: str = "self") -> Attention:
    return Attention(
        path,
        projections=tuple(f"{inner}.{name}" for name in ("query", "key", "value")),
        output="output.dense",
        counts=(f"{inner}.num_attention_heads",),
        widths=(f"{inner}.head_size",),
    )


class LxmertLayerPolicy(BlockPolicy):
    """A LXMERT language or vision layer: BERT's, its width attribute named ``head_size``."""

    layer_class = f"{_MODELS}.lxmert.modeling_lxmert.LxmertLayer"
    attentions = (_lxmert_attention("attention"),)
    mlp_inputs = ("intermediate.dense",)
    mlp_outputs = ("output.dense",)


class LxmertXLayerPolicy(BlockPolicy):
    """A LXMERT cross-modality layer: one cross-attention that both streams run (language to vision
    and back), a self-attention and a feed-forward per stream."""

    layer_class = f"{_MODELS}.lxmert.modeling_lxmert.LxmertXLayer"
    attentions = (
        _lxmert_attention("visual_attention", inner="att"),
        _lxmert_attention("lang_self_att"),
        _lxmert_attention("visn_self_att"),
    )
    mlp_inputs = ("lang_inter.dense", "visn_inter.dense")
    mlp_outputs = ("lang_output.dense", "visn_output.dense")


class MobileBertPolicy(BertPolicy):
    """MobileBERT: attention and feed-forward at the bottleneck width ``true_hidden_size``; the
    bottleneck projections in and out of it, and the NoNorms, stay whole."""

    layer_class = f"{_MODELS}.mobilebert.modeling_mobilebert.MobileBertLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, _HEADS)
        width = heads * (config.true_hidden_size // config.num_attention_heads)
        return {"attention.self.num_attention_heads": heads, "attention.self.all_head_size": width}

    @staticmethod
    def attn_qkv():
        return _qkv("attention")

    @staticmethod
    def attn_out():
        return _out("attention")


class MobileBertFFNPolicy(BlockPolicy):
    """One of MobileBERT's extra feed-forwards (``num_feedforward_networks - 1`` per layer)."""

    layer_class = f"{_MODELS}.mobilebert.modeling_mobilebert.FFNLayer"
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

    layer_class = f"{_MODELS}.mobilebert.modeling_mobilebert.MobileBertLMPredictionHead"

    @staticmethod
    def replace_modules():
        return {"": decoder_called_lm_head}


class FunnelLayerPolicy(Policy):
    """A Funnel layer: ``attention.{q,k,v}_head`` and ``post_proj``, the relative attention's per-head
    terms (``r_w_bias``, ``r_r_bias``, ``r_s_bias`` ``(heads, d_head)``, ``r_kernel`` ``(d_model, heads,
    d_head)``, ``seg_embed`` ``(2, heads, d_head)``) by heads; ``ffn.linear_1``/``linear_2``. The
    attention reads ``n_head`` from its config: it gets a copy holding the rank's count."""

    layer_class = f"{_MODELS}.funnel.modeling_funnel.FunnelLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        return {"attention.config": local_config(config, world_size, n_head=local_heads(config, world_size, "n_head"))}

    @staticmethod
    def attn_qkv():
        projections = [linear(f"attention.{name}_head", heads="n_head") for name in "qkv"]
        per_head = [
            Layer(weight=f"attention.{name}", dim=0, heads="n_head") for name in ("r_w_bias", "r_r_bias", "r_s_bias")
        ]
        per_head += [Layer(weight=f"attention.{name}", dim=1, heads="n_head") for name in ("r_kernel", "seg_embed")]
        return projections + per_head

    @staticmethod
    def attn_out():
        return [linear("attention.post_proj", heads="n_head")]

    @staticmethod
    def mlp_in():
        return [linear("ffn.linear_1")]

    @staticmethod
    def mlp_out():
        return [linear("ffn.linear_2")]


class XLMAttentionPolicy(BlockPolicy):
    """XLM has no layer class: its encoder holds lists of attentions and feed-forwards. One attention
    (self-attention, or a decoder's attention to the encoder): ``{q,k,v,out}_lin`` by ``n_heads``."""

    layer_class = f"{_MODELS}.xlm.modeling_xlm.MultiHeadAttention"
    heads = "n_heads"
    attentions = (Attention("", projections=("q_lin", "k_lin", "v_lin"), output="out_lin", counts=("n_heads",)),)
    mlp_inputs = mlp_outputs = ()


class XLMFeedForwardPolicy(BlockPolicy):
    layer_class = f"{_MODELS}.xlm.modeling_xlm.TransformerFFN"
    attentions = ()
    mlp_inputs = ("lin1",)
    mlp_outputs = ("lin2",)


@subclassing("ReducedOutput")
def reduced_output_attention(base: type) -> dict:
    """For XLNet's attention, whose output projection is a parameter ``o`` ``(d_model, heads, d_head)``
    contracted over the heads (``einsum("ibnd,hnd->ibh")``) before the residual: a subclass whose
    ``post_attention`` all-reduces that sum of the rank's heads, then adds the residual and normalizes."""

    def post_attention(self, h: torch.Tensor, attn_vec: torch.Tensor, residual: bool = True) -> torch.Tensor:
        attn_out = reduce_partial_sums(torch.einsum("ibnd,hnd->ibh", attn_vec, self.o), self.tp_group)
        attn_out = self.dropout(attn_out)
        return self.layer_norm(attn_out + h if residual else attn_out)

    return {"post_attention": post_attention, "tp_group": None}


class XLNetPolicy(Policy):
    """XLNet's two-stream relative attention: the 3-D projections ``q``, ``k``, ``v``, ``o``, ``r``
    ``(d_model, heads, d_head)``, the per-head biases ``r_{w,r,s}_bias`` ``(heads, d_head)`` and the
    segment embedding ``seg_embed`` ``(2, heads, d_head)`` cut on their heads dimension; the output's sum
    over the heads all-reduced (:func:`reduced_output_attention`); ``ff.layer_1``/``ff.layer_2``."""

    layer_class = f"{_MODELS}.xlnet.modeling_xlnet.XLNetLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        return {"rel_attn.n_head": local_heads(config, world_size, "n_head")}

    @staticmethod
    def replace_modules():
        return {"rel_attn": reduced_output_attention}

    @staticmethod
    def attn_qkv():
        projections = [Layer(weight=f"rel_attn.{name}", dim=1, heads="n_head") for name in "qkvor"]
        biases = [Layer(weight=f"rel_attn.r_{name}_bias", dim=0, heads="n_head") for name in "wrs"]
        return [*projections, *biases, Layer(weight="rel_attn.seg_embed", dim=1, heads="n_head")]

    @staticmethod
    def mlp_in():
        return [linear("ff.layer_1")]

    @staticmethod
    def mlp_out():
        return [linear("ff.layer_2")]


@subclassing("RowParallel")
def row_parallel_quant_linear(base: type) -> dict:
    """For I-BERT's ``QuantLinear`` as a row-parallel layer (it returns ``(output, scaling factor)``).
    Float mode: ``sum_r x_r W_r^T + b``. Integer mode: the weight's scale per output row comes from
    the row's minimum and maximum over all ranks' columns (so every rank quantizes as the unsplit
    layer), then ``(sum_r x_int,r W_int,r^T + b_int) * s_w * s_x``, the sum all-reduced."""
    from transformers.models.ibert.quant_modules import symmetric_linear_quantization_params

    def extreme(values: torch.Tensor, group, largest: bool) -> torch.Tensor:
        every = all_gather(values[None], group, dim=0)  # [ranks, rows]
        return every.amax(0) if largest else every.amin(0)

    def forward(self, x: torch.Tensor, prev_act_scaling_factor: torch.Tensor | None = None):
        if not self.quant_mode:
            out = reduce_partial_sums(nn.functional.linear(x, self.weight), self.tp_group)
            return (out if self.bias is None else out + self.bias), None
        weight = self.weight.detach()
        rows = (weight.amin(1), weight.amax(1)) if self.per_channel else (weight.min()[None], weight.max()[None])
        w_min, w_max = extreme(rows[0], self.tp_group, False), extreme(rows[1], self.tp_group, True)
        self.fc_scaling_factor = symmetric_linear_quantization_params(self.weight_bit, w_min, w_max, self.per_channel)
        self.weight_integer = self.weight_function(
            self.weight, self.weight_bit, self.percentile_mode, self.fc_scaling_factor
        )
        bias_scaling_factor = self.fc_scaling_factor * prev_act_scaling_factor
        x_int = x / prev_act_scaling_factor.view(1, -1)
        out = reduce_partial_sums(nn.functional.linear(x_int, self.weight_integer), self.tp_group)
        if self.bias is not None:
            self.bias_integer = self.weight_function(self.bias, self.bias_bit, False, bias_scaling_factor)
            out = out + self.bias_integer
        return out * bias_scaling_factor, bias_scaling_factor

    return {"forward": forward, "tp_group": None}


def _quant_linear(path: str, style: str, **heads) -> list[Layer]:
    """A ``QuantLinear`` at ``path``: its weight and bias, and the integer copies and scales it keeps
    beside them (recomputed by each integer-mode forward), cut alike."""
    if style == "column":
        kept = [Layer(weight=f"{path}.{name}", dim=0, **heads) for name in ("weight_integer", "bias_integer")]
        return [linear(path, **heads), *kept, Layer(weight=f"{path}.fc_scaling_factor", dim=0, **heads)]
    return [linear(path, replace=row_parallel_quant_linear, **heads)]


class IBertPolicy(BertPolicy):
    """I-BERT: BERT's layout in ``QuantLinear`` layers, in float or integer mode (``quant_mode``). Column
    layers quantize each output row by its own range, as unsplit; row layers take each row's range
    over every rank (:func:`row_parallel_quant_linear`). The activations' quantizers keep whole-tensor
    ranges, the integer GELU, softmax and layer norm see what they see unsplit."""

    layer_class = f"{_MODELS}.ibert.modeling_ibert.IBertLayer"

    @staticmethod
    def attn_qkv():
        projections = [
            _quant_linear(f"attention.self.{name}", "column", heads=_HEADS) for name in ("query", "key", "value")
        ]
        output = Layer(weight="attention.output.dense.weight_integer", dim=1, heads=_HEADS)  # as its weight
        return [*(layer for layers in projections for layer in layers), output]

    @staticmethod
    def attn_out():
        return _quant_linear("attention.output.dense", "row", heads=_HEADS)

    @staticmethod
    def mlp_in():
        return [*_quant_linear("intermediate.dense", "column"), Layer(weight="output.dense.weight_integer", dim=1)]

    @staticmethod
    def mlp_out():
        return _quant_linear("output.dense", "row")


class _RankHeadsDraws(TorchFunctionMode):
    """While active, ``torch.randn`` of a shape that starts with the rank's ``local`` heads draws for all
    ``full`` heads and keeps the rank's, from ``first``: the random numbers every head gets, and how
    many the generator gives out, are the unsplit model's."""

    def __init__(self, full: int, first: int, local: int):
        super().__init__()
        self.full, self.first, self.local = full, first, local

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.randn and self.full != self.local:
            shape = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if shape and shape[0] == self.local:
                return func((self.full, *shape[1:]), **kwargs)[self.first : self.first + self.local]
        return func(*args, **kwargs)


def rank_rotations_lsh_attention(module: nn.Module | None) -> type[nn.Module] | None:
    """For Reformer's LSH attention, which hashes with random rotations ``(heads, head_size, hashes,
    buckets / 2)`` drawn in every forward (from ``hash_seed``, or the global generator): a subclass whose
    ``_hash_vectors`` draws them for all ``full_heads`` heads and keeps the rank's (from ``first_head``),
    so each head hashes as it does unsplit. ``None`` for the local attention, which draws nothing."""
    return _rank_rotations(module) if hasattr(module, "_hash_vectors") else None


@subclassing("RankRotations")
def _rank_rotations(base: type) -> dict:
    """Reformer's LSH attention drawing every head's rotations and keeping the rank's
    (:func:`rank_rotations_lsh_attention`)."""

    def _hash_vectors(self, *args, **kwargs):
        with _RankHeadsDraws(self.full_heads, self.first_head, self.num_attention_heads):
            return base._hash_vectors(self, *args, **kwargs)

    return {"_hash_vectors": _hash_vectors, "full_heads": None, "first_head": None}


class ReformerPolicy(Policy):
    """A Reformer layer (reversible: its attention and feed-forward each add to one half of the
    stream): LSH attention (``query_key``, ``value``; rotations per :func:`rank_rotations_lsh_attention`)
    or local attention (``query``, ``key``, ``value``), ``output.dense`` row parallel;
    ``feed_forward.dense.dense`` and ``feed_forward.output.dense``."""

    layer_class = f"{_MODELS}.reformer.modeling_reformer.ReformerLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, _HEADS)
        attention, lsh = "attention.self_attention", "attention.self_attention.query_key"
        arguments = {f"{attention}.num_attention_heads": heads}
        arguments[f"{attention}.all_head_size"] = heads * config.attention_head_size
        arguments[f"{attention}.full_heads"] = IfHeld(config.num_attention_heads, lsh)
        arguments[f"{attention}.first_head"] = IfHeld(
            share(config.num_attention_heads, world_size, _HEADS, first=True), lsh
        )
        return arguments

    @staticmethod
    def replace_modules():
        return {"attention.self_attention": rank_rotations_lsh_attention}

    @staticmethod
    def attn_qkv():
        names = ("query_key", "value", "query", "key")  # LSH: query_key, value; local: query, key, value
        return [linear(f"attention.self_attention.{name}", optional=True, heads=_HEADS) for name in names]

    @staticmethod
    def attn_out():
        return [linear("attention.output.dense", heads=_HEADS)]

    @staticmethod
    def mlp_in():
        return [linear("feed_forward.dense.dense")]

    @staticmethod
    def mlp_out():
        return [linear("feed_forward.output.dense")]


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


class _LlamaLayoutPolicy(Policy):
    """``self_attn.{q,k,v,o}_proj`` and a gated MLP ``mlp.{gate,up,down}_proj``; no head attribute
    is read in forward, so only the head counts are checked."""

    @staticmethod
    def replace_arguments(config, world_size):
        local_heads(config, world_size, _HEADS)
        return {}

    @staticmethod
    def attn_qkv():
        return [linear(f"self_attn.{name}_proj", heads=_HEADS) for name in "qkv"]

    @staticmethod
    def attn_out():
        return [linear("self_attn.o_proj", heads=_HEADS)]

    @staticmethod
    def mlp_in():
        return [linear("mlp.gate_proj"), linear("mlp.up_proj")]

    @staticmethod
    def mlp_out():
        return [linear("mlp.down_proj")]


class NomicBertPolicy(_LlamaLayoutPolicy):
    layer_class = f"{_MODELS}.nomic_bert.modeling_nomic_bert.NomicBertLayer"


class EuroBertPolicy(_LlamaLayoutPolicy):
    """EuroBERT: Llama's layout with grouped key/value heads, each kept with its query heads (replicated
    when the ranks outnumber them); ``num_key_value_groups`` becomes each rank's query-to-KV ratio."""

    layer_class = f"{_MODELS}.eurobert.modeling_eurobert.EuroBertDecoderLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, _HEADS, groups="num_key_value_heads")
        return {"self_attn.num_key_value_groups": heads // local_heads(config, world_size, "num_key_value_heads")}

    @staticmethod
    def attn_qkv():
        grouped = {"heads": _HEADS, "groups": "num_key_value_heads"}
        kv = {"heads": "num_key_value_heads"}
        return [
            linear("self_attn.q_proj", **grouped),
            linear("self_attn.k_proj", **kv),
            linear("self_attn.v_proj", **kv),
        ]

    @staticmethod
    def attn_out():
        return [linear("self_attn.o_proj", heads=_HEADS, groups="num_key_value_heads")]


class ModernBertPolicy(Policy):
    """ModernBERT layer: fused ``attn.Wqkv`` (q|k|v) and ``mlp.Wi`` (input|gate), outputs ``Wo``."""

    layer_class = f"{_MODELS}.modernbert.modeling_modernbert.ModernBertEncoderLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        local_heads(config, world_size, _HEADS)
        return {}

    @staticmethod
    def attn_qkv():
        return [linear("attn.Wqkv", n_fused=3, heads=_HEADS)]

    @staticmethod
    def attn_out():
        return [linear("attn.Wo", heads=_HEADS)]

    @staticmethod
    def mlp_in():
        return [linear("mlp.Wi", n_fused=2)]

    @staticmethod
    def mlp_out():
        return [linear("mlp.Wo")]


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
    BigBirdPolicy,
    ConvBertPolicy,
    AlbertPolicy,
    DebertaPolicy,
    DebertaV2Policy,
    RoFormerPolicy,
    TapasPolicy,
    VisualBertPolicy,
    LongformerPolicy,
    LxmertLayerPolicy,
    LxmertXLayerPolicy,
    MobileBertPolicy,
    MobileBertFFNPolicy,
    MobileBertLMHeadPolicy,
    FunnelLayerPolicy,
    XLMAttentionPolicy,
    XLMFeedForwardPolicy,
    XLNetPolicy,
    IBertPolicy,
    ReformerPolicy,
    LukePolicy,
    MPNetPolicy,
    MPNetEncoderPolicy,
    NomicBertPolicy,
    EuroBertPolicy,
    ModernBertPolicy,
)
