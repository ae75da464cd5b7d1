"""MXFP4 checkpoints (``quant_method: "mxfp4"``: gpt-oss): fused experts whose ``gate_up_proj`` and ``down_proj`` the
checkpoint stores as ``{proj}_blocks`` and ``{proj}_scales`` become :class:`~tpcore.parallel.mxfp4_experts.Mxfp4Experts`
in the meta skeleton; every other tensor is stored plain."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpcore.authoring.quantized_format import QuantizedFormat
from tpcore.errors import ShardingError
from tpcore.parallel.mxfp4_experts import Mxfp4Experts
from tpcore.parallel.quantized_experts import PROJECTIONS, hold_experts

__all__ = ["MXFP4"]


class MXFP4(QuantizedFormat):
    """MXFP4 experts (module docstring): e2m1 codes two a byte, an e8m0 scale per 32 values along the input features."""

    quant_method = "mxfp4"
    description = "MXFP4 (gpt-oss: e2m1 expert weights, a power-of-two scale per 32 values)"

    def hold(self, model: nn.Module, checkpoint: Any, quantization: dict[str, Any]) -> int:
        stored = {key for key in checkpoint.files if key.endswith(("_blocks", "_scales"))}
        keys = checkpoint.stored_keys(model)
        held = 0
        for path, module in list(model.named_modules()):
            prefix = _stored_prefix(keys, path)
            if prefix is None or f"{prefix}{PROJECTIONS[0]}_blocks" not in checkpoint.files:
                continue
            names = [f"{prefix}{projection}_{part}" for projection in PROJECTIONS for part in ("blocks", "scales")]
            missing = [name for name in names if name not in checkpoint.files]
            if missing:
                raise ShardingError(f"{names[0]!r} is stored without {missing[0]!r}")
            for name in names:
                if checkpoint.stored_dtype(name) != torch.uint8:
                    raise ShardingError(f"{name!r} is stored in {checkpoint.stored_dtype(name)}, not uint8")
            scale_shapes = {p: tuple(checkpoint.stored_shape(f"{prefix}{p}_scales")) for p in PROJECTIONS}
            hold_experts(module, Mxfp4Experts, repr(names[0]), lambda experts: experts.hold(scale_shapes, prefix))  # noqa: B023
            stored.difference_update(names)
            held += 1
        if stored:  # blocks of a module that is no fused experts with biases
            raise ShardingError(
                f"{min(stored)!r} is MXFP4 outside fused experts (gate_up_proj and down_proj with their biases, as "
                f"gpt-oss stores them), which tpcore does not split yet ({len(stored)} such tensors)"
            )
        return held


def _stored_prefix(keys: dict[str, str], path: str) -> str | None:
    """The stored key prefix of the fused experts module at ``path`` (``"model.layers.0.mlp.experts."``), found from
    its plain bias, or ``None`` where ``path`` holds no fused experts' biases."""
    key = keys.get(f"{path}.gate_up_proj_bias" if path else "gate_up_proj_bias")
    return None if key is None else key.removesuffix("gate_up_proj_bias")
