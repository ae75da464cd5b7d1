"""Policies for the BERT family of encoders (transformers 5.x).

Most of the family shares BERT's layer layout (``attention.self.{query,key,value}``,
``attention.output.dense``, ``intermediate.dense``, ``output.dense``, and an optional
``crossattention`` of the same shape: :class:`tpcore.BertLayoutPolicy`); their policies are
:class:`BertPolicy` naming another layer class, made from the table :data:`tp_bert.bert.SAME_LAYOUT`.
That covers BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, Data2VecText, ERNIE,
RoBERTa-PreLayerNorm, XLM-RoBERTa-XL, Megatron-BERT, LayoutLM, MarkupLM, Splinter, RemBERT,
BertGeneration, RoCBert, X-MOD, ESM, RoFormer, TAPAS and VisualBERT. Where these differ from BERT
nothing more needs a split: LayerNorms (pre- or post-), X-MOD's language adapters and the embeddings
(LayoutLM's boxes, MarkupLM's xpaths, RoCBert's shapes and pronunciations, TAPAS' table positions,
VisualBERT's visual embeddings) see whole hidden states, and ESM's and RoFormer's rotary embeddings
act within each head.

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
  its input's width (:func:`tpcore.local_width_class`).
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

Each family's policies are in a module of their own (:mod:`tp_bert.bert` holds BERT's layout);
:data:`POLICIES` is every policy those modules define for a layer class, and every policy and
helper is importable from here by its name.
"""

from __future__ import annotations

from typing import Any

from tp_bert import (
    albert,
    bert,
    convbert,
    deberta,
    funnel,
    ibert,
    llama_layout,
    longformer,
    lxmert,
    mobilebert,
    reformer,
    xlm,
)
from tpcore import Policy

#: the modules of the families, in the order their policies register
_FAMILIES = (
    bert,
    convbert,
    albert,
    deberta,
    longformer,
    lxmert,
    mobilebert,
    funnel,
    xlm,
    ibert,
    reformer,
    llama_layout,
)


def _policies(module) -> list[type[Policy]]:
    """The policies ``module`` defines for a layer class, in their order."""
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, Policy)
        and value.__module__ == module.__name__
        and "layer_class" in vars(value)
    ]


POLICIES = tuple(policy for family in _FAMILIES for policy in _policies(family))


def _public(module) -> dict[str, Any]:
    """The public names ``module`` defines (its classes and functions, not what it imports)."""
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    }


#: every family's policies and helpers, importable from here as they were (``from tp_bert.policies import BertPolicy``)
_NAMES = {name: value for family in _FAMILIES for name, value in _public(family).items()}


def __getattr__(name: str) -> Any:
    try:
        return _NAMES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
