"""compressed-tensors checkpoints (llmcompressor's output): ``pack-quantized`` integers (W4A16, W8A16) become
:class:`~tpcore.parallel.packed_int_linear.PackedIntLinear`, ``nvfp4-pack-quantized`` NVFP4A16
:class:`~tpcore.parallel.nvfp4_linear.NVFP4Linear`, ``float-quantized`` FP8_DYNAMIC
:class:`~tpcore.parallel.quantized_linear.TokenFP8Linear` and FP8_BLOCK
:class:`~tpcore.parallel.quantized_linear.GroupFP8Linear`, from a directory (:meth:`CompressedTensors.hold`) or from
the object transformers loads (:meth:`CompressedTensors.adopt`); every other variant is refused by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpcore.authoring.quantized_format import FP8_VALUES, QuantizedFormat, refuse_untaken
from tpcore.errors import ShardingError
from tpcore.parallel.int8_linear import TokenInt8Linear
from tpcore.parallel.nvfp4_linear import NVFP4Linear
from tpcore.parallel.packed_int_linear import BIT_WIDTHS, PackedIntLinear
from tpcore.parallel.quantized_linear import GroupFP8Linear, TokenFP8Linear

__all__ = ["CompressedTensors"]


class CompressedTensors(QuantizedFormat):
    """compressed-tensors checkpoints (llmcompressor's output), in these layouts:

    - ``pack-quantized`` integers (W4A16, W8A16): a linear stored as ``weight_packed`` (int32 words along the input
      features) beside its ``weight_scale`` (and, asymmetric, its packed ``weight_zero_point``) becomes a
      :class:`PackedIntLinear`; a scale per group or per row, activations unquantized;
    - ``nvfp4-pack-quantized`` (NVFP4A16): e2m1 values two a byte in ``weight_packed``, e4m3 group scales and a
      ``weight_global_scale`` become an :class:`NVFP4Linear`, activations unquantized;
    - ``float-quantized`` FP8 with dynamic per-token activations (``FP8_DYNAMIC``): an e4m3 ``weight`` beside its
      per-row ``weight_scale`` becomes a :class:`TokenFP8Linear`; with a scale per ``(B0, B1)`` block and
      activations rounded per group of ``B1`` features (``FP8_BLOCK``) a :class:`GroupFP8Linear`;
    - ``int-quantized`` int8 with dynamic per-token activations (``W8A8``): an int8 ``weight`` beside its per-row
      ``weight_scale`` becomes a :class:`TokenInt8Linear`."""

    quant_method = "compressed-tensors"
    description = (
        "compressed-tensors pack-quantized integers (W4A16, W4A16_ASYM, W8A16), NVFP4A16, FP8_DYNAMIC, FP8_BLOCK "
        "and W8A8"
    )

    def check(self, quantization: dict[str, Any], where: str) -> None:
        for name in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if quantization.get(name):
                raise ShardingError(f"{where} is compressed-tensors with a {name}: tpcore splits its quantization only")
        self.scheme(quantization, where)

    def scheme(self, quantization: dict[str, Any], where: str) -> tuple[str | None, dict[str, Any]]:
        """The one layout and weight scheme of every config group, checked."""
        groups = quantization.get("config_groups") or {}
        schemes = []
        for name, group in groups.items():
            layout = group.get("format") or quantization.get("format")
            schemes.append((layout, _checked_group(layout, group, f"{where}, config group {name!r}")))
        if not schemes:
            raise ShardingError(f"{where} is compressed-tensors without config groups")
        if any(scheme != schemes[0] for scheme in schemes):
            raise ShardingError(f"{where} has config groups of different schemes: tpcore splits one scheme")
        return schemes[0]

    def adopt(self, model: nn.Module, quantization: dict[str, Any]) -> int:
        """compressed-tensors' own layers become tpcore's: a linear still compressed (transformers leaves it so until
        the first forward) a :class:`PackedIntLinear` or :class:`TokenFP8Linear` with its tensors; one decompressed
        by a forward a plain linear again, where its activations were not quantized. Either way compressed-tensors'
        forward and its tensors go."""
        hook = model.__dict__.pop("ct_decompress_hook", None)  # decompresses the whole model on its first forward
        if hook is not None:
            hook.remove()
        if any(type(module._parameters) is not dict for module in model.modules()):  # its offloading, on decompressing
            from compressed_tensors.offload.dispatch import remove_dispatch

            remove_dispatch(model, onload_tensors=True)
        adopted = 0
        for path, module in model.named_modules():
            own = module.__dict__.get("forward")
            if getattr(own, "__func__", None) is type(module).forward:  # the class's own, bound back by remove_dispatch
                del module.forward
            scheme = module.__dict__.get("quantization_scheme")
            if scheme is not None:
                adopted += _adopt_layer(module, scheme, f"{type(model).__name__}'s {path!r}")
        return adopted

    def hold(self, model: nn.Module, checkpoint: Any, quantization: dict[str, Any]) -> int:
        layout, weights = self.scheme(quantization, "the checkpoint")
        if layout in _TOKEN_ROUNDED:
            return _hold_token_rounded(model, checkpoint, layout, weights)
        keys = checkpoint.stored_keys(model)
        packed_keys = {key for key in checkpoint.files if key.endswith(".weight_packed")}
        for key in checkpoint.files:
            if key.endswith(".weight_g_idx"):
                raise ShardingError(f"{key!r}: activation-ordered groups (g_idx) are not split by tpcore yet")
        held = 0
        for path, module in list(model.named_modules()):
            key = keys.get(f"{path}.weight" if path else "weight", f"{path}.weight")
            packed_key = key.removesuffix("weight") + "weight_packed"
            if not isinstance(module, nn.Linear) or packed_key not in packed_keys:
                continue
            try:
                _hold_packed(module, layout, weights, checkpoint, packed_key.removesuffix("packed"))
            except ValueError as error:
                raise ShardingError(f"{packed_key!r}: {error}") from None
            packed_keys.discard(packed_key)
            held += 1
        refuse_untaken(packed_keys, "packs", "compressed-tensors")
        return held


#: compressed-tensors' layout of NVFP4 (e2m1 values two a byte, e4m3 group scales, a float32 global scale)
NVFP4 = "nvfp4-pack-quantized"


def _hold_packed(module: nn.Linear, layout: str | None, weights: dict[str, Any], checkpoint: Any, prefix: str) -> None:
    """Make the meta ``module`` hold what ``checkpoint`` stores under ``prefix`` (``"...weight_"``) in ``layout``:
    NVFP4, or packed integers (with their zero points where asymmetric); ValueError naming what does not fit."""
    scale_key = prefix + "scale"
    if scale_key not in checkpoint.files:
        raise ValueError(f"stored without its {scale_key!r}")
    scale_shape, scale_dtype = tuple(checkpoint.stored_shape(scale_key)), checkpoint.stored_dtype(scale_key)
    if layout == NVFP4:
        if prefix + "global_scale" not in checkpoint.files:
            raise ValueError(f"stored without its {prefix + 'global_scale'!r}")
        NVFP4Linear.hold_fp4(module, int(weights["group_size"]), scale_shape, scale_dtype)
        return
    zero_key, asymmetric = prefix + "zero_point", weights.get("symmetric") is False
    if asymmetric and zero_key not in checkpoint.files:
        raise ValueError(f"asymmetric, stored without its {zero_key!r}")
    group = module.in_features if weights["strategy"] == "channel" else int(weights["group_size"])
    bits = int(weights["num_bits"])
    packed = PackedIntLinear.hold(module, bits, group, scale_shape, scale_dtype, zero_points=asymmetric)
    if asymmetric:
        _check_zero_points(packed, tuple(checkpoint.stored_shape(zero_key)))


#: the layouts whose inputs are rounded per token: the dtype each stores its values in, and its layer class
_TOKEN_ROUNDED = {
    "float-quantized": (FP8_VALUES, TokenFP8Linear.hold_rows),
    "int-quantized": ((torch.int8,), TokenInt8Linear.hold),
}


def _hold_token_rounded(model: nn.Module, checkpoint: Any, layout: str, weights: dict[str, Any]) -> int:
    """FP8_DYNAMIC, FP8_BLOCK or W8A8: each linear stored in 8-bit values beside its ``weight_scale`` (a scale per
    row, or per block) becomes the layout's layer class."""
    dtypes = _TOKEN_ROUNDED[layout][0]
    keys = checkpoint.stored_keys(model)
    scale_keys = {key for key in checkpoint.files if key.endswith(".weight_scale")}
    held = 0
    for path, module in list(model.named_modules()):
        key = keys.get(f"{path}.weight" if path else "weight")
        if not isinstance(module, nn.Linear) or key is None or checkpoint.stored_dtype(key) not in dtypes:
            continue
        scale_key = key + "_scale"
        if scale_key not in scale_keys:
            raise ShardingError(f"{key!r} is stored quantized without its {scale_key!r}")
        _hold_rounded(module, layout, weights, tuple(checkpoint.stored_shape(scale_key)),
                      checkpoint.stored_dtype(scale_key), f"{key!r}")  # fmt: skip
        scale_keys.discard(scale_key)
        held += 1
    refuse_untaken(scale_keys, "scales", f"compressed-tensors {layout}")
    return held


def _check_zero_points(module: PackedIntLinear, shape: tuple[int, ...]) -> None:
    """Refuse zero points of any shape but the packed one ``module`` holds (ValueError)."""
    packed = tuple(module.weight_zero_point.shape)
    if shape != packed:
        raise ValueError(f"zero points of shape {list(shape)}, not the packed {list(packed)}")


def _hold_rounded(module: nn.Linear, layout: str, weights: dict[str, Any], scale_shape: tuple[int, ...],
                  scale_dtype: torch.dtype, where: str) -> None:  # fmt: skip
    """Make the meta ``module`` hold ``layout``'s values and a ``weight_scale`` of ``scale_shape``: a scale per
    ``block_structure`` block (FP8_BLOCK), else per row."""
    if weights.get("strategy") == "block":
        block = (int(weights["block_structure"][0]), int(weights["block_structure"][1]))
        try:
            GroupFP8Linear.hold_blocks(module, block, scale_shape, scale_dtype)
        except ValueError as error:
            raise ShardingError(f"{where}: {error}") from None
        return
    if scale_shape != (module.out_features, 1):
        raise ShardingError(f"{where} is stored quantized with a scale of shape {list(scale_shape)}, not one a row")
    _TOKEN_ROUNDED[layout][1](module, scale_dtype)


def _adopt_layer(module: nn.Module, scheme: Any, where: str) -> int:
    """One layer compressed-tensors set up (its ``quantization_scheme``) made tpcore's in place; 1 if it holds
    quantized tensors still, else 0."""
    if getattr(scheme.weights, "type", None) == "float":
        layout = NVFP4 if getattr(scheme.weights, "num_bits", None) == 4 else "float-quantized"
    elif scheme.input_activations is not None:
        layout = "int-quantized"
    else:
        layout = "pack-quantized"  # weights quantized only: packed, or decompressed by a forward
    group = {name: getattr(scheme, name) for name in ("weights", "input_activations", "output_activations")}
    weights = _checked_group(layout, {k: v.model_dump() if v is not None else None for k, v in group.items()}, where)
    quantizes_tokens = scheme.input_activations is not None
    for attribute in ("forward", "quantization_scheme", "quantization_status", "quantization_enabled"):
        module.__dict__.pop(attribute, None)
    parameters = module._parameters
    words, scale, weight = parameters.get("weight_packed"), parameters.get("weight_scale"), parameters.get("weight")
    zeros, global_scale = parameters.get("weight_zero_point"), parameters.get("weight_global_scale")
    for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape",
                 "weight_g_idx"):  # fmt: skip
        parameters.pop(name, None)
    if not isinstance(module, nn.Linear) or scale is None:
        return 0
    if layout in _TOKEN_ROUNDED:
        if weight is None or weight.dtype not in _TOKEN_ROUNDED[layout][0]:
            raise ShardingError(
                f"{where} was decompressed by a forward, and its inputs are quantized per token: parallelize the "
                "checkpoint's directory, or the model as transformers loads it, before any forward"
            )
        _hold_rounded(module, layout, weights, tuple(scale.shape), scale.dtype, where)
        module.weight, module.weight_scale = weight, scale
        if isinstance(module, TokenFP8Linear | GroupFP8Linear):
            module.weight_scale_inv = scale
        return 1
    if words is None:
        return 0  # decompressed: a plain linear again
    assert not quantizes_tokens
    adopt = _adopt_nvfp4 if layout == NVFP4 else _adopt_packed
    adopt(module, weights, words, scale, global_scale if layout == NVFP4 else zeros, where)
    return 1


def _adopt_nvfp4(module: nn.Linear, weights: dict[str, Any], words: nn.Parameter, scale: nn.Parameter,
                 global_scale: nn.Parameter | None, where: str) -> None:  # fmt: skip
    """A still-packed NVFP4 layer made an :class:`NVFP4Linear` holding its bytes, scales and global scale."""
    try:
        if global_scale is None:
            raise ValueError("NVFP4 without its weight_global_scale")
        fp4 = NVFP4Linear.hold_fp4(module, int(weights["group_size"]), tuple(scale.shape), scale.dtype)
    except ValueError as error:
        raise ShardingError(f"{where}: {error}") from None
    fp4.weight_packed, fp4.weight_scale, fp4.weight_global_scale = words, scale, global_scale
    fp4.weight = words


def _adopt_packed(module: nn.Linear, weights: dict[str, Any], words: nn.Parameter, scale: nn.Parameter,
                  zeros: nn.Parameter | None, where: str) -> None:  # fmt: skip
    """A still-packed integer layer made a :class:`PackedIntLinear` holding its words, scales and (asymmetric) zero
    points."""
    group_size = module.in_features if weights["strategy"] == "channel" else int(weights["group_size"])
    asymmetric = weights.get("symmetric") is False
    try:
        packed = PackedIntLinear.hold(
            module, int(weights["num_bits"]), group_size, tuple(scale.shape), scale.dtype, asymmetric
        )
        if asymmetric:
            if zeros is None:
                raise ValueError("asymmetric, without its weight_zero_point")
            _check_zero_points(packed, tuple(zeros.shape))
    except ValueError as error:
        hint = ""
        if asymmetric and zeros is not None:  # transformers expects them one a row and reinitializes the packed ones
            hint = " (transformers reinitialized them: parallelize the checkpoint's directory)"
        raise ShardingError(f"{where}: {error}{hint}") from None
    packed.weight_packed = words
    packed.weight, packed.weight_scale = words, scale
    if asymmetric and zeros is not None:
        packed.weight_zero_point = zeros


def _checked_group(layout: str | None, group: dict[str, Any], where: str) -> dict[str, Any]:
    """A compressed-tensors config group's weight scheme where tpcore splits the group, or :class:`ShardingError`
    naming what it does not."""
    if layout in _TOKEN_ROUNDED:
        return _checked_token_rounded(layout, group, where)
    if layout not in ("pack-quantized", NVFP4):
        raise ShardingError(
            f"{where} is compressed-tensors {layout!r}: tpcore splits its 'pack-quantized' integers, "
            f"{NVFP4!r} NVFP4A16, 'float-quantized' FP8_DYNAMIC and FP8_BLOCK and 'int-quantized' W8A8"
        )
    for activations in ("input_activations", "output_activations"):
        if group.get(activations):
            raise ShardingError(
                f"{where} quantizes {activations.replace('_', ' ')}: tpcore splits packed values with weights "
                "quantized only (W4A16, W8A16, NVFP4A16)"
            )
    weights = group.get("weights") or {}
    return _checked_nvfp4(weights, where) if layout == NVFP4 else _checked_weights(weights, where)


def _checked_nvfp4(weights: dict[str, Any], where: str) -> dict[str, Any]:
    """NVFP4's weight scheme (e2m1 values, a scale per group, a global scale: ``tensor_group``), or
    :class:`ShardingError` naming what differs."""
    wanted = {"type": "float", "num_bits": 4, "strategy": "tensor_group", "symmetric": True, "dynamic": False}
    differing = {key: weights.get(key) for key, value in wanted.items() if weights.get(key) != value}
    if differing or not isinstance(weights.get("group_size"), int):
        raise ShardingError(f"{where} is {NVFP4} with weights {differing or weights}: tpcore splits NVFP4 ({wanted})")
    return weights


def _checked_token_rounded(layout: str, group: dict[str, Any], where: str) -> dict[str, Any]:
    """FP8_DYNAMIC (``float-quantized``) or W8A8 (``int-quantized``): 8-bit weights, a static scale a row; 8-bit
    inputs of the same kind, a dynamic scale a token; outputs as they are. Or FP8_BLOCK (``float-quantized``): a
    static scale per ``(B0, B1)`` block of the weight, a dynamic one per token and group of ``B1`` input features."""
    kind = "float" if layout == "float-quantized" else "int"
    name = "FP8_DYNAMIC" if kind == "float" else "W8A8"
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    wanted_weights = {"type": kind, "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False}
    wanted_inputs = {"type": kind, "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}
    block = weights.get("block_structure")
    if kind == "float" and weights.get("strategy") == "block" and isinstance(block, list | tuple) and len(block) == 2:
        name = "FP8_BLOCK"
        wanted_weights = {**wanted_weights, "strategy": "block"}
        wanted_inputs = {**wanted_inputs, "strategy": "group", "group_size": block[1]}
    for what, found, wanted in (("weights", weights, wanted_weights), ("input activations", inputs, wanted_inputs)):
        differing = {key: found.get(key) for key, value in wanted.items() if found.get(key) != value}
        if differing:
            raise ShardingError(
                f"{where} is {layout} with {what} {differing}: tpcore splits {name} (weights {wanted_weights}, "
                f"input activations {wanted_inputs})"
            )
    if group.get("output_activations"):
        raise ShardingError(f"{where} quantizes output activations: tpcore splits {name}")
    return weights


def _checked_weights(weights: dict[str, Any], where: str) -> dict[str, Any]:
    """A compressed-tensors weight scheme tpcore splits, or :class:`ShardingError` naming what it does not."""
    refusals = {
        "type": (weights.get("type") == "int", f"{weights.get('type')!r} values (tpcore splits integers)"),
        "num_bits": (
            weights.get("num_bits") in BIT_WIDTHS,
            f"{weights.get('num_bits')}-bit values (tpcore unpacks {', '.join(map(str, BIT_WIDTHS))} bits)",
        ),
        "strategy": (
            weights.get("strategy") in ("group", "channel"),
            f"a {weights.get('strategy')!r} strategy (tpcore splits a scale per group or per row)",
        ),
        "dynamic": (not weights.get("dynamic"), "dynamic weight scales"),
        "actorder": (
            weights.get("actorder") in (None, "weight", "static"),
            f"activation-ordered groups ({weights.get('actorder')!r}, g_idx)",
        ),
    }
    for ok, what in refusals.values():
        if not ok:
            raise ShardingError(f"{where} stores {what}")
    return weights
