"""No split is accepted that then fails on the ranks: DeepSeek-V2's multi-head latent attention at every
world size, the trial run ``plan_for`` makes of derived policies, and a rotating draw over every
(model type, world size) the plugins and the tp-plan fallback claim (``bench/split_sweep.py`` sweeps them all).
"""

from __future__ import annotations

import datetime
import os
import random
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tpcore import Layer
from tpcore.errors import ShardingError
from tpcore.plan import plan_for
from tpcore.plan.tiny_copy import tiny_config
from tpcore.select import choose_policies
from tpcore.testing import ModelSpec, check_equivalence
from tpcore.testing.samples import sample_inputs, small_config

BENCH = Path(__file__).resolve().parents[2] / "bench"

#: MLA widths that all differ: a query head is nope + rope = 12 features, a kv_b head nope + v = 20, an o head 12
MLA = dict(qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, kv_lora_rank=16)


def deepseek_v2(q_lora_rank: int | None, **more) -> ModelSpec:
    sizes = dict(vocab_size=64, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=2)
    sizes |= dict(num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, pad_token_id=0)
    config = transformers.DeepseekV2Config(q_lora_rank=q_lora_rank, **{**sizes, **MLA, **more})
    return ModelSpec(transformers.DeepseekV2ForCausalLM, config, seed=3)


def batch() -> dict:
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_deepseek_v2_deals_its_latent_attention_in_whole_heads_of_each_projection_width(q_lora_rank):
    model = deepseek_v2(q_lora_rank).build()
    plan = plan_for(model, choose_policies(model, None), 3)
    query = "q_proj" if q_lora_rank is None else "q_b_proj"
    heads = [2, 1, 1]  # 4 heads over 3 ranks
    for name, width, dim in ((query, 12, 0), ("kv_b_proj", 20, 0), ("o_proj", 12, 1)):
        tensor = f"model.layers.0.self_attn.{name}.weight"
        assert [plan.shard_shape(tensor, rank)[dim] for rank in range(3)] == [h * width for h in heads]
    assert [plan.attributes["model.layers.0.self_attn.num_heads"][rank] for rank in range(3)] == heads


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_deepseek_v2_splits_equal_over_three_ranks(rank_pools, q_lora_rank):
    check_equivalence(deepseek_v2(q_lora_rank), batch(), world_sizes=(3,), pools=rank_pools)


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_deepseek_v2_with_dense_first_layers_splits_equal_at_two_to_four_ranks(rank_pools, q_lora_rank):
    """The real checkpoints' layout: dense first layers, then MoE (experts in some blocks only)."""
    spec = deepseek_v2(q_lora_rank, num_hidden_layers=3, first_k_dense_replace=1)
    assert sorted(check_equivalence(spec, batch(), world_sizes=(2, 3, 4), pools=rank_pools)) == [2, 3, 4]


def test_experts_held_by_some_blocks_get_the_eager_experts_where_a_share_breaks_grouped_mm():
    model = deepseek_v2(None, num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=1408).build()
    model.config._experts_implementation = "grouped_mm"
    plan = plan_for(model, choose_policies(model, None), 3, trial=False)  # 1408 / 3: shares of 470, 469, 469
    assert plan.attributes["model.layers.1.mlp.experts.config"]._experts_implementation == "eager"
    assert "model.layers.0.mlp.experts.config" not in plan.attributes  # a dense block: no experts


def _without_head_words(policy):
    """``policy`` as the derived policies were before MLA: its attention projections cut as plain columns."""
    tensors = tuple(
        Layer(weight=layer.weight, bias=layer.bias, style=layer.style, optional=layer.optional)
        if "self_attn" in layer.weight
        else layer
        for layer in policy.tensors
    )
    return type("PlainCut", (policy,), {"tensors": tensors})


def test_a_split_the_static_checks_accept_but_the_forward_cannot_run_is_refused_by_the_trial():
    model = deepseek_v2(16).build()
    policies = [_without_head_words(policy) for policy in choose_policies(model, None)]
    plan_for(model, policies, 3, trial=False)  # 4 heads of 12 features over 3 ranks: 16 features each
    state, threads = torch.random.get_rng_state(), torch.get_num_threads()
    with pytest.raises(ShardingError, match=r"DeepseekV2ForCausalLM over 3 ranks.*trial.*rank 0: RuntimeError"):
        plan_for(model, policies, 3)
    assert torch.equal(torch.random.get_rng_state(), state) and torch.get_num_threads() == threads
    plan_for(model, policies, 2)  # 2 heads each: the trial runs
    opted_out = [type("Trusted", (policy,), {"verify_by_trial": False}) for policy in policies]
    plan_for(model, opted_out, 3)  # a policy that does not ask for a trial gets none


def test_the_tiny_copy_keeps_the_head_counts_and_shrinks_every_width():
    config = transformers.DeepseekV2Config(num_attention_heads=128, first_k_dense_replace=3, n_group=8, topk_group=4)
    tiny = tiny_config(config, 3)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (128, 128)
    assert tiny.hidden_size == 128 * 8 and tiny.qk_head_dim == 16 and tiny.vocab_size == 64
    assert tiny.num_hidden_layers == 4 and tiny.n_routed_experts == 4 and tiny.topk_group <= tiny.n_group
    assert tiny.moe_intermediate_size % 24 == config.moe_intermediate_size % 24  # the same shares modulo 8


# -- a rotating draw over every claimed (model type, world size) -------------------------------------------

#: pairs per run; the seed is the date (or HYPOTHESIS_SEED), so each day draws others
DRAWN_PAIRS = 8


def drawn_pairs() -> list[tuple[str, int]]:
    sys.path.insert(0, str(BENCH))
    from split_sweep import MAX_WORLD_SIZE, claimed_model_types

    seed = os.environ.get("HYPOTHESIS_SEED") or datetime.date.today().isoformat()
    pairs = [(name, size) for name in claimed_model_types() for size in range(2, MAX_WORLD_SIZE + 1)]
    return random.Random(seed).sample(pairs, min(DRAWN_PAIRS, len(pairs)))


@pytest.mark.slow
def test_a_drawn_claimed_pair_runs_equal_or_is_refused_before_any_rank_starts(rank_pools):
    """Each drawn (model type, world size) the tiny model can serve: ``plan_for`` refuses it, or every rank
    runs it equal to the unsplit model; never accepted and then failing."""
    from split_sweep import claimed_model_types, sweep_one

    transformers.logging.set_verbosity_error()
    claimed, outcomes = claimed_model_types(), []
    for model_type, world_size in drawn_pairs():
        rows = sweep_one(model_type, claimed[model_type], rank_pools, (world_size,))
        outcomes += [(model_type, world_size, row["outcome"], row["detail"]) for row in rows]
    bad = [outcome for outcome in outcomes if outcome[2] in ("accepted then failed", "accepted, not equal")]
    assert not bad, bad


def test_small_config_keeps_deepseek_v2_multi_head():
    config = small_config(transformers.DeepseekV2Config(), (2,))
    model = transformers.DeepseekV2ForCausalLM(config)
    assert config.num_key_value_heads == config.num_attention_heads and sample_inputs(model)
