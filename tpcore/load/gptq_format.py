"""GPTQ and AWQ checkpoints. GPTQ (GPTQModel's and AutoGPTQ's layout, ``quant_method: gptq``): a linear stored as
``qweight``, ``qzeros``, ``scales`` and ``g_idx`` becomes a :class:`~tpcore.parallel.gptq_linear.GPTQLinear`, from a
directory (:meth:`GPTQ.hold`) or from the object transformers loads through optimum and GPTQModel (:meth:`GPTQ.adopt`,
before any forward: GPTQModel's CPU kernel repacks its tensors on the first). Act-order (``desc_act``) splits; 3-bit
values and kernel-repacked formats (Marlin, BitBLAS) are refused by name. AWQ (AutoAWQ's GEMM layout,
``quant_method: awq``): ``qweight``, ``qzeros`` and ``scales`` become an
:class:`~tpcore.parallel.gptq_linear.AWQLinear` the same ways; its GEMV layouts and other bit widths are refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tpcore.authoring.quantized_format import QuantizedFormat, refuse_untaken
from tpcore.errors import ShardingError
from tpcore.parallel.gptq_linear import GPTQ_BIT_WIDTHS, AWQLinear, GPTQLinear

__all__ = ["AWQ", "GPTQ"]

#: GPTQ's checkpoint formats tpcore reads, and what each stores of a zero point ``z`` (v1: ``z - 1``)
_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}

#: the groups GPTQModel's default CPU kernels take (its ``SUPPORTS_GROUP_SIZE``; tpcore computes groups of 16
#: dequantizing, since torch's int4 product does not take them); for others GPTQModel picks a dequantizing kernel
_INT4_KERNEL_GROUPS = (16, 32, 64, 128)

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

        def make(module: nn.Linear, scale_dtype: torch.dtype) -> GPTQLinear:
            layer = GPTQLinear.hold(module, bits, _group(group_size, module), scale_dtype, zero_offset)
            return _kernel_by_backend(layer, quantization)

        return _hold_packed(model, checkpoint, _STORED, "GPTQ", make)

    def adopt(self, model: nn.Module, quantization: dict[str, Any]) -> int:
        """Each of GPTQModel's quantized linears (its tensors still as GPTQ stores them) becomes a
        :class:`GPTQLinear` holding them."""

        def make(module: Any, linear: nn.Linear, where: str) -> GPTQLinear:
            # GPTQModel's kernels that require v2 zero points (its CPU ones) hold them so whatever the checkpoint's
            offset = 0 if getattr(module, "REQUIRES_FORMAT_V2", False) else _zero_offset(quantization, where)
            group = _group(int(module.group_size), linear)
            layer = GPTQLinear.hold(linear, int(module.bits), group, module.scales.dtype, offset)
            return _kernel_as(layer, module)

        return _adopt_packed(model, _STORED, make)


def _hold_packed(
    model: nn.Module,
    checkpoint: Any,
    stored: tuple[str, ...],
    form: str,
    make: Callable[[nn.Linear, torch.dtype], GPTQLinear],
) -> int:
    """Each linear of the meta ``model`` whose ``qweight`` ``checkpoint`` stores (with the tensors ``stored`` beside
    it) becomes the layer ``make(linear, scale dtype)`` makes, its stored shapes checked; the number made. A packed
    tensor no linear takes, or a layer stored otherwise, is refused naming the tensor."""
    keys = checkpoint.stored_keys(model)
    packed_keys = {key for key in checkpoint.files if key.endswith(".qweight")}
    held = 0
    for path, module in list(model.named_modules()):
        key = keys.get(f"{path}.weight" if path else "weight", f"{path}.weight")
        packed_key = key.removesuffix("weight") + "qweight"
        if not isinstance(module, nn.Linear) or packed_key not in packed_keys:
            continue
        stem = packed_key.removesuffix("qweight")
        missing = [stem + name for name in stored if stem + name not in checkpoint.files]
        if missing:
            raise ShardingError(f"{packed_key!r} is stored without {missing[0]!r}")
        try:
            layer = make(module, checkpoint.stored_dtype(stem + "scales"))
        except ValueError as error:
            raise ShardingError(f"{packed_key!r}: {error}") from None
        _check_stored(layer, checkpoint, stem, ("qweight", *stored))
        packed_keys.discard(packed_key)
        held += 1
    refuse_untaken(packed_keys, "packs", form)
    return held


def _zero_offset(quantization: dict[str, Any], where: str) -> int:
    """What the checkpoint's stored zero points lack (its ``checkpoint_format``, or ``format``)."""
    layout = quantization.get("checkpoint_format") or quantization.get("format") or "gptq"
    if layout not in _ZERO_OFFSETS:
        raise ShardingError(
            f"{where} is GPTQ in the {layout!r} layout: tpcore splits {', '.join(map(repr, _ZERO_OFFSETS))}"
        )
    return _ZERO_OFFSETS[layout]


def _check_stored(layer: GPTQLinear, checkpoint: Any, stem: str, names: tuple[str, ...]) -> None:
    """Each of the layer's tensors ``names`` is stored in its shape and integer dtype, or :class:`ShardingError` names
    it."""
    for name in names:
        tensor, key = getattr(layer, name), stem + name
        stored = (checkpoint.stored_shape(key), checkpoint.stored_dtype(key))
        if stored[0] != list(tensor.shape) or (tensor.dtype == torch.int32 and stored[1] != torch.int32):
            raise ShardingError(
                f"{key!r} is stored as {stored}: a ({layer.out_features}, {layer.in_features}) GPTQ linear in "
                f"{layer.bits}-bit values in groups of {layer.group_size} stores "
                f"({list(tensor.shape)}, {tensor.dtype})"
            )


class AWQ(QuantizedFormat):
    """AWQ's GEMM layout (:class:`AWQLinear`): 4-bit values with zero points, groups in order."""

    quant_method = "awq"
    description = "AWQ 4-bit integers (AutoAWQ's GEMM layout, zero points)"

    def check(self, quantization: dict[str, Any], where: str) -> None:
        layout = str(quantization.get("version") or quantization.get("format") or "gemm").lower()
        if layout != "gemm":
            raise ShardingError(f"{where} is AWQ in the {layout!r} layout: tpcore splits AutoAWQ's 'gemm' layout")
        if quantization.get("bits", 4) != 4:
            raise ShardingError(f"{where} is AWQ {quantization.get('bits')}-bit: tpcore splits 4-bit values")
        if quantization.get("zero_point") is False:
            raise ShardingError(f"{where} is AWQ without zero points: tpcore splits AWQ with zero points")

    def hold(self, model: nn.Module, checkpoint: Any, quantization: dict[str, Any]) -> int:
        group_size = int(quantization.get("group_size", 128))

        def make(module: nn.Linear, scale_dtype: torch.dtype) -> GPTQLinear:
            return _kernel_by_backend(AWQLinear.hold_awq(module, _group(group_size, module), scale_dtype), quantization)

        return _hold_packed(model, checkpoint, _AWQ_STORED, "AWQ", make)

    def adopt(self, model: nn.Module, quantization: dict[str, Any]) -> int:
        """Each of GPTQModel's AWQ linears (its tensors still as AWQ stores them) becomes an :class:`AWQLinear`."""

        def make(module: Any, linear: nn.Linear, where: str) -> GPTQLinear:
            return _kernel_as(
                AWQLinear.hold_awq(linear, _group(int(module.group_size), linear), module.scales.dtype), module
            )

        return _adopt_packed(model, _AWQ_STORED, make)


#: the tensors an AWQ linear stores beside ``qweight``
_AWQ_STORED = ("qzeros", "scales")


def _kernel_by_backend(layer: GPTQLinear, quantization: dict[str, Any]) -> GPTQLinear:
    """``layer`` computing as transformers would load the checkpoint: GPTQModel's default CPU kernel (torch's int4
    product) unless the config's ``backend`` names another, whose product is then the torch kernels' dequantizing
    one."""
    backend = str(quantization.get("backend") or "auto").lower()
    layer.int4_kernel = (backend == "auto" or "aten" in backend) and layer.group_size in _INT4_KERNEL_GROUPS
    return layer


def _kernel_as(layer: GPTQLinear, module: Any) -> GPTQLinear:
    """``layer`` computing as GPTQModel's ``module`` does: torch's int4 product where it is GPTQModel's CPU int4
    kernel (``TorchAtenLinear``, ``TorchAtenAwqLinear``), else the dequantizing product."""
    layer.int4_kernel = "Aten" in type(module).__name__
    return layer


def _group(size: int, linear: nn.Linear) -> int:
    """The input features a scale covers: ``size``, or the whole row where a config says ``-1``."""
    return size if size > 0 else linear.in_features


def _adopt_packed(model: nn.Module, stored: tuple[str, ...], make: Callable[[Any, nn.Linear, str], GPTQLinear]) -> int:
    """Each of GPTQModel's layers of ``model`` holding ``qweight`` and the tensors ``stored`` is replaced by the layer
    ``make(module, meta linear, where)`` makes, holding those tensors and its bias; the number replaced. A layer whose
    CPU kernel has repacked its tensors (a forward) is refused."""
    adopted = 0
    for path, module in list(model.named_modules()):
        names = ("qweight", *stored)
        if not all(isinstance(getattr(module, name, None), torch.Tensor) for name in names):
            continue
        where = f"{type(model).__name__}'s {path!r}"
        words: torch.Tensor = getattr(module, "qweight")  # noqa: B009  # a buffer mypy reads as a module
        if getattr(module, "linear_mode", None) == "inference" or words.dim() != 2:
            raise ShardingError(
                f"{where} holds GPTQModel's CPU-repacked tensors (made by a forward): parallelize the model as "
                "transformers loads it, before any forward, or its saved directory"
            )
        bias = getattr(module, "bias", None)
        linear = nn.Linear(module.in_features, module.out_features, bias=bias is not None, device="meta")
        try:
            layer = make(module, linear, where)
        except ValueError as error:
            raise ShardingError(f"{where}: {error}") from None
        for name in names:
            setattr(layer, name, nn.Parameter(getattr(module, name).data, requires_grad=False))
        layer.weight = layer.qweight
        layer.bias = None if bias is None else nn.Parameter(bias.data, requires_grad=False)  # type: ignore[assignment]
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        adopted += 1
    return adopted
