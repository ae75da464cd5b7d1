"""Quantized checkpoints: the format a checkpoint's ``quantization_config`` declares, split as stored where a
:class:`~tpcore.QuantizedFormat` knows it, refused by name before any rank starts where none does.

The built-in formats (:data:`BUILT_IN_FORMATS`: block FP8, compressed-tensors, torchao, bitsandbytes, GPTQ, AWQ,
MXFP4, each in a module of its own) make the meta skeleton's linears (MXFP4: fused experts) quantized layers holding
what the files store before it is planned, so the plan counts a rank's bytes as stored and each rank reads only its
part of the values. Plugins add formats (``tpcore_register_quantized_formats``; the callers above pass them in).

A model object that transformers quantized (``model.hf_quantizer``) is split where its weights are plain again
(FP8 dequantized at load on a device without FP8 kernels) or where its format adopts its layers (compressed-tensors',
torchao's, bitsandbytes' and GPTQModel's become tpcore's layers, their tensors kept); otherwise it is refused
(:func:`adopt_quantized_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tpcore.authoring.quantized_format import QuantizedFormat
from tpcore.errors import ShardingError
from tpcore.load.bitsandbytes_format import BitsAndBytes
from tpcore.load.block_fp8_format import BlockFP8
from tpcore.load.checkpoint import Checkpoint
from tpcore.load.compressed_tensors_format import CompressedTensors
from tpcore.load.gptq_format import AWQ, GPTQ
from tpcore.load.mxfp4_format import MXFP4
from tpcore.load.skeleton import empty_model
from tpcore.load.torchao_format import TorchAO
from tpcore.parallel.quantized_linear import QuantizedLayer

__all__ = [
    "BUILT_IN_FORMATS",
    "check_quantization",
    "checkpoint_skeleton",
    "adopt_quantized_model",
    "quantization_of",
]

#: dtypes that hold quantized values (packed integers, 8-bit floats), not a model's own precision
_STORAGE = {torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2}


#: the formats tpcore itself splits; plugins add more (``tpcore_register_quantized_formats``)
BUILT_IN_FORMATS: tuple[QuantizedFormat, ...] = (
    BlockFP8(),
    CompressedTensors(),
    TorchAO(),
    BitsAndBytes(),
    GPTQ(),
    AWQ(),
    MXFP4(),
)


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
    quantized ones too, as their format holds them; a format ``formats`` do not split is refused first. Its
    generation config is the directory's where one was saved (as ``from_pretrained`` reads it: Whisper's timestamp
    and language tokens, a model's own ``max_length``)."""
    where = f"the checkpoint in {checkpoint.directory.name!r}"
    found = check_quantization(config, where, formats)
    model = empty_model(config, model_class)
    if found is not None:
        quantization = quantization_of(config) or {}
        try:
            found.hold(model, checkpoint, quantization)
        except ShardingError as error:
            raise ShardingError(f"{where}, {found.description}: {error}") from None
    if (checkpoint.directory / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(checkpoint.directory)  # type: ignore[assignment]
    return model


def adopt_quantized_model(model: Any, formats: Sequence[QuantizedFormat] = BUILT_IN_FORMATS) -> int:
    """Make a model object transformers quantized hold tpcore's quantized layers where its format adopts them
    (:meth:`~tpcore.QuantizedFormat.adopt`); the number of layers made. Raise :class:`ShardingError` for weights
    still quantized outside them (the method and the first such tensor named). A plain model, or one transformers
    dequantized at load, passes unchanged."""
    if not isinstance(model, nn.Module):
        return 0
    quantizer = getattr(model, "hf_quantizer", None)
    quantization = quantization_of(getattr(model, "config", None))
    if quantizer is None and quantization is None:
        return 0
    method = (quantization or {}).get("quant_method", type(quantizer).__name__)
    found = next((form for form in formats if form.quant_method == method), None)
    adopted = 0 if found is None else found.adopt(model, quantization or {})
    held = {
        id(tensor) for module in model.modules() if isinstance(module, QuantizedLayer) for tensor in module.parameters()
    }
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in held:
            continue
        if type(tensor) not in (torch.Tensor, nn.Parameter) or (tensor.dtype in _STORAGE and tensor.dim() >= 2):
            known = ", ".join(form.quant_method for form in formats)
            raise ShardingError(
                f"{type(model).__name__} is quantized as {method!r} ({name!r} is a {type(tensor).__name__} of "
                f"{tensor.dtype}); tpcore splits a quantized model object only where its format adopts it: "
                f"parallelize its saved directory where its format is one tpcore splits ({known})"
            )
    return adopted
