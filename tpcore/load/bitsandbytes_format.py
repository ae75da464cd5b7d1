"""bitsandbytes checkpoints as transformers loads and saves them (``BitsAndBytesConfig``): 8-bit (``load_in_8bit``,
LLM.int8()) layers become :class:`~tpcore.parallel.llm_int8_linear.LLMInt8Linear`, from a directory or from the
``Linear8bitLt`` layers of the object transformers loads; every other variant is refused by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpcore.authoring.quantized_format import QuantizedFormat, refuse_untaken
from tpcore.errors import ShardingError
from tpcore.parallel.llm_int8_linear import LLMInt8Linear

__all__ = ["BitsAndBytes"]

#: ``weight_format`` as bitsandbytes saves it: 0 is the row-major layout it computes with on every device now
_ROW_FORMAT = 0


class BitsAndBytes(QuantizedFormat):
    """bitsandbytes' 8-bit layers (``Linear8bitLt``): an int8 ``weight`` beside its per-row ``SCB`` becomes an
    :class:`LLMInt8Linear` computing as bitsandbytes does, outlier threshold included."""

    quant_method = "bitsandbytes"
    description = "bitsandbytes 8-bit (LLM.int8(): int8 rows, outlier columns in the input's dtype)"

    def check(self, quantization: dict[str, Any], where: str) -> None:
        if quantization.get("load_in_4bit") or quantization.get("_load_in_4bit"):
            kind = quantization.get("bnb_4bit_quant_type", "fp4")
            raise ShardingError(f"{where} is bitsandbytes 4-bit ({kind}): tpcore splits bitsandbytes 8-bit only yet")
        if quantization.get("llm_int8_has_fp16_weight"):
            raise ShardingError(
                f"{where} is bitsandbytes 8-bit with float16 weights kept (llm_int8_has_fp16_weight, for training): "
                "tpcore splits the int8 weights inference uses"
            )

    @staticmethod
    def threshold(quantization: dict[str, Any]) -> float:
        return float(quantization.get("llm_int8_threshold", 6.0))

    def adopt(self, model: nn.Module, quantization: dict[str, Any]) -> int:
        """A ``Linear8bitLt`` becomes an :class:`LLMInt8Linear` holding its int8 values and ``SCB``."""
        adopted = 0
        for path, module in model.named_modules():
            state = getattr(module, "state", None)
            if type(module).__name__ != "Linear8bitLt" or state is None:
                continue
            weight = module.weight
            scales = getattr(weight, "SCB", None)
            if scales is None:
                scales = state.SCB
            if weight.dtype != torch.int8 or scales is None or state.has_fp16_weights:
                raise ShardingError(
                    f"{type(model).__name__}'s {path!r} is a bitsandbytes 8-bit layer without int8 weights and their "
                    "scales (not yet quantized, or kept in float16 for training): tpcore splits quantized ones"
                )
            bias = module.bias
            assert isinstance(module, nn.Linear)
            LLMInt8Linear.hold(module, state.threshold)
            module.weight = nn.Parameter(weight.data, requires_grad=False)
            module.SCB = nn.Parameter(scales, requires_grad=False)
            module.bias = bias
            for attribute in ("state", "index", "init_8bit_state"):
                module.__dict__.pop(attribute, None)
            adopted += 1
        return adopted

    def hold(self, model: nn.Module, checkpoint: Any, quantization: dict[str, Any]) -> int:
        keys = checkpoint.stored_keys(model)
        scale_keys = {key for key in checkpoint.files if key.endswith(".SCB")}
        held = 0
        for path, module in list(model.named_modules()):
            key = keys.get(f"{path}.weight" if path else "weight")
            if not isinstance(module, nn.Linear) or key is None or key.removesuffix("weight") + "SCB" not in scale_keys:
                continue
            scale_key = key.removesuffix("weight") + "SCB"
            shapes = [checkpoint.stored_shape(key), checkpoint.stored_shape(scale_key)]
            dtypes = [checkpoint.stored_dtype(key), checkpoint.stored_dtype(scale_key)]
            if shapes != [[module.out_features, module.in_features], [module.out_features]] or dtypes != [
                torch.int8,
                torch.float32,
            ]:
                raise ShardingError(
                    f"{key!r} and {scale_key!r} are stored as {shapes} of {dtypes}: tpcore splits bitsandbytes' int8 "
                    f"rows and float32 row scales, here ({module.out_features}, {module.in_features}) and "
                    f"({module.out_features},)"
                )
            format_key = key + "_format"
            if format_key in checkpoint.files and int(checkpoint.read(format_key, None, 0, 1)) != _ROW_FORMAT:
                raise ShardingError(f"{format_key!r} is not bitsandbytes' row format: tpcore splits row-major int8")
            LLMInt8Linear.hold(module, self.threshold(quantization))
            scale_keys.discard(scale_key)
            held += 1
        refuse_untaken(scale_keys, "scales", "bitsandbytes 8-bit")
        return held
