"""GPTQ checkpoints (GPTQModel's and AutoGPTQ's layout, ``quant_method: gptq``): a linear stored as ``qweight``,
``qzeros``, ``scales`` and ``g_idx`` becomes a :class:`~tpcore.parallel.gptq_linear.GPTQLinear`, from a directory
(:meth:`GPTQ.hold`) or from the object transformers loads through optimum and GPTQModel (:meth:`GPTQ.adopt`, before
any forward: GPTQModel's CPU kernel repacks its tensors on the first). Act-order (``desc_act``) splits; 3-bit values
and kernel-repacked formats (Marlin, BitBLAS) are refused by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpcore.authoring.quantized_format import QuantizedFormat, refuse_untaken
from tpcore.errors import ShardingError
from tpcore.parallel.gptq_linear import GPTQ_BIT_WIDTHS, GPTQLinear

__all__ = ["GPTQ"]

#: GPTQ's checkpoint formats tpcore reads, and what each stores of a zero point ``z`` (v1: ``z - 1``)
_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}

#: the tensors a GPTQ linear stores beside ``qweight``
_STORED = ("qzeros", "scales", "g_idx")


class GPTQ(QuantizedFormat):
    """GPTQ's packed integers (:mod:`tpcore.parallel.gptq_linear`), v1 and v2 checkpoints, act-order or not."""

    quant_method = "gptq"
    description = "GPTQ 2-, 4- and 8-bit integers (v1 and v2 checkpoints, act-order too)"

    def check(self, quantization: dict[str, Any], where: str) -> None:
        bits = quantization.get("bits")
        if bits not in GPTQ_BIT_WIDTHS:
            raise ShardingError(
                f"{where} is GPTQ {bits}-bit: tpcore splits {', '.join(map(str, GPTQ_BIT_WIDTHS))}-bit values"
            )
        _zero_offset(quantization, where)
        if quantization.get("is_marlin_format"):
            raise ShardingError(f"{where} is GPTQ repacked for Marlin kernels: tpcore splits the GPTQ layout")

    def hold(self, model: nn.Module, checkpoint: Any, quantization: dict[str, Any]) -> int:
        bits, group_size = int(quantization["bits"]), int(quantization.get("group_size", -1))
        zero_offset = _zero_offset(quantization, "the checkpoint")
        keys = checkpoint.stored_keys(model)
        packed_keys = {key for key in checkpoint.files if key.endswith(".qweight")}
        held = 0
        for path, module in list(model.named_modules()):
            key = keys.get(f"{path}.weight" if path else "weight", f"{path}.weight")
            packed_key = key.removesuffix("weight") + "qweight"
            if not isinstance(module, nn.Linear) or packed_key not in packed_keys:
                continue
            stem = packed_key.removesuffix("qweight")
            missing = [stem + name for name in _STORED if stem + name not in checkpoint.files]
            if missing:
                raise ShardingError(f"{packed_key!r} is stored without {missing[0]!r}")
            try:
                layer = GPTQLinear.hold(
                    module,
                    bits,
                    group_size if group_size > 0 else module.in_features,
                    checkpoint.stored_dtype(stem + "scales"),
                    zero_offset,
                )
            except ValueError as error:
                raise ShardingError(f"{packed_key!r}: {error}") from None
            _check_stored(layer, checkpoint, stem)
            packed_keys.discard(packed_key)
            held += 1
        refuse_untaken(packed_keys, "packs", "GPTQ")
        return held

    def adopt(self, model: nn.Module, quantization: dict[str, Any]) -> int:
        """Each of GPTQModel's quantized linears (its tensors still as GPTQ stores them) becomes a
        :class:`GPTQLinear` holding them."""
        adopted = 0
        for path, module in list(model.named_modules()):
            if not all(isinstance(getattr(module, name, None), torch.Tensor) for name in ("qweight", *_STORED)):
                continue
            where = f"{type(model).__name__}'s {path!r}"
            if getattr(module, "linear_mode", None) == "inference" or module.qweight.dim() != 2:
                raise ShardingError(
                    f"{where} holds GPTQModel's CPU-repacked tensors (made by a forward): parallelize the model as "
                    "transformers loads it, before any forward, or its saved directory"
                )
            # GPTQModel's kernels that require v2 zero points (its CPU ones) hold them so whatever the checkpoint's
            stored_offset = 0 if getattr(module, "REQUIRES_FORMAT_V2", False) else _zero_offset(quantization, where)
            bias = getattr(module, "bias", None)
            linear = nn.Linear(module.in_features, module.out_features, bias=bias is not None, device="meta")
            try:
                layer = GPTQLinear.hold(
                    linear,
                    int(module.bits),
                    int(module.group_size) if int(module.group_size) > 0 else module.in_features,
                    module.scales.dtype,
                    stored_offset,
                )
            except ValueError as error:
                raise ShardingError(f"{where}: {error}") from None
            for name in ("qweight", *_STORED):
                setattr(layer, name, nn.Parameter(getattr(module, name).data, requires_grad=False))
            layer.weight = layer.qweight
            layer.bias = None if bias is None else nn.Parameter(bias.data, requires_grad=False)  # type: ignore[assignment]
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
            adopted += 1
        return adopted


def _zero_offset(quantization: dict[str, Any], where: str) -> int:
    """What the checkpoint's stored zero points lack (its ``checkpoint_format``, or ``format``)."""
    layout = quantization.get("checkpoint_format") or quantization.get("format") or "gptq"
    if layout not in _ZERO_OFFSETS:
        raise ShardingError(
            f"{where} is GPTQ in the {layout!r} layout: tpcore splits {', '.join(map(repr, _ZERO_OFFSETS))}"
        )
    return _ZERO_OFFSETS[layout]


def _check_stored(layer: GPTQLinear, checkpoint: Any, stem: str) -> None:
    """Each of the layer's tensors is stored in its shape and integer dtype, or :class:`ShardingError` names it."""
    for name in ("qweight", *_STORED):
        tensor, key = getattr(layer, name), stem + name
        stored = (checkpoint.stored_shape(key), checkpoint.stored_dtype(key))
        if stored[0] != list(tensor.shape) or (tensor.dtype == torch.int32 and stored[1] != torch.int32):
            raise ShardingError(
                f"{key!r} is stored as {stored}: a ({layer.out_features}, {layer.in_features}) GPTQ linear in "
                f"{layer.bits}-bit values in groups of {layer.group_size} stores "
                f"({list(tensor.shape)}, {tensor.dtype})"
            )
