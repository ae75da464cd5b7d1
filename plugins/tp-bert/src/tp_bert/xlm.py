"""XLM's attention and feed-forward classes; XLNet's 3-D projection parameters."""

from __future__ import annotations

import torch

from tp_bert.bert import _MODELS
from tpcore import Attention, BlockPolicy, Layer, Policy, linear, local_heads, reduce_partial_sums, subclassing


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
