"""Policies for mixture-of-experts decoders whose tp plans leave parts of them whole (transformers 5.x).

Fused experts hold every expert in two 3-D parameters, ``gate_up_proj (E, 2I, H)`` and
``down_proj (E, H, I)``. Each rank holds its share of every expert's intermediate size ``I``: the
gate and up halves are cut along dim 1 alike, ``down_proj`` along dim 2, and the experts module's
output, a sum of partial products, is all-reduced once. Where a rank's share breaks the 16-byte rows
of transformers' grouped-mm kernels, its experts run eagerly (:func:`tpcore.experts_arguments`).
The router stays whole on every rank, so every rank routes each token to the same experts with the
same weights.

- Qwen2-MoE: its shared expert (a gated MLP) is split like any MLP; the shared-expert gate
  (``Linear(H, 1)``) stays whole and scales the reduced output. Its tp plan names neither.
- DeepSeek-V3 (multi-head latent attention): the low-rank projections ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` and their norms stay whole (every rank caches the whole latent); the
  up-projections ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` are cut by heads, each head's rows
  together (``qk_nope + qk_rope`` and ``qk_nope + v`` of them), ``o_proj`` by the same heads. The
  attention views by ``-1`` heads, so only ``num_heads`` is rewritten. Its tp plan has no attention
  rules, so the derived policy keeps attention whole.
- GPT-OSS: attention as Llama's with biases, and one learned sink logit per query head (``sinks``,
  cut with its heads). Its experts are stored ``(in, out)`` with biases: ``gate_up_proj (E, H, 2I)``
  interleaves each intermediate feature's gate and up columns, so it is cut along its last dim in
  whole (gate, up) pairs, the bias ``(E, 2I)`` with it; ``down_proj (E, I, H)`` is cut along dim 1 and
  its bias ``(E, H)``, added inside each expert before the routing weight scales it, is held by rank 0
  alone (zeros on the others), so the all-reduced sum adds it once. Its tp plan splits only the
  embedding.

The policies apply to the module classes (attention, experts, MLP) rather than the decoder layer,
because a model mixes dense and sparse layers (``first_k_dense_replace``, ``mlp_only_layers``) and
uses one MLP class for its dense layers and its shared experts.
"""

from __future__ import annotations

from tp_gpt.policies import GROUPED_QUERIES
from tpcore import (
    PER_HEAD,
    Attention,
    BlockPolicy,
    Layer,
    Policy,
    experts_arguments,
    linear,
    local_heads,
    transformers_class,
)


class _FusedExperts(Policy):
    """Fused experts module: every rank holds ``1 / N`` of each expert's intermediate features."""

    intermediate = "moe_intermediate_size"  # the config attribute of ``I``

    @classmethod
    def replace_arguments(cls, config, world_size):
        return experts_arguments(config, getattr(config, cls.intermediate), world_size)

    @staticmethod
    def mlp_in():
        return [Layer(weight="gate_up_proj", dim=1, n_fused=2)]

    @staticmethod
    def mlp_out():
        return [Layer(weight="down_proj", dim=2)]


class _GatedMLP(BlockPolicy):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: dense layers and shared experts alike."""

    attentions = ()
    mlp_inputs = ("gate_proj", "up_proj")
    mlp_outputs = ("down_proj",)


class Qwen2MoeAttentionPolicy(Policy):
    """Qwen2-MoE attention: q/k/v (with biases) by grouped heads, as Llama's."""

    layer_class = transformers_class("qwen2_moe", "Qwen2MoeAttention")

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, "num_attention_heads", groups="num_key_value_heads")
        kv_heads = local_heads(config, world_size, "num_key_value_heads")
        return {"num_key_value_groups": heads // kv_heads}

    @staticmethod
    def attn_qkv():
        kv = "num_key_value_heads"
        return [linear("q_proj", **GROUPED_QUERIES), linear("k_proj", heads=kv), linear("v_proj", heads=kv)]

    @staticmethod
    def attn_out():
        return [linear("o_proj", **GROUPED_QUERIES)]


class Qwen2MoeExpertsPolicy(_FusedExperts):
    layer_class = transformers_class("qwen2_moe", "Qwen2MoeExperts")


class Qwen2MoeMLPPolicy(_GatedMLP):
    """The shared expert of each sparse layer, and the MLP of dense layers."""

    layer_class = transformers_class("qwen2_moe", "Qwen2MoeMLP")


class DeepseekV3AttentionPolicy(BlockPolicy):
    """Multi-head latent attention: the latent projections whole, the per-head up-projections by heads
    (``q_proj`` without a query latent, ``q_lora_rank=None``; ``q_b_proj`` with one)."""

    layer_class = transformers_class("deepseek_v3", "DeepseekV3Attention")
    attentions = (
        Attention("", projections=("kv_b_proj",), output="o_proj", optional_projections=("q_proj", "q_b_proj")),
    )
    mlp_inputs = mlp_outputs = ()


class DeepseekV3ExpertsPolicy(_FusedExperts):
    layer_class = transformers_class("deepseek_v3", "DeepseekV3Experts")


class DeepseekV3MLPPolicy(_GatedMLP):
    """The shared experts of each sparse layer, and the MLP of the first dense layers."""

    layer_class = transformers_class("deepseek_v3", "DeepseekV3MLP")


class GptOssAttentionPolicy(Qwen2MoeAttentionPolicy):
    """GPT-OSS attention: as Qwen2-MoE's (biases on q/k/v and o), and the per-head sink logits with their heads."""

    layer_class = transformers_class("gpt_oss", "GptOssAttention")

    @staticmethod
    def attn_qkv():
        return [*Qwen2MoeAttentionPolicy.attn_qkv(), Layer(weight="sinks", style=PER_HEAD, **GROUPED_QUERIES)]


class GptOssExpertsPolicy(Policy):
    """GPT-OSS experts: every rank holds ``1 / N`` of each expert's intermediate features (module docstring)."""

    layer_class = transformers_class("gpt_oss", "GptOssExperts")

    @staticmethod
    def replace_arguments(config, world_size):
        arguments = experts_arguments(config, config.intermediate_size, world_size)
        return {"intermediate_size": arguments.pop("intermediate_dim"), **arguments}

    @staticmethod
    def mlp_in():
        pairs = {"n_fused": 2, "interleaved": True, "heads": "intermediate_size"}  # [g0 u0 | g1 u1 | ...]
        return [Layer(weight="gate_up_proj", bias="gate_up_proj_bias", dim=-1, bias_dim=-1, **pairs)]

    @staticmethod
    def mlp_out():
        return [Layer(weight="down_proj", bias="down_proj_bias", dim=1)]


POLICIES = (
    Qwen2MoeAttentionPolicy,
    Qwen2MoeExpertsPolicy,
    Qwen2MoeMLPPolicy,
    DeepseekV3AttentionPolicy,
    DeepseekV3ExpertsPolicy,
    DeepseekV3MLPPolicy,
    GptOssAttentionPolicy,
    GptOssExpertsPolicy,
)
