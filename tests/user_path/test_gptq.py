"""GPTQ and AWQ checkpoints on the user's path: 4-bit integers packed by GPTQModel's own packers (GPTQ v1 symmetric,
v2 asymmetric with act-order ``g_idx``; AWQ's GEMM layout), split by ``tpcore.parallelize(dir)``, by
``parallelize(model)`` of the object transformers loads through optimum and GPTQModel, and by the SPMD engine, give
transformers' own outputs at an even and an uneven world size, each rank holding its packed words. A rank computes
as transformers would: with GPTQModel's default CPU kernel (torch's int4 product, bfloat16) for a directory whose
config names no other backend and for an object of those kernels' layers, else with the torch kernels' dequantizing
product. The tiny Llama's MLP is 5 groups of 32: at 2 ranks a cut falls inside a group, where vLLM requires whole
groups a rank. What tpcore does not split is refused by name before any rank starts."""

from __future__ import annotations

import pytest
import torch
import transformers
from quantized_checks import (
    HALF_RTOL,
    check_engine_reads,
    check_kernels,
    check_plan_shown,
    check_saved_as_stored,
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
from tpcore.testing.quantized_checkpoints import save_awq, save_gptq
from tpcore.tools.cli import main

pytest.importorskip("gptqmodel", reason="GPTQModel packs the checkpoints and computes transformers' reference")
pytest.importorskip("optimum", reason="transformers loads GPTQ checkpoints through optimum")


def torch_kernel() -> dict:
    """``from_pretrained`` options for GPTQModel's torch kernel in float16: its dequantizing product, as tpcore's
    ranks compute (its default CPU kernel computes in bfloat16). The splits below run in float16 too (``dtype=``)."""
    return {"dtype": torch.float16, "quantization_config": transformers.GPTQConfig(bits=4, backend="torch")}


@pytest.fixture(scope="module")
def gptq_dirs(tmp_path_factory):
    """v1 (symmetric, groups in order) and v2 (asymmetric, act-order), by name; and v1 whose config names GPTQModel's
    torch kernel (``backend: torch``, as ``GPTQConfig(backend="torch")`` saves it)."""
    root = tmp_path_factory.mktemp("gptq")
    dirs = {
        "v1": save_gptq(quantizable_llama(), root / "v1", checkpoint_format="gptq"),
        "v2-act-order": save_gptq(quantizable_llama(), root / "v2", checkpoint_format="gptq_v2", act_order=True),
    }
    dirs["v1-torch"] = with_quantization_changed(dirs["v1"], root / "v1-torch", lambda q: q.update(backend="torch"))
    return dirs


def check_split(model, expected, tokens, world_size, dtype=torch.float16, int4=False):
    """Logits of a float16 (or bfloat16) run within :data:`HALF_RTOL`, greedy tokens identical; at 3 ranks the
    largest keeps at most 0.42 of the bytes: scales of groups of 32 weigh an eighth of the words here, and the
    row-parallel layers keep them whole (groups of 128 in a release weigh 1/32). ``int4``: every quantized layer
    computes with torch's int4 product (bfloat16 inside, so bfloat16's tolerance), else none does."""
    rtol = HALF_RTOL[torch.bfloat16 if int4 else dtype]
    check_split_layers(
        model, expected, tokens, world_size, "qweight", "torch.int32", "RowParallelGPTQLinear", rtol, 0.42
    )
    check_kernels(model, int4)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "world_size"), [("v1", 2), ("v2-act-order", 3)])
def test_a_gptq_directory_splits_and_gives_transformers_outputs(gptq_dirs, kind, world_size, tmp_path):
    """transformers computes with GPTQModel's default CPU kernel (``TorchAtenLinear``), and so do the ranks; the
    rank's kernel copy replaces its words, which ``save_pretrained`` still gathers as the files store them."""
    expected, tokens = transformers_outputs(gptq_dirs[kind], dtype=torch.float16)
    with split(str(gptq_dirs[kind]), world_size, dtype=torch.float16) as model:
        check_split(model, expected, tokens, world_size, int4=True)
        model.save_pretrained(tmp_path / "saved")
    check_saved_as_stored(gptq_dirs[kind], tmp_path / "saved", ("qweight", "qzeros", "scales", "g_idx"))


@pytest.mark.slow
def test_a_gptq_directory_naming_the_torch_kernel_splits_with_its_product(gptq_dirs):
    """``backend: torch`` in the config: transformers computes with GPTQModel's dequantizing torch kernel, and so do
    the ranks (float16 logits within float16's tolerance)."""
    expected, tokens = transformers_outputs(gptq_dirs["v1-torch"], dtype=torch.float16)
    with split(str(gptq_dirs["v1-torch"]), 3, dtype=torch.float16) as model:
        check_split(model, expected, tokens, 3)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "world_size", "backend"), [("v1", 3, "torch"), ("v2-act-order", 2, None)])
def test_the_gptq_object_splits_with_its_packed_words(gptq_dirs, kind, world_size, backend):
    """The object transformers holds (v1 zero points made v2 at load) is split as it is: its packed words go to the
    ranks, which compute as its layers do (``TorchLinear``: dequantizing; ``TorchAtenLinear``: torch's int4 product)."""
    load = torch_kernel() if backend else {"dtype": torch.float16}
    reference = transformers.AutoModelForCausalLM.from_pretrained(gptq_dirs[kind], **load).eval()
    assert type(reference.model.layers[0].mlp.up_proj).__name__ == ("TorchLinear" if backend else "TorchAtenLinear")
    expected, tokens = transformers_outputs(gptq_dirs[kind], **load)  # another load: a forward repacks its layers
    with split(reference, world_size) as model:
        check_split(model, expected, tokens, world_size, int4=backend is None)


@pytest.mark.slow
def test_a_bfloat16_split_rounds_its_partial_sums_once(gptq_dirs):
    """In bfloat16 the row-parallel layers sum their partial products in float32 and round once, as the unsplit
    product does (summed in bfloat16, this run's greedy tokens differ from transformers')."""
    expected, tokens = transformers_outputs(gptq_dirs["v1-torch"], dtype=torch.bfloat16)
    with split(str(gptq_dirs["v1-torch"]), 2, dtype=torch.bfloat16) as model:
        check_split(model, expected, tokens, 2, torch.bfloat16)


@pytest.mark.slow
def test_the_spmd_engine_reads_a_gptq_directory(gptq_dirs, rank_pools):
    """The engine runs the checkpoint in float32 (no ``dtype=``), each layer through torch's int4 product as
    transformers' float16 model does: within bfloat16's tolerance of transformers'."""
    check_engine_reads(gptq_dirs["v2-act-order"], rank_pools, HALF_RTOL[torch.bfloat16], dtype=torch.float16)


def test_the_plan_shown_for_a_gptq_directory_counts_its_packed_words(gptq_dirs, capsys, no_process_starts):
    """A column-parallel layer's words, scales and zero points cut with its output features; a row-parallel one's
    words and ``g_idx`` with its input features, its scales and zero points whole. (Without ``dtype=`` the plan counts
    the float16 embedding and norms at the float32 the ranks then run in, so the whole is not the files' bytes.)"""
    assert main(["plugins", "--model", str(gptq_dirs["v1"]), "--world-size", "2"]) == 0
    shown = capsys.readouterr().out
    up = (
        "model.layers.*.mlp.up_proj.qweight",
        "model.layers.*.mlp.up_proj.scales",
        "model.layers.*.mlp.up_proj.qzeros",
    )
    check_plan_shown(
        gptq_dirs["v1"], shown, cut=up, replicated=("model.layers.*.mlp.up_proj.g_idx",), cut_dim=1, as_stored=False
    )
    check_plan_shown(
        gptq_dirs["v1"],
        shown,
        cut=("model.layers.*.mlp.down_proj.qweight", "model.layers.*.mlp.down_proj.g_idx"),
        replicated=("model.layers.*.mlp.down_proj.scales", "model.layers.*.mlp.down_proj.qzeros"),
        as_stored=False,
    )


# -- refused --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q: q.update(bits=3), "GPTQ 3-bit: tpcore splits 2, 4, 8-bit values"),
        (lambda q: q.update(checkpoint_format="marlin"), "GPTQ in the 'marlin' layout"),
        (lambda q: q.update(is_marlin_format=True), "repacked for Marlin kernels"),
    ],
)
def test_a_gptq_variant_tpcore_does_not_split_is_refused_before_any_rank_starts(
    gptq_dirs, tmp_path, change, message, no_process_starts
):
    directory = with_quantization_changed(gptq_dirs["v1"], tmp_path / "model", change)
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(str(directory), num_gpus=2)


@pytest.mark.parametrize(
    ("key", "change", "message"),
    [
        ("model.layers.1.mlp.up_proj.g_idx", None, r"'model.layers.1.mlp.up_proj.qweight' is stored without .*g_idx"),
        (
            "model.layers.1.mlp.up_proj.scales",
            lambda t: t[:-1].clone(),
            r"'model.layers.1.mlp.up_proj.scales' is stored as \(\[2, 160\], torch.float16\)",
        ),
        ("model.layers.1.mlp.up_proj.qzeros", lambda t: t.float(), r"up_proj.qzeros' is stored as .*torch.float32"),
    ],
)
def test_a_gptq_layer_stored_otherwise_is_refused_naming_its_tensor_before_any_rank_starts(
    gptq_dirs, tmp_path, key, change, message, no_process_starts
):
    directory = with_quantization_changed(gptq_dirs["v1"], tmp_path / "model", lambda q: None)
    tensors = load_file(directory / "model.safetensors")
    if change is None:
        del tensors[key]
    else:
        tensors[key] = change(tensors[key])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(str(directory), num_gpus=2)


def test_a_gptq_object_repacked_by_a_forward_is_refused(gptq_dirs, no_process_starts):
    """GPTQModel's default CPU kernel repacks a layer's tensors for ``_weight_int4pack_mm_for_cpu`` in its first
    forward."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(gptq_dirs["v1"], dtype=torch.float16).eval()
    assert type(reference.model.layers[0].mlp.up_proj).__name__ == "TorchAtenLinear"
    with torch.no_grad():
        reference(input_ids=torch.tensor([[1, 2, 3]]))
    with pytest.raises(ShardingError, match=r"'model.layers.0.self_attn.\w_proj' holds GPTQModel's CPU-repacked"):
        tpcore.parallelize(reference, num_gpus=2)


# -- AWQ ------------------------------------------------------------------------------------------------------


def awq_torch_kernel() -> dict:
    """``from_pretrained`` options for GPTQModel's AWQ torch kernel in float16 (its default CPU kernel computes in
    bfloat16)."""
    return {"dtype": torch.float16, "quantization_config": transformers.AwqConfig(bits=4, backend="torch_awq")}


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    return save_awq(quantizable_llama(), tmp_path_factory.mktemp("awq") / "model")


def check_awq_split(model, expected, tokens, world_size, int4=False):
    rtol = HALF_RTOL[torch.bfloat16 if int4 else torch.float16]
    check_split_layers(model, expected, tokens, world_size, "qweight", "torch.int32", "RowParallelAWQLinear", rtol)
    check_kernels(model, int4)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_awq_directory_splits_and_gives_transformers_outputs(awq_dir, world_size, tmp_path):
    """transformers computes with GPTQModel's default CPU kernel for AWQ (``TorchAtenAwqLinear``), and so do the
    ranks; ``save_pretrained`` gathers the words as stored."""
    expected, tokens = transformers_outputs(awq_dir, dtype=torch.float16)
    with split(str(awq_dir), world_size, dtype=torch.float16) as model:
        check_awq_split(model, expected, tokens, world_size, int4=True)
        model.save_pretrained(tmp_path / "saved")
    check_saved_as_stored(awq_dir, tmp_path / "saved", ("qweight", "qzeros", "scales"))


@pytest.mark.slow
def test_the_awq_object_splits_with_its_packed_words(awq_dir):
    reference = transformers.AutoModelForCausalLM.from_pretrained(awq_dir, **awq_torch_kernel()).eval()
    assert type(reference.model.layers[0].mlp.up_proj).__name__ == "AwqTorchLinear"
    expected, tokens = greedy_outputs(reference)
    with split(reference, 3) as model:
        check_awq_split(model, expected, tokens, 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q: q.update(version="gemv"), "AWQ in the 'gemv' layout"),
        (lambda q: q.update(bits=8), "AWQ 8-bit"),
        (lambda q: q.update(zero_point=False), "AWQ without zero points"),
    ],
)
def test_an_awq_variant_tpcore_does_not_split_is_refused_before_any_rank_starts(
    awq_dir, tmp_path, change, message, no_process_starts
):
    directory = with_quantization_changed(awq_dir, tmp_path / "model", change)
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(str(directory), num_gpus=2)


def test_an_awq_layer_stored_otherwise_is_refused_naming_its_tensor(awq_dir, tmp_path, no_process_starts):
    directory = with_quantization_changed(awq_dir, tmp_path / "model", lambda q: None)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.qzeros"] = tensors["model.layers.0.mlp.down_proj.qzeros"][:, :-1].clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShardingError, match=r"'model.layers.0.mlp.down_proj.qzeros' is stored as \(\[5, 11\]"):
        tpcore.parallelize(str(directory), num_gpus=2)
