"""Quantized checkpoints: the format a checkpoint's ``quantization_config`` declares, split as stored where a
:class:`~tpcore.QuantizedFormat` knows it, refused by name before any rank starts where none does.

The built-in format, :class:`BlockFP8` (``quant_method: "fp8"`` with ``weight_block_size [B0, B1]``:
DeepSeek-V3/R1, Qwen3-FP8, transformers' ``FineGrainedFP8``): a linear whose weight the checkpoint stores in
float8 beside a ``weight_scale_inv`` becomes a :class:`~tpcore.parallel.quantized_linear.BlockFP8Linear` in the
meta skeleton before it is planned, so the plan counts a rank's bytes as stored and each rank reads only its
part of the values. Plugins add formats (``tpcore_register_quantized_formats``; the callers above pass them in).

A model object that transformers quantized (``model.hf_quantizer``) is split only where its weights are plain
again (FP8 dequantized at load on a device without FP8 kernels); otherwise it is refused
(:func:`refuse_quantized_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tpcore.authoring.quantized_format import QuantizedFormat
from tpcore.errors import ShardingError
from tpcore.load.checkpoint import Checkpoint
from tpcore.load.skeleton import empty_model
from tpcore.parallel.quantized_linear import BlockFP8Linear

__all__ = [
    "BUILT_IN_FORMATS",
    "BlockFP8",
    "check_quantization",
    "checkpoint_skeleton",
    "quantization_of",
    "refuse_quantized_model",
]

_FP8 = (torch.float8_e4m3fn,)
#: dtypes that hold quantized values (packed integers, 8-bit floats), not a model's own precision
_STORAGE = {torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2}


class BlockFP8(QuantizedFormat):
    """Block FP8: a linear whose weight the checkpoint stores in float8 beside its ``weight_scale_inv`` becomes a
    :class:`BlockFP8Linear`; blocks of ``weight_block_size``, activations dynamic."""

    quant_method = "fp8"
    description = "block FP8 (e4m3 weights, a float32 scale per block)"

    def check(self, quantization: dict[str, Any], where: str) -> None:
        if not _block_size(quantization):
            raise ShardingError(
                f"{where} is FP8 without 'weight_block_size' (one scale per tensor): tpcore splits block FP8 only"
            )
        if quantization.get("activation_scheme", "dynamic") != "dynamic":
            raise ShardingError(
                f"{where} is FP8 with {quantization['activation_scheme']!r} activation scales: tpcore splits block "
                "FP8 with dynamic activations only"
            )

    def hold(self, model: nn.Module, checkpoint: Any, quantization: dict[str, Any]) -> int:
        block = _block_size(quantization)
        if block is None:
            raise ShardingError("block FP8 needs the config's 'weight_block_size'")
        keys = checkpoint.stored_keys(model)
        scale_keys = {key for key in checkpoint.files if key.endswith("_scale_inv")}
        held = 0
        for path, module in list(model.named_modules()):
            key = keys.get(f"{path}.weight" if path else "weight")
            if not isinstance(module, nn.Linear) or key is None or checkpoint.stored_dtype(key) not in _FP8:
                continue  # not a linear, or kept in full precision
            scale_key = key.removesuffix("weight") + "weight_scale_inv"
            if scale_key not in scale_keys:
                raise ShardingError(f"{key!r} is stored in {checkpoint.stored_dtype(key)} without its {scale_key!r}")
            try:
                BlockFP8Linear.hold(module, block, tuple(checkpoint.stored_shape(scale_key)))
            except ValueError as error:
                raise ShardingError(f"{scale_key!r}: {error}") from None
            scale_keys.discard(scale_key)
            held += 1
        untaken = sorted(scale_keys)  # each linear took its own
        if untaken:
            raise ShardingError(
                f"{untaken[0]!r} scales a tensor that tpcore does not split in block FP8 yet (only linear layers' "
                f"weights; {len(untaken)} such scales)"
            )
        return held


#: the formats tpcore itself splits; plugins add more (``tpcore_register_quantized_formats``)
BUILT_IN_FORMATS: tuple[QuantizedFormat, ...] = (BlockFP8(),)


def quantization_of(config: Any) -> dict[str, Any] | None:
    """A config's ``quantization_config`` as a dict (transformers keeps a dict or a config object), or ``None``."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict() if hasattr(quantization, "to_dict") else vars(quantization)
    return dict(quantization)


def check_quantization(
    config: Any, where: str, formats: Sequence[QuantizedFormat] = BUILT_IN_FORMATS
) -> QuantizedFormat | None:
    """The format of ``formats`` the checkpoint ``where`` names is stored in (``None``: unquantized); raise
    :class:`ShardingError` for a format or variant none of them splits."""
    quantization = quantization_of(config)
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    found = next((form for form in formats if form.quant_method == method), None)
    if found is None:
        known = ", ".join(f"{form.quant_method!r} ({form.description})" for form in formats)
        raise ShardingError(
            f"{where} is quantized as {method!r}, which tpcore does not split yet; it splits {known} and "
            "unquantized checkpoints"
        )
    found.check(quantization, where)
    return found


def checkpoint_skeleton(
    checkpoint: Checkpoint, config: Any, model_class: Any = None, formats: Sequence[QuantizedFormat] = BUILT_IN_FORMATS
) -> nn.Module:
    """The model ``checkpoint`` holds, its parameters on meta (:func:`~tpcore.load.skeleton.empty_model`) as stored:
    quantized ones too, as their format holds them; a format ``formats`` do not split is refused first."""
    where = f"the checkpoint in {checkpoint.directory.name!r}"
    found = check_quantization(config, where, formats)
    model = empty_model(config, model_class)
    if found is not None:
        quantization = quantization_of(config) or {}
        try:
            found.hold(model, checkpoint, quantization)
        except ShardingError as error:
            raise ShardingError(f"{where}, {found.description}: {error}") from None
    return model


def refuse_quantized_model(model: Any, formats: Sequence[QuantizedFormat] = BUILT_IN_FORMATS) -> None:
    """Raise :class:`ShardingError` for a model object transformers quantized whose weights are not plain (the
    method and the first such tensor named); a model it dequantized at load passes."""
    if not isinstance(model, nn.Module):
        return
    quantizer = getattr(model, "hf_quantizer", None)
    quantization = quantization_of(getattr(model, "config", None))
    if quantizer is None and quantization is None:
        return
    method = (quantization or {}).get("quant_method", type(quantizer).__name__)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if type(tensor) not in (torch.Tensor, nn.Parameter) or (tensor.dtype in _STORAGE and tensor.dim() >= 2):
            known = ", ".join(form.quant_method for form in formats)
            raise ShardingError(
                f"{type(model).__name__} is quantized as {method!r} ({name!r} is a {type(tensor).__name__} of "
                f"{tensor.dtype}); tpcore does not split a quantized model object yet: parallelize its saved "
                f"directory where its format is one tpcore splits ({known})"
            )


def _block_size(quantization: dict[str, Any]) -> tuple[int, int] | None:
    block = quantization.get("weight_block_size")
    if not block:
        return None
    if len(block) != 2 or not all(isinstance(size, int) and size >= 1 for size in block):
        raise ShardingError(f"weight_block_size {block} is not two positive block sides")
    return int(block[0]), int(block[1])
