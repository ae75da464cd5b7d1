"""Structural policies (:mod:`tpcore.select.structural`) for models neither a plugin nor a tp plan covers: read
off the blocks' Linears, proven on a tiny random copy over threads acting as ranks (:mod:`tpcore.plan.proof`)
before the user's model is touched, used only when that passes, refused otherwise.

BioGPT (no plugin installed here, no tp plan) through ``tpcore.parallelize()``: the object over 3 ranks (4
heads: 2, 1, 1) and a saved directory over 2, logits and greedy tokens equal to the unsplit model's. A model
whose MLP normalizes its intermediate features (a softmax) (which a column -> row split cannot keep) is refused by the
proof, naming the difference; a model with no repeated block is refused saying so."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import transformers
from torch import nn

import tpcore
from tpcore.parallel.threads import ThreadGroup, run_ranks
from tpcore.plan import plan_for
from tpcore.select import choose_policies, policy_origin
from tpcore.select.structural import STRUCTURAL_ORIGIN, StructuralPolicy, block_rules
from tpcore.testing import compare_outputs, padded_batch

VOCAB = 64


@functools.cache
def biogpt() -> transformers.BioGptForCausalLM:
    """2 layers, 4 heads of 8 features (built once: do not change it)."""
    config = transformers.BioGptConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48
    )
    torch.manual_seed(0)
    return transformers.BioGptForCausalLM(config).eval()


# -- what the structure gives (pure) -----------------------------------------------------------------------


def test_biogpt_blocks_give_their_attention_and_mlp_pairs():
    model = biogpt()
    (policy,) = choose_policies(model)
    assert issubclass(policy, StructuralPolicy) and policy_origin(policy) == STRUCTURAL_ORIGIN
    rules = block_rules(model.biogpt.layers[0], model.config)
    assert {path: rule[0] for path, rule in rules.items()} == {
        "self_attn.q_proj": "column",
        "self_attn.k_proj": "column",
        "self_attn.v_proj": "column",
        "self_attn.out_proj": "row",
        "fc1": "column",
        "fc2": "row",
    }


def test_a_structural_plan_is_proven_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="tpcore.plan"):
        plan = plan_for(biogpt(), choose_policies(biogpt()), 3)
    assert plan.shard_shape("biogpt.layers.0.self_attn.q_proj.weight", 0) == (16, 32)  # 2 of 4 heads
    assert "proven on a tiny random copy of its config" in caplog.text


class NormedMLPConfig(transformers.PretrainedConfig):
    model_type = "normed_mlp_test"

    def __init__(self, vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.intermediate_size, self.num_hidden_layers = intermediate_size, num_hidden_layers
        super().__init__(**kwargs)


class NormedMLP(nn.Module):
    """``down(softmax(up(x)))``: the softmax over the intermediate features needs all of them on each rank
    (and, holding no parameter, runs on a rank's share of them without complaint)."""

    def __init__(self, config):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return x + self.down(self.up(x).softmax(-1))


class NormedMLPModel(transformers.PreTrainedModel):
    config_class = NormedMLPConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NormedMLP(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def test_a_structural_split_the_forward_does_not_keep_is_refused_by_its_proof(spawned):
    model = NormedMLPModel(NormedMLPConfig()).eval()
    policies = choose_policies(model)
    assert [p.policy_name() for p in policies] == ["NormedMLP (structural)"]
    with pytest.raises(tpcore.ShardingError, match=r"by the structural policy.*on a tiny random copy.*differs"):
        plan_for(model, policies, 2)
    assert spawned == []


def test_blocks_inside_lists_of_lists_are_found_not_the_lists():
    model = NormedMLPModel(NormedMLPConfig()).eval()
    model.layers = nn.ModuleList(nn.ModuleList([layer]) for layer in model.layers)  # stages of blocks
    assert [p.layer_class_name().rpartition(".")[2] for p in choose_policies(model)] == ["NormedMLP"]


def test_a_model_without_repeated_blocks_is_refused_saying_so():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    model.config = NormedMLPConfig(hidden_size=4, intermediate_size=8)
    with pytest.raises(tpcore.UnsupportedModelError, match="No structural split of Sequential"):
        choose_policies(model)


def test_thread_ranks_sum_and_gather_in_rank_order_and_raise_the_first_failure():
    group = ThreadGroup(3)

    def work(rank: int):
        total = tpcore.all_reduce(torch.full((2,), float(rank + 1)), group)
        return total, tpcore.all_gather(torch.tensor([rank]), group, dim=0)

    for total, gathered in run_ranks(group, work):
        assert total.tolist() == [6.0, 6.0] and gathered.tolist() == [0, 1, 2]

    broken = ThreadGroup(3)

    def fails(rank: int):
        if rank == 1:
            raise ValueError("rank 1 broke")
        return tpcore.all_reduce(torch.ones(1), broken)  # the others waiting for rank 1 are released

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_ranks(broken, fails)


# -- the user's path ------------------------------------------------------------------------------------------


def matches_unsplit(served) -> None:
    model = biogpt()
    inputs = padded_batch([5, 3], seq=5, vocab_size=VOCAB, seed=2)
    with torch.inference_mode():
        assert compare_outputs(model(**inputs), served(**inputs))
    prompt = {"input_ids": inputs["input_ids"][:1], "max_new_tokens": 6, "do_sample": False}
    assert torch.equal(served.generate(**prompt), model.generate(**prompt))


def test_biogpt_by_its_structure_over_3_ranks_through_parallelize():
    served = tpcore.parallelize(biogpt(), num_gpus=3, backend="gloo")
    try:
        matches_unsplit(served)
    finally:
        served.deparallelize()


@pytest.mark.slow  # a world of its own
def test_biogpt_by_its_structure_from_a_directory_over_2_ranks(tmp_path):
    biogpt().save_pretrained(tmp_path)
    served = tpcore.parallelize(str(tmp_path), num_gpus=2, backend="gloo")
    try:
        matches_unsplit(served)
    finally:
        served.deparallelize()


def test_an_image_encoder_is_proven_on_random_images(caplog):
    """DINOv2 with registers (no plugin, no tp plan): its proof runs the tiny copy on two random images."""
    config = transformers.Dinov2WithRegistersConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=32, patch_size=8
    )
    model = transformers.Dinov2WithRegistersModel(config).eval()
    (policy,) = choose_policies(model)
    assert policy_origin(policy) == STRUCTURAL_ORIGIN
    with caplog.at_level(logging.WARNING, logger="tpcore.plan"):
        plan_for(model, [policy], 3)
    proven = "Dinov2WithRegistersModel over 3 ranks: split by Dinov2WithRegistersLayer (structural), proven"
    assert proven in caplog.text


def test_an_attention_reshaping_to_its_width_gets_the_ranks_width_on_the_tiny_copy_too():
    """YOSO (BERT's layout, no plugin, no tp plan) reshapes its context to ``all_head_size``: the structural
    policy gives each rank its heads x head_dim, read from the config it is given (the tiny copy's heads are
    narrower than the model's), so the proof passes and the rank holds 2 of 4 heads' width."""
    config = transformers.YosoConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48
    )
    model = transformers.YosoModel(config).eval()
    plan = plan_for(model, choose_policies(model), 2)
    assert plan.attributes["encoder.layer.0.attention.self.all_head_size"] == 32


def test_a_two_tower_model_is_proven_on_token_ids_and_images(caplog):
    """OwlViT (no plugin, no tp plan, no image token in its text): the proof feeds both towers."""
    from tpcore.testing.samples import small_config

    model = transformers.OwlViTModel(small_config(transformers.OwlViTConfig())).eval()
    with caplog.at_level(logging.WARNING, logger="tpcore.plan"):
        plan_for(model, choose_policies(model), 2)
    assert "OwlViTModel over 2 ranks: split by OwlViTEncoderLayer (structural), proven" in caplog.text
