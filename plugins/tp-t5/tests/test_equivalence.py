"""A T5-family model split over 1-4 gloo ranks gives the unsplit model's outputs and tokens.

Configs are built fresh per model: some T5 classes change the config they are given.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpcore
from tpcore.testing import HALF_PRECISION_RTOL, ModelSpec, check_equivalence

VOCAB = 64
FAMILIES = ("T5", "MT5", "UMT5")
MLPS = ("relu", "gated-gelu")  # original T5; T5 v1.1 / FLAN-T5 / mT5 / UMT5
HEADS = (
    "Model",
    "ForConditionalGeneration",
    "EncoderModel",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
)
CASES = [(family, mlp, head) for family in FAMILIES for mlp in MLPS for head in HEADS]


def model_spec(family, mlp, head, heads=12, d_kv=4, layers=2, d_ff=96, seed=1) -> ModelSpec:
    config = getattr(transformers, family + "Config")(
        vocab_size=VOCAB,
        d_model=heads * d_kv,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads,
        feed_forward_proj=mlp,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        num_labels=2,
    )
    return ModelSpec(getattr(transformers, family + head), config, seed)


def padded(lengths: list[int], seq: int, seed: int) -> dict:
    """Encoder ids with right padding: row ``i`` has ``lengths[i]`` real tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), seq), generator=generator)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def forward_inputs(head: str, lengths: list[int], seq: int, seed: int, decoder_seq: int = 4) -> dict:
    inputs = padded(lengths, seq, seed)
    if head in ("Model", "ForConditionalGeneration"):
        generator = torch.Generator().manual_seed(seed + 1)
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (len(lengths), decoder_seq), generator=generator)
    if head == "ForSequenceClassification":  # pools the hidden state at each row's last eos token
        rows = torch.arange(len(lengths))
        inputs["input_ids"][rows, torch.tensor(lengths) - 1] = 1
    return {**inputs, "output_hidden_states": True}


@pytest.mark.parametrize(("family", "mlp", "head"), CASES, ids=["-".join(case) for case in CASES])
def test_every_head(rank_pools, family, mlp, head):
    """Encoder outputs and decoder logits over 1, 2, 3 and 4 ranks; padded batch of 3."""
    spec = model_spec(family, mlp, head)
    report = check_equivalence(
        spec, forward_inputs(head, [7, 3, 5], 7, seed=2), world_sizes=(1, 2, 3, 4), pools=rank_pools
    )
    assert sorted(report) == [1, 2, 3, 4]


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam"])
@pytest.mark.parametrize(("family", "mlp"), [(f, m) for f in FAMILIES for m in MLPS])
def test_generate_tokens_match(rank_pools, family, mlp, num_beams):
    """32 new tokens for a padded batch, identical to the unsplit model's on every rank."""
    spec = model_spec(family, mlp, "ForConditionalGeneration", heads=4, seed=3)
    inputs = {**padded([6, 3], 6, seed=4), "max_new_tokens": 32, "min_new_tokens": 32, "num_beams": num_beams}
    report = check_equivalence(spec, inputs, world_sizes=(2, 4), pools=rank_pools, method="generate", rtol=0)
    assert all(diff == 0 for diffs in report.values() for diff in diffs.values())


def test_generate_through_parallelize():
    spec = model_spec("T5", "gated-gelu", "ForConditionalGeneration", heads=4, seed=5)
    reference = spec.build()
    inputs = {**padded([6, 3, 5], 6, seed=6), "max_new_tokens": 32, "min_new_tokens": 32}
    served = tpcore.parallelize(spec.build(), num_gpus=2, backend="gloo")
    try:
        for num_beams in (1, 3):
            assert torch.equal(
                served.generate(**inputs, num_beams=num_beams), reference.generate(**inputs, num_beams=num_beams)
            )
    finally:
        served.deparallelize()


def test_heads_that_do_not_divide_are_refused():
    spec = model_spec("T5", "relu", "ForConditionalGeneration", heads=6)
    with pytest.raises(tpcore.ShardingError, match=r"T5ForConditionalGeneration over 4 ranks.*num_heads = 6"):
        tpcore.TensorReplacer(spec.build(), None, False, 4, rank=0).validate()


@st.composite
def cases(draw):
    family, mlp, head = draw(st.sampled_from(CASES))
    world_size = draw(st.sampled_from([1, 2, 3, 4]))
    heads = world_size * draw(st.integers(1, 3))
    d_kv = draw(st.sampled_from([2, 4, 8]))
    d_ff = world_size * draw(st.integers(1, 24))
    batch = draw(st.integers(1, 3))
    seq = draw(st.integers(2, 9))
    lengths = draw(st.lists(st.integers(1, seq), min_size=batch, max_size=batch))
    layers = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**16))
    return family, mlp, head, world_size, heads, d_kv, d_ff, layers, lengths, seq, seed


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_random_configs_match_unsplit(rank_pools, case):
    family, mlp, head, world_size, heads, d_kv, d_ff, layers, lengths, seq, seed = case
    spec = model_spec(family, mlp, head, heads, d_kv, layers, d_ff, seed)
    inputs = forward_inputs(head, lengths, seq, seed + 1, decoder_seq=1 + seed % 5)
    report = check_equivalence(spec, inputs, world_sizes=(world_size,), pools=rank_pools)
    assert report[world_size]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(HALF_PRECISION_RTOL), ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_nccl_matches_unsplit(nccl_rank_pools, family, world_size, dtype):
    """Decoder logits on CUDA with NCCL in half precision; world sizes beyond the GPUs are skipped."""
    visible = torch.cuda.device_count()
    if visible < world_size:
        pytest.skip(f"world size {world_size} needs {world_size} GPUs; this machine has {visible}")
    spec = model_spec(family, "gated-gelu", "ForConditionalGeneration")
    inputs = forward_inputs("ForConditionalGeneration", [7, 3, 5], 7, seed=2)
    report = check_equivalence(
        spec, inputs, world_sizes=(world_size,), pools=nccl_rank_pools, rtol=HALF_PRECISION_RTOL[dtype], dtype=dtype
    )
    assert report[world_size]
