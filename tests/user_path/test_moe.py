"""Mixture-of-experts decoders split with their experts tensor-parallel and their routers whole.

Mixtral and Qwen3-MoE follow their tp plans; Qwen2-MoE (its shared expert split too), DeepSeek-V3
(multi-head latent attention split by heads) and GPT-OSS (attention sinks cut with their heads; experts
with biases, the down projection's held by rank 0 alone) use tp-gpt's policies. GPT-OSS starts its
biases at zero, so its models draw them at random (``ModelSpec.bias_std``). Six query heads
are not divided by 4 ranks, nor an expert intermediate size of 20 by 3 (nor into the 8 features per
rank that make grouped-mm rows of a multiple of 16 bytes), so the matrix covers uneven deals of both: a rank
whose share breaks those rows runs transformers' eager experts (the same sums).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import tpcore
from tpcore.load.checkpoint import Checkpoint
from tpcore.load.skeleton import empty_model
from tpcore.plan import plan_for
from tpcore.testing import ModelSpec, check_equivalence, compare_outputs
from tpcore.tools.check import run_check

SIZES = dict(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, pad_token_id=0)
EXPERTS = dict(moe_intermediate_size=20, num_experts_per_tok=2)
CONFIGS = {
    "mixtral": ("MixtralForCausalLM", dict(num_key_value_heads=3, intermediate_size=20, num_local_experts=4)),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        dict(
            num_key_value_heads=3,
            intermediate_size=40,
            shared_expert_intermediate_size=29,
            num_experts=4,
            mlp_only_layers=[0],
            **EXPERTS,
        ),
    ),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_key_value_heads=3, head_dim=8, num_experts=4, **EXPERTS)),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=6,
            intermediate_size=38,
            n_routed_experts=4,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 sparse
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_rope_head_dim=4,
            qk_nope_head_dim=6,
            v_head_dim=5,
            **EXPERTS,
        ),
    ),
    "gpt_oss": (
        "GptOssForCausalLM",
        dict(num_key_value_heads=3, head_dim=8, intermediate_size=20, num_local_experts=4, num_experts_per_tok=2),
    ),
}
#: models whose experts keep their size in ``intermediate_size`` and cut ``down_proj (E, I, H)`` along dim 1
STORED_IN_BY_OUT = {"gpt_oss"}
#: model -> (tensors every rank holds whole, tensors split over the ranks), in the sparse layer 1
WHOLE_AND_SPLIT = {
    "mixtral": (["mlp.gate.weight"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj.weight"]),
    "qwen2_moe": (
        ["mlp.gate.weight", "mlp.shared_expert_gate.weight"],
        ["mlp.experts.gate_up_proj", "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.down_proj.weight"],
    ),
    "qwen3_moe": (["mlp.gate.weight", "self_attn.q_norm.weight"], ["mlp.experts.down_proj", "self_attn.k_proj.weight"]),
    "deepseek_v3": (
        ["mlp.gate.weight", "self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"],
        ["self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.experts.down_proj"],
    ),
    "gpt_oss": (
        ["mlp.router.weight", "mlp.router.bias", "self_attn.o_proj.bias"],
        ["mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj", "self_attn.sinks"],
    ),
}


def config_of(name: str, **changes):
    model_class, sizes = CONFIGS[name]
    return getattr(transformers, model_class).config_class(**{**SIZES, **sizes, **changes})


def spec(name: str, seed: int = 1, **changes) -> ModelSpec:
    bias_std = 0.5 if name in STORED_IN_BY_OUT else 0.0  # GPT-OSS starts its biases at zero
    return ModelSpec(getattr(transformers, CONFIGS[name][0]), config_of(name, **changes), seed, bias_std)


def batch(seed: int = 2) -> dict:
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_experts_are_cut_along_their_intermediate_size_and_the_router_stays_whole(name):
    model = spec(name).build()
    plan = tpcore.TensorReplacer(model, None, False, 3, rank=0).split_plan()
    whole, split = WHOLE_AND_SPLIT[name]
    assert not [path for path in whole if f"model.layers.1.{path}" in plan.splits]
    assert [path for path in split if f"model.layers.1.{path}" in plan.splits] == split
    down = "model.layers.1.mlp.experts.down_proj"
    in_by_out = name in STORED_IN_BY_OUT
    features = [plan.shard_shape(down, rank)[1 if in_by_out else 2] for rank in range(3)]
    assert features == [7, 7, 6]  # dealt near-equally
    size = "intermediate_size" if in_by_out else "intermediate_dim"
    assert plan.attributes[f"model.layers.1.mlp.experts.{size}"] == tpcore.PerRank(tuple(features))
    # rows of 7 features are not the 16-byte multiples grouped-mm kernels need: the ranks run the eager experts
    assert plan.attributes["model.layers.1.mlp.experts.config"]._experts_implementation == "eager"
    assert model.config._experts_implementation == "grouped_mm"


def test_deepseek_v3_latent_attention_splits_by_heads_and_matches_unsplit(rank_pools):
    """Five heads over 2 ranks (3 + 2), each head's rows of q_b_proj and kv_b_proj together."""
    model_spec = ModelSpec(transformers.DeepseekV3ForCausalLM, config_of("deepseek_v3", num_attention_heads=5))
    model = model_spec.build()
    plan = plan_for(model, tpcore.AutoPolicy().get_policy(model), 2)
    rows = [plan.shard_shape("model.layers.0.self_attn.kv_b_proj.weight", rank)[0] for rank in range(2)]
    assert rows == [3 * (6 + 5), 2 * (6 + 5)]  # heads * (qk_nope_head_dim + v_head_dim)
    report = check_equivalence(model_spec, batch(), world_sizes=(2,), pools=rank_pools)
    assert report[2]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_logits_equal_the_unsplit_models_at_one_to_four_ranks(rank_pools, name):
    report = check_equivalence(spec(name), batch(), world_sizes=(1, 2, 3, 4), pools=rank_pools)
    assert sorted(report) == [1, 2, 3, 4]


#: each model's config field for the number of routed experts and for the size of one expert
EXPERT_FIELDS = {
    "mixtral": ("num_local_experts", "intermediate_size"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size"),
    "gpt_oss": ("num_local_experts", "intermediate_size"),
}


@st.composite
def moe_cases(draw):
    """A model, a world size of 1-4 and random sizes: query heads the ranks mostly do not divide (in
    key/value groups; DeepSeek-V3's latent attention has none), 2 or 4 experts (DeepSeek-V3: 4) of 1 or 2
    per token, an expert size of a few features per rank, mostly dealt unevenly."""
    name = draw(st.sampled_from(list(CONFIGS)))
    world_size = draw(st.sampled_from([1, 2, 3, 4]))
    heads = draw(st.integers(world_size, 2 * world_size + 1))
    kv_heads = (
        heads if name == "deepseek_v3" else draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    )
    experts_field, size_field = EXPERT_FIELDS[name]
    changes = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": 8 * heads,
        experts_field: 4 if name == "deepseek_v3" else draw(st.sampled_from([2, 4])),  # 2 groups of top-2 experts
        "num_experts_per_tok": draw(st.integers(1, 2)),
        # 16-byte rows for the unsplit model's grouped-mm kernels (4 fp32 features); the shares need not be
        size_field: 4 * draw(st.integers(max(1, world_size // 2), 2 * world_size)),
    }
    if name in ("qwen3_moe", "gpt_oss"):
        changes["head_dim"] = 8
    return name, world_size, changes, draw(st.integers(0, 2**16))


@pytest.mark.slow
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=moe_cases())
def test_random_moe_configs_match_unsplit(rank_pools, case):
    name, world_size, changes, seed = case
    report = check_equivalence(spec(name, seed, **changes), batch(seed), world_sizes=(world_size,), pools=rank_pools)
    assert report[world_size]


GENERATION = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=3),
    "sampling": dict(do_sample=True, top_k=20, temperature=0.9),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_beam_and_seeded_sampling_give_the_unsplit_models_32_tokens(rank_pools, name):
    for mode, options in GENERATION.items():
        inputs = {**batch(), **options, "max_new_tokens": 32, "min_new_tokens": 32}
        seed = 7 if options["do_sample"] else None
        options = dict(world_sizes=(3,), pools=rank_pools, method="generate", rtol=0, seed=seed)
        report = check_equivalence(spec(name), inputs, **options)
        assert report[3], mode


def saved(tmp_path, name: str):
    spec(name, seed=0).build().save_pretrained(tmp_path)
    return tmp_path


class ByteCount:
    """Wraps a safetensors file of a checkpoint and adds up the bytes of every tensor read from it."""

    def __init__(self, handle, counts: list):
        self.handle, self.counts = handle, counts

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def read(self, *args):
        tensor = self.handle.read(*args)
        self.counts.append(tensor.nbytes)
        return tensor


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_a_rank_reads_from_the_per_expert_checkpoint_only_the_bytes_it_holds(tmp_path, monkeypatch, name):
    directory = saved(tmp_path, name)
    with safe_open(directory / "model.safetensors", framework="pt") as file:
        keys = list(file.keys())
        whole = sum(file.get_slice(key)[:].nbytes for key in keys)
    assert ".experts.0." in " ".join(keys) and "experts.gate_up_proj" not in " ".join(keys)  # one tensor per expert
    counts: list = []
    handle = Checkpoint._handle
    monkeypatch.setattr(Checkpoint, "_handle", lambda self, *args: ByteCount(handle(self, *args), counts))
    world_size = 3
    checkpoint = Checkpoint(directory)
    model = empty_model(checkpoint.config())
    plan = tpcore.TensorReplacer(model, None, False, world_size, rank=0).split_plan()
    reads = checkpoint.reads(model, plan.splits)
    experts = [read for read in reads if ".experts." in read.name]
    assert experts and all(read.split is not None for read in experts)  # gate_up_proj, down_proj of each layer
    for rank in range(world_size):
        total = 0
        for read in reads:
            counts.clear()
            held = checkpoint.read_tensor(read, rank, world_size).nbytes
            if read in experts:  # its pieces of every expert's stored tensors, and nothing more
                assert sum(counts) == held < math.prod(plan.shapes[read.name]) * 4, read.name
            assert sum(counts) <= held, read.name  # a vocabulary share may be padded with zeros
            total += sum(counts)
        assert total < whole * 0.6, f"rank {rank} read {total} of {whole} bytes"


@pytest.mark.slow  # its own 3-rank world: the point is parallelize() on a saved directory
@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_parallelize_a_saved_checkpoint_generates_the_from_pretrained_models_tokens(tmp_path, name):
    directory = saved(tmp_path, name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    inputs = {**batch(), "max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False}
    with torch.inference_mode():
        want = reference.generate(**inputs)
        logits = reference(**batch()).logits
    model = tpcore.parallelize(directory, num_gpus=3, backend="gloo")
    try:
        assert torch.equal(model.generate(**inputs), want)
        compare_outputs(logits, model(**batch()).logits)
    finally:
        model.deparallelize()


@pytest.mark.slow
@pytest.mark.parametrize("model_class", [CONFIGS[name][0] for name in CONFIGS])
def test_tpcore_check_passes_at_two_and_three_ranks(rank_pools, capsys, model_class):
    assert run_check(model_class, [2, 3], pools=rank_pools) == 0
    out = capsys.readouterr().out
    assert "2 ranks: PASS" in out and "3 ranks: PASS" in out
