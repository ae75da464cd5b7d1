"""MXFP4 checkpoints (gpt-oss's experts) on the user's path: a directory split by ``tpcore.parallelize(dir)`` and by
the SPMD engine gives transformers' outputs for it (transformers dequantizes it at load on a CPU; each rank keeps its
share of every expert's codes and dequantizes the routed experts per forward), at an even and an uneven deal of the
32-value blocks; the object transformers loads (dequantized) splits as a plain model; a saved split writes the
format's own tensors back."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import transformers
from quantized_checks import IDS, check_engine_reads, check_largest_rank
from safetensors.torch import load_file, save_file

import tpcore
from tpcore import ShardingError
from tpcore.load.checkpoint import Checkpoint
from tpcore.load.quantized_formats import checkpoint_skeleton
from tpcore.parallel.mxfp4_experts import FP4_VALUES, dequantize_mxfp4
from tpcore.plan import plan_for
from tpcore.testing import ModelSpec, compare_outputs
from tpcore.testing.quantized_checkpoints import mxfp4, save_mxfp4
from tpcore.tools.cli import main

#: 128 intermediate features are 4 blocks of 32: 2 + 2 at 2 ranks, 2 + 1 + 1 at 3; 6 query heads in 2 key/value groups
CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    num_attention_heads=6,
    num_key_value_heads=2,
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=64,
    pad_token_id=0,
)
EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """A tiny gpt-oss (its zero-initialised biases drawn at random) saved in MXFP4, the model it was made from, and
    transformers' model loaded from it."""
    original = ModelSpec(transformers.GptOssForCausalLM, transformers.GptOssConfig(**CONFIG), 3, bias_std=0.5).build()
    directory = save_mxfp4(original, tmp_path_factory.mktemp("mxfp4") / "model")
    reference = transformers.GptOssForCausalLM.from_pretrained(directory).eval()
    return directory, original, reference


@pytest.mark.parametrize("seed", range(4))
def test_the_codes_written_dequantize_to_the_nearest_e2m1_of_each_block(seed):
    weight = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed - 2)
    blocks, scales = mxfp4(weight)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2) and blocks.dtype == scales.dtype == torch.uint8
    values = dequantize_mxfp4(blocks, scales, torch.float32)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    grid = torch.tensor(FP4_VALUES) * scale.unsqueeze(-1)  # every value each weight's block can hold
    nearest = grid.gather(-1, (grid - weight.unsqueeze(-1)).abs().argmin(-1, keepdim=True)).squeeze(-1)
    assert torch.equal((values - weight).abs(), (nearest - weight).abs())
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), values.bfloat16())  # exact in bfloat16


def test_the_plan_cuts_the_codes_in_whole_blocks_and_counts_them_as_stored(mxfp4_dir, capsys, no_process_starts):
    directory, _, _ = mxfp4_dir
    assert main(["plugins", "--model", str(directory), "--world-size", "2"]) == 0
    shown = capsys.readouterr().out
    stored = sum(t.numel() * t.element_size() for t in load_file(directory / "model.safetensors").values())
    per_rank, whole = (float(n) for n in re.search(r"per rank ([\d.]+) KiB of ([\d.]+) KiB", shown).groups())
    assert abs(whole * 1024 - stored) < 0.01 * stored and per_rank <= 0.55 * whole  # uint8 codes, as stored
    checkpoint = Checkpoint(directory)
    skeleton = checkpoint_skeleton(checkpoint, checkpoint.config())
    plan = plan_for(skeleton, tpcore.AutoPolicy().get_policy(skeleton), 3)
    blocks = [plan.shard_shape(f"{EXPERTS}.down_proj", rank) for rank in range(3)]
    assert blocks == [(4, 64, 2, 16), (4, 64, 1, 16), (4, 64, 1, 16)]  # 4 blocks of 32 intermediate features
    rows = [plan.shard_shape(f"{EXPERTS}.gate_up_proj", rank)[1] for rank in range(3)]
    assert rows == [128, 64, 64]  # the same features' gate and up rows: 64, 32 and 32 pairs
    assert [plan.shard_shape(f"{EXPERTS}.down_proj_scales", rank)[2] for rank in range(3)] == [2, 1, 1]
    assert [plan.shard_shape(f"{EXPERTS}.gate_up_proj_bias", rank)[1] for rank in range(3)] == [128, 64, 64]
    assert plan.splits[f"{EXPERTS}.down_proj_bias"].summand  # rank 0 adds it, once
    assert plan.dtypes[f"{EXPERTS}.gate_up_proj"] == plan.dtypes[f"{EXPERTS}.gate_up_proj_scales"] == torch.uint8


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_mxfp4_directory_splits_and_gives_transformers_outputs(mxfp4_dir, world_size):
    directory, original, reference = mxfp4_dir
    with torch.no_grad():
        expected = reference(input_ids=IDS)
        tokens = reference.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert not torch.allclose(original(input_ids=IDS).logits, expected.logits, atol=1e-3)  # it is quantized
    model = tpcore.parallelize(str(directory), num_gpus=world_size)
    try:
        compare_outputs(expected, model(input_ids=IDS))
        assert torch.equal(model.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False), tokens)
        held = model._tpcore_handle.pool.run(expert_tensors)[0]
        assert held["class"] == "RowParallelMxfp4GptOssExperts"
        assert held["gate_up_proj"] == held["down_proj_scales"] == "torch.uint8"
        check_largest_rank(model._tpcore_handle.plan, world_size, at_three=0.45)
    except BaseException:
        model.deparallelize()
        raise
    whole = model.deparallelize()  # the gathered codes, dequantized per forward in this process
    with torch.no_grad():
        compare_outputs(expected, whole(input_ids=IDS))


def expert_tensors(context) -> dict[str, str]:
    """On a rank: the first experts module's class and its tensors' dtypes."""
    experts = context.store["model"].model.layers[0].mlp.experts
    return {"class": type(experts).__name__, **{n: str(t.dtype) for n, t in experts.named_parameters()}}


@pytest.mark.slow
def test_a_bfloat16_load_gives_transformers_bfloat16_tokens(mxfp4_dir):
    """``dtype=bfloat16``: the codes stay uint8 and dequantize to bfloat16, transformers' values at load."""
    directory, _, _ = mxfp4_dir
    reference = transformers.GptOssForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = reference(input_ids=IDS).logits
        tokens = reference.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    model = tpcore.parallelize(str(directory), num_gpus=2, dtype=torch.bfloat16)
    try:
        compare_outputs(expected.float(), model(input_ids=IDS).logits.float(), rtol=1.6e-2)
        assert torch.equal(model.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False), tokens)
    finally:
        model.deparallelize()


@pytest.mark.slow
def test_the_spmd_engine_reads_an_mxfp4_directory(mxfp4_dir, rank_pools):
    check_engine_reads(mxfp4_dir[0], rank_pools, world_size=3)


@pytest.mark.slow
def test_the_object_transformers_loads_and_a_saved_split_keep_the_format(mxfp4_dir, tmp_path):
    """transformers dequantizes MXFP4 at load on a CPU: its object splits as a plain model. A split directory saved
    again holds the checkpoint's own blocks and scales, which transformers and tpcore read as before."""
    directory, _, reference = mxfp4_dir
    with torch.no_grad():
        expected = reference(input_ids=IDS)
    model = tpcore.parallelize(reference, num_gpus=2)
    try:
        compare_outputs(expected, model(input_ids=IDS))
    finally:
        model.deparallelize()
    split = tpcore.parallelize(str(directory), num_gpus=2)
    try:
        split.save_pretrained(tmp_path / "saved")
    finally:
        split.deparallelize()
    stored, written = load_file(directory / "model.safetensors"), load_file(tmp_path / "saved" / "model.safetensors")
    assert stored.keys() == written.keys()
    assert all(torch.equal(written[key], stored[key]) for key in stored if key.endswith(("_blocks", "_scales")))
    again = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        compare_outputs(expected, again(input_ids=IDS), rtol=0)


def test_blocks_outside_fused_experts_are_refused_naming_them(mxfp4_dir, tmp_path, no_process_starts):
    directory = tmp_path / "model"
    shutil.copytree(mxfp4_dir[0], directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj_blocks"] = torch.zeros(96, 2, 16, dtype=torch.uint8)  # (out, in / 32, 16)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShardingError, match="'model.layers.0.self_attn.q_proj_blocks' is MXFP4 outside fused experts"):
        tpcore.parallelize(str(directory), num_gpus=2)
