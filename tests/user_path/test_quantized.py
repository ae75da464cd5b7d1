"""Quantized checkpoints on the user's path: a block FP8 directory (DeepSeek-V3's layout) split by
``tpcore.parallelize(dir)`` and by the SPMD engine gives transformers' own outputs for it (transformers dequantizes
it at load on a CPU; each rank dequantizes its e4m3 shard a layer at a time), at an even and an uneven world
size; every format tpcore does not split is refused by name, before any rank starts."""

from __future__ import annotations

import functools
import json
import re
import shutil
import types

import pytest
import torch
import transformers
from quantized_checks import check_engine_reads, check_largest_rank, check_real_minilm_split
from safetensors.torch import load_file, save_file
from torch import nn

import tpcore
from tpcore import BlockFP8Linear, ShardingError
from tpcore.select.plugins import get_plugin_manager
from tpcore.testing import compare_outputs, tiny_llama
from tpcore.testing.quantized_checkpoints import save_block_fp8
from tpcore.tools.cli import main

#: heads of 16 features in blocks of 32 rows: at 2 ranks (3 query heads each) a block straddles the cut; the MLP's
#: 160 features are 54 + 53 + 53 at 3 ranks, no whole blocks either
WIDTHS = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 160}
BLOCK = (32, 32)
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 3, 4, 99, 1, 2, 50]])


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """A tiny Llama saved in block FP8, the model it was made from, and transformers' model loaded from it."""
    original = tiny_llama(**WIDTHS, head_dim=16)
    directory = save_block_fp8(original, tmp_path_factory.mktemp("fp8") / "model", BLOCK)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    return directory, original, reference


def weight_dtypes(context) -> dict[str, str]:
    """On a rank: the dtypes of one attention layer's tensors, and its class."""
    attention = context.store["model"].model.layers[0].self_attn
    found = {name: str(tensor.dtype) for name, tensor in attention.named_parameters()}
    return {**found, "o_proj": type(attention.o_proj).__name__}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_block_fp8_directory_splits_and_gives_transformers_outputs(fp8_dir, world_size):
    directory, original, reference = fp8_dir
    with torch.no_grad():
        expected = reference(input_ids=IDS)
        tokens = reference.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        assert not torch.allclose(original(input_ids=IDS).logits, expected.logits, atol=1e-4)  # it is quantized
    model = tpcore.parallelize(str(directory), num_gpus=world_size)
    try:
        compare_outputs(expected, model(input_ids=IDS))
        generated = model.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(generated, tokens)
        on_rank = model._tpcore_handle.pool.run(weight_dtypes)[0]
        assert on_rank["q_proj.weight"] == "torch.float8_e4m3fn"
        assert on_rank["q_proj.weight_scale_inv"] == "torch.float32"
        assert on_rank["o_proj"] == "RowParallelBlockFP8Linear"
        plan = model._tpcore_handle.plan
        check_largest_rank(plan, world_size)
        assert plan.dtypes["model.layers.0.mlp.up_proj.weight"] == torch.float8_e4m3fn
    finally:
        model.deparallelize()


@pytest.mark.slow
def test_a_block_fp8_directory_keeps_its_values_under_a_half_precision_load(fp8_dir):
    """``dtype=bfloat16`` casts the unquantized tensors; the e4m3 values and float32 scales stay as stored, and the
    layers compute in bfloat16."""
    directory, _, _ = fp8_dir
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        tokens = reference.generate(IDS, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    model = tpcore.parallelize(str(directory), num_gpus=2, dtype=torch.bfloat16)
    try:
        on_rank = model._tpcore_handle.pool.run(weight_dtypes)[0]
        assert on_rank["q_proj.weight"] == "torch.float8_e4m3fn"
        assert on_rank["q_proj.weight_scale_inv"] == "torch.float32"
        generated = model.generate(IDS, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert generated.shape == tokens.shape
        assert (generated == tokens).float().mean() >= 0.9  # bf16 partial sums may round a close pair otherwise
    finally:
        model.deparallelize()


@pytest.mark.slow
def test_the_spmd_engine_reads_a_block_fp8_directory(fp8_dir, rank_pools):
    check_engine_reads(fp8_dir[0], rank_pools)


@pytest.mark.slow
def test_real_minilm_weights_in_block_fp8_split_with_their_biases(tmp_path):
    """all-MiniLM-L6-v2's real weights in block FP8 (blocks of 128: its 32-feature heads and 1536 MLP features cut
    inside blocks), every linear with a bias, row-parallel ones included: the split's hidden states are
    transformers' for the same directory."""
    check_real_minilm_split(functools.partial(save_block_fp8, keep=()), tmp_path / "fp8", 2)


def test_the_plan_shown_for_a_block_fp8_directory_counts_its_bytes_as_stored(fp8_dir, capsys, no_process_starts):
    directory, _, _ = fp8_dir
    assert main(["plugins", "--model", str(directory), "--world-size", "2"]) == 0
    shown = capsys.readouterr().out
    assert "model.layers.*.self_attn.q_proj.weight_scale_inv  replicated" in shown
    stored = sum(t.numel() * t.element_size() for t in load_file(directory / "model.safetensors").values())
    per_rank, whole = (float(n) for n in re.search(r"per rank ([\d.]+) KiB of ([\d.]+) KiB", shown).groups())
    assert abs(whole * 1024 - stored) < 0.01 * stored  # e4m3 values, float32 scales: the files' own bytes
    assert per_rank <= 0.55 * whole


class RowwiseFP8(tpcore.QuantizedFormat):
    """A third party's format: e4m3 weights with one scale per output row (``weight_scale_inv`` ``(out, 1)``),
    held as block FP8 whose blocks are whole rows."""

    quant_method = "fp8-rows"
    description = "FP8, a scale per output row"

    def hold(self, model, checkpoint, quantization):
        keys, held = checkpoint.stored_keys(model), 0
        for path, module in list(model.named_modules()):
            key = keys.get(f"{path}.weight")
            if isinstance(module, nn.Linear) and key is not None and f"{key}_scale_inv" in checkpoint.files:
                BlockFP8Linear.hold(module, (1, module.in_features), (module.out_features, 1))
                held += 1
        return held


@pytest.mark.slow
def test_a_plugin_s_format_splits_its_checkpoints_through_parallelize(tmp_path, fresh_plugins):
    """A format registered by a plugin (``tpcore_register_quantized_formats``) is the one ``parallelize(dir)`` splits
    with: the outputs of the model its rows' scales dequantize to, at an uneven world size."""
    original = tiny_llama(**WIDTHS, head_dim=16)
    directory = save_block_fp8(original, tmp_path / "rows", block=(1, 480))  # 480 >= every in_features: (out, 1)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8-rows"}
    (directory / "config.json").write_text(json.dumps(config))
    stored = load_file(directory / "model.safetensors")
    with torch.no_grad():
        for path, module in original.named_modules():
            if f"{path}.weight_scale_inv" in stored:
                module.weight.copy_(stored[f"{path}.weight"].float() * stored[f"{path}.weight_scale_inv"])
        expected = original(input_ids=IDS)
    plugin = types.ModuleType("tp_rowwise")
    plugin.tpcore_register_quantized_formats = tpcore.hookimpl(lambda: [RowwiseFP8()])
    with pytest.raises(ShardingError, match="quantized as 'fp8-rows', which tpcore does not split"):
        tpcore.parallelize(str(directory), num_gpus=3)
    get_plugin_manager().register(plugin, name="tp-rowwise")
    model = tpcore.parallelize(str(directory), num_gpus=3)
    try:
        compare_outputs(expected, model(input_ids=IDS))
        assert model._tpcore_handle.plan.dtypes["model.layers.0.mlp.down_proj.weight"] == torch.float8_e4m3fn
    finally:
        model.deparallelize()


# -- refused before any rank starts ----------------------------------------------------------------------


def with_quantization(source, directory, quantization):
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "hqq", "nbits": 4}, "quantized as 'hqq', which tpcore does not split"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "FP8 without 'weight_block_size'"),
        (
            {"quant_method": "fp8", "weight_block_size": [32, 32], "activation_scheme": "static"},
            "'static' activation scales",
        ),
    ],
)
def test_a_format_tpcore_does_not_split_is_refused_before_any_rank_starts(
    fp8_dir, tmp_path, quantization, message, no_process_starts
):
    directory = with_quantization(fp8_dir[0], tmp_path / "model", quantization)
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(str(directory), num_gpus=2)


def test_compile_is_refused_for_quantized_layers(fp8_dir):
    with pytest.raises(ValueError, match=r"compile=True does not compile quantized layers yet \(model.layers.0"):
        tpcore.parallelize(str(fp8_dir[0]), num_gpus=2, compile=True)


def test_a_scale_no_linear_takes_is_refused_naming_it_before_any_rank_starts(fp8_dir, tmp_path, no_process_starts):
    directory = tmp_path / "model"
    shutil.copytree(fp8_dir[0], directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.embed_tokens.weight_scale_inv"] = torch.ones(4, 3)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShardingError, match="'model.embed_tokens.weight_scale_inv' scales a tensor"):
        tpcore.parallelize(str(directory), num_gpus=2)


def test_a_quantized_model_object_is_refused_naming_its_format_and_a_tensor(no_process_starts):
    """What a quantizer leaves (integer weights under a ``quantization_config``) is refused, not cast or sliced."""
    model = tiny_llama()
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    projection = model.model.layers[0].self_attn.q_proj
    projection.weight = nn.Parameter(projection.weight.data.to(torch.int8), requires_grad=False)
    with pytest.raises(ShardingError, match=r"quantized as 'bitsandbytes' \('model.layers.0.self_attn.q_proj.weight'"):
        tpcore.parallelize(model, num_gpus=2)


@pytest.mark.slow
def test_the_object_transformers_loads_from_a_block_fp8_directory_splits(fp8_dir):
    """On a CPU transformers dequantizes block FP8 at load (and drops its ``quantization_config``): the object is a
    plain model, split as one, with its own outputs."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(fp8_dir[0]).eval()
    with torch.no_grad():
        expected = reference(input_ids=IDS)
    model = tpcore.parallelize(reference, num_gpus=2)
    try:
        compare_outputs(expected, model(input_ids=IDS))
    finally:
        model.deparallelize()
