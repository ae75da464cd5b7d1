"""Funnel: the relative attention's per-head terms, a per-rank config copy."""

from __future__ import annotations

from tp_bert.bert import _MODELS
from tpcore import Layer, Policy, linear, local_config, local_heads


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
