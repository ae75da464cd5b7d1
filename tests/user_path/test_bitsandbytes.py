"""bitsandbytes 8-bit checkpoints on the user's path: LLM.int8() (int8 rows, a scale a row, outlier input columns
in the input's dtype), quantized and saved by transformers' ``BitsAndBytesConfig`` itself, split by
``tpcore.parallelize(dir)``, by ``parallelize(model)`` of the quantized object transformers holds, and by the SPMD
engine, give transformers' own outputs at an even and an uneven world size, outliers in column- and row-parallel
layers alike, each rank holding its int8 values; what tpcore does not split is refused by name."""

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
from tpcore.testing.quantized_checkpoints import save_llm_int8
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
        (lambda q: q.update(load_in_8bit=False, load_in_4bit=True, bnb_4bit_quant_type="nf4"), r"4-bit \(nf4\)"),
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
        ("model.layers.1.mlp.up_proj.SCB", lambda t: t[:-1].clone(), r"are stored as \[\[160, 96\], \[159\]\]"),
    ],
)
def test_a_layer_stored_otherwise_is_refused_naming_its_tensor(int8_dir, tmp_path, key, change, message):
    directory = with_quantization_changed(int8_dir, tmp_path / "model", lambda q: None)
    tensors = load_file(directory / "model.safetensors")
    tensors[key] = change(tensors[key])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(str(directory), num_gpus=2)
