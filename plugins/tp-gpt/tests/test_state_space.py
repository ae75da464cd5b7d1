"""Mamba split by channels equals the unsplit model through ``tpcore.parallelize()``: logits of a padded
batch and greedy ``generate()`` tokens (the conv and recurrent caches hold each rank's channels), from the
object over 3 ranks (80 channels: 27, 27, 26) and from a saved directory over 2; ``tpcore check`` from the
default config shrunk."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

import tpcore
from tpcore.testing import compare_outputs, padded_batch
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


def matches_unsplit(served) -> None:
    model = mamba()
    inputs = padded_batch([6, 3], seq=6, vocab_size=VOCAB, seed=5)
    with torch.inference_mode():
        assert compare_outputs(model(**inputs), served(**inputs))
    prompt = {"input_ids": inputs["input_ids"][:1, :6], "max_new_tokens": 8, "do_sample": False}
    assert torch.equal(served.generate(**prompt), model.generate(**prompt))


def test_mamba_channels_over_3_ranks_through_parallelize():
    assert mamba().config.intermediate_size % 3
    served = tpcore.parallelize(mamba(), num_gpus=3, backend="gloo")
    try:
        matches_unsplit(served)
    finally:
        served.deparallelize()


@pytest.mark.slow  # a world of its own
def test_mamba_from_a_directory_over_2_ranks(tmp_path):
    mamba().save_pretrained(tmp_path)
    served = tpcore.parallelize(str(tmp_path), num_gpus=2, backend="gloo")
    try:
        matches_unsplit(served)
    finally:
        served.deparallelize()


@pytest.mark.slow
def test_tpcore_check_passes_for_mamba(rank_pools, capsys):
    assert run_check("MambaForCausalLM", (2, 3), pools=rank_pools) == 0, capsys.readouterr().out
