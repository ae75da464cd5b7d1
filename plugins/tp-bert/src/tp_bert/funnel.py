"""Funnel: the relative attention's per-head terms, a per-rank config copy."""

from __future__ import annotations

from tpcore import PER_HEAD, Attention, BlockPolicy, Layer, local_config, share, transformers_class


class FunnelLayerPolicy(BlockPolicy):
    """A Funnel layer: ``attention.{q,k,v}_head`` and ``post_proj``, the relative attention's per-head
    terms (``r_w_bias``, ``r_r_bias``, ``r_s_bias`` ``(heads, d_head)``, ``r_kernel`` ``(d_model, heads,
    d_head)``, ``seg_embed`` ``(2, heads, d_head)``) by heads; ``ffn.linear_1``/``linear_2``. The
    attention reads ``n_head`` from its config: it gets a copy holding the rank's count."""

    layer_class = transformers_class("funnel", "FunnelLayer")
    heads = "n_head"
    attentions = (Attention("attention", projections=("q_head", "k_head", "v_head"), output="post_proj", counts=()),)
    mlp_inputs = ("ffn.linear_1",)
    mlp_outputs = ("ffn.linear_2",)

    @staticmethod
    def replace_arguments(config, world_size):
        return {"attention.config": local_config(config, world_size, n_head=share(config.n_head, world_size, "n_head"))}

    @classmethod
    def layers(cls):
        per_head = [
            Layer(weight=f"attention.{name}", style=PER_HEAD, heads=cls.heads)
            for name in ("r_w_bias", "r_r_bias", "r_s_bias")
        ]
        per_head += [
            Layer(weight=f"attention.{name}", style=PER_HEAD, dim=1, heads=cls.heads)
            for name in ("r_kernel", "seg_embed")
        ]
        return [*super().layers(), *per_head]
