"""XLM's attention and feed-forward classes; XLNet's 3-D projection parameters."""

from __future__ import annotations

import torch

from tpcore import (
    COLUMN,
    PER_HEAD,
    ROW,
    Attention,
    BlockPolicy,
    Layer,
    Policy,
    linear,
    reduce_partial_sums,
    share,
    subclassing,
    transformers_class,
)


class XLMAttentionPolicy(BlockPolicy):
    """XLM has no layer class: its encoder holds lists of attentions and feed-forwards. One attention
    (self-attention, or a decoder's attention to the encoder): ``{q,k,v,out}_lin`` by ``n_heads``."""

    layer_class = transformers_class("xlm", "MultiHeadAttention")
    heads = "n_heads"
    attentions = (Attention("", projections=("q_lin", "k_lin", "v_lin"), output="out_lin", counts=("n_heads",)),)
    mlp_inputs = mlp_outputs = ()


class XLMFeedForwardPolicy(BlockPolicy):
    layer_class = transformers_class("xlm", "TransformerFFN")
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

    layer_class = transformers_class("xlnet", "XLNetLayer")

    @staticmethod
    def replace_arguments(config, world_size):
        return {"rel_attn.n_head": share(config.n_head, world_size, "n_head")}

    @staticmethod
    def replace_modules():
        return {"rel_attn": reduced_output_attention}

    @staticmethod
    def layers():
        per_head = [Layer(weight=f"rel_attn.{name}", style=PER_HEAD, dim=1, heads="n_head") for name in "qkvor"]
        per_head += [Layer(weight=f"rel_attn.r_{name}_bias", style=PER_HEAD, heads="n_head") for name in "wrs"]
        per_head.append(Layer(weight="rel_attn.seg_embed", style=PER_HEAD, dim=1, heads="n_head"))
        return [*per_head, linear("ff.layer_1", style=COLUMN), linear("ff.layer_2", style=ROW)]
