"""World sizes that do not divide the head counts: shard plans of BERT, GPT-2, Llama (grouped KV heads)
and T5 over 1-5 ranks, built on the meta device (no rank is started), and the one-liner from a checkpoint.

The plugins' property tests check the split models' outputs over real ranks; these check what the
plans promise: whole heads, query heads beside their key/value heads, every rank within one head
(one key/value group) of an equal share, plain ints where the ranks divide, and a report that says
each rank's share.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import tpcore
from tpcore import PerRank, ShardingError
from tpcore.plan import ShardPlan, apply_plan, as_json, report
from tpcore.testing import compare_outputs, padded_batch


def family_config(family: str, heads: int, kv_heads: int, head_dim: int, intermediate: int):
    if family == "Bert":
        return transformers.BertForMaskedLM, transformers.BertConfig(
            vocab_size=50, hidden_size=heads * head_dim, num_attention_heads=heads,
            intermediate_size=intermediate, num_hidden_layers=2,
        )  # fmt: skip
    if family == "GPT2":
        return transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=50, n_embd=heads * head_dim, n_head=heads, n_inner=intermediate, n_layer=2
        )
    if family == "Llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            vocab_size=50, hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
            intermediate_size=intermediate, num_hidden_layers=2,
        )  # fmt: skip
    return transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=50, d_model=heads * head_dim, d_kv=head_dim, num_heads=heads, d_ff=intermediate, num_layers=2
    )


def plan_of(family: str, world: int, heads: int, kv_heads: int = 0, head_dim: int = 4, intermediate: int = 30):
    model_class, config = family_config(family, heads, kv_heads or heads, head_dim, intermediate)
    with torch.device("meta"):
        model = model_class(config)
    return tpcore.TensorReplacer(model, None, False, world, rank=0).split_plan()


def one_group(plan: ShardPlan, name: str) -> int:
    """Elements of one dealt group (a head, a key/value group, or a feature) of each packed segment of
    tensor ``name`` along its cut dimension, times the rest of its shape."""
    split, shape = plan.splits[name], plan.shapes[name]
    size = shape[split.dim]
    segments = len(split.parts) if split.parts else 1 if split.interleaved else split.n_fused
    groups = split.groups or (math.gcd(*split.parts) if split.parts else split.heads or size // segments)
    return size // groups * math.prod(shape) // size


@st.composite
def cases(draw):
    """A family, a world of 1-5 ranks and head counts it can hold: at least one query head per rank,
    key/value heads (Llama) any divisor of the query heads."""
    family = draw(st.sampled_from(["Bert", "GPT2", "Llama", "T5"]))
    world = draw(st.integers(1, 5))
    heads = draw(st.integers(world, 3 * world))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0])) if family == "Llama" else 0
    return family, world, heads, kv_heads, draw(st.integers(world, 40))


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_every_rank_holds_whole_heads_within_one_group_of_an_equal_share(case):
    family, world, heads, kv_heads, intermediate = case
    plan = plan_of(family, world, heads, kv_heads, intermediate=intermediate)
    for name, split in plan.splits.items():
        if split.pad:  # vocabularies keep their padding: equal rows on every rank
            assert len({plan.shard_shape(name, rank) for rank in range(world)}) == 1
            continue
        numel = math.prod(plan.shapes[name])
        shares = [math.prod(plan.shard_shape(name, rank)) for rank in range(world)]
        replicated = split.replicated(plan.shapes[name][split.dim], world)
        assert sum(shares) >= numel if replicated else sum(shares) == numel, name  # nothing lost
        segments = len(split.parts) if split.parts else 1 if split.interleaved else split.n_fused
        assert max(shares) - numel / world <= segments * one_group(plan, name), name
    if heads % world == 0 and (not kv_heads or kv_heads % world == 0 or world % kv_heads == 0):
        assert all(not isinstance(value, PerRank) for value in plan.attributes.values())


@pytest.mark.parametrize("family", ["Bert", "GPT2", "Llama", "T5"])
def test_where_the_ranks_divide_the_heads_the_plan_is_the_equal_one(family):
    """12 heads (Llama: 4 key/value heads) over 4 ranks: every rank the same shapes, plain int attributes."""
    plan = plan_of(family, 4, 12, kv_heads=4, intermediate=32)
    assert plan.uniform
    for name in plan.splits:
        assert len({plan.shard_shape(name, rank) for rank in range(4)}) == 1
    assert all(isinstance(value, int) for value in plan.attributes.values())


def test_a_nine_head_model_over_two_ranks_keeps_each_kv_head_with_its_query_heads_and_reports_the_shares():
    """SmolLM2-135M's head counts (9 query, 3 key/value) over 2 ranks: 6 + 2 and 3 + 1."""
    plan = plan_of("Llama", 2, 9, kv_heads=3, head_dim=4, intermediate=30)
    assert not plan.uniform
    assert [plan.shard_shape("model.layers.0.self_attn.q_proj.weight", r) for r in (0, 1)] == [(24, 36), (12, 36)]
    assert [plan.shard_shape("model.layers.0.self_attn.k_proj.weight", r) for r in (0, 1)] == [(8, 36), (4, 36)]
    assert [plan.shard_shape("model.layers.0.self_attn.o_proj.weight", r) for r in (0, 1)] == [(36, 24), (36, 12)]
    assert [plan.shard_shape("model.layers.0.mlp.up_proj.weight", r) for r in (0, 1)] == [(15, 36), (15, 36)]
    text = report(plan)
    assert "LlamaForCausalLM over 2 ranks, shares by rank:" in text
    assert "(36, 36) -> (24, 36) | (12, 36) x2" in text
    per_rank = [plan.bytes_per_rank(rank) for rank in (0, 1)]
    assert per_rank[0] > per_rank[1] and f"per rank {per_rank[0] / 1024:.1f} KiB | {per_rank[1] / 1024:.1f} KiB" in text
    shown = as_json(plan)
    assert shown["bytes_per_rank"] == per_rank
    assert shown["tensors"]["model.layers.0.self_attn.q_proj.weight"]["per_rank"] == [[24, 36], [12, 36]]


def test_per_rank_attributes_are_reported_and_each_rank_gets_its_own():
    plan = plan_of("GPT2", 2, 5)
    assert plan.attributes["transformer.h.0.attn.num_heads"] == PerRank((3, 2))
    assert plan.attributes["transformer.h.0.attn.split_size"] == PerRank((12, 8))
    assert "transformer.h.*.attn.num_heads" in report(plan) and "3 | 2 x2" in report(plan)
    assert as_json(plan)["attributes_per_rank"]["transformer.h.1.attn.embed_dim"] == [12, 8]
    model_class, config = family_config("GPT2", 5, 5, 4, 30)
    with torch.device("meta"):
        shards = [apply_plan(plan, model_class(config), rank) for rank in (0, 1)]
    assert [s.transformer.h[0].attn.num_heads for s in shards] == [3, 2]
    assert [s.transformer.h[0].attn.c_attn.weight.shape[1] for s in shards] == [36, 24]


@pytest.mark.parametrize(("family", "world"), [("Bert", 5), ("GPT2", 7), ("T5", 4)])
def test_fewer_query_heads_than_ranks_are_refused_naming_the_row_parallel_tensor(family, world):
    with pytest.raises(ShardingError, match=rf"over {world} ranks: tensor .* heads are fewer than the ranks"):
        plan_of(family, world, world - 1)


@pytest.mark.slow  # a world of its own, loading from a saved checkpoint
def test_a_grouped_query_checkpoint_loads_unevenly_and_generates_the_unsplit_tokens(tmp_path):
    """9 query and 3 key/value heads saved to disk, served by 2 ranks that each read their uneven slices:
    logits within tolerance, greedy and beam tokens identical."""
    model_class, config = family_config("Llama", 9, 3, 4, 30)
    config.pad_token_id = 0
    torch.manual_seed(3)
    reference = model_class(config).eval()
    reference.save_pretrained(tmp_path)
    inputs = padded_batch([6, 4], 6, 50, seed=2, padding="left")
    with torch.inference_mode():
        expected = reference(**inputs)
        greedy = reference.generate(**inputs, max_new_tokens=10, do_sample=False)
        beams = reference.generate(**inputs, max_new_tokens=10, num_beams=3, do_sample=False)
    model = tpcore.parallelize(tmp_path, num_gpus=2, backend="gloo")
    try:
        compare_outputs(expected, model(**inputs))
        assert torch.equal(model.generate(**inputs, max_new_tokens=10, do_sample=False), greedy)
        assert torch.equal(model.generate(**inputs, max_new_tokens=10, num_beams=3, do_sample=False), beams)
        plan = tpcore.TensorReplacer(reference, None, False, 2, rank=0).split_plan()
        allocated = list(model.memory_allocated().values())  # tensor bytes, rank by rank
        assert allocated == [plan.bytes_per_rank(rank) for rank in (0, 1)] and allocated[0] > allocated[1]
    finally:
        model.deparallelize()
