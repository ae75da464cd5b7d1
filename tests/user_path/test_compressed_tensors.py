"""compressed-tensors checkpoints on the user's path: ``pack-quantized`` integers (llmcompressor's W4A16 and W8A16,
written here by compressed-tensors itself) split by ``tpcore.parallelize(dir)``, by ``parallelize(model)`` of the
object transformers loads, and by the SPMD engine, give transformers' own outputs for them at an even and an uneven
world size, each rank holding its int32 words; the variants tpcore does not split are refused by name before any
rank starts."""

from __future__ import annotations

import functools
import re
import shutil
from typing import Any

import pytest
import torch
import transformers
from quantized_checks import (
    HALF_RTOL,
    IDS,
    check_engine_reads,
    check_kernels,
    check_real_minilm_split,
    check_saved_as_stored,
    check_split_outputs,
    greedy_outputs,
    quantizable_llama,
    split,
    transformers_outputs,
    with_quantization_changed,
)
from safetensors.torch import load_file, save_file

import tpcore
from tpcore import ShardingError
from tpcore.testing import compare_outputs
from tpcore.testing.quantized_checkpoints import (
    save_fp8_block,
    save_fp8_dynamic,
    save_nvfp4,
    save_pack_quantized,
    save_w8a8,
)
from tpcore.tools.cli import main

pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the checkpoints")


def saved(directory, bits: int, group_size: int | None, symmetric: bool = True):
    return save_pack_quantized(quantizable_llama(), directory, bits=bits, group_size=group_size, symmetric=symmetric)


@pytest.fixture(scope="module")
def w4_dir(tmp_path_factory):
    """A tiny Llama saved as W4A16: int4 in groups of 32 (4 words), lm_head kept. Its MLP's 160 features are 20
    words, dealt 7 + 7 + 6 at 3 ranks: the down projection's groups are cut inside at every boundary."""
    return saved(tmp_path_factory.mktemp("w4a16") / "model", 4, 32)


def weight_layout(context) -> dict[str, str]:
    """On a rank: one layer's packed tensors' dtypes and the classes of its projections."""
    layer = context.store["model"].model.layers[0]
    attention = layer.self_attn
    found = {name: str(tensor.dtype) for name, tensor in attention.q_proj.named_parameters()}
    return {**found, "o_proj": type(attention.o_proj).__name__, "down_proj": type(layer.mlp.down_proj).__name__}


@pytest.fixture(scope="module")
def w4_asym_dir(tmp_path_factory):
    """The same Llama saved as W4A16_ASYM: min-max groups of 32, a zero point each, packed 8 rows a word. Its 16-feature
    heads are 2 words of zero points, which follow the heads' cut."""
    return saved(tmp_path_factory.mktemp("w4a16-asym") / "model", 4, 32, symmetric=False)


def check_split(model, expected, tokens, world_size):
    check_split_outputs(model, expected, tokens, world_size)
    on_rank = model._tpcore_handle.pool.run(weight_layout)[0]
    assert on_rank["weight_packed"] == "torch.int32"
    assert on_rank["weight_scale"] == "torch.float32"
    assert on_rank["o_proj"] == on_rank["down_proj"] == "RowParallelPackedIntLinear"
    assert model._tpcore_handle.plan.dtypes["model.layers.0.mlp.up_proj.weight_packed"] == torch.int32


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bits", "group_size", "world_size"), [(4, 32, 2), (4, 32, 3), (8, None, 3)], ids=["w4-2", "w4-3", "w8-rows-3"]
)
def test_a_pack_quantized_directory_splits_and_gives_transformers_outputs(tmp_path, bits, group_size, world_size):
    directory = saved(tmp_path / "model", bits, group_size)
    expected, tokens = transformers_outputs(directory)
    with split(str(directory), world_size) as model:
        check_split(model, expected, tokens, world_size)


def decompressed_outputs(directory, dtype: torch.dtype = torch.float32) -> tuple[Any, torch.Tensor]:
    """The unsplit model as compressed-tensors itself decompresses ``directory`` (each packed linear's weight from its
    layout's compressor's ``decompress``; integer scales cast to ``dtype`` first, as transformers casts them), its
    outputs for :data:`IDS` and greedy tokens: the reference where transformers cannot load the checkpoint."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    config = transformers.AutoConfig.from_pretrained(directory)
    quantization = config.quantization_config
    compressor = BaseCompressor.get_value_from_registry(quantization["format"])
    scheme = QuantizationScheme.model_validate(quantization["config_groups"]["group_0"])
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    stored, state = load_file(directory / "model.safetensors"), {}
    for key, tensor in stored.items():
        prefix, _, name = key.rpartition(".")
        if name == "weight_packed":
            module = {n: t for n, t in stored.items() if n.startswith(f"{prefix}.weight_")}
            module = {n.removeprefix(f"{prefix}."): t for n, t in module.items()}
            if module["weight_scale"].is_floating_point() and module["weight_scale"].itemsize > 1:
                module["weight_scale"] = module["weight_scale"].to(dtype)
            state[f"{prefix}.weight"] = compressor.decompress(module, scheme)["weight"].to(dtype)
        elif not name.startswith("weight_"):
            state[key] = tensor.to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [key for key in missing if key != "lm_head.weight"]
    return greedy_outputs(model)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_asymmetric_directory_splits_with_its_zero_points(w4_asym_dir, world_size):
    """W4A16_ASYM (llmcompressor's AWQ output): each rank holds its words and the packed zero points of its rows (the
    heads' cut deals whole words of them) and computes ``(u - z) s``: the logits and greedy tokens of the unsplit model
    as compressed-tensors decompresses it (transformers cannot load this layout), at an even and an uneven size."""
    expected, tokens = decompressed_outputs(w4_asym_dir)
    with split(str(w4_asym_dir), world_size) as model:
        check_split(model, expected, tokens, world_size)
        plan = model._tpcore_handle.plan
        assert plan.splits["model.layers.0.self_attn.q_proj.weight_zero_point"].dim == 0
        assert plan.dtypes["model.layers.0.self_attn.q_proj.weight_zero_point"] == torch.int32


@pytest.mark.slow
def test_an_asymmetric_bfloat16_load_takes_the_zero_points_into_the_int4_product(w4_asym_dir):
    """In bfloat16 each rank's int4 product takes the zero points as its offsets: within bfloat16's tolerance of the
    decompressed model in bfloat16, the same greedy tokens."""
    expected, tokens = decompressed_outputs(w4_asym_dir, torch.bfloat16)
    with split(str(w4_asym_dir), 3, dtype=torch.bfloat16) as model:
        check_split_outputs(model, expected, tokens, 3, HALF_RTOL[torch.bfloat16])
        check_kernels(model, int4=True)


def test_an_asymmetric_object_with_reinitialized_zero_points_is_refused(w4_asym_dir, no_process_starts):
    """transformers (with compressed-tensors 0.20) expects zero points one a row where the checkpoint packs them 8 rows
    a word, and loads it only with ``ignore_mismatched_sizes=True``, the zero points then random: refused, naming the
    layer and the shapes, before any rank starts."""
    try:
        reference = transformers.AutoModelForCausalLM.from_pretrained(w4_asym_dir, ignore_mismatched_sizes=True)
    except Exception as error:  # a transformers that loads no such checkpoint at all
        pytest.skip(f"transformers does not load it: {error}")
    zeros = reference.model.layers[0].self_attn.q_proj.weight_zero_point
    if zeros.shape[0] == 12:
        pytest.skip("this transformers holds the zero points packed, as stored")
    message = r"q_proj'.*zero points of shape \[96, 3\], not the packed \[12, 3\].*the checkpoint's directory"
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(reference, num_gpus=2)


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    """The same Llama saved as NVFP4A16: e2m1 values two a byte, an e4m3 scale per 16 features, a global scale per
    tensor. At 3 ranks its MLP's 160 features are 80 bytes dealt 27 + 27 + 26: the down projection's groups are cut
    inside."""
    return save_nvfp4(quantizable_llama(), tmp_path_factory.mktemp("nvfp4") / "model")


def nvfp4_layout(context) -> dict[str, str]:
    """On a rank: one layer's NVFP4 tensors' dtypes and the class of its down projection."""
    layer = context.store["model"].model.layers[0]
    found = {name: str(tensor.dtype) for name, tensor in layer.mlp.up_proj.named_parameters()}
    return {**found, "down_proj": type(layer.mlp.down_proj).__name__}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_nvfp4_directory_splits_and_gives_transformers_outputs_in_bfloat16(nvfp4_dir, world_size):
    """NVFP4A16 in bfloat16 (transformers decompresses it in bfloat16 whatever the dtype asked): each rank keeps its
    bytes and e4m3 scales and dequantizes them as compressed-tensors does; transformers' logits within bfloat16's
    tolerance, its greedy tokens."""
    expected, tokens = transformers_outputs(nvfp4_dir, dtype=torch.bfloat16)
    with split(str(nvfp4_dir), world_size, dtype=torch.bfloat16) as model:
        check_split_outputs(model, expected, tokens, world_size, HALF_RTOL[torch.bfloat16])
        on_rank = model._tpcore_handle.pool.run(nvfp4_layout)[0]
        assert on_rank == {"weight_packed": "torch.uint8", "weight_scale": "torch.float8_e4m3fn",
                           "weight_global_scale": "torch.float32", "down_proj": "RowParallelNVFP4Linear"}  # fmt: skip


@pytest.mark.slow
def test_an_nvfp4_object_and_a_float32_load_split_with_their_bytes(nvfp4_dir):
    """The object transformers loads (still packed) splits with its bytes; and in float32, where transformers' own
    forward fails (its decompressed bfloat16 weights against float32 inputs), the split computes with those same
    weights: the outputs of the model compressed-tensors decompresses, run in float32."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(nvfp4_dir, dtype=torch.bfloat16).eval()
    assert reference.model.layers[0].mlp.up_proj.weight_packed.dtype == torch.uint8
    expected, tokens = transformers_outputs(nvfp4_dir, dtype=torch.bfloat16)
    with split(reference, 3) as model:
        check_split_outputs(model, expected, tokens, 3, HALF_RTOL[torch.bfloat16])
    expected, tokens = decompressed_outputs(nvfp4_dir)
    with split(str(nvfp4_dir), 2) as model:
        check_split_outputs(model, expected, tokens, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bfloat16_load_computes_4_bit_words_with_the_int4_product(w4_dir, world_size, tmp_path):
    """``dtype=bfloat16``: transformers casts the scales and decompresses in bfloat16 (``q s`` rounded); each rank
    casts its scales alike and computes its words with torch's CPU int4 product (``q s`` exact, a row-parallel rank's
    partial products summed in float32): logits within bfloat16's tolerance, the same greedy tokens. The kernel's copy
    replaces the rank's words, and ``save_pretrained`` gathers them as stored."""
    expected, tokens = transformers_outputs(w4_dir, dtype=torch.bfloat16)
    with split(str(w4_dir), world_size, dtype=torch.bfloat16) as model:
        on_rank = model._tpcore_handle.pool.run(weight_layout)[0]
        assert (on_rank["weight_packed"], on_rank["weight_scale"]) == ("torch.int32", "torch.bfloat16")
        check_split_outputs(model, expected, tokens, world_size, HALF_RTOL[torch.bfloat16])
        check_kernels(model, int4=True)
        model.save_pretrained(tmp_path / "saved")
    check_saved_as_stored(w4_dir, tmp_path / "saved", ("weight_packed",))  # the scales saved as cast


@pytest.mark.slow
def test_the_object_transformers_loads_splits_with_its_words(w4_dir):
    """transformers leaves the layers packed until a first forward: tpcore takes them as they are (each rank gets its
    words, never the dequantized weights), and the user's object computes the same afterwards."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(w4_dir).eval()
    assert reference.model.layers[0].mlp.up_proj.weight_packed.dtype == torch.int32
    expected, tokens = transformers_outputs(w4_dir)
    with split(reference, 3) as model:
        check_split(model, expected, tokens, 3)


@pytest.mark.slow
def test_an_object_already_decompressed_by_a_forward_splits_as_a_plain_model(w4_dir):
    reference = transformers.AutoModelForCausalLM.from_pretrained(w4_dir).eval()
    expected, tokens = greedy_outputs(reference)  # decompresses every layer
    with split(reference, 2) as model:
        compare_outputs(expected, model(input_ids=IDS))
        assert torch.equal(greedy_outputs(model)[1], tokens)


def token_layer_classes(context) -> dict[str, str]:
    """On a rank: one layer's 8-bit values' dtype and the classes of its projections."""
    layer = context.store["model"].model.layers[0]
    return {
        "values": str(layer.self_attn.q_proj.weight.dtype),
        "q_proj": type(layer.self_attn.q_proj).__name__,
        "down_proj": type(layer.mlp.down_proj).__name__,
    }


#: each preset whose inputs are rounded per token (FP8_BLOCK: per token and group of 32 features): its writer, its
#: values' dtype and its layer class
TOKEN_PRESETS = {
    "fp8-dynamic": (save_fp8_dynamic, "torch.float8_e4m3fn", "TokenFP8Linear"),
    "fp8-block": (save_fp8_block, "torch.float8_e4m3fn", "GroupFP8Linear"),
    "w8a8": (save_w8a8, "torch.int8", "TokenInt8Linear"),
}


@pytest.fixture(scope="module")
def token_dirs(tmp_path_factory):
    """A tiny Llama saved as FP8_DYNAMIC and as W8A8 (8-bit weights, a scale a row, inputs rounded per token) and
    as FP8_BLOCK (e4m3 weights, a scale per 32 x 32 block, inputs rounded per token and group of 32 features)."""
    root = tmp_path_factory.mktemp("token-rounded")
    return {name: save(quantizable_llama(), root / name) for name, (save, _, _) in TOKEN_PRESETS.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "source", "world_size"),
    [
        ("fp8-dynamic", "directory", 2),
        ("fp8-dynamic", "directory", 3),
        ("fp8-dynamic", "object", 3),
        ("fp8-block", "directory", 2),
        ("fp8-block", "directory", 3),
        ("fp8-block", "object", 2),
        ("w8a8", "directory", 3),
        ("w8a8", "object", 2),
    ],
)
def test_token_rounded_presets_split_with_each_token_s_scale_gathered_from_every_rank(
    token_dirs, preset, source, world_size
):
    """Row-parallel layers hold some of each token's features: the token's scale is the maximum over all of them
    (FP8_BLOCK: over its group's, a group cut inside by the attention output's heads at 2 ranks), gathered, so each
    rank rounds its features as the whole layer does."""
    directory, (_, values, layer_class) = token_dirs[preset], TOKEN_PRESETS[preset]
    expected, tokens = transformers_outputs(directory)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with split(str(directory) if source == "directory" else loaded, world_size) as model:
        check_split_outputs(model, expected, tokens, world_size)
        assert model._tpcore_handle.pool.run(token_layer_classes)[0] == {
            "values": values,
            "q_proj": layer_class,
            "down_proj": f"RowParallel{layer_class}",
        }


@pytest.mark.slow
def test_the_spmd_engine_reads_a_pack_quantized_directory(w4_dir, rank_pools):
    check_engine_reads(w4_dir, rank_pools)


@pytest.mark.slow
def test_real_minilm_weights_in_w4a16_split_with_their_biases(tmp_path):
    """all-MiniLM-L6-v2's real weights in W4A16 (groups of 128), every linear with a bias, row-parallel ones
    included, at 3 ranks (its 12 heads of 32 features, 4 words each; 1536 MLP features, 64 words a rank): the
    split's hidden states are transformers' for the same directory."""
    check_real_minilm_split(functools.partial(save_pack_quantized, group_size=128, keep=()), tmp_path / "w4a16", 3)


def test_the_plan_shown_for_a_pack_quantized_directory_counts_its_words(w4_dir, capsys, no_process_starts):
    assert main(["plugins", "--model", str(w4_dir), "--world-size", "2"]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"model\.layers\.\*\.mlp\.up_proj\.weight_scale\s+cut dim 0", shown)
    assert re.search(r"model\.layers\.\*\.mlp\.down_proj\.weight_scale\s+replicated", shown)
    tensors = load_file(w4_dir / "model.safetensors")
    stored = sum(t.numel() * t.element_size() for key, t in tensors.items() if not key.endswith("weight_shape"))
    per_rank, whole = (float(n) for n in re.search(r"per rank ([\d.]+) KiB of ([\d.]+) KiB", shown).groups())
    assert abs(whole * 1024 - stored) < 0.01 * stored  # int32 words, float32 scales: the files' own bytes
    assert per_rank <= 0.55 * whole


# -- refused before any rank starts ----------------------------------------------------------------------


def weights(**values):
    return lambda quantization: quantization["config_groups"]["group_0"]["weights"].update(values)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (weights(symmetric=False, strategy="tensor"), "a 'tensor' strategy"),
        (weights(num_bits=3), "3-bit values"),
        (weights(strategy="tensor"), "a 'tensor' strategy"),
        (weights(actorder="group"), r"activation-ordered groups \('group', g_idx\)"),
        (weights(type="float"), "'float' values"),
        (
            lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int"}),
            "quantizes input activations",
        ),
        (lambda q: q.update(format="float-quantized"), r"float-quantized with weights \{'type': 'int'"),
        (
            lambda q: q.update(format="int-quantized"),
            r"int-quantized with weights \{'num_bits': 4, 'strategy': 'group'\}",
        ),
        (lambda q: q.update(format="nvfp4-pack-quantized"), r"nvfp4-pack-quantized with weights \{'type': 'int'"),
        (lambda q: q.update(format="mxfp4-pack-quantized"), "'mxfp4-pack-quantized'"),
        (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "with a sparsity_config"),
        (lambda q: q.update(config_groups={}), "without config groups"),
    ],
)
def test_a_variant_tpcore_does_not_split_is_refused_before_any_rank_starts(
    w4_dir, tmp_path, change, message, no_process_starts
):
    def changed(quantization):
        quantization["config_groups"]["group_0"].pop("format", None)
        change(quantization)

    directory = with_quantization_changed(w4_dir, tmp_path / "model", changed)
    with pytest.raises(ShardingError, match=message):
        tpcore.parallelize(str(directory), num_gpus=2)


def test_packed_words_no_linear_takes_are_refused_naming_them_before_any_rank_starts(
    w4_dir, tmp_path, no_process_starts
):
    directory = tmp_path / "model"
    shutil.copytree(w4_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.embed_tokens.weight_packed"] = torch.zeros(4, 3, dtype=torch.int32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShardingError, match="'model.embed_tokens.weight_packed' packs a tensor"):
        tpcore.parallelize(str(directory), num_gpus=2)


def test_compile_is_refused_for_packed_layers(w4_dir):
    with pytest.raises(ValueError, match="compile=True does not compile quantized layers yet"):
        tpcore.parallelize(str(w4_dir), num_gpus=2, compile=True)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_plan_cuts_a_packed_mlp_s_up_rows_and_down_words_at_the_same_features(w4_dir, world_size):
    """Plain cuts deal runs of 8 features where the model holds int4 words: up and gate rows, and down's words
    times 8, are the same features on every rank (160 = 20 words: 10 + 10, 7 + 7 + 6, 5 + 5 + 5 + 5)."""
    from tpcore.load.checkpoint import Checkpoint
    from tpcore.load.quantized_formats import checkpoint_skeleton
    from tpcore.plan import plan_for
    from tpcore.select import choose_policies

    checkpoint = Checkpoint(w4_dir)
    skeleton = checkpoint_skeleton(checkpoint, checkpoint.config())
    plan = plan_for(skeleton, choose_policies(skeleton), world_size)
    mlp = "model.layers.0.mlp."
    for rank in range(world_size):
        rows = plan.shard_shape(mlp + "up_proj.weight_packed", rank)[0]
        assert plan.shard_shape(mlp + "gate_proj.weight_scale", rank)[0] == rows
        assert plan.shard_shape(mlp + "down_proj.weight_packed", rank)[1] * 8 == rows
        assert rows % 8 == 0
        assert plan.shard_shape(mlp + "down_proj.weight_scale", rank) == (96, 5)  # whole: groups cut inside


def test_fp8_block_whose_input_groups_are_not_its_blocks_columns_is_refused(token_dirs, tmp_path, no_process_starts):
    """FP8_BLOCK rounds each input group with the columns of one weight block; other groups are refused, naming the
    scheme, before any rank starts."""

    def other_groups(quantization):
        quantization["config_groups"]["group_0"]["input_activations"]["group_size"] = 16

    directory = with_quantization_changed(token_dirs["fp8-block"], tmp_path / "model", other_groups)
    with pytest.raises(ShardingError, match=r"float-quantized with input activations \{'group_size': 16\}"):
        tpcore.parallelize(str(directory), num_gpus=2)
