"""Block FP8 mixture-of-experts checkpoints (DeepSeek-V3/R1's and Qwen3-MoE FP8's layout: every expert's projections
stored e4m3 beside their block scales, merged into fused experts as transformers loads them) on the user's path:
``tpcore.parallelize(dir)`` keeps each rank's e4m3 share of every expert, the scales whole, and gives transformers'
outputs for the directory (transformers dequantizes it at load on a CPU) at an even and an uneven world size."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import transformers
from quantized_checks import IDS, check_largest_rank
from safetensors.torch import load_file, save_file

import tpcore
from tpcore import ShardingError
from tpcore.load.checkpoint import Checkpoint
from tpcore.load.quantized_formats import checkpoint_skeleton
from tpcore.plan import plan_for
from tpcore.testing import ModelSpec, compare_outputs
from tpcore.testing.quantized_checkpoints import save_block_fp8
from tpcore.tools.cli import main

BLOCK = (16, 16)
#: widths of whole 16 x 16 blocks, as transformers' CPU dequantization needs (it takes a block from the scale grid);
#: 48 expert features are 16 each at 3 ranks, 24 each at 2 (a block cut in two); 4 heads are 2 + 1 + 1 at 3 ranks
CONFIGS = {
    "deepseek_v3": dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, moe_intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0,
    ),
    "qwen3_moe": dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
    ),
}  # fmt: skip
EXPERTS = "model.layers.1.mlp.experts"


def fp8_moe(directory, name: str):
    """A tiny ``name`` model saved in block FP8, experts per expert; the model it was made from."""
    config = transformers.AutoConfig.for_model(name, **CONFIGS[name])
    original = ModelSpec(transformers.AutoModelForCausalLM._model_mapping[type(config)], config, 1).build()
    return save_block_fp8(original, directory, BLOCK), original


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return fp8_moe(tmp_path_factory.mktemp("fp8-moe") / "model", "deepseek_v3")[0]


def test_the_experts_values_are_cut_as_plain_ones_and_their_scales_stay_whole(deepseek_dir, capsys, no_process_starts):
    checkpoint = Checkpoint(deepseek_dir)
    skeleton = checkpoint_skeleton(checkpoint, checkpoint.config())
    plan = plan_for(skeleton, tpcore.AutoPolicy().get_policy(skeleton), 3)
    assert plan.dtypes[f"{EXPERTS}.gate_up_proj"] == torch.float8_e4m3fn
    assert [plan.shard_shape(f"{EXPERTS}.gate_up_proj", rank) for rank in range(3)] == [(4, 32, 64)] * 3  # 16 + 16
    assert [plan.shard_shape(f"{EXPERTS}.down_proj", rank)[2] for rank in range(3)] == [16, 16, 16]
    for scales in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):  # (4, 6, 4) and (4, 4, 3): whole on every rank
        assert f"{EXPERTS}.{scales}" not in plan.splits and plan.dtypes[f"{EXPERTS}.{scales}"] == torch.float32
    assert plan.shapes[f"{EXPERTS}.gate_up_proj_scale_inv"] == (4, 6, 4)  # the gate's 3 block rows, then the up's
    assert main(["plugins", "--model", str(deepseek_dir), "--world-size", "2"]) == 0
    shown = capsys.readouterr().out
    stored = sum(t.numel() * t.element_size() for t in load_file(deepseek_dir / "model.safetensors").values())
    per_rank, whole = (float(n) for n in re.search(r"per rank ([\d.]+) KiB of ([\d.]+) KiB", shown).groups())
    assert abs(whole * 1024 - stored) < 0.01 * stored and per_rank <= 0.55 * whole  # e4m3 as stored


@pytest.mark.slow
@pytest.mark.parametrize(("name", "world_size"), [("deepseek_v3", 2), ("deepseek_v3", 3), ("qwen3_moe", 3)])
def test_an_fp8_moe_directory_splits_and_gives_transformers_outputs(tmp_path, name, world_size):
    directory, original = fp8_moe(tmp_path / "model", name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        expected = reference(input_ids=IDS)
        tokens = reference.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert not torch.allclose(original(input_ids=IDS).logits, expected.logits, atol=1e-4)  # it is quantized
    model = tpcore.parallelize(str(directory), num_gpus=world_size)
    try:
        compare_outputs(expected, model(input_ids=IDS))
        assert torch.equal(model.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False), tokens)
        held = model._tpcore_handle.pool.run(expert_tensors)[0]
        assert held["class"].startswith("RowParallelBlockFP8") and held["class"].endswith("Experts")
        assert held["gate_up_proj"] == held["down_proj"] == "torch.float8_e4m3fn"
        check_largest_rank(model._tpcore_handle.plan, world_size, at_three=0.45)
        if name == "deepseek_v3" and world_size == 2:  # saved again: the experts fused, which tpcore reads back
            model.save_pretrained(tmp_path / "saved")
            again = tpcore.parallelize(str(tmp_path / "saved"), num_gpus=2)
            try:
                compare_outputs(expected, again(input_ids=IDS))
            finally:
                again.deparallelize()
    except BaseException:
        model.deparallelize()
        raise
    whole = model.deparallelize()  # the gathered e4m3 experts and scales, computing unsplit in this process
    with torch.no_grad():
        compare_outputs(expected, whole(input_ids=IDS))


def expert_tensors(context) -> dict[str, str]:
    """On a rank: the sparse layer's experts class and its tensors' dtypes."""
    experts = context.store["model"].model.layers[1].mlp.experts
    return {"class": type(experts).__name__, **{n: str(t.dtype) for n, t in experts.named_parameters()}}


def test_an_expert_stored_in_fp8_without_its_scales_is_refused_naming_it(deepseek_dir, tmp_path, no_process_starts):
    directory = tmp_path / "model"
    shutil.copytree(deepseek_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors[f"{EXPERTS}.2.up_proj.weight_scale_inv"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShardingError, match=rf"'{EXPERTS}.2.up_proj.weight' is stored in float8 without its"):
        tpcore.parallelize(str(directory), num_gpus=2)
