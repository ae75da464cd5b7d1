"""Block FP8 checkpoints (``quant_method: "fp8"`` with ``weight_block_size [B0, B1]``: DeepSeek-V3/R1, Qwen3-FP8,
transformers' ``FineGrainedFP8``): a linear whose weight the checkpoint stores in float8 beside a ``weight_scale_inv``
becomes a :class:`~tpcore.parallel.quantized_linear.BlockFP8Linear` in the meta skeleton, and fused experts whose
per-expert weights it stores so a :class:`~tpcore.parallel.fp8_experts.BlockFP8Experts`."""

from __future__ import annotations

from typing import Any

from torch import nn

from tpcore.authoring.quantized_format import FP8_VALUES, QuantizedFormat, refuse_untaken
from tpcore.errors import ShardingError
from tpcore.parallel.fp8_experts import BlockFP8Experts
from tpcore.parallel.quantized_experts import PROJECTIONS, QuantizedExperts, hold_experts
from tpcore.parallel.quantized_linear import BlockFP8Linear

__all__ = ["BlockFP8"]


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
            if not isinstance(module, nn.Linear) or key is None or checkpoint.stored_dtype(key) not in FP8_VALUES:
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
        held += _hold_experts(model, checkpoint, block, scale_keys)
        refuse_untaken(scale_keys, "scales", "block FP8")  # each linear took its own
        return held


def _block_size(quantization: dict[str, Any]) -> tuple[int, int] | None:
    block = quantization.get("weight_block_size")
    if not block:
        return None
    if len(block) != 2 or not all(isinstance(size, int) and size >= 1 for size in block):
        raise ShardingError(f"weight_block_size {block} is not two positive block sides")
    return int(block[0]), int(block[1])


def _hold_experts(model: nn.Module, checkpoint: Any, block: tuple[int, int], scale_keys: set[str]) -> int:
    """Make each fused experts module whose per-expert weights the checkpoint stores in float8 a
    :class:`BlockFP8Experts`, its scales merged as transformers merges the weights; the number made. Takes their
    scale keys from ``scale_keys``."""
    sources = checkpoint.stored_sources(model)
    held = 0
    for path, module in list(model.named_modules()):
        names = [f"{path}.{projection}" if path else projection for projection in PROJECTIONS]
        if isinstance(module, QuantizedExperts) or not all(name in sources for name in names):
            continue
        parameters = [module._parameters.get(projection) for projection in PROJECTIONS]
        if not all(parameter is not None and parameter.dim() == 3 for parameter in parameters):
            continue
        keys = {projection: sources[name].keys for projection, name in zip(PROJECTIONS, names, strict=True)}
        first = keys[PROJECTIONS[0]][0][0]
        if checkpoint.stored_dtype(first) not in FP8_VALUES:
            continue  # experts kept in full precision
        scale_shapes: dict[str, tuple[int, ...]] = {}
        for projection, groups in keys.items():
            missing = [key for group in groups for key in group if f"{key}_scale_inv" not in checkpoint.files]
            if missing:
                raise ShardingError(f"{missing[0]!r} is stored in float8 without its '{missing[0]}_scale_inv'")
            shapes = [checkpoint.stored_shape(f"{group[0]}_scale_inv") for group in groups]  # each merged part's
            if len(shapes[0]) == 3:  # stored fused already (a split saved by tpcore)
                scale_shapes[projection] = tuple(shapes[0])
            else:
                scale_shapes[projection] = (len(groups[0]), sum(shape[0] for shape in shapes), shapes[0][1])
            scale_keys.difference_update(f"{key}_scale_inv" for group in groups for key in group)
        hold_experts(module, BlockFP8Experts, path, lambda experts: experts.hold(block, scale_shapes))  # noqa: B023
        held += 1
    return held
