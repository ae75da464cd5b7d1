"""Whole models that need the layout words, split by the shard plan and run over real gloo ranks.

Each test-only policy says its model's layout with the core's words (explicit dims and packed halves
of fused MoE experts, unequal ``parts`` of a packed q|k|v, a norm over a column-split activation,
a scaled embedding split over the vocabulary); the plan cuts the model in this process, each rank
runs its shard (classes travel by value, ``bind_group`` binds them), and the logits of every rank
must equal the unsplit model's.
"""

from __future__ import annotations

import copy

import layer_helpers
import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer
from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer

from tpcore import Layer, Policy, divide
from tpcore.load.skeleton import named_tensors
from tpcore.parallel.layers import VocabParallelEmbedding, column_split_norm_class
from tpcore.plan import apply_plan, plan_for
from tpcore.testing import random_weights

VOCAB = 61  # odd: the vocabulary is padded over any world size
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def seeded(model: torch.nn.Module) -> torch.nn.Module:
    return random_weights(model, seed=3, scale=0.3).eval()


def attention_arguments(config, world_size: int, **more) -> dict:
    heads = divide(config.num_attention_heads, world_size, "num_attention_heads")
    kv_heads = max(config.num_key_value_heads // world_size, 1)
    return {"self_attn.num_key_value_groups": heads // kv_heads, **more}


class LlamaLikeAttention(Policy):
    """q/k/v column (k/v with grouped heads, replicated when fewer than the ranks), o row."""

    @staticmethod
    def attn_qkv():
        kv = "num_key_value_heads"
        return [
            Layer(weight="self_attn.q_proj.weight"),
            Layer(weight="self_attn.k_proj.weight", heads=kv),
            Layer(weight="self_attn.v_proj.weight", heads=kv),
        ]

    @staticmethod
    def attn_out():
        return [Layer(weight="self_attn.o_proj.weight")]


class MixtralExpertsPolicy(LlamaLikeAttention):
    """Every rank holds 1/N of every expert's intermediate size; the router stays whole."""

    layer_class = MixtralDecoderLayer

    @staticmethod
    def replace_arguments(config, world_size):
        intermediate = divide(config.intermediate_size, world_size, "intermediate_size")
        return attention_arguments(config, world_size, **{"mlp.experts.intermediate_dim": intermediate})

    @staticmethod
    def mlp_in():
        return [Layer(weight="mlp.experts.gate_up_proj", dim=1, n_fused=2)]

    @staticmethod
    def mlp_out():
        return [Layer(weight="mlp.experts.down_proj", dim=2)]


class Olmo2Policy(LlamaLikeAttention):
    """OLMo 2 normalizes the full-width q and k: the norms become column-split norms (one all-reduce)."""

    layer_class = Olmo2DecoderLayer

    @staticmethod
    def replace_arguments(config, world_size):
        return attention_arguments(config, world_size)

    @staticmethod
    def attn_qkv():
        return LlamaLikeAttention.attn_qkv() + [
            Layer(weight="self_attn.q_norm.weight", replace=column_split_norm_class),
            Layer(weight="self_attn.k_norm.weight", heads="num_key_value_heads", replace=column_split_norm_class),
        ]

    @staticmethod
    def mlp_in():
        return [Layer(weight="mlp.gate_proj.weight"), Layer(weight="mlp.up_proj.weight")]

    @staticmethod
    def mlp_out():
        return [Layer(weight="mlp.down_proj.weight")]


class Phi3Policy(Policy):
    """Phi-3 packs ``[Q | K | V]`` with fewer KV heads in one ``qkv_proj``, and gate|up in one projection."""

    layer_class = Phi3DecoderLayer

    @staticmethod
    def replace_arguments(config, world_size):
        local = copy.copy(config)  # its attention slices the packed output by the config's head count
        local.num_attention_heads = divide(config.num_attention_heads, world_size, "num_attention_heads")
        local.num_key_value_heads = max(config.num_key_value_heads // world_size, 1)
        return {
            "self_attn.config": local,
            "self_attn.num_key_value_heads": local.num_key_value_heads,
            "self_attn.num_key_value_groups": local.num_attention_heads // local.num_key_value_heads,
        }

    @staticmethod
    def attn_qkv():
        parts = ("num_attention_heads", "num_key_value_heads", "num_key_value_heads")
        return [Layer(weight="self_attn.qkv_proj.weight", parts=parts)]

    @staticmethod
    def attn_out():
        return [Layer(weight="self_attn.o_proj.weight")]

    @staticmethod
    def mlp_in():
        return [Layer(weight="mlp.gate_up_proj.weight", n_fused=2)]

    @staticmethod
    def mlp_out():
        return [Layer(weight="mlp.down_proj.weight")]


def mixtral():
    config = MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    return seeded(MixtralForCausalLM(config))


def olmo2():
    return seeded(Olmo2ForCausalLM(Olmo2Config(**COMMON, intermediate_size=48)))


def phi3():
    return seeded(Phi3ForCausalLM(Phi3Config(**COMMON, intermediate_size=48, pad_token_id=0)))


def gemma():
    return seeded(GemmaForCausalLM(GemmaConfig(**COMMON, intermediate_size=48, head_dim=8)))


def qwen2_moe():
    sizes = dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    config = Qwen2MoeConfig(**COMMON, **sizes, num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    return seeded(Qwen2MoeForCausalLM(config))


def cohere():
    return seeded(CohereForCausalLM(CohereConfig(**COMMON, intermediate_size=48, use_qk_norm=True, pad_token_id=0)))


CASES = {
    "mixtral-experts": (mixtral, [MixtralExpertsPolicy]),
    "olmo2-qk-norm": (olmo2, [Olmo2Policy]),
    "phi3-unequal-parts": (phi3, [Phi3Policy]),
    "gemma-scaled-embedding": (gemma, None),  # its tp plan, and the scaled embedding split over the vocabulary
    # their tp plans: fused experts (packed_colwise / rowwise / moe_tp_experts), Cohere's per-head q/k norms
    "mixtral-tp-plan": (mixtral, None),
    "qwen2-moe-tp-plan": (qwen2_moe, None),
    "cohere-qk-norm-tp-plan": (cohere, None),
}


QUICK = {("mixtral-experts", 2), ("olmo2-qk-norm", 2)}  # the rest is the slow matrix


@pytest.mark.parametrize(
    ("case", "world_size"),
    [
        pytest.param(case, world_size, marks=() if (case, world_size) in QUICK else pytest.mark.slow)
        for case in CASES
        for world_size in (2, 4)
    ],
)
def test_the_plan_splits_the_layout_and_every_rank_gives_the_whole_models_logits(rank_pools, case, world_size):
    build, policies = CASES[case]
    model = build()
    if policies is None:
        from tpcore.select.auto import AutoPolicy

        policies = AutoPolicy().get_policy(model)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(world_size))
    with torch.no_grad():
        expected = model(ids).logits
    plan = plan_for(model, policies, world_size)
    shards = [apply_plan(plan, copy.deepcopy(model), rank) for rank in range(world_size)]
    whole_bytes = sum(t.numel() for t in named_tensors(model).values())
    assert all(sum(t.numel() for t in named_tensors(s).values()) < whole_bytes for s in shards)
    if case == "gemma-scaled-embedding":
        assert isinstance(shards[0].get_input_embeddings(), VocabParallelEmbedding)
    results = rank_pools.get(world_size).run(layer_helpers.bound_forward, shards, [(ids,)] * world_size)
    for rank, (out, _, _) in enumerate(results):
        torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5, msg=f"{case}, rank {rank}")
