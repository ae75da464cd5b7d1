"""torchao weight-only checkpoints on the user's path: ``Int8WeightOnlyConfig`` (int8 values, a scale per row) and
``Float8WeightOnlyConfig`` (e4m3 values, a scale per row), quantized and saved by transformers' ``TorchAoConfig``
itself, split by ``tpcore.parallelize(dir)``, by ``parallelize(model)`` of the quantized object transformers holds,
and by the SPMD engine, give transformers' own outputs at an even and an uneven world size, each rank holding its
int8 or e4m3 values; what tpcore does not split is refused by name."""

from __future__ import annotations

import shutil

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
from tpcore.testing.quantized_checkpoints import save_float8_weight_only, save_int8_weight_only
from tpcore.tools.cli import main

pytest.importorskip("torchao", reason="torchao quantizes the checkpoints")


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory):
    return save_int8_weight_only(quantizable_llama(), tmp_path_factory.mktemp("int8") / "model")


def check_split(model, expected, tokens, world_size):
    check_split_layers(model, expected, tokens, world_size, "_weight_qdata", "torch.int8", "RowParallelInt8Linear")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_int8_weight_only_directory_splits_and_gives_transformers_outputs(int8_dir, world_size):
    expected, tokens = transformers_outputs(int8_dir)
    with split(str(int8_dir), world_size) as model:
        check_split(model, expected, tokens, world_size)


@pytest.mark.slow
def test_the_quantized_object_splits_with_its_int8_values(int8_dir):
    """The object transformers holds (``Int8Tensor`` weights) is split as it is: its values go to the ranks."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(int8_dir).eval()
    assert type(reference.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    expected, tokens = greedy_outputs(reference)
    with split(reference, 3) as model:
        check_split(model, expected, tokens, 3)


@pytest.mark.slow
def test_the_spmd_engine_reads_an_int8_weight_only_directory(int8_dir, rank_pools):
    check_engine_reads(int8_dir, rank_pools)


@pytest.mark.slow
def test_real_minilm_weights_in_int8_split_with_their_biases(tmp_path):
    """all-MiniLM-L6-v2's real weights in int8 at 3 ranks, every linear with a bias, compared in float64: in float32
    this quantized model amplifies a partial sum's rounding about 4x a layer (8e-5 of outputs near 5.7 after 6
    layers, where the same split in float64 is within 4e-14), beyond the default tolerance."""
    check_real_minilm_split(save_int8_weight_only, tmp_path / "int8", 3, dtype=torch.float64)


def test_the_plan_shown_for_an_int8_directory_counts_its_bytes_as_stored(int8_dir, capsys, no_process_starts):
    assert main(["plugins", "--model", str(int8_dir), "--world-size", "2"]) == 0
    check_plan_shown(
        int8_dir,
        capsys.readouterr().out,
        cut=("model.layers.*.mlp.up_proj._weight_scale",),
        replicated=("model.layers.*.mlp.down_proj._weight_scale",),
    )


# -- float8 weight-only ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def float8_dir(tmp_path_factory):
    return save_float8_weight_only(quantizable_llama(), tmp_path_factory.mktemp("float8") / "model")


def check_float8_split(model, expected, tokens, world_size):
    check_split_layers(model, expected, tokens, world_size, "weight", "torch.float8_e4m3fn", "RowParallelRowFP8Linear")


@pytest.mark.slow
def test_a_float8_weight_only_directory_splits_and_gives_transformers_outputs(float8_dir):
    """e4m3 values read from ``_weight_qdata``, their row scales from ``_weight_scale``, at an uneven 3 ranks."""
    expected, tokens = transformers_outputs(float8_dir)
    with split(str(float8_dir), 3) as model:
        check_float8_split(model, expected, tokens, 3)


@pytest.mark.slow
def test_the_float8_object_splits_with_its_e4m3_values(float8_dir):
    reference = transformers.AutoModelForCausalLM.from_pretrained(float8_dir).eval()
    assert type(reference.model.layers[0].mlp.up_proj.weight).__name__ == "Float8Tensor"
    expected, tokens = greedy_outputs(reference)
    with split(reference, 2) as model:
        check_float8_split(model, expected, tokens, 2)


@pytest.mark.slow
def test_real_minilm_weights_in_float8_split_with_their_biases(tmp_path):
    check_real_minilm_split(save_float8_weight_only, tmp_path / "float8", 2)


# -- refused --------------------------------------------------------------------------------------------------


def default_type(**data):
    return lambda quantization: quantization["quant_type"]["default"].update(data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (default_type(_type="Int4WeightOnlyConfig"), r"torchao Int4WeightOnlyConfig \(PerRow\)"),
        (
            default_type(_type="Float8WeightOnlyConfig", _data={"weight_dtype": {"_data": "float8_e5m2"}}),
            r"torchao Float8WeightOnlyConfig \(PerRow, float8_e5m2\)",
        ),
        (default_type(_data={"group_size": 32}), r"PerRow, groups of 32"),
        (default_type(_data={"granularity": {"_type": "PerTensor"}}), r"\(PerTensor\)"),
        (lambda q: q.update(quant_type="int8_weight_only"), "torchao 'int8_weight_only'"),
        (lambda q: q.update(include_input_output_embeddings=True), "quantizes its embeddings"),
    ],
)
def test_a_torchao_variant_tpcore_does_not_split_is_refused_before_any_rank_starts(
    int8_dir, tmp_path, change, message, no_process_starts
):
    directory = with_quantization_changed(int8_dir, tmp_path / "model", change)
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(str(directory), num_gpus=2)


@pytest.mark.slow
def test_nonzero_zero_points_are_refused_on_the_ranks(int8_dir, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(int8_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    key = "model.layers.1.mlp.up_proj._weight_zero_point"
    tensors[key] = torch.ones_like(tensors[key])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="nonzero zero points"):
        tpcore.parallelize(str(directory), num_gpus=2)
