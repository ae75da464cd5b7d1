"""A BART-family model split over 1-4 gloo ranks gives the unsplit model's outputs and tokens.

Every family runs every head transformers ships for it: the first head over 1-4 ranks (BART, LED
and ProphetNet in the quick suite), the others (slow) over 2 and 3. Encoders have 6 heads and
decoders 4, so 3 and 4 ranks deal them unevenly (6 over 4: 2, 2, 1, 1; 4 over 3: 2, 1, 1), and
encoder and decoder blocks read their own counts. Inputs are padded batches; LED's carry global
attention on each row's first token, BigBirdPegasus' encoder runs block sparse (16 tokens in blocks
of 2) and, for shorter inputs, the full attention it switches to. Generation (greedy and 4 beams, no
repeated 3-grams, forced BOS and EOS) runs through the engine for every family, beam search from a
``save_pretrained`` directory each rank reading its slices, and both through ``tpcore.parallelize()``
for ProphetNet; ``tpcore check`` runs each class from its default config; a hypothesis property
draws random uneven sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpcore
from tpcore.testing import (
    HALF_PRECISION_RTOL,
    ModelSpec,
    SavedModelSpec,
    check_equivalence,
    padded_batch,
    seeds,
    split_sizes,
)
from tpcore.tools.check import run_check

VOCAB = 64
BOS, PAD, EOS = 0, 1, 2
ENCODER_HEADS, DECODER_HEADS = 6, 4
SEQ2SEQ_HEADS = ("Model", "ForConditionalGeneration", "MTModel")


@dataclass(frozen=True)
class Family:
    prefix: str
    heads: tuple[str, ...]
    #: config fields of the family's own (long-input attentions, vocabularies, position tables)
    options: tuple[tuple[str, object], ...] = ()
    #: the head generate() runs on
    generator: str = "ForConditionalGeneration"
    #: the fewest input tokens its encoder takes as it is meant to run (BigBirdPegasus: block sparse)
    encoder_seq: int = 7

    def model_class(self, head: str) -> type:
        return getattr(transformers, self.prefix + head)


_FIVE = ("ForConditionalGeneration", "Model", "ForCausalLM", "ForSequenceClassification", "ForQuestionAnswering")
_THREE = ("ForConditionalGeneration", "Model", "ForCausalLM")
FAMILIES = {
    family.prefix: family
    for family in (
        Family("Bart", _FIVE),
        Family("MBart", _FIVE),
        Family("Marian", ("MTModel", "Model", "ForCausalLM"), generator="MTModel"),
        Family("Pegasus", _THREE),
        Family("PegasusX", ("ForConditionalGeneration", "Model"), (("block_size", 4), ("num_global_tokens", 2))),
        Family("Blenderbot", _THREE),
        Family("BlenderbotSmall", _THREE),
        Family("M2M100", ("ForConditionalGeneration", "Model")),
        Family("PLBart", ("ForConditionalGeneration", "Model", "ForCausalLM", "ForSequenceClassification")),
        Family("FSMT", ("ForConditionalGeneration", "Model"), (("src_vocab_size", VOCAB), ("tgt_vocab_size", 48))),
        Family("LED", ("ForConditionalGeneration", "Model", "ForQuestionAnswering"), (("attention_window", 4),)),
        Family(
            "BigBirdPegasus",
            _FIVE,
            (("attention_type", "block_sparse"), ("block_size", 2), ("num_random_blocks", 1)),
            encoder_seq=16,
        ),
        Family(
            "ProphetNet",
            ("ForConditionalGeneration", "Model", "ForCausalLM", "Encoder", "Decoder"),
            (("ngram", 2), ("num_buckets", 8), ("relative_max_distance", 16)),
        ),
    )
}
CASES = [(family, head) for family in FAMILIES for head in FAMILIES[family].heads]


def model_config(family: str, encoder_heads=ENCODER_HEADS, decoder_heads=DECODER_HEADS, hidden=24, ffn=40, layers=2):
    """A small config of ``family``: ``hidden`` features, ``encoder_heads`` / ``decoder_heads`` heads."""
    sizes = {
        "vocab_size": VOCAB,
        "d_model": hidden,
        "encoder_layers": layers,
        "decoder_layers": layers,
        "encoder_attention_heads": encoder_heads,
        "decoder_attention_heads": decoder_heads,
        "encoder_ffn_dim": ffn,
        "decoder_ffn_dim": ffn,
        "max_position_embeddings": 64,
    }
    if family == "ProphetNet":
        sizes = {"vocab_size": VOCAB, "hidden_size": hidden, "num_encoder_layers": layers}
        sizes |= {"num_decoder_layers": layers, "num_encoder_attention_heads": encoder_heads}
        sizes |= {"num_decoder_attention_heads": decoder_heads, "encoder_ffn_dim": ffn, "decoder_ffn_dim": ffn}
        sizes |= {"max_position_embeddings": 64}
    if family == "LED":
        sizes |= {"max_encoder_position_embeddings": 64, "max_decoder_position_embeddings": 64}
    if family == "FSMT":
        sizes |= {"langs": ["en", "de"]}
    tokens = {"bos_token_id": BOS, "pad_token_id": PAD, "eos_token_id": EOS, "decoder_start_token_id": EOS}
    config_class = FAMILIES[family].model_class("Model").config_class
    return config_class(**sizes, **tokens, **dict(FAMILIES[family].options), num_labels=3)


def model_spec(family: str, head: str, seed: int = 1, **sizes) -> ModelSpec:
    return ModelSpec(FAMILIES[family].model_class(head), model_config(family, **sizes), seed)


def encoder_inputs(family: str, lengths: list[int], seq: int, seed: int) -> dict:
    """A right-padded batch: row ``i`` holds ``lengths[i]`` tokens, ending in EOS as the tokenizers end them."""
    inputs = padded_batch(lengths, seq, VOCAB, seed, pad_token_id=PAD)
    inputs["input_ids"][torch.arange(len(lengths)), torch.tensor(lengths) - 1] = EOS
    if family == "LED":  # global attention on each row's first token (the *_global projections)
        inputs["global_attention_mask"] = torch.zeros_like(inputs["input_ids"])
        inputs["global_attention_mask"][:, 0] = 1
    return inputs


def head_inputs(family: str, head: str, lengths: list[int], seq: int, seed: int, decoder_seq: int = 5) -> dict:
    """What ``head`` takes: encoder ids, decoder ids for the encoder-decoder heads, hidden states."""
    inputs = encoder_inputs(family, lengths, seq, seed)
    if head in SEQ2SEQ_HEADS:
        decoder = padded_batch([decoder_seq] * len(lengths), decoder_seq, VOCAB, seed + 1, pad_token_id=PAD)
        inputs["decoder_input_ids"] = decoder["input_ids"]
    if head in ("ForCausalLM", "Decoder", "Encoder"):
        inputs.pop("global_attention_mask", None)
    return {**inputs, "output_hidden_states": True}


def generate_inputs(family: str, lengths: list[int], seq: int, seed: int, num_beams: int) -> dict:
    """32 new tokens (the 32nd forced EOS), the first forced BOS, no repeated 3-gram; left padding is
    the encoder's right padding here."""
    inputs = encoder_inputs(family, lengths, seq, seed)
    options = {"max_new_tokens": 32, "min_new_tokens": 31, "num_beams": num_beams, "no_repeat_ngram_size": 3}
    if family == "ProphetNet":  # its cached generate() fails unsplit in transformers 5 (the position-ids check)
        options["use_cache"] = False
    return {**inputs, **options, "forced_bos_token_id": BOS, "forced_eos_token_id": EOS, "do_sample": False}


#: the families whose first head runs in the quick suite: the plain layout, local widths with global
#: attention, per-rank config copies with the n-gram attention
QUICK = ("Bart", "LED", "ProphetNet")


def every_head_cases():
    """``(family, head, world sizes)``: each family's first head over 1-4 ranks (in the quick suite for
    :data:`QUICK`), the others (slow) over 2 and 3."""
    for family, head in CASES:
        if head == FAMILIES[family].heads[0]:
            marks = [] if family in QUICK else [pytest.mark.slow]
            yield pytest.param(family, head, (1, 2, 3, 4), id=f"{family}{head}", marks=marks)
        else:
            yield pytest.param(family, head, (2, 3), id=f"{family}{head}", marks=pytest.mark.slow)


@pytest.mark.parametrize(("family", "head", "world_sizes"), list(every_head_cases()))
def test_every_head(rank_pools, family, head, world_sizes):
    """Encoder and decoder hidden states and logits over each world size; padded batch of 3."""
    seq = FAMILIES[family].encoder_seq
    inputs = head_inputs(family, head, [seq, 3, seq - 2], seq, seed=2)
    report = check_equivalence(model_spec(family, head), inputs, world_sizes=world_sizes, pools=rank_pools)
    assert sorted(report) == list(world_sizes)


def _generation_cases():
    for family in FAMILIES:
        for num_beams, name in ((1, "greedy"), (4, "beam")):
            quick = family == "Bart" and num_beams == 1
            yield pytest.param(family, num_beams, id=f"{family}-{name}", marks=[] if quick else [pytest.mark.slow])


@pytest.mark.parametrize(("family", "num_beams"), list(_generation_cases()))
def test_generate_tokens_match(rank_pools, family, num_beams):
    """32 new tokens for a padded batch of 2, identical to the unsplit model's on every rank, over 2 and 4 ranks."""
    spec = model_spec(family, FAMILIES[family].generator, seed=3)
    inputs = generate_inputs(family, [6, 3], 6, seed=4, num_beams=num_beams)
    report = check_equivalence(spec, inputs, world_sizes=(2, 4), pools=rank_pools, method="generate", rtol=0)
    assert all(diff == 0 for diffs in report.values() for diff in diffs.values())


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_from_a_saved_directory_each_rank_reading_its_slices(rank_pools, tmp_path, family):
    """``save_pretrained`` (tied tables stored once, ``final_logits_bias``, Marian's unsaved sinusoidal
    positions), then each of 3 ranks reads only its slices (``ParallelEngine.parallelize(path)``):
    beam-search tokens as ``from_pretrained``'s unsplit model gives them (greedy ones: the engine test above)."""
    model_class = FAMILIES[family].model_class(FAMILIES[family].generator)
    model_spec(family, FAMILIES[family].generator, seed=5).build().save_pretrained(tmp_path)
    inputs = generate_inputs(family, [6, 3, 5], 6, seed=6, num_beams=4)
    spec = SavedModelSpec(str(tmp_path), model_class)
    report = check_equivalence(spec, inputs, world_sizes=(3,), pools=rank_pools, method="generate", rtol=0)
    assert all(diff == 0 for diff in report[3].values())


@pytest.mark.slow  # a world per model (tests/user_path/test_parallelize.py runs the one-liner in the quick suite)
@pytest.mark.parametrize("family", ["ProphetNet"])  # Marian's unsaved positions: the engine test above
def test_generate_through_parallelize_from_a_saved_directory(tmp_path, family):
    """The one-liner over 2 ranks from a ``save_pretrained`` directory: greedy and beam tokens as the
    unsplit model's (ProphetNet: per-rank config copies)."""
    spec = model_spec(family, FAMILIES[family].generator, seed=7)
    reference = spec.build()
    reference.save_pretrained(tmp_path)
    served = tpcore.parallelize(str(tmp_path), num_gpus=2, backend="gloo")
    try:
        for num_beams in (1, 4):
            inputs = generate_inputs(family, [6, 3, 5], 6, seed=8, num_beams=num_beams)
            assert torch.equal(served.generate(**inputs), reference.generate(**inputs))
    finally:
        served.deparallelize()


@pytest.mark.slow
@pytest.mark.parametrize("name", [family + head for family, head in CASES])
def test_tpcore_check_passes_from_the_default_config(rank_pools, capsys, name):
    """``tpcore check CLASS`` on the default config shrunk (the family's own special ids, sizes, options)."""
    assert run_check(name, (2, 3), pools=rank_pools) == 0, capsys.readouterr().out


def test_tied_embeddings_and_lm_head_are_split_over_the_vocabulary_together():
    """BART's ``shared``, ``encoder.embed_tokens``, ``decoder.embed_tokens`` and ``lm_head`` hold one
    table: all four become vocabulary parallel, cut by the same rows; ``final_logits_bias`` stays whole."""
    model = model_spec("Bart", "ForConditionalGeneration").build()
    plan = tpcore.TensorReplacer(model, None, False, 3, rank=0).split_plan()
    tied = ["model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens", "lm_head"]
    assert sorted(plan.vocab) == sorted(tied) and set(plan.vocab.values()) == {VOCAB}
    assert plan.shard_shape("model.shared.weight", 0) == (22, 24)  # ceil(64 / 3) rows
    assert "final_logits_bias" not in plan.splits


def test_heads_the_ranks_do_not_divide_are_dealt_whole_and_fewer_heads_than_ranks_are_refused():
    plan = tpcore.TensorReplacer(model_spec("Bart", "Model").build(), None, False, 4, rank=0).split_plan()
    assert plan.attributes["encoder.layers.0.self_attn.num_heads"] == tpcore.PerRank((2, 2, 1, 1))
    assert plan.attributes["decoder.layers.1.encoder_attn.num_heads"] == 1
    assert plan.shard_shape("encoder.layers.0.self_attn.q_proj.weight", 3) == (4, 24)  # one head of 4
    with pytest.raises(tpcore.ShardingError, match=r"BartModel over 5 ranks.*heads are fewer"):
        tpcore.TensorReplacer(model_spec("Bart", "Model").build(), None, False, 5, rank=0).validate()


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=st.sampled_from(CASES),
    sizes=split_sizes(world_sizes=(2, 3, 4), uneven=True, head_dims=(2, 4), intermediate_per_rank=(1, 8)),
    decoder_heads=st.integers(1, 3),
    lengths=st.lists(st.integers(2, 9), min_size=1, max_size=3),
    seed=seeds(),
)
def test_random_configs_match_unsplit(rank_pools, case, sizes, decoder_heads, lengths, seed):
    """Random head counts, widths and depths over 2-4 ranks, mostly uneven, the decoder's heads another
    count (``decoder_heads`` per rank)."""
    family, head = case
    decoder = decoder_heads * sizes.world_size
    if sizes.hidden % decoder:
        decoder = sizes.heads
    spec = model_spec(
        family,
        head,
        seed,
        encoder_heads=sizes.heads,
        decoder_heads=decoder,
        hidden=sizes.hidden,
        ffn=sizes.intermediate,
        layers=sizes.layers,
    )
    seq = max(FAMILIES[family].encoder_seq, max(lengths))
    inputs = head_inputs(family, head, [min(n, seq) for n in lengths], seq, seed=seed % 97)
    report = check_equivalence(spec, inputs, world_sizes=(sizes.world_size,), pools=rank_pools)
    assert report[sizes.world_size]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(HALF_PRECISION_RTOL), ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("family", ["Bart", "Marian", "M2M100", "LED", "ProphetNet"])
def test_cuda_nccl_matches_unsplit(nccl_rank_pools, family, world_size, dtype):
    """Decoder logits on CUDA with NCCL in half precision; world sizes beyond the GPUs are skipped."""
    visible = torch.cuda.device_count()
    if visible < world_size:
        pytest.skip(f"world size {world_size} needs {world_size} GPUs; this machine has {visible}")
    head = FAMILIES[family].generator
    inputs = head_inputs(family, head, [7, 3, 5], 7, seed=2)
    report = check_equivalence(
        model_spec(family, head),
        inputs,
        world_sizes=(world_size,),
        pools=nccl_rank_pools,
        rtol=HALF_PRECISION_RTOL[dtype],
        dtype=dtype,
    )
    assert report[world_size]
