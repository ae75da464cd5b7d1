"""Mamba split by channels and Mamba2 by groups of heads equal the unsplit model through
``tpcore.parallelize()``: logits of a padded batch and greedy ``generate()`` tokens (the conv and recurrent
caches hold each rank's channels), from the object over 3 ranks (Mamba: 80 channels, 27, 27, 26; Mamba2: 4
groups of 2 heads, 2, 1, 1 groups; and one group of 8 heads dealt 3, 3, 2, its B and C on every rank) and
from a saved directory over 2; ``tpcore check`` from the default configs shrunk; Mamba2 over more ranks than
a group has heads refused naming them."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

import tpcore
from tpcore.plan import plan_for
from tpcore.select import choose_policies
from tpcore.testing import ModelSpec, check_equivalence, compare_outputs, padded_batch
from tpcore.tools.check import run_check

VOCAB = 64


@functools.cache
def mamba() -> transformers.MambaForCausalLM:
    """2 layers, hidden 40, 80 channels (uneven over 3 ranks), state 8 (built once: do not change it)."""
    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, state_size=8, expand=2, pad_token_id=0
    )
    torch.manual_seed(3)
    return transformers.MambaForCausalLM(config).eval()


@functools.cache
def mamba2() -> transformers.Mamba2ForCausalLM:
    """2 layers, hidden 32, 8 heads of 8 channels in 4 groups (uneven over 3 ranks), state 8 (built once)."""
    config = transformers.Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=8,
        expand=2,
        head_dim=8,
        num_heads=8,
        n_groups=4,
        chunk_size=4,
        pad_token_id=0,
    )
    torch.manual_seed(4)
    return transformers.Mamba2ForCausalLM(config).eval()


@functools.cache
def mamba2_one_group() -> transformers.Mamba2ForCausalLM:
    """As :func:`mamba2`, its 8 heads in one group: B and C shared by every rank, the gated norm over all ranks."""
    config = transformers.Mamba2Config(**{**mamba2().config.to_dict(), "n_groups": 1})
    torch.manual_seed(5)
    return transformers.Mamba2ForCausalLM(config).eval()


MODELS = {"Mamba": mamba, "Mamba2": mamba2, "Mamba2 (one group)": mamba2_one_group}


def matches_unsplit(served, family: str = "Mamba") -> None:
    model = MODELS[family]()
    inputs = padded_batch([6, 3], seq=6, vocab_size=VOCAB, seed=5)
    with torch.inference_mode():
        assert compare_outputs(model(**inputs), served(**inputs))
    prompt = {"input_ids": inputs["input_ids"][:1, :6], "max_new_tokens": 8, "do_sample": False}
    assert torch.equal(served.generate(**prompt), model.generate(**prompt))


def test_mamba_channels_over_3_ranks_on_shared_rank_pools(rank_pools):
    """The engine's path on warm ranks (the quick suite): logits and greedy tokens, 80 channels over 3."""
    assert mamba().config.intermediate_size % 3
    spec = ModelSpec(transformers.MambaForCausalLM, mamba().config, seed=3)
    inputs = padded_batch([6, 3], seq=6, vocab_size=VOCAB, seed=5)
    assert check_equivalence(spec, inputs, world_sizes=(3,), pools=rank_pools)[3]
    prompt = {"input_ids": inputs["input_ids"][:1], "max_new_tokens": 8, "do_sample": False}
    report = check_equivalence(spec, prompt, world_sizes=(3,), pools=rank_pools, method="generate", rtol=0)
    assert all(diff == 0 for diff in report[3].values())


@pytest.mark.slow  # a world of its own
def test_mamba_channels_over_3_ranks_through_parallelize():
    served = tpcore.parallelize(mamba(), num_gpus=3, backend="gloo")
    try:
        matches_unsplit(served)
    finally:
        served.deparallelize()


def test_mamba2_groups_over_3_ranks_through_parallelize():
    served = tpcore.parallelize(mamba2(), num_gpus=3, backend="gloo")
    try:
        matches_unsplit(served, "Mamba2")
    finally:
        served.deparallelize()


@pytest.mark.slow  # a world each
@pytest.mark.parametrize("family", list(MODELS))
def test_from_a_directory_over_2_ranks(tmp_path, family):
    MODELS[family]().save_pretrained(tmp_path)
    served = tpcore.parallelize(str(tmp_path), num_gpus=2, backend="gloo")
    try:
        matches_unsplit(served, family)
    finally:
        served.deparallelize()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM"])
def test_tpcore_check_passes(rank_pools, capsys, name):
    assert run_check(name, (2, 3), pools=rank_pools) == 0, capsys.readouterr().out


@pytest.mark.slow  # a world of its own
def test_mamba2_with_fewer_groups_than_ranks_over_3_ranks_through_parallelize():
    """One group over 3 ranks: each rank 3, 3 or 2 of its heads, the group's B and C, and the gated norm's
    statistic summed over the ranks (``tpcore.ColumnSplitGatedRMSNorm``)."""
    served = tpcore.parallelize(mamba2_one_group(), num_gpus=3, backend="gloo")
    try:
        matches_unsplit(served, "Mamba2 (one group)")
    finally:
        served.deparallelize()


def test_mamba2_with_more_ranks_than_heads_in_a_group_is_refused_naming_them():
    with pytest.raises(tpcore.ShardingError, match=r"3 ranks would share each of its 4 groups of 2 heads"):
        plan_for(mamba2(), choose_policies(mamba2()), 9)  # before any rank starts
