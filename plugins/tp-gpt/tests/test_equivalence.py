"""A decoder-only LM split over 1-4 gloo ranks gives the unsplit model's logits and tokens.

``test_every_head`` runs each architecture's first head at world sizes 1-4 (the quick core) and
every other head over 2 and 3 ranks; the generation tests compare greedy and beam-search tokens of
every architecture, and seeded-sampling tokens of GPT-2 and Llama (ranks stay in step whatever the
model), 32 new tokens for a left-padded batch, through ``ParallelEngine`` on rank pools and through
``tpcore.parallelize()``; the hypothesis property draws random small configs (strategies of
``tpcore.testing``), including grouped KV heads fewer than the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    compare_outputs,
    padded_batch,
    padded_batches,
    seeds,
    split_sizes,
    with_choices,
)

VOCAB = 64
HEADS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


@dataclass(frozen=True)
class Architecture:
    config: str
    #: config keywords for (hidden, heads, layers, intermediate); intermediate may be None
    names: tuple[str, str, str, str | None]
    heads: tuple[str, ...] = HEADS
    causal_lm: str = "ForCausalLM"
    #: the config keyword of grouped key/value heads, if any
    kv_heads: str | None = None
    extra: dict = field(default_factory=dict)
    #: the transformers class prefix (``FalconForCausalLM``), where the table's name is a variant's
    #: (a variant's first head is in the slow matrix; its family's stays in the quick core)
    model: str | None = None

    def make_config(self, hidden, heads, layers, intermediate, kv_heads=None, **overrides):
        hidden_name, heads_name, layers_name, intermediate_name = self.names
        values = {hidden_name: hidden, heads_name: heads, layers_name: layers, "vocab_size": VOCAB}
        if intermediate_name:
            values[intermediate_name] = intermediate
        if self.kv_heads:
            values[self.kv_heads] = kv_heads or heads
        special = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None}
        return getattr(transformers, self.config)(**values, **special, **self.extra, **overrides)


LLAMA_NAMES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
FALCON_NAMES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "ffn_hidden_size")
BIGCODE_NAMES = ("n_embd", "n_head", "n_layer", "n_inner")
KV = "num_key_value_heads"
ARCHITECTURES = {
    "GPT2": Architecture(
        "GPT2Config",
        ("n_embd", "n_head", "n_layer", "n_inner"),
        ("Model", "LMHeadModel", *HEADS[2:], "DoubleHeadsModel"),
        causal_lm="LMHeadModel",
        extra={"n_positions": 128},
    ),
    "GPTNeo": Architecture(
        "GPTNeoConfig",
        ("hidden_size", "num_heads", "num_layers", "intermediate_size"),
        extra={"max_position_embeddings": 128, "window_size": 5},
    ),
    "GPTJ": Architecture(
        "GPTJConfig", ("n_embd", "n_head", "n_layer", "n_inner"), HEADS[:3] + HEADS[4:], extra={"rotary_dim": 2}
    ),
    "GPTNeoX": Architecture("GPTNeoXConfig", LLAMA_NAMES, extra={"rotary_pct": 0.5}),
    "OPT": Architecture(
        "OPTConfig",
        ("hidden_size", "num_attention_heads", "num_hidden_layers", "ffn_dim"),
        HEADS[:3] + HEADS[4:],
        extra={"max_position_embeddings": 128},
    ),
    "Bloom": Architecture("BloomConfig", ("hidden_size", "n_head", "n_layer", None)),
    "Llama": Architecture("LlamaConfig", LLAMA_NAMES, kv_heads=KV),
    "Mistral": Architecture("MistralConfig", LLAMA_NAMES, kv_heads=KV, extra={"sliding_window": 6}),
    "Qwen2": Architecture("Qwen2Config", LLAMA_NAMES, kv_heads=KV),
    # Falcon's three query_key_value layouts: grouped KV (new decoder architecture, parallel attention
    # with two norms), multi-query (Falcon-7B: [q | k | v], parallel attention with one norm), per-head
    # q|k|v with ALiBi and biases (Falcon-RW: sequential attention and MLP)
    "Falcon": Architecture(
        "FalconConfig", FALCON_NAMES, kv_heads="num_kv_heads", extra={"new_decoder_architecture": True}
    ),
    "FalconMultiQuery": Architecture(
        "FalconConfig", FALCON_NAMES, model="Falcon", extra={"multi_query": True, "parallel_attn": True}
    ),
    "FalconALiBi": Architecture(
        "FalconConfig",
        FALCON_NAMES,
        model="Falcon",
        extra={"multi_query": False, "parallel_attn": False, "alibi": True, "bias": True},
    ),
    "GPTBigCode": Architecture("GPTBigCodeConfig", BIGCODE_NAMES, HEADS[:4], extra={"n_positions": 128}),
    "GPTBigCodeMultiHead": Architecture(
        "GPTBigCodeConfig",
        BIGCODE_NAMES,
        HEADS[:4],
        model="GPTBigCode",
        extra={"n_positions": 128, "multi_query": False},
    ),
    # StableLM: per-head q/k norms and the parallel residual, partial rotary (a quarter by default)
    "StableLm": Architecture(
        "StableLmConfig", LLAMA_NAMES, HEADS[:4], kv_heads=KV, extra={"qk_layernorm": True, "use_qkv_bias": True}
    ),
    "StableLmParallel": Architecture(
        "StableLmConfig",
        LLAMA_NAMES,
        HEADS[:4],
        kv_heads=KV,
        model="StableLm",
        extra={"use_parallel_residual": True, "partial_rotary_factor": 0.5},
    ),
    "OpenAIGPT": Architecture(
        "OpenAIGPTConfig",
        ("n_embd", "n_head", "n_layer", None),
        ("Model", "LMHeadModel", "ForSequenceClassification", "DoubleHeadsModel"),
        causal_lm="LMHeadModel",
        extra={"n_positions": 128},
    ),
    "CTRL": Architecture(
        "CTRLConfig",
        ("n_embd", "n_head", "n_layer", "dff"),
        ("Model", "LMHeadModel", "ForSequenceClassification"),
        causal_lm="LMHeadModel",
        extra={"n_positions": 128},
    ),
}
CASES = [(arch, head) for arch, spec in ARCHITECTURES.items() for head in spec.heads]


def model_spec(arch, head, hidden=48, heads=12, layers=2, intermediate=96, kv_heads=None, seed=1) -> ModelSpec:
    architecture = ARCHITECTURES[arch]
    overrides = {"num_labels": 2}
    if arch == "GPTNeo":  # one attention type per layer: alternate global and local windows
        overrides["attention_types"] = (
            [[["global", "local"], layers // 2]] if layers % 2 == 0 else [[["local"], layers]]
        )
    config = architecture.make_config(hidden, heads, layers, intermediate, kv_heads, **overrides)
    return ModelSpec(getattr(transformers, (architecture.model or arch) + head), config, seed)


def left_padded(lengths: list[int], seq: int, seed: int) -> dict:
    """Token ids with left padding (as for generation): row ``i`` ends with ``lengths[i]`` real tokens."""
    return padded_batch(lengths, seq, VOCAB, seed, padding="left")


def shaped_for(arch: str, head: str, inputs: dict) -> dict:
    """``inputs`` shaped for ``head`` (``DoubleHeadsModel`` scores two choices per row). OpenAI-GPT's model
    flattens ``(batch, choices, seq)`` ids but not the mask, so it gets the mask flat, one row per choice."""
    if head != "DoubleHeadsModel":
        return inputs
    shaped = with_choices(inputs)
    if arch == "OpenAIGPT":
        shaped["attention_mask"] = shaped["attention_mask"].flatten(0, 1)
    return shaped


def every_head_cases():
    """``(arch, head, world sizes)``: the first head of each architecture over 1-4 ranks (slow for a
    variant of a family), the others (slow) over 2 and 3."""
    for arch, architecture in ARCHITECTURES.items():
        first, *others = architecture.heads
        variant = [pytest.mark.slow] if architecture.model else []
        yield pytest.param(arch, first, (1, 2, 3, 4), id=arch + first, marks=variant)
        for head in others:
            yield pytest.param(arch, head, (2, 3), id=arch + head, marks=pytest.mark.slow)


@pytest.mark.parametrize(("arch", "head", "world_sizes"), list(every_head_cases()))
def test_every_head(rank_pools, arch, head, world_sizes):
    """12 query heads (1 KV head where grouped) over each world size; padded batch of 3."""
    spec = model_spec(arch, head, kv_heads=1)
    inputs = shaped_for(arch, head, left_padded([7, 3, 5], seq=7, seed=2))
    if head != "DoubleHeadsModel":
        inputs["output_hidden_states"] = True
    report = check_equivalence(spec, inputs, world_sizes=world_sizes, pools=rank_pools)
    assert sorted(report) == list(world_sizes)


GENERATION = {
    "greedy": {"do_sample": False},
    "beam": {"do_sample": False, "num_beams": 3},
    "sampling": {"do_sample": True, "top_k": 0},
}


def generation_cases():
    """Greedy and beam search for every architecture (the cache is each model's own); sampling, whose
    point is that the ranks draw in step, for GPT-2 and Llama (slow, as are all but greedy GPT-2 and Llama)."""
    for arch in ARCHITECTURES:
        for mode in GENERATION:
            if mode == "sampling" and arch not in ("GPT2", "Llama"):
                continue
            core = mode == "greedy" and arch in ("GPT2", "Llama")
            yield pytest.param(arch, mode, id=f"{arch}-{mode}", marks=[] if core else [pytest.mark.slow])


@pytest.mark.parametrize(("arch", "mode"), list(generation_cases()))
def test_generate_tokens_match_through_the_engine(rank_pools, arch, mode):
    """32 new tokens for a left-padded batch: identical to the unsplit model's, on every rank. 6 heads
    (3 key/value heads) are dealt unevenly over 4 ranks (and, grouped by KV head, over 2: 4 + 2 and 2 + 1)."""
    architecture = ARCHITECTURES[arch]
    spec = model_spec(arch, architecture.causal_lm, heads=6, kv_heads=3)
    inputs = {**left_padded([5, 2], seq=5, seed=3), "max_new_tokens": 32, **GENERATION[mode]}
    report = check_equivalence(spec, inputs, world_sizes=(2, 4), pools=rank_pools, method="generate", rtol=0, seed=11)
    assert all(diff == 0 for diffs in report.values() for diff in diffs.values())


@pytest.fixture(scope="module")
def served_llama():
    """A Llama with 8 query and 2 KV heads served by 4 ranks (KV heads replicated) via parallelize()."""
    spec = model_spec("Llama", "ForCausalLM", heads=8, kv_heads=2, seed=5)
    reference = spec.build()
    served = tpcore.parallelize(spec.build(), num_gpus=4, backend="gloo")
    yield reference, served
    served.deparallelize()


@pytest.mark.slow  # a 4-rank world of its own (GPT-2 through parallelize() stays in the quick core)
@pytest.mark.parametrize("mode", list(GENERATION))
def test_generate_tokens_match_through_parallelize(served_llama, mode):
    reference, served = served_llama
    inputs = {**left_padded([6, 3, 4], seq=6, seed=4), "max_new_tokens": 32, **GENERATION[mode]}
    torch.manual_seed(21)
    expected = reference.generate(**inputs)
    torch.manual_seed(21)
    assert torch.equal(served.generate(**inputs), expected)
    compare_outputs(reference(**left_padded([6, 3], seq=6, seed=5)), served(**left_padded([6, 3], seq=6, seed=5)))


#: one of each layout the one-liner's skeletons carry: Conv1D (GPT-2), one key/value head replicated
#: (Llama), config-chosen layouts (Falcon), multi-query (GPT-BigCode), interleaved q|k|v with ALiBi
#: (BLOOM); the engine tests run every architecture, the same plan on the same rank code
THROUGH_PARALLELIZE = ("GPT2", "Llama", "Falcon", "GPTBigCode", "Bloom")


@pytest.mark.slow  # a world per architecture (tests/user_path/test_parallelize.py runs the one-liner quickly)
@pytest.mark.parametrize("arch", THROUGH_PARALLELIZE)
def test_layouts_through_parallelize(arch):
    """The one-liner on 2 ranks: logits within tolerance and 12 greedy tokens identical; 5 heads
    (Llama: one key/value head) are dealt 3 and 2, each rank's skeleton shaped for its own share."""
    spec = model_spec(arch, ARCHITECTURES[arch].causal_lm, hidden=40, heads=5, kv_heads=1, seed=7)
    reference = spec.build()
    inputs = left_padded([5, 3], seq=5, seed=8)
    with torch.inference_mode():
        expected_logits = reference(**inputs)
    expected_tokens = reference.generate(**inputs, max_new_tokens=12, do_sample=False)
    served = tpcore.parallelize(spec.build(), num_gpus=2, backend="gloo")
    try:
        compare_outputs(expected_logits, served(**inputs))
        assert torch.equal(served.generate(**inputs, max_new_tokens=12, do_sample=False), expected_tokens)
    finally:
        served.deparallelize()


@pytest.mark.slow  # a world of 5 ranks
def test_gpt2_xl_head_count_splits_over_five_ranks_evenly_and_over_two_and_four_unevenly(rank_pools):
    """GPT-2 XL has 25 heads: 5 ranks hold 5 each; 2 ranks hold 13 and 12, 4 ranks 7, 6, 6, 6."""
    spec = model_spec("GPT2", "LMHeadModel", hidden=50, heads=25, layers=1, intermediate=100)
    inputs = left_padded([4, 2], seq=4, seed=6)
    assert sorted(check_equivalence(spec, inputs, world_sizes=(2, 4, 5), pools=rank_pools)) == [2, 4, 5]
    plan = tpcore.TensorReplacer(spec.build(), None, False, 2, rank=0).split_plan()
    assert plan.attributes["transformer.h.0.attn.num_heads"] == tpcore.PerRank((13, 12))
    assert [plan.shard_shape("transformer.h.0.attn.c_attn.weight", rank) for rank in (0, 1)] == [(50, 78), (50, 72)]


def test_smollm2_head_counts_split_over_two_ranks_with_each_kv_head_beside_its_query_heads(rank_pools):
    """SmolLM2-135M's 9 query and 3 key/value heads over 2 ranks: 6 + 2 and 3 + 1; greedy tokens as unsplit."""
    spec = model_spec("Llama", "ForCausalLM", hidden=36, heads=9, layers=2, intermediate=37, kv_heads=3)
    inputs = left_padded([5, 3], seq=5, seed=3)
    assert check_equivalence(spec, inputs, world_sizes=(2,), pools=rank_pools)[2]
    generation = {**inputs, "max_new_tokens": 8, "do_sample": False}
    report = check_equivalence(spec, generation, world_sizes=(2,), pools=rank_pools, method="generate", rtol=0)
    assert all(diff == 0 for diff in report[2].values())
    plan = tpcore.TensorReplacer(spec.build(), None, False, 2, rank=0).split_plan()
    assert plan.attributes["model.layers.0.self_attn.num_key_value_groups"] == 3
    assert [plan.shard_shape("model.layers.0.self_attn.q_proj.weight", rank) for rank in (0, 1)] == [(24, 36), (12, 36)]
    assert [plan.shard_shape("model.layers.0.self_attn.k_proj.weight", rank) for rank in (0, 1)] == [(8, 36), (4, 36)]


def test_falcon_7b_multi_query_heads_split_over_world_sizes_up_to_71():
    """Falcon-7B's 71 query heads and one key/value head: the plan holds up to 71 ranks (the k and v head
    on every rank), 72 are refused; over 2 ranks ``query_key_value`` holds 36 + 2 and 35 + 2 heads."""
    spec = model_spec("FalconMultiQuery", "ForCausalLM", hidden=142, heads=71, layers=1, intermediate=142)
    model = spec.build()
    for world_size in (3, 8, 70, 71):
        tpcore.TensorReplacer(model, None, False, world_size, rank=0).validate()
    with pytest.raises(tpcore.ShardingError, match="dense.*heads are fewer than the ranks"):
        tpcore.TensorReplacer(model, None, False, 72, rank=0).validate()
    plan = tpcore.TensorReplacer(model, None, False, 2, rank=0).split_plan()
    qkv = "transformer.h.0.self_attention.query_key_value.weight"
    assert [plan.shard_shape(qkv, rank) for rank in (0, 1)] == [(76, 142), (74, 142)]
    assert plan.attributes["transformer.h.0.self_attention.num_heads"] == tpcore.PerRank((36, 35))


@pytest.mark.parametrize(("heads", "kv_heads", "world_size"), [(2, 2, 3), (4, 1, 5)])
def test_fewer_query_heads_than_ranks_are_refused_naming_the_output_projection(heads, kv_heads, world_size):
    spec = model_spec("Llama", "ForCausalLM", hidden=4 * heads, heads=heads, kv_heads=kv_heads)
    with pytest.raises(tpcore.ShardingError, match=r"o_proj.*heads are fewer than the ranks"):
        tpcore.TensorReplacer(spec.build(), None, False, world_size, rank=0).validate()


@pytest.mark.slow
@settings(max_examples=95, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=st.sampled_from(CASES),
    sizes=split_sizes(world_sizes=(2, 3, 4, 5), grouped_kv=True, uneven=True),
    inputs=padded_batches(VOCAB, batch=(1, 3), seq=(1, 9), padding="left"),
    seed=seeds(),
)
def test_random_configs_match_unsplit(rank_pools, case, sizes, inputs, seed):
    """Random configs over 2-5 ranks, head counts and sizes mostly not divided by them (world size 1 is
    ``test_every_head``'s)."""
    arch, head = case
    spec = model_spec(arch, head, sizes.hidden, sizes.heads, sizes.layers, sizes.intermediate, sizes.kv_heads, seed)
    report = check_equivalence(spec, shaped_for(arch, head, inputs), world_sizes=(sizes.world_size,), pools=rank_pools)
    assert report[sizes.world_size]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(HALF_PRECISION_RTOL), ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_cuda_nccl_matches_unsplit(nccl_rank_pools, arch, world_size, dtype):
    """Logits on CUDA with NCCL in half precision; world sizes beyond the visible GPUs are skipped."""
    visible = torch.cuda.device_count()
    if visible < world_size:
        pytest.skip(f"world size {world_size} needs {world_size} GPUs; this machine has {visible}")
    spec = model_spec(arch, ARCHITECTURES[arch].causal_lm, kv_heads=1)
    inputs = left_padded([7, 3, 5], seq=7, seed=2)
    report = check_equivalence(
        spec, inputs, world_sizes=(world_size,), pools=nccl_rank_pools, rtol=HALF_PRECISION_RTOL[dtype], dtype=dtype
    )
    assert report[world_size]
