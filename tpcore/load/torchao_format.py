"""torchao checkpoints as transformers saves them in safetensors: ``Int8WeightOnlyConfig`` per row becomes
:class:`~tpcore.parallel.int8_linear.Int8Linear` and ``Float8WeightOnlyConfig`` per row
:class:`~tpcore.parallel.quantized_linear.RowFP8Linear`, from a directory or from the ``Int8Tensor`` and
``Float8Tensor`` weights of the object transformers loads; every other torchao config is refused by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpcore.authoring.quantized_format import QuantizedFormat, refuse_untaken
from tpcore.errors import ShardingError
from tpcore.parallel.int8_linear import Int8Linear
from tpcore.parallel.quantized_linear import RowFP8Linear

__all__ = ["TorchAO"]


#: the weight-only configs tpcore splits, per row
_WEIGHT_ONLY = ("Int8WeightOnlyConfig", "Float8WeightOnlyConfig")
#: the value dtypes a config may name (none: int8's)
_FP8_NAMES = (None, "float8_e4m3fn")


class TorchAO(QuantizedFormat):
    """torchao's weight-only quantization per row (``Int8WeightOnlyConfig``, ``Float8WeightOnlyConfig``), as
    transformers saves it in safetensors: a linear stored as ``_weight_qdata`` (int8 or e4m3) beside its
    ``_weight_scale`` becomes an :class:`Int8Linear` or a :class:`RowFP8Linear`."""

    quant_method = "torchao"
    description = "torchao int8 and float8 weight-only (a scale per row)"

    def check(self, quantization: dict[str, Any], where: str) -> None:
        quant_type = quantization.get("quant_type")
        if not isinstance(quant_type, dict) or set(quant_type) != {"default"}:
            raise ShardingError(
                f"{where} is torchao {quant_type!r}: tpcore splits one Int8WeightOnlyConfig for every layer, as "
                "transformers 5 saves it"
            )
        kind, data = quant_type["default"].get("_type"), quant_type["default"].get("_data") or {}
        granularity = (data.get("granularity") or {}).get("_type", "PerRow")
        values = (data.get("weight_dtype") or {}).get("_data")
        if kind not in _WEIGHT_ONLY or granularity != "PerRow" or data.get("group_size") or values not in _FP8_NAMES:
            group = f", groups of {data['group_size']}" if data.get("group_size") else ""
            stored = f", {values}" if values else ""
            raise ShardingError(
                f"{where} is torchao {kind} ({granularity}{group}{stored}): tpcore splits Int8WeightOnlyConfig and "
                "Float8WeightOnlyConfig (e4m3) per row only"
            )
        if quantization.get("include_input_output_embeddings"):
            raise ShardingError(f"{where} quantizes its embeddings: tpcore splits torchao's linear layers only")

    def adopt(self, model: nn.Module, quantization: dict[str, Any]) -> int:
        """A linear whose weight is torchao's per-row ``Int8Tensor`` becomes an :class:`Int8Linear` holding its
        values, scales and zero points; one whose weight is a per-row ``Float8Tensor`` a :class:`RowFP8Linear`."""
        adopted = 0
        for path, module in model.named_modules():
            weight: Any = module._parameters.get("weight")
            if isinstance(module, nn.Linear) and type(weight).__name__ == "Float8Tensor":
                _adopt_float8(module, weight, f"{type(model).__name__}'s {path!r}")
                adopted += 1
            if not isinstance(module, nn.Linear) or type(weight).__name__ != "Int8Tensor":
                continue
            per_row = list(weight.block_size) == [1, module.in_features]
            if not per_row or weight.act_quant_kwargs is not None or weight.act_pre_scale is not None:
                raise ShardingError(
                    f"{type(model).__name__}'s {path!r} is a torchao Int8Tensor of blocks {weight.block_size} or "
                    "with activations quantized: tpcore splits per-row int8 weight-only ones"
                )
            values, scale, zero_point = weight.qdata, weight.scale, weight.zero_point
            module.__dict__.pop("extra_repr", None)  # torchao's, bound to the layer: nothing a rank can import
            Int8Linear.hold(module, scale.dtype)
            module._weight_qdata = nn.Parameter(values, requires_grad=False)
            module.weight = module._weight_qdata
            module._weight_scale = nn.Parameter(scale.reshape(-1, 1), requires_grad=False)
            module._weight_zero_point = nn.Parameter(zero_point.reshape(-1, 1), requires_grad=False)
            adopted += 1
        return adopted

    def hold(self, model: nn.Module, checkpoint: Any, quantization: dict[str, Any]) -> int:
        keys = checkpoint.stored_keys(model)
        value_keys = {key for key in checkpoint.files if key.endswith("._weight_qdata")}
        held = 0
        for path, module in list(model.named_modules()):
            value_key = keys.get(f"{path}.weight", f"{path}.weight").removesuffix("weight") + "_weight_qdata"
            if not isinstance(module, nn.Linear) or value_key not in value_keys:
                continue
            scale_key = value_key.removesuffix("qdata") + "scale"
            shapes = [
                checkpoint.stored_shape(key) if key in checkpoint.files else None for key in (value_key, scale_key)
            ]
            if shapes != [[module.out_features, module.in_features], [module.out_features, 1]]:
                raise ShardingError(
                    f"{value_key!r} and {scale_key!r} are stored as {shapes}: tpcore splits values with a scale "
                    f"per row, here ({module.out_features}, {module.in_features}) and ({module.out_features}, 1)"
                )
            values = checkpoint.stored_dtype(value_key)
            if values == torch.float8_e4m3fn:
                layer = RowFP8Linear.hold_rows(module)
                layer.stored_as = {"weight": value_key, "weight_scale_inv": scale_key}
            elif values == torch.int8:
                Int8Linear.hold(module, checkpoint.stored_dtype(scale_key))
            else:
                raise ShardingError(f"{value_key!r} holds {values}: tpcore splits int8 and e4m3 values")
            value_keys.discard(value_key)
            held += 1
        refuse_untaken(value_keys, "quantizes", "torchao")
        return held


def _adopt_float8(module: nn.Linear, weight: Any, where: str) -> None:
    """``module``, whose weight is torchao's ``Float8Tensor``, made a :class:`RowFP8Linear` with its values and
    scales."""
    per_row = list(weight.block_size) == [1, module.in_features] and weight.qdata.dtype == torch.float8_e4m3fn
    if not per_row or weight.act_quant_kwargs is not None:
        raise ShardingError(
            f"{where} is a torchao Float8Tensor of blocks {weight.block_size} in {weight.qdata.dtype} or with "
            "activations quantized: tpcore splits per-row e4m3 weight-only ones"
        )
    values, scale, bias = weight.qdata, weight.scale, module.bias
    module.__dict__.pop("extra_repr", None)  # torchao's, bound to the layer: nothing a rank can import
    layer = RowFP8Linear.hold_rows(module)
    layer.weight = nn.Parameter(values, requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(scale.float().reshape(-1, 1), requires_grad=False)
    layer.bias = bias
