"""Quantized checkpoints: the format a checkpoint's ``quantization_config`` declares, split as stored where a
:class:`~tpcore.QuantizedFormat` knows it, refused by name before any rank starts where none does.

The built-in format, :class:`BlockFP8` (``quant_method: "fp8"`` with ``weight_block_size [B0, B1]``:
DeepSeek-V3/R1, Qwen3-FP8, transformers' ``FineGrainedFP8``): a linear whose weight the checkpoint stores in
float8 beside a ``weight_scale_inv`` becomes a :class:`~tpcore.parallel.quantized_linear.BlockFP8Linear` in the
meta skeleton before it is planned, so the plan counts a rank's bytes as stored and each rank reads only its
part of the values. Plugins add formats (``tpcore_register_quantized_formats``; the callers above pass them in).

A model object that transformers quantized (``model.hf_quantizer``) is split where its weights are plain again
(FP8 dequantized at load on a device without FP8 kernels) or where its format adopts its layers (compressed-tensors
packed integers become tpcore's layers, their tensors kept); otherwise it is refused (:func:`adopt_quantized_model`).
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
from tpcore.parallel.int8_linear import Int8Linear
from tpcore.parallel.packed_int_linear import BIT_WIDTHS, PackedIntLinear
from tpcore.parallel.quantized_linear import BlockFP8Linear, QuantizedLayer, TokenFP8Linear

__all__ = [
    "BUILT_IN_FORMATS",
    "BlockFP8",
    "CompressedTensors",
    "TorchAO",
    "check_quantization",
    "checkpoint_skeleton",
    "adopt_quantized_model",
    "quantization_of",
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
        _refuse_untaken(scale_keys, "scales", "block FP8")  # each linear took its own
        return held


class CompressedTensors(QuantizedFormat):
    """compressed-tensors checkpoints (llmcompressor's output), in two of its layouts:

    - ``pack-quantized`` integers (W4A16, W8A16): a linear stored as ``weight_packed`` (int32 words along the input
      features) beside its ``weight_scale`` becomes a :class:`PackedIntLinear`; symmetric, a scale per group or per
      row, activations unquantized;
    - ``float-quantized`` FP8 with dynamic per-token activations (``FP8_DYNAMIC``): an e4m3 ``weight`` beside its
      per-row ``weight_scale`` becomes a :class:`TokenFP8Linear`."""

    quant_method = "compressed-tensors"
    description = "compressed-tensors pack-quantized integers (W4A16, W8A16) and FP8_DYNAMIC"

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
        if layout == "float-quantized":
            return _hold_token_fp8(model, checkpoint)
        bits = int(weights["num_bits"])
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
            scale_key = packed_key.removesuffix("packed") + "scale"
            if scale_key not in checkpoint.files:
                raise ShardingError(f"{packed_key!r} is stored without its {scale_key!r}")
            group = module.in_features if weights["strategy"] == "channel" else int(weights["group_size"])
            try:
                PackedIntLinear.hold(
                    module, bits, group, tuple(checkpoint.stored_shape(scale_key)), checkpoint.stored_dtype(scale_key)
                )
            except ValueError as error:
                raise ShardingError(f"{packed_key!r}: {error}") from None
            packed_keys.discard(packed_key)
            held += 1
        _refuse_untaken(packed_keys, "packs", "compressed-tensors")
        return held


def _hold_token_fp8(model: nn.Module, checkpoint: Any) -> int:
    """compressed-tensors FP8_DYNAMIC: each linear stored in e4m3 beside its per-row ``weight_scale`` becomes a
    :class:`TokenFP8Linear`."""
    keys = checkpoint.stored_keys(model)
    scale_keys = {key for key in checkpoint.files if key.endswith(".weight_scale")}
    held = 0
    for path, module in list(model.named_modules()):
        key = keys.get(f"{path}.weight" if path else "weight")
        if not isinstance(module, nn.Linear) or key is None or checkpoint.stored_dtype(key) not in _FP8:
            continue
        scale_key = key + "_scale"
        shape = checkpoint.stored_shape(scale_key) if scale_key in scale_keys else None
        if shape != [module.out_features, 1]:
            raise ShardingError(f"{key!r} is stored in e4m3 with {scale_key!r} of shape {shape}, not one scale a row")
        TokenFP8Linear.hold_rows(module, checkpoint.stored_dtype(scale_key))
        scale_keys.discard(scale_key)
        held += 1
    _refuse_untaken(scale_keys, "scales", "compressed-tensors FP8")
    return held


def _adopt_layer(module: nn.Module, scheme: Any, where: str) -> int:
    """One layer compressed-tensors set up (its ``quantization_scheme``) made tpcore's in place; 1 if it holds
    quantized tensors still, else 0."""
    layout = "float-quantized" if getattr(scheme.weights, "type", None) == "float" else "pack-quantized"
    group = {name: getattr(scheme, name) for name in ("weights", "input_activations", "output_activations")}
    weights = _checked_group(layout, {k: v.model_dump() if v is not None else None for k, v in group.items()}, where)
    quantizes_tokens = scheme.input_activations is not None
    for attribute in ("forward", "quantization_scheme", "quantization_status", "quantization_enabled"):
        module.__dict__.pop(attribute, None)
    parameters = module._parameters
    words, scale, weight = parameters.get("weight_packed"), parameters.get("weight_scale"), parameters.get("weight")
    for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"):
        parameters.pop(name, None)
    if not isinstance(module, nn.Linear) or scale is None:
        return 0
    if layout == "float-quantized":
        if weight is None or weight.dtype not in _FP8:
            raise ShardingError(
                f"{where} was decompressed by a forward, and its inputs are quantized per token: parallelize the "
                "checkpoint's directory, or the model as transformers loads it, before any forward"
            )
        TokenFP8Linear.hold_rows(module, scale.dtype)
        module.weight, module.weight_scale = weight, scale
        module.weight_scale_inv = scale
        return 1
    if words is None:
        return 0  # decompressed: a plain linear again
    assert not quantizes_tokens
    group_size = module.in_features if weights["strategy"] == "channel" else int(weights["group_size"])
    try:
        PackedIntLinear.hold(module, int(weights["num_bits"]), group_size, tuple(scale.shape), scale.dtype)
    except ValueError as error:
        raise ShardingError(f"{where}: {error}") from None
    module.weight_packed = words
    module.weight, module.weight_scale = words, scale
    return 1


def _checked_group(layout: str | None, group: dict[str, Any], where: str) -> dict[str, Any]:
    """A compressed-tensors config group's weight scheme where tpcore splits the group, or :class:`ShardingError`
    naming what it does not."""
    if layout == "float-quantized":
        return _checked_token_fp8(group, where)
    if layout != "pack-quantized":
        raise ShardingError(
            f"{where} is compressed-tensors {layout!r}: tpcore splits its 'pack-quantized' integers and "
            "'float-quantized' FP8_DYNAMIC"
        )
    for activations in ("input_activations", "output_activations"):
        if group.get(activations):
            raise ShardingError(
                f"{where} quantizes {activations.replace('_', ' ')}: tpcore splits packed integers with weights "
                "quantized only (W4A16, W8A16)"
            )
    return _checked_weights(group.get("weights") or {}, where)


def _checked_token_fp8(group: dict[str, Any], where: str) -> dict[str, Any]:
    """FP8_DYNAMIC: e4m3 weights, a static scale a row; e4m3 inputs, a dynamic scale a token; outputs as they are."""
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    wanted_weights = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False}
    wanted_inputs = {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}
    for what, found, wanted in (("weights", weights, wanted_weights), ("input activations", inputs, wanted_inputs)):
        differing = {key: found.get(key) for key, value in wanted.items() if found.get(key) != value}
        if differing:
            raise ShardingError(
                f"{where} is float-quantized with {what} {differing}: tpcore splits FP8_DYNAMIC (weights "
                f"{wanted_weights}, input activations {wanted_inputs})"
            )
    if group.get("output_activations"):
        raise ShardingError(f"{where} quantizes output activations: tpcore splits FP8_DYNAMIC")
    return weights


def _refuse_untaken(keys: set[str], verb: str, form: str) -> None:
    """Raise :class:`ShardingError` naming the first of the stored ``keys`` no layer took."""
    if keys:
        first = min(keys)
        raise ShardingError(
            f"{first!r} {verb} a tensor that tpcore does not split in {form} yet (only linear layers' weights; "
            f"{len(keys)} such tensors)"
        )


def _checked_weights(weights: dict[str, Any], where: str) -> dict[str, Any]:
    """A compressed-tensors weight scheme tpcore splits, or :class:`ShardingError` naming what it does not."""
    refusals = {
        "type": (weights.get("type") == "int", f"{weights.get('type')!r} values (tpcore splits integers)"),
        "num_bits": (
            weights.get("num_bits") in BIT_WIDTHS,
            f"{weights.get('num_bits')}-bit values (tpcore unpacks {', '.join(map(str, BIT_WIDTHS))} bits)",
        ),
        "symmetric": (
            weights.get("symmetric", True) is True,
            "asymmetric values with zero points (tpcore splits symmetric ones)",
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


class TorchAO(QuantizedFormat):
    """torchao's int8 weight-only quantization (``Int8WeightOnlyConfig``, per row), as transformers saves it in
    safetensors: a linear stored as ``_weight_qdata`` (int8) beside its ``_weight_scale`` becomes an
    :class:`Int8Linear`."""

    quant_method = "torchao"
    description = "torchao int8 weight-only (int8 values, a scale per row)"

    def check(self, quantization: dict[str, Any], where: str) -> None:
        quant_type = quantization.get("quant_type")
        if not isinstance(quant_type, dict) or set(quant_type) != {"default"}:
            raise ShardingError(
                f"{where} is torchao {quant_type!r}: tpcore splits one Int8WeightOnlyConfig for every layer, as "
                "transformers 5 saves it"
            )
        kind, data = quant_type["default"].get("_type"), quant_type["default"].get("_data") or {}
        granularity = (data.get("granularity") or {}).get("_type", "PerRow")
        if kind != "Int8WeightOnlyConfig" or granularity != "PerRow" or data.get("group_size"):
            group = f", groups of {data['group_size']}" if data.get("group_size") else ""
            raise ShardingError(
                f"{where} is torchao {kind} ({granularity}{group}): tpcore splits Int8WeightOnlyConfig per row only"
            )
        if quantization.get("include_input_output_embeddings"):
            raise ShardingError(f"{where} quantizes its embeddings: tpcore splits torchao's linear layers only")

    def adopt(self, model: nn.Module, quantization: dict[str, Any]) -> int:
        """A linear whose weight is torchao's per-row ``Int8Tensor`` becomes an :class:`Int8Linear` holding its
        values, scales and zero points."""
        adopted = 0
        for path, module in model.named_modules():
            weight: Any = module._parameters.get("weight")
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
                    f"{value_key!r} and {scale_key!r} are stored as {shapes}: tpcore splits int8 values with a scale "
                    f"per row, here ({module.out_features}, {module.in_features}) and ({module.out_features}, 1)"
                )
            Int8Linear.hold(module, checkpoint.stored_dtype(scale_key))
            value_keys.discard(value_key)
            held += 1
        _refuse_untaken(value_keys, "quantizes", "torchao")
        return held


#: the formats tpcore itself splits; plugins add more (``tpcore_register_quantized_formats``)
BUILT_IN_FORMATS: tuple[QuantizedFormat, ...] = (BlockFP8(), CompressedTensors(), TorchAO())


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


def _block_size(quantization: dict[str, Any]) -> tuple[int, int] | None:
    block = quantization.get("weight_block_size")
    if not block:
        return None
    if len(block) != 2 or not all(isinstance(size, int) and size >= 1 for size in block):
        raise ShardingError(f"weight_block_size {block} is not two positive block sides")
    return int(block[0]), int(block[1])
