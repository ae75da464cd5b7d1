"""Policies for the T5 family (transformers 5.x).

T5 blocks differ between the encoder (self-attention, MLP) and the decoder (self-attention,
cross-attention, MLP), so these policies apply to the attention and MLP modules themselves, one
policy per module class, wherever they sit:

- Attention (``SelfAttention`` and ``EncDecAttention`` alike): ``q``, ``k``, ``v`` column
  parallel, ``o`` row parallel, dealt in whole heads (``num_heads=6`` over 4 ranks: 2, 2, 1, 1);
  ``n_heads`` and ``inner_dim`` become the local values. The
  ``relative_attention_bias`` table, ``Embedding(buckets, heads)``, is a ``PER_HEAD`` table split
  along its heads (its columns, dim 1), so the position bias a rank computes, ``[1, local heads, q, k]``,
  matches its heads; T5 computes it in block 0 and reuses it in later blocks, UMT5 in every
  layer. Cross-attention has no table and builds a zero bias of ``n_heads`` heads.
- MLP: ``wi`` (or the gated ``wi_0``, ``wi_1`` of T5 v1.1/FLAN, mT5, UMT5) column parallel,
  ``wo`` row parallel. The forwards read ``wo.weight.dtype``; row-parallel modules keep ``.weight``.
"""

from __future__ import annotations

from tpcore import COLUMN, PER_HEAD, ROW, BlockPolicy, Layer, Policy, linear, share, transformers_class


class T5AttentionPolicy(Policy):
    """``T5Attention``: heads split across ranks, with their relative position bias."""

    layer_class = transformers_class("t5", "T5Attention")

    @staticmethod
    def replace_arguments(config, world_size):
        heads = share(config.num_heads, world_size, "num_heads")  # per rank where the ranks do not divide them
        return {"n_heads": heads, "inner_dim": heads * config.d_kv}

    @staticmethod
    def layers():
        projections = [linear(name, style=COLUMN, heads="num_heads") for name in "qkv"]
        bias_table = Layer(
            weight="relative_attention_bias.weight", style=PER_HEAD, dim=1, optional=True, heads="num_heads"
        )
        return [*projections, bias_table, linear("o", style=ROW, heads="num_heads")]


class T5DenseActDensePolicy(BlockPolicy):
    """``T5DenseActDense`` (original T5): ``wi`` then ``wo``."""

    layer_class = transformers_class("t5", "T5DenseActDense")
    attentions = ()
    mlp_inputs = ("wi",)
    mlp_outputs = ("wo",)


class T5DenseGatedActDensePolicy(BlockPolicy):
    """``T5DenseGatedActDense`` (T5 v1.1, FLAN-T5): ``act(wi_0 x) * wi_1 x``, then ``wo``."""

    layer_class = transformers_class("t5", "T5DenseGatedActDense")
    attentions = ()
    mlp_inputs = ("wi_0", "wi_1")
    mlp_outputs = ("wo",)


class MT5AttentionPolicy(T5AttentionPolicy):
    layer_class = transformers_class("mt5", "MT5Attention")


class MT5DenseActDensePolicy(T5DenseActDensePolicy):
    layer_class = transformers_class("mt5", "MT5DenseActDense")


class MT5DenseGatedActDensePolicy(T5DenseGatedActDensePolicy):
    layer_class = transformers_class("mt5", "MT5DenseGatedActDense")


class UMT5AttentionPolicy(T5AttentionPolicy):
    layer_class = transformers_class("umt5", "UMT5Attention")


class UMT5DenseActDensePolicy(T5DenseActDensePolicy):
    layer_class = transformers_class("umt5", "UMT5DenseActDense")


class UMT5DenseGatedActDensePolicy(T5DenseGatedActDensePolicy):
    layer_class = transformers_class("umt5", "UMT5DenseGatedActDense")


POLICIES = (
    T5AttentionPolicy,
    T5DenseActDensePolicy,
    T5DenseGatedActDensePolicy,
    MT5AttentionPolicy,
    MT5DenseActDensePolicy,
    MT5DenseGatedActDensePolicy,
    UMT5AttentionPolicy,
    UMT5DenseActDensePolicy,
    UMT5DenseGatedActDensePolicy,
)
