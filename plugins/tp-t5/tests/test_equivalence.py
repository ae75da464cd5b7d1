"""A T5-family model split over 1-4 gloo ranks gives the unsplit model's outputs and tokens.

``test_every_head`` runs the first head of each family and MLP at world sizes 1-4 (the quick core)
and every other head over 2 and 3 ranks; generation (greedy and beam) runs each family with the
gated MLP (the MLPs differ in the forward only, which ``test_every_head`` covers); the hypothesis
property draws random small configs (strategies of ``tpcore.testing``). Configs are built fresh
per model: some T5 classes change the config they are given.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpcore
from tpcore.testing import (
    HALF_PRECISION_RTOL,
    ModelSpec,
    check_equivalence,
    padded_batch,
    padded_batches,
    seeds,
    split_sizes,
)

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
    return padded_batch(lengths, seq, VOCAB, seed)


def forward_inputs(head: str, inputs: dict) -> dict:
    """``inputs`` (a padded batch with ``decoder_input_ids``) as ``head`` takes them, with hidden states."""
    inputs = dict(inputs)
    if head not in ("Model", "ForConditionalGeneration"):
        del inputs["decoder_input_ids"]
    if head == "ForSequenceClassification":  # pools the hidden state at each row's last eos token
        ids = inputs["input_ids"] = inputs["input_ids"].clone()
        ids[torch.arange(len(ids)), inputs["attention_mask"].sum(1) - 1] = 1
    return {**inputs, "output_hidden_states": True}


def fixed_inputs(head: str, lengths: list[int], seq: int, seed: int, decoder_seq: int = 4) -> dict:
    decoder = padded_batch([decoder_seq] * len(lengths), decoder_seq, VOCAB, seed + 1)["input_ids"]
    return forward_inputs(head, {**padded(lengths, seq, seed), "decoder_input_ids": decoder})


def every_head_cases():
    """``(family, mlp, head, world sizes)``: the first head over 1-4 ranks, the others (slow) over 2 and 3."""
    for family, mlp, head in CASES:
        name = f"{family}-{mlp}-{head}"
        if head == HEADS[0]:
            yield pytest.param(family, mlp, head, (1, 2, 3, 4), id=name)
        else:
            yield pytest.param(family, mlp, head, (2, 3), id=name, marks=pytest.mark.slow)


@pytest.mark.parametrize(("family", "mlp", "head", "world_sizes"), list(every_head_cases()))
def test_every_head(rank_pools, family, mlp, head, world_sizes):
    """Encoder outputs and decoder logits over each world size; padded batch of 3."""
    spec = model_spec(family, mlp, head)
    report = check_equivalence(
        spec, fixed_inputs(head, [7, 3, 5], 7, seed=2), world_sizes=world_sizes, pools=rank_pools
    )
    assert sorted(report) == list(world_sizes)


@pytest.mark.parametrize("num_beams", [1, pytest.param(3, marks=pytest.mark.slow)], ids=["greedy", "beam"])
@pytest.mark.parametrize(
    ("family", "mlp"), [pytest.param(f, "gated-gelu", marks=[] if f == "T5" else [pytest.mark.slow]) for f in FAMILIES]
)
def test_generate_tokens_match(rank_pools, family, mlp, num_beams):
    """32 new tokens for a padded batch, identical to the unsplit model's on every rank; 6 heads are 3 + 3
    over 2 ranks and 2, 2, 1, 1 over 4 (with their position bias columns)."""
    spec = model_spec(family, mlp, "ForConditionalGeneration", heads=6, seed=3)
    inputs = {**padded([6, 3], 6, seed=4), "max_new_tokens": 32, "min_new_tokens": 32, "num_beams": num_beams}
    report = check_equivalence(spec, inputs, world_sizes=(2, 4), pools=rank_pools, method="generate", rtol=0)
    assert all(diff == 0 for diffs in report.values() for diff in diffs.values())


@pytest.mark.slow  # a world of its own (tp-gpt runs the one-liner in the quick suite)
def test_generate_through_parallelize():
    """5 heads over 2 ranks (3 and 2) through the one-liner: greedy and beam tokens as the unsplit model's."""
    spec = model_spec("T5", "gated-gelu", "ForConditionalGeneration", heads=5, seed=5)
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


def test_heads_the_ranks_do_not_divide_are_dealt_whole_and_fewer_heads_than_ranks_are_refused():
    spec = model_spec("T5", "relu", "ForConditionalGeneration", heads=6)
    plan = tpcore.TensorReplacer(spec.build(), None, False, 4, rank=0).split_plan()
    assert plan.attributes["encoder.block.0.layer.0.SelfAttention.n_heads"] == tpcore.PerRank((2, 2, 1, 1))
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert [plan.shard_shape(bias, rank)[1] for rank in range(4)] == [2, 2, 1, 1]  # the position bias follows
    with pytest.raises(tpcore.ShardingError, match=r"T5ForConditionalGeneration over 8 ranks.*heads are fewer"):
        tpcore.TensorReplacer(spec.build(), None, False, 8, rank=0).validate()


@pytest.mark.slow
@settings(max_examples=65, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=st.sampled_from(CASES),
    sizes=split_sizes(world_sizes=(2, 3, 4, 5), uneven=True),
    inputs=padded_batches(VOCAB, batch=(1, 3), seq=(2, 9), decoder_seq=(1, 5)),
    seed=seeds(),
)
def test_random_configs_match_unsplit(rank_pools, case, sizes, inputs, seed):
    """Random configs over 2-5 ranks, head counts and sizes mostly not divided by them (world size 1 is
    ``test_every_head``'s)."""
    family, mlp, head = case
    spec = model_spec(family, mlp, head, sizes.heads, sizes.head_dim, sizes.layers, sizes.intermediate, seed)
    report = check_equivalence(spec, forward_inputs(head, inputs), world_sizes=(sizes.world_size,), pools=rank_pools)
    assert report[sizes.world_size]


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
    inputs = fixed_inputs("ForConditionalGeneration", [7, 3, 5], 7, seed=2)
    report = check_equivalence(
        spec, inputs, world_sizes=(world_size,), pools=nccl_rank_pools, rtol=HALF_PRECISION_RTOL[dtype], dtype=dtype
    )
    assert report[world_size]
