"""bitsandbytes checkpoints as transformers loads and saves them (``BitsAndBytesConfig``): 8-bit (``load_in_8bit``,
LLM.int8()) layers become :class:`~tpcore.parallel.llm_int8_linear.LLMInt8Linear` and 4-bit ones (``load_in_4bit``,
NF4 or FP4, nested or not) :class:`~tpcore.parallel.four_bit_linear.FourBitLinear`, from a directory or from the
``Linear8bitLt`` and ``Linear4bit`` layers of the object transformers loads; every other variant is refused by name.

transformers saves a 4-bit layer's packed codes flat, ``weight`` ``(out * in / 2, 1)``, with its quantization state
beside it (``weight.absmax``, ``weight.quant_map``, ``weight.nested_absmax``, ``weight.nested_quant_map`` and the
JSON of ``weight.quant_state.bitsandbytes__nf4``): the layer reads the codes as rows and the state under those
names (``stored_as``), so each rank reads its own rows' or columns' bytes.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from tpcore.authoring.quantized_format import QuantizedFormat, refuse_untaken
from tpcore.errors import ShardingError
from tpcore.parallel.four_bit_linear import NESTED_BLOCK, FourBitLinear
from tpcore.parallel.llm_int8_linear import LLMInt8Linear

__all__ = ["BitsAndBytes"]

#: ``weight_format`` as bitsandbytes saves it: 0 is the row-major layout it computes with on every device now
_ROW_FORMAT = 0


#: the 4-bit codes bitsandbytes has
_FOUR_BIT_CODES = ("nf4", "fp4")


class BitsAndBytes(QuantizedFormat):
    """bitsandbytes' 8-bit layers (``Linear8bitLt``): an int8 ``weight`` beside its per-row ``SCB`` becomes an
    :class:`LLMInt8Linear` computing as bitsandbytes does, outlier threshold included. Its 4-bit layers
    (``Linear4bit``): packed NF4 or FP4 codes beside their block scales become a :class:`FourBitLinear` computing as
    bitsandbytes' dequantizing product does."""

    quant_method = "bitsandbytes"
    description = "bitsandbytes 8-bit (LLM.int8()) and 4-bit (NF4, FP4, nested scales or not)"
    rank_modules = ("bitsandbytes",)  # its 4-bit dequantizing operator

    def check(self, quantization: dict[str, Any], where: str) -> None:
        if _four_bit(quantization):
            kind, storage = quantization.get("bnb_4bit_quant_type", "fp4"), quantization.get("bnb_4bit_quant_storage")
            if kind not in _FOUR_BIT_CODES:
                raise ShardingError(f"{where} is bitsandbytes 4-bit {kind!r}: tpcore splits {_FOUR_BIT_CODES}")
            if storage not in (None, "uint8"):
                raise ShardingError(
                    f"{where} stores bitsandbytes 4-bit codes as {storage} (bnb_4bit_quant_storage): tpcore splits "
                    "them stored as uint8"
                )
            _compute_dtype(quantization, where)
            return
        if quantization.get("llm_int8_has_fp16_weight"):
            raise ShardingError(
                f"{where} is bitsandbytes 8-bit with float16 weights kept (llm_int8_has_fp16_weight, for training): "
                "tpcore splits the int8 weights inference uses"
            )

    def adopt(self, model: nn.Module, quantization: dict[str, Any]) -> int:
        """A ``Linear8bitLt`` becomes an :class:`LLMInt8Linear` holding its int8 values and ``SCB``, a
        ``Linear4bit`` a :class:`FourBitLinear` holding its codes and its block scales (nested ones made float32)."""
        return _adopt_four_bit(model) if _four_bit(quantization) else _adopt_llm_int8(model)

    def hold(self, model: nn.Module, checkpoint: Any, quantization: dict[str, Any]) -> int:
        if _four_bit(quantization):
            return _hold_four_bit(model, checkpoint, _compute_dtype(quantization, "the checkpoint"))
        return _hold_llm_int8(model, checkpoint, float(quantization.get("llm_int8_threshold", 6.0)))


def _adopt_llm_int8(model: nn.Module) -> int:
    """Each ``Linear8bitLt`` of ``model`` made an :class:`LLMInt8Linear` with its int8 values and ``SCB``."""
    adopted = 0
    for path, module in model.named_modules():
        state = getattr(module, "state", None)
        if type(module).__name__ != "Linear8bitLt" or state is None:
            continue
        assert isinstance(module, nn.Linear)
        weight, bias = module.weight, module.bias
        scales = getattr(weight, "SCB", None)
        if scales is None:
            scales = state.SCB
        if weight.dtype != torch.int8 or scales is None or state.has_fp16_weights:
            raise ShardingError(
                f"{type(model).__name__}'s {path!r} is a bitsandbytes 8-bit layer without int8 weights and their "
                "scales (not yet quantized, or kept in float16 for training): tpcore splits quantized ones"
            )
        LLMInt8Linear.hold(module, state.threshold)
        module.weight = nn.Parameter(weight.data, requires_grad=False)
        module.SCB = nn.Parameter(scales, requires_grad=False)
        module.bias = bias
        for attribute in ("state", "index", "init_8bit_state"):
            module.__dict__.pop(attribute, None)
        adopted += 1
    return adopted


def _hold_llm_int8(model: nn.Module, checkpoint: Any, threshold: float) -> int:
    """Each linear stored as int8 rows beside its ``SCB`` becomes an :class:`LLMInt8Linear`."""
    keys = checkpoint.stored_keys(model)
    scale_keys = {key for key in checkpoint.files if key.endswith(".SCB")}
    held = 0
    for path, module in list(model.named_modules()):
        key = keys.get(f"{path}.weight" if path else "weight")
        scale_key = None if key is None else key.removesuffix("weight") + "SCB"
        if not isinstance(module, nn.Linear) or scale_key not in scale_keys:
            continue
        stored = [(checkpoint.stored_shape(k), checkpoint.stored_dtype(k)) for k in (key, scale_key)]
        wanted = [([module.out_features, module.in_features], torch.int8), ([module.out_features], torch.float32)]
        if stored != wanted:
            raise ShardingError(
                f"{key!r} and {scale_key!r} are stored as {stored}: tpcore splits bitsandbytes' int8 rows and "
                f"float32 row scales, here {wanted}"
            )
        format_key = f"{key}_format"
        if format_key in checkpoint.files and int(checkpoint.read(format_key, None, 0, 1)) != _ROW_FORMAT:
            raise ShardingError(f"{format_key!r} is not bitsandbytes' row format: tpcore splits row-major int8")
        LLMInt8Linear.hold(module, threshold)
        scale_keys.discard(scale_key)
        held += 1
    refuse_untaken(scale_keys, "scales", "bitsandbytes 8-bit")
    return held


def _four_bit(quantization: dict[str, Any]) -> bool:
    return bool(quantization.get("load_in_4bit") or quantization.get("_load_in_4bit"))


def _compute_dtype(quantization: dict[str, Any], where: str) -> torch.dtype | None:
    """``bnb_4bit_compute_dtype`` as a torch dtype (``None``: the input's)."""
    name = quantization.get("bnb_4bit_compute_dtype")
    if name is None:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ShardingError(f"{where} computes bitsandbytes 4-bit in {name!r}, which is no torch floating dtype")
    return dtype


def _hold_four_bit(model: nn.Module, checkpoint: Any, compute_dtype: torch.dtype | None) -> int:
    """Each linear whose codes are stored with a 4-bit quantization state becomes a :class:`FourBitLinear` reading
    the stored tensors under their names (module docstring)."""
    keys = checkpoint.stored_keys(model)
    state_keys = {key for key in checkpoint.files if ".quant_state.bitsandbytes__" in key}
    by_weight = {state_key.partition(".quant_state.")[0]: state_key for state_key in state_keys}
    held = 0
    for path, module in list(model.named_modules()):
        key = keys.get(f"{path}.weight" if path else "weight")
        state_key = by_weight.get(key) if key is not None else None
        if not isinstance(module, nn.Linear) or state_key is None:
            continue
        state = json.loads(bytes(checkpoint.read(state_key, None, 0, 1).tolist()))
        shape = [module.out_features, module.in_features]
        if state.get("shape") != shape or state.get("quant_type") not in _FOUR_BIT_CODES:
            raise ShardingError(
                f"{state_key!r} gives {state.get('quant_type')!r} codes of shape {state.get('shape')}: tpcore splits "
                f"NF4 or FP4 codes of a {tuple(shape)} weight here"
            )
        nested = "nested_offset" in state
        if nested and state.get("nested_blocksize") != NESTED_BLOCK:
            raise ShardingError(f"{state_key!r}: nested scales in blocks of {state.get('nested_blocksize')}")
        stored_as = {"weight": key, "absmax": f"{key}.absmax", "code": f"{key}.quant_map"}
        if nested:
            stored_as.update(nested_absmax=f"{key}.nested_absmax", nested_code=f"{key}.nested_quant_map")
        missing = [stored for stored in stored_as.values() if stored not in checkpoint.files]
        if missing:
            raise ShardingError(f"{key!r} is stored 4-bit without {missing[0]!r}")
        try:
            layer = FourBitLinear.hold(
                module,
                state["quant_type"],
                int(state["blocksize"]),
                compute_dtype,
                checkpoint.stored_shape(f"{key}.nested_absmax")[0] if nested else None,
                float(state.get("nested_offset", 0.0)),
            )
        except ValueError as error:
            raise ShardingError(f"{key!r}: {error}") from None
        layer.stored_as = stored_as
        state_keys.discard(state_key)
        held += 1
    refuse_untaken(state_keys, "quantizes", "bitsandbytes 4-bit")
    return held


def _adopt_four_bit(model: nn.Module) -> int:
    """Each ``Linear4bit`` of ``model`` made a :class:`FourBitLinear` with its codes and float32 block scales."""
    adopted = 0
    for path, module in model.named_modules():
        state = getattr(module.weight, "quant_state", None) if type(module).__name__ == "Linear4bit" else None
        if state is None:
            continue
        assert isinstance(module, nn.Linear)
        where = f"{type(model).__name__}'s {path!r}"
        if getattr(state, "packing_format_for_cpu", False):
            raise ShardingError(
                f"{where} holds bitsandbytes' CPU-packed codes (made by a forward): parallelize the model as "
                "transformers loads it, before any forward, or its saved directory"
            )
        if state.quant_type not in _FOUR_BIT_CODES or list(state.shape) != [module.out_features, module.in_features]:
            raise ShardingError(f"{where}: {state.quant_type!r} codes of shape {list(state.shape)}")
        absmax = state.absmax
        if state.nested:
            index = torch.arange(absmax.numel()) // state.state2.blocksize
            absmax = state.state2.code[absmax.long()] * state.state2.absmax[index] + state.offset
        codes, bias = module.weight.data, module.bias
        try:
            FourBitLinear.hold(module, state.quant_type, int(state.blocksize), getattr(module, "compute_dtype", None))
        except ValueError as error:
            raise ShardingError(f"{where}: {error}") from None
        module.weight = nn.Parameter(codes.view(torch.uint8).reshape(module.out_features, -1), requires_grad=False)
        module.absmax = nn.Parameter(absmax.float().reshape(module.out_features, -1), requires_grad=False)
        module.code = nn.Parameter(state.code.float(), requires_grad=False)
        module.bias = bias
        adopted += 1
    return adopted
