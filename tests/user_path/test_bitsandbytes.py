"""bitsandbytes checkpoints on the user's path: 8-bit LLM.int8() (int8 rows, a scale a row, outlier input columns
in the input's dtype) and 4-bit NF4 and FP4 (two codes a byte, a scale per block of 64, nested or not), quantized and
saved by transformers' ``BitsAndBytesConfig`` itself, split by ``tpcore.parallelize(dir)``, by ``parallelize(model)``
of the quantized object transformers holds, and by the SPMD engine, give transformers' own outputs at an even and an
uneven world size (8-bit: outliers in column- and row-parallel layers alike; 4-bit: cuts inside blocks), each rank
holding its int8 values or 4-bit codes; what tpcore does not split is refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from quantized_checks import (
    check_engine_reads,
    check_plan_shown,
    check_real_minilm_split,
    check_split_layers,
    greedy_outputs,
    quantizable_llama,
    split,
    transformers_outputs,
    with_quantization_changed,
)
from safetensors.torch import load_file, save_file

import tpcore
from tpcore import ShardingError
from tpcore.testing import tiny_llama
from tpcore.testing.quantized_checkpoints import dequantizing, save_four_bit, save_llm_int8
from tpcore.tools.cli import main

pytest.importorskip("bitsandbytes", reason="bitsandbytes quantizes the checkpoints")

#: an outlier threshold the tiny model's inputs cross in every kind of layer (see outlying_llama)
THRESHOLD = 4.0


def outlying_llama() -> torch.nn.Module:
    """The tiny Llama with a few value and up-projection rows made large, so that the inputs of the row-parallel
    ``o_proj`` and ``down_proj`` hold outlier columns (on one rank), as the column-parallel layers' inputs do."""
    model = quantizable_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight[3:5] *= 60
            layer.mlp.up_proj.weight[150:152] *= 60
            layer.mlp.gate_proj.weight[150:152] *= 60
    return model


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory):
    return save_llm_int8(outlying_llama(), tmp_path_factory.mktemp("llm_int8") / "model", threshold=THRESHOLD)


def check_split(model, expected, tokens, world_size):
    check_split_layers(model, expected, tokens, world_size, "weight", "torch.int8", "RowParallelLLMInt8Linear")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_llm_int8_directory_splits_and_gives_transformers_outputs(int8_dir, world_size):
    expected, tokens = transformers_outputs(int8_dir)
    with split(str(int8_dir), world_size) as model:
        check_split(model, expected, tokens, world_size)


@pytest.mark.slow
def test_the_quantized_object_splits_with_its_int8_values(int8_dir):
    """The object transformers holds (``Linear8bitLt`` layers) is split as it is: its values go to the ranks."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(int8_dir).eval()
    assert type(reference.model.layers[0].mlp.up_proj).__name__ == "Linear8bitLt"
    expected, tokens = greedy_outputs(reference)
    with split(reference, 3) as model:
        check_split(model, expected, tokens, 3)


@pytest.mark.slow
def test_the_spmd_engine_reads_an_llm_int8_directory(int8_dir, rank_pools):
    check_engine_reads(int8_dir, rank_pools)


@pytest.mark.slow
def test_real_minilm_weights_in_llm_int8_split_with_their_biases(tmp_path):
    """all-MiniLM-L6-v2's real weights, every linear with a bias, at 3 ranks (bitsandbytes' default threshold)."""
    check_real_minilm_split(save_llm_int8, tmp_path / "llm_int8", 3)


def test_the_plan_shown_for_an_llm_int8_directory_counts_its_bytes_as_stored(int8_dir, capsys, no_process_starts):
    assert main(["plugins", "--model", str(int8_dir), "--world-size", "2"]) == 0
    check_plan_shown(
        int8_dir,
        capsys.readouterr().out,
        cut=("model.layers.*.mlp.up_proj.SCB",),
        replicated=("model.layers.*.mlp.down_proj.SCB",),
    )


# -- refused --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q: q.update(load_in_8bit=False, load_in_4bit=True, bnb_4bit_quant_type="int4"), "4-bit 'int4'"),
        (
            lambda q: q.update(load_in_8bit=False, load_in_4bit=True, bnb_4bit_quant_storage="bfloat16"),
            r"as bfloat16 \(bnb_4bit_quant_storage\)",
        ),
        (
            lambda q: q.update(load_in_8bit=False, load_in_4bit=True, bnb_4bit_compute_dtype="int8"),
            "computes bitsandbytes 4-bit in 'int8'",
        ),
        (lambda q: q.update(llm_int8_has_fp16_weight=True), "llm_int8_has_fp16_weight"),
    ],
)
def test_a_bitsandbytes_variant_tpcore_does_not_split_is_refused_before_any_rank_starts(
    int8_dir, tmp_path, change, message, no_process_starts
):
    directory = with_quantization_changed(int8_dir, tmp_path / "model", change)
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(str(directory), num_gpus=2)


@pytest.mark.parametrize(
    ("key", "change", "message"),
    [
        ("model.layers.1.mlp.up_proj.weight_format", lambda t: torch.ones_like(t), "not bitsandbytes' row format"),
        (
            "model.layers.1.mlp.up_proj.SCB",
            lambda t: t[:-1].clone(),
            r"stored as \[\(\[160, 96\], torch.int8\), \(\[159\], torch.float32\)\]",
        ),
    ],
)
def test_a_layer_stored_otherwise_is_refused_naming_its_tensor_before_any_rank_starts(
    int8_dir, tmp_path, key, change, message, no_process_starts
):
    directory = with_quantization_changed(int8_dir, tmp_path / "model", lambda q: None)
    tensors = load_file(directory / "model.safetensors")
    tensors[key] = change(tensors[key])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(str(directory), num_gpus=2)


# -- 4-bit ----------------------------------------------------------------------------------------------------


def whole_block_llama() -> torch.nn.Module:
    """A tiny Llama whose linears' inputs are whole blocks of 64 (192 and 448 features, as bitsandbytes' 4-bit layers
    need), 6 query heads of 32 over 2 key/value heads: at 2 ranks the MLP's 448 features are cut inside a block."""
    return tiny_llama(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, intermediate_size=448, head_dim=32)


@pytest.fixture(scope="module")
def four_bit_dirs(tmp_path_factory):
    """NF4 with nested scales and FP4 without, by name."""
    root = tmp_path_factory.mktemp("four_bit")
    return {
        "nf4": save_four_bit(whole_block_llama(), root / "nf4", "nf4", nested=True),
        "fp4": save_four_bit(whole_block_llama(), root / "fp4", "fp4", nested=False),
    }


def check_four_bit_split(model, expected, tokens, world_size):
    check_split_layers(model, expected, tokens, world_size, "weight", "torch.uint8", "RowParallelFourBitLinear")


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "world_size"), [("nf4", 2), ("fp4", 3)])
def test_a_four_bit_directory_splits_and_gives_transformers_outputs(four_bit_dirs, kind, world_size):
    expected, tokens = transformers_outputs(four_bit_dirs[kind])
    with split(str(four_bit_dirs[kind]), world_size) as model:
        check_four_bit_split(model, expected, tokens, world_size)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "world_size"), [("nf4", 3), ("fp4", 2)])
def test_the_four_bit_object_splits_with_its_codes(four_bit_dirs, kind, world_size):
    """The object transformers holds (``Linear4bit`` layers, nested scales made float32 on the caller) is split as
    it is: its packed codes go to the ranks."""
    reference = dequantizing(transformers.AutoModelForCausalLM.from_pretrained(four_bit_dirs[kind]).eval())
    assert type(reference.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    expected, tokens = greedy_outputs(reference)
    with split(reference, world_size) as model:
        check_four_bit_split(model, expected, tokens, world_size)


@pytest.mark.slow
def test_the_spmd_engine_reads_a_four_bit_directory(four_bit_dirs, rank_pools):
    check_engine_reads(four_bit_dirs["nf4"], rank_pools)


@pytest.mark.slow
def test_real_minilm_weights_in_nf4_split_with_their_biases(tmp_path):
    """all-MiniLM-L6-v2's real weights in NF4 with nested scales (384 and 1536 features: whole blocks), every linear
    with a bias, at 3 ranks."""
    check_real_minilm_split(save_four_bit, tmp_path / "nf4", 3)


def test_the_plan_shown_for_a_four_bit_directory_counts_its_codes(four_bit_dirs, capsys, no_process_starts):
    assert main(["plugins", "--model", str(four_bit_dirs["nf4"]), "--world-size", "2"]) == 0
    check_plan_shown(
        four_bit_dirs["nf4"],
        capsys.readouterr().out,
        cut=("model.layers.*.mlp.up_proj.absmax",),
        replicated=("model.layers.*.mlp.down_proj.absmax", "model.layers.*.mlp.down_proj.nested_absmax"),
        unread=".quant_state.",
    )


def test_four_bit_layers_whose_blocks_cross_rows_are_refused_before_any_rank_starts(tmp_path, no_process_starts):
    """The tiny Llama's 96 and 160 input features are no whole blocks of 64: its flat blocks run across rows."""
    directory = save_four_bit(quantizable_llama(), tmp_path / "nf4")
    with pytest.raises(ShardingError, match=r"'model.layers.0.self_attn.q_proj.weight': 96 input features are not"):
        tpcore.parallelize(str(directory), num_gpus=2)


def test_a_four_bit_object_repacked_by_a_forward_is_refused(four_bit_dirs, no_process_starts):
    """bitsandbytes' fused CPU kernel repacks a layer's codes in its first forward (on CPUs with AVX-512-BF16)."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(four_bit_dirs["fp4"]).eval()
    reference.model.layers[1].mlp.up_proj.weight.quant_state.packing_format_for_cpu = True
    with pytest.raises(ShardingError, match=r"'model.layers.1.mlp.up_proj' holds bitsandbytes' CPU-packed codes"):
        tpcore.parallelize(reference, num_gpus=2)
