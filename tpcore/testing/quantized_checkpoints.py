"""Quantized checkpoints for tests and benchmarks, written as their formats' releases lay them out.

:func:`save_block_fp8` writes DeepSeek-V3's block FP8 (transformers can load it: on a CPU it dequantizes at load).
No library on the package registry writes that layout without a GPU, so the blocks are made here: each
``B0 x B1`` block of a weight gets the scale ``amax / 448`` (448: e4m3's largest value) and its values
``round_e4m3(w / scale)``.

:func:`save_pack_quantized` writes compressed-tensors' ``pack-quantized`` integers (llmcompressor's W4A16) with
compressed-tensors itself: its scheme applied to the model, each group's scale from its weights' absolute maximum
(``calculate_qparams``, as a min-max observer gives it), then its compressor packs and saves.

:func:`save_fp8_dynamic` and :func:`save_w8a8` write compressed-tensors' ``FP8_DYNAMIC`` and ``W8A8`` presets the
same way (e4m3 or int8 weights, a scale a row from each row's absolute maximum; activations quantized per token at
run time).

:func:`save_int8_weight_only` writes torchao's per-row int8 weight-only layout as transformers does: the model
saved, loaded again with ``TorchAoConfig(Int8WeightOnlyConfig())`` and saved in safetensors
(:func:`save_float8_weight_only`: ``Float8WeightOnlyConfig``). :func:`save_llm_int8`
writes bitsandbytes' 8-bit layout the same way (``BitsAndBytesConfig(load_in_8bit=True)``), :func:`save_four_bit` its
4-bit one.

:func:`save_mxfp4` writes gpt-oss's MXFP4 experts (``{proj}_blocks`` and ``{proj}_scales``); transformers writes them
only through GPU kernels, so they are made here as the OCP microscaling format rounds: each block of 32 values the
scale ``2 ** (floor(log2(amax)) - 2)`` (2: e2m1's largest exponent) and each value the nearest e2m1 of
``w / scale``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from tpcore.parallel.token_rounding import E4M3_MAX

__all__ = [
    "E4M3_MAX",
    "block_fp8",
    "mxfp4",
    "dequantizing",
    "save_block_fp8",
    "save_float8_weight_only",
    "save_awq",
    "save_four_bit",
    "save_gptq",
    "save_fp8_block",
    "save_fp8_dynamic",
    "save_int8_weight_only",
    "save_llm_int8",
    "save_mxfp4",
    "save_nvfp4",
    "save_pack_quantized",
    "save_w8a8",
]


def block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of a 2-d ``weight``: e4m3 ``(out, in)`` and float32 ``(ceil(out / B0), ceil(in / B1))``,
    ``weight[i, j] ~ values[i, j] * scales[i // B0, j // B1]``."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
    padded = weight.new_zeros(rows * block[0], cols * block[1], dtype=torch.float32)
    padded[:out_features, :in_features] = weight.float()
    blocks = padded.view(rows, block[0], cols, block[1])
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    values = (blocks / scales[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view_as(padded)
    return values[:out_features, :in_features].to(torch.float8_e4m3fn).contiguous(), scales


def save_block_fp8(
    model: nn.Module, directory: str | Path, block: tuple[int, int] = (128, 128), keep: tuple[str, ...] = ("lm_head",)
) -> Path:
    """Save ``model`` in ``directory`` (``save_pretrained``) with every ``nn.Linear`` weight and every expert's
    weight of fused experts (saved per expert, as DeepSeek-V3's are) but those whose module path ends with a name in
    ``keep`` stored in block FP8 (``weight`` e4m3 + ``weight_scale_inv``), and its
    config's ``quantization_config`` saying so. Returns the directory."""
    linears = [f"{path}.weight" for path, module in model.named_modules() if isinstance(module, nn.Linear)]

    def quantize(tensors: dict[str, torch.Tensor]) -> None:
        per_expert = [key for key in tensors if re.search(r"\.experts\.\d+\.\w+\.weight$", key)]
        for name in linears + per_expert:
            if name in tensors and not name.removesuffix(".weight").endswith(keep):
                tensors[name], tensors[f"{name}_scale_inv"] = block_fp8(tensors[name], block)

    quantization = {
        "quant_method": "fp8",
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
        "modules_to_not_convert": list(keep),
    }
    return _saved_quantized(model, directory, quantize, quantization)


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``weight (..., in)``: uint8 codes ``(..., in / 32, 16)`` (low nibble first) and
    exponents + 127 ``(..., in / 32)``, ``weight ~ FP4[code] * 2 ** (scale - 127)`` (module docstring)."""
    from tpcore.parallel.mxfp4_experts import FP4_VALUES, MXFP4_BLOCK

    values = weight.float().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = values.abs().amax(dim=-1)
    exponents = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)).clamp(-127, 127)
    scaled = values / torch.exp2(exponents).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (
        torch.bucketize(scaled.abs().contiguous(), (magnitudes[1:] + magnitudes[:-1]) / 2) | (scaled < 0).long() << 3
    )
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return blocks.contiguous(), (exponents + 127).to(torch.uint8)


def save_mxfp4(model: nn.Module, directory: str | Path) -> Path:
    """Save ``model`` (gpt-oss) in ``directory`` as its MXFP4 release lays it out: each fused experts module's
    ``gate_up_proj (E, H, 2I)`` and ``down_proj (E, I, H)`` stored ``(E, out, in)`` as ``{proj}_blocks`` and
    ``{proj}_scales`` (:func:`mxfp4`), everything else as saved, and its config's ``quantization_config`` saying so.
    Returns the directory."""

    def quantize(tensors: dict[str, torch.Tensor]) -> None:
        for name in [name for name in tensors if name.endswith((".gate_up_proj", ".down_proj"))]:
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4(tensors.pop(name).transpose(1, 2))

    plain = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    return _saved_quantized(model, directory, quantize, {"quant_method": "mxfp4", "modules_to_not_convert": plain})


def save_pack_quantized(
    model: nn.Module,
    directory: str | Path,
    bits: int = 4,
    group_size: int | None = 32,
    keep: tuple[str, ...] = ("lm_head",),
    symmetric: bool = True,
) -> Path:
    """Save ``model`` (changed in place: quantized and packed) in ``directory`` as compressed-tensors'
    ``pack-quantized`` ``bits``-bit integers, a scale per ``group_size`` input features (``None``: per row), every
    ``nn.Linear`` but those named in ``keep``; ``symmetric=False``: min-max ranges with a zero point each (W4A16_ASYM).
    Needs the ``compressed-tensors`` package. Returns the directory."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "channel" if group_size is None else "group"
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return _save_compressed(model, directory, scheme, group_size, keep, "pack-quantized")


def save_nvfp4(model: nn.Module, directory: str | Path, keep: tuple[str, ...] = ("lm_head",)) -> Path:
    """Save ``model`` (changed in place) in ``directory`` as compressed-tensors' ``NVFP4A16``
    (``nvfp4-pack-quantized``): every ``nn.Linear`` but those named in ``keep`` in e2m1 values, an e4m3 scale per
    group of 16 input features and a float32 global scale per tensor; activations as they are. Needs
    ``compressed-tensors``."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    return _save_compressed(model, directory, scheme, scheme.weights.group_size, keep, "nvfp4-pack-quantized")


def save_fp8_dynamic(model: nn.Module, directory: str | Path, keep: tuple[str, ...] = ("lm_head",)) -> Path:
    """Save ``model`` (changed in place) in ``directory`` as compressed-tensors' ``FP8_DYNAMIC``: every
    ``nn.Linear`` but those named in ``keep`` in e4m3 with a scale per row. Needs ``compressed-tensors``."""
    return _save_preset(model, directory, "FP8_DYNAMIC", keep, "float-quantized")


def save_fp8_block(
    model: nn.Module, directory: str | Path, block: int = 32, keep: tuple[str, ...] = ("lm_head",)
) -> Path:
    """Save ``model`` (changed in place) in ``directory`` as compressed-tensors' ``FP8_BLOCK`` with blocks of
    ``block`` x ``block`` (the preset's 128 shrunk for tiny models): every ``nn.Linear`` but those named in ``keep``
    in e4m3 with a scale per block, inputs rounded per token and group of ``block`` features through e4m3 at run
    time. Needs ``compressed-tensors``."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    scheme.weights.block_structure = [block, block]
    scheme.input_activations.group_size = block
    return _save_compressed(model, directory, scheme, None, keep, "float-quantized")


def save_w8a8(model: nn.Module, directory: str | Path, keep: tuple[str, ...] = ("lm_head",)) -> Path:
    """Save ``model`` (changed in place) in ``directory`` as compressed-tensors' ``W8A8``: every ``nn.Linear`` but
    those named in ``keep`` in int8 with a scale per row, inputs rounded per token through int8 at run time. Needs
    ``compressed-tensors``."""
    return _save_preset(model, directory, "W8A8", keep, "int-quantized")


def _save_preset(model: nn.Module, directory: str | Path, preset: str, keep: tuple[str, ...], layout: str) -> Path:
    from compressed_tensors.quantization import preset_name_to_scheme

    return _save_compressed(model, directory, preset_name_to_scheme(preset, ["Linear"]), None, keep, layout)


def _save_compressed(model, directory, scheme, group_size: int | None, keep: tuple[str, ...], layout: str):
    """compressed-tensors' ``scheme`` applied to ``model``'s linears, each scale (and zero point, asymmetric) from
    its group's (or row's, or block's) range, within a global scale from the tensor's (NVFP4's ``tensor_group``),
    compressed and saved in ``layout``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(keep), format=layout)
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            weight, scales = module.get_parameter("weight").detach(), module.get_parameter("weight_scale")
            groups = weight.view(weight.shape[0], -1, group_size or weight.shape[1])
            if scheme.weights.strategy == "block":  # (out / B0, in / B1) blocks of B0 * B1 values
                (rows, columns), (b0, b1) = weight.shape, scheme.weights.block_structure
                groups = weight.view(rows // b0, b0, columns // b1, b1).transpose(1, 2).reshape(rows // b0, -1, b0 * b1)
            global_scale = None
            if scheme.weights.strategy == "tensor_group":
                global_scale = generate_gparam(weight.amin().reshape(1), weight.amax().reshape(1))
                module.get_parameter("weight_global_scale").data.copy_(global_scale)
            scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale)
            scales.data.copy_(scale.to(scales.dtype).view_as(scales))
            if not scheme.weights.symmetric:
                zeros = module.get_parameter("weight_zero_point")
                zeros.data.copy_(zero_point.to(zeros.dtype).view_as(zeros))
    compressor = ModelCompressor.from_pretrained_model(model, layout)
    compressor.compress_model(model)
    directory = Path(directory)
    model.save_pretrained(directory)  # a transformers model
    compressor.update_config(str(directory))
    return directory


def save_int8_weight_only(model: nn.Module, directory: str | Path) -> Path:
    """Save ``model`` in ``directory`` with torchao's ``Int8WeightOnlyConfig`` (int8 values, a scale per row) on
    every linear layer but the LM head, through transformers' ``TorchAoConfig``. Needs the ``torchao`` package.
    Returns the directory."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return _save_through_transformers(model, directory, TorchAoConfig(Int8WeightOnlyConfig()))


def save_float8_weight_only(model: nn.Module, directory: str | Path) -> Path:
    """Save ``model`` in ``directory`` with torchao's ``Float8WeightOnlyConfig`` (e4m3 values, a scale per row) on
    every linear layer but the LM head, through transformers' ``TorchAoConfig``. Needs the ``torchao`` package."""
    from torchao.quantization import Float8WeightOnlyConfig
    from transformers import TorchAoConfig

    return _save_through_transformers(model, directory, TorchAoConfig(Float8WeightOnlyConfig()))


def save_llm_int8(model: nn.Module, directory: str | Path, threshold: float = 6.0) -> Path:
    """Save ``model`` in ``directory`` as bitsandbytes 8-bit (LLM.int8(), outlier ``threshold``) on every linear
    layer but the LM head, through transformers' ``BitsAndBytesConfig(load_in_8bit=True)``. Needs the
    ``bitsandbytes`` package. Returns the directory."""
    from transformers import BitsAndBytesConfig

    return _save_through_transformers(
        model, directory, BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)
    )


def save_four_bit(model: nn.Module, directory: str | Path, kind: str = "nf4", nested: bool = True) -> Path:
    """Save ``model`` in ``directory`` as bitsandbytes 4-bit (``kind``: ``"nf4"`` or ``"fp4"``, block scales
    ``nested`` or not) on every linear layer but the LM head, through transformers' ``BitsAndBytesConfig(
    load_in_4bit=True)``. Needs the ``bitsandbytes`` package. Returns the directory."""
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=nested)
    return _save_through_transformers(model, directory, quantization)


def save_gptq(
    model: nn.Module,
    directory: str | Path,
    bits: int = 4,
    group_size: int = 32,
    act_order: bool = False,
    checkpoint_format: str = "gptq",
    keep: tuple[str, ...] = ("lm_head",),
) -> Path:
    """Save ``model`` in ``directory`` in float16 as a GPTQ checkpoint packed by GPTQModel's own packer: every
    ``nn.Linear`` but those named in ``keep`` in ``bits``-bit integers, a scale and zero point per ``group_size``
    input features (``act_order``: the features ranked by a fixed random order before grouping, as ``desc_act``
    ranks them, so ``g_idx`` is not sorted). Round to nearest, no calibration: ``checkpoint_format="gptq"`` (v1,
    stored zero points ``z - 1``) symmetric, as AutoGPTQ's releases are, ``"gptq_v2"`` asymmetric (min-max). Needs
    the ``gptqmodel`` package. Returns the directory."""
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    symmetric = checkpoint_format == "gptq"
    generator = torch.Generator().manual_seed(0)

    def pack(module: nn.Linear) -> dict[str, torch.Tensor]:
        features = module.in_features
        order = torch.randperm(features, generator=generator) if act_order else torch.arange(features)
        g_idx = torch.empty(features, dtype=torch.int32)
        g_idx[order] = torch.arange(features, dtype=torch.int32) // group_size
        scales, zeros = _round_to_nearest(module.weight.detach().float(), g_idx, bits, symmetric)
        packer = TorchLinear(bits, group_size, symmetric, act_order, features, module.out_features)
        packer.pack_original(module, scales.to(torch.float16), zeros - (1 if symmetric else 0), g_idx)
        return {name: getattr(packer, name) for name in ("qweight", "qzeros", "scales", "g_idx")}

    quantization = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                    "sym": symmetric, "checkpoint_format": checkpoint_format}  # fmt: skip
    return _save_packed(model, directory, pack, quantization, keep)


def save_awq(
    model: nn.Module, directory: str | Path, group_size: int = 32, keep: tuple[str, ...] = ("lm_head",)
) -> Path:
    """Save ``model`` in ``directory`` in float16 as an AWQ checkpoint (AutoAWQ's GEMM layout) packed by GPTQModel's
    AWQ packer: every ``nn.Linear`` but those named in ``keep`` in 4-bit integers with zero points, a min-max group
    of ``group_size`` input features (round to nearest; no activation-aware scaling, which changes the weights and
    not the layout). Needs the ``gptqmodel`` package. Returns the directory."""
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear

    def pack(module: nn.Linear) -> dict[str, torch.Tensor]:
        groups = torch.arange(module.in_features) // group_size
        scales, zeros = _round_to_nearest(module.weight.detach().float(), groups, 4, symmetric=False)
        packer = AwqTorchLinear(bits=4, group_size=group_size, sym=False, desc_act=False,
                                in_features=module.in_features, out_features=module.out_features)  # fmt: skip
        packer.pack(module, scales.to(torch.float16), zeros)
        return {name: getattr(packer, name) for name in ("qweight", "qzeros", "scales")}

    quantization = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": list(keep)}  # fmt: skip
    return _save_packed(model, directory, pack, quantization, keep)


def _round_to_nearest(
    weight: torch.Tensor, groups: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest ``(scales, zeros)`` ``(out, groups)`` of a float ``weight (out, in)`` whose input feature
    ``i`` is in group ``groups[i]``: symmetric (zero point ``2^(b-1)``) from each group's absolute maximum, else from
    its minimum and maximum (zero inside the range)."""
    top = 2**bits - 1
    members = [weight[:, groups == group] for group in range(int(groups.max()) + 1)]
    if symmetric:
        scales = torch.stack([group.abs().amax(1) for group in members], 1).clamp(min=1e-8) * 2 / top
        return scales, torch.full(scales.shape, (top + 1) // 2, dtype=torch.int32)
    low = torch.stack([group.amin(1).clamp(max=0) for group in members], 1)
    high = torch.stack([group.amax(1).clamp(min=0) for group in members], 1)
    scales = ((high - low) / top).clamp(min=1e-8)
    return scales, (-low / scales).round().clamp(0, top).to(torch.int32)


def _save_packed(model: nn.Module, directory: str | Path, pack, quantization: dict, keep: tuple[str, ...]) -> Path:
    """``model`` saved in float16 in ``directory`` with each ``nn.Linear`` but those named in ``keep`` stored as the
    tensors ``pack(linear)`` returns (``{name: tensor}``, under the linear's path) and ``quantization`` as its
    config's ``quantization_config``."""
    model = model.to(torch.float16)

    def quantize(tensors: dict[str, torch.Tensor]) -> None:
        for path, module in model.named_modules():
            if isinstance(module, nn.Linear) and f"{path}.weight" in tensors and not path.endswith(keep):
                del tensors[f"{path}.weight"]
                tensors.update({f"{path}.{name}": tensor.contiguous() for name, tensor in pack(module).items()})

    return _saved_quantized(model, directory, quantize, quantization)


def _saved_quantized(model: nn.Module, directory: str | Path, quantize, quantization: dict) -> Path:
    """``model`` saved in ``directory`` (``save_pretrained``, one weight file) with ``quantize`` editing its tensors
    (``{key: tensor}``, in place) and ``quantization`` as its config's ``quantization_config``; the directory."""
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    model.save_pretrained(directory)  # type: ignore[operator]  # a transformers model
    files = sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"a quantized checkpoint is written as one weight file; save_pretrained wrote {len(files)}")
    tensors = load_file(files[0])
    quantize(tensors)
    save_file(tensors, files[0], metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization
    config_path.write_text(json.dumps(config, indent=2))
    return directory


def dequantizing(model: nn.Module) -> nn.Module:
    """``model`` (loaded by transformers) with bitsandbytes' fused 4-bit CPU kernel turned off in its ``Linear4bit``
    layers, so that they compute through bitsandbytes' dequantizing product, as tpcore's ranks do: on CPUs with
    AVX-512-BF16 a first forward would otherwise repack the codes and compute in bfloat16, whatever the compute
    dtype. Returns ``model``."""
    for module in model.modules():
        if type(module).__name__ == "Linear4bit":
            module.support_avx512bf16_for_cpu = False  # type: ignore[assignment]  # a bitsandbytes flag
    return model


def _save_through_transformers(model: nn.Module, directory: str | Path, quantization: object) -> Path:
    """``model`` saved, loaded again by transformers with ``quantization_config=quantization`` and saved in
    ``directory`` (safetensors)."""
    import tempfile

    from transformers import AutoConfig

    directory = Path(directory)
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch)  # type: ignore[operator]  # a transformers model
        model_class = type(model)
        config = AutoConfig.from_pretrained(scratch)
        quantized = model_class.from_pretrained(  # type: ignore[attr-defined]
            scratch, config=config, quantization_config=quantization
        )
    quantized.save_pretrained(directory, safe_serialization=True)
    return directory
