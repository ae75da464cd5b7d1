"""Fused MoE experts stored in block FP8 (DeepSeek-V3/R1, Qwen3-MoE FP8, Kimi K2): a rank's e4m3 share of every
expert, dequantized per forward.

The checkpoints store each expert's projections as e4m3 ``weight (out, in)`` with a float32 ``weight_scale_inv`` per
``B0 x B1`` block; transformers 5 merges the experts of a layer into ``gate_up_proj (E, 2I, H)`` (each expert's gate
rows, then its up rows) and ``down_proj (E, H, I)``, and their scales alike::

    gate_up_proj_scale_inv  (E, 2 ceil(I / B0), ceil(H / B1))    the gate's block rows, then the up's
    down_proj_scale_inv     (E, ceil(H / B0), ceil(I / B1))

The values are one an element, so a policy cuts ``gate_up_proj`` and ``down_proj`` as it cuts the plain ones (the two
halves of ``gate_up_proj`` alike, ``down_proj`` by its input features), inside a block or not; the scales stay whole on
every rank, which looks up the block of each row and column it holds (:func:`tpcore.cut.scale_blocks.block_index`, a
half at a time for ``gate_up_proj``), as :class:`~tpcore.parallel.quantized_linear.BlockFP8Linear` does for a linear.
Each forward dequantizes the routed experts: the float32 product of values and scales, rounded once to the activations'
dtype, as transformers dequantizes each expert at load on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from tpcore.cut.scale_blocks import block_index
from tpcore.cut.split import Split
from tpcore.parallel.quantized_experts import PROJECTIONS, QuantizedExperts
from tpcore.parallel.quantized_linear import _E4M3_TO_FP16, e4m3_as_scaled_float32

__all__ = ["BlockFP8Experts"]

#: how many merged parts each projection's rows hold, each with its own block rows (gate and up; down)
_PARTS = {"gate_up_proj": 2, "down_proj": 1}


class BlockFP8Experts(QuantizedExperts):
    """Mixin before a fused experts class (module docstring): e4m3 ``gate_up_proj`` and ``down_proj``, each with its
    float32 ``{proj}_scale_inv`` whole on every rank."""

    packing = (1, 1, 1)  # a value an element
    companions = tuple(f"{projection}_scale_inv" for projection in PROJECTIONS)
    #: the ``(B0, B1)`` blocks, and each projection's whole ``(out, in)``
    block: tuple[int, int] = (1, 1)
    whole_shapes: dict[str, tuple[int, int]] = {}

    def hold(self, block: tuple[int, int], scale_shapes: dict[str, tuple[int, ...]]) -> None:
        """Make the meta plain experts hold e4m3 values of their weights' shapes and float32 scales of
        ``scale_shapes``, checked against ``block``."""
        self.block, self.whole_shapes = block, {}
        for projection in PROJECTIONS:
            experts, out_features, in_features = getattr(self, projection).shape
            parts = _PARTS[projection]
            expected = (experts, parts * -(-out_features // parts // block[0]), -(-in_features // block[1]))
            if tuple(scale_shapes[projection]) != expected:
                raise ValueError(
                    f"{projection} ({experts}, {out_features}, {in_features}) in blocks of {block[0]} x {block[1]} "
                    f"has scales {expected}, not {tuple(scale_shapes[projection])}"
                )
            values = torch.empty(experts, out_features, in_features, dtype=torch.float8_e4m3fn, device="meta")
            setattr(self, projection, nn.Parameter(values, requires_grad=False))
            scales = torch.empty(expected, dtype=torch.float32, device="meta")
            setattr(self, f"{projection}_scale_inv", nn.Parameter(scales, requires_grad=False))
            self.whole_shapes[projection] = (out_features, in_features)

    def localize(self, rank: int, world_size: int) -> None:
        """Find the block row and column of each row and column this rank holds of each projection (buffers)."""
        for projection in PROJECTIONS:
            splits: list[Split | None] = [None, None, None]
            cut = self.cuts.get(projection)
            if cut is not None:
                splits[cut.dim] = cut
            out_features, in_features = self.whole_shapes[projection]
            rows = _merged_block_rows(splits[1], out_features, _PARTS[projection], self.block[0], rank, world_size)
            cols = block_index(splits[2], in_features, self.block[1], rank, world_size)
            device = self._parameters[projection].device  # type: ignore[union-attr]
            self.register_buffer(f"{projection}_scale_rows", rows.to(device), persistent=False)
            self.register_buffer(f"{projection}_scale_cols", cols.to(device), persistent=False)

    def dequantized(self, projection: str, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rank's ``(n, out_r, in_r)`` weight of ``projection`` for the ``n`` ``experts``: values times their
        blocks' scales in float32, rounded once to ``dtype``."""
        values = self._parameters[projection][experts]  # type: ignore[index]
        scales = self._parameters[f"{projection}_scale_inv"][experts].float()  # type: ignore[index]
        if values.device.type == "cpu":  # e4m3 read as 2^-8 of itself by integer ops (BlockFP8Linear's way)
            values, scales = e4m3_as_scaled_float32(values), scales * _E4M3_TO_FP16
        else:
            values = values.float()
        rows, cols = getattr(self, f"{projection}_scale_rows"), getattr(self, f"{projection}_scale_cols")
        count, out_features, in_features = values.shape
        (whole_rows, whole_cols), (block_rows, block_cols) = self._whole_blocks(projection), self.block
        if whole_cols:  # a scale per row and column block, broadcast over the block's columns
            scales = scales.index_select(1, rows).unsqueeze(-1)
            blocks = values.view(count, out_features, in_features // block_cols, block_cols).mul_(scales)
        elif whole_rows:  # a scale per row block and column, broadcast over the block's rows
            scales = scales.index_select(2, cols).unsqueeze(2)
            blocks = values.view(count, out_features // block_rows, block_rows, in_features).mul_(scales)
        else:
            blocks = values.mul_(scales.index_select(1, rows).index_select(2, cols))
        return blocks.view(count, out_features, in_features).to(dtype)

    def _whole_blocks(self, projection: str) -> tuple[bool, bool]:
        """Whether this rank holds ``projection``'s rows, and its columns, whole and in whole blocks (the scales then
        broadcast over a block instead of being looked up for every value)."""
        cut = self.cuts.get(projection)
        out_features, in_features = self.whole_shapes[projection]
        rows = (cut is None or cut.dim != 1) and _PARTS[projection] == 1 and out_features % self.block[0] == 0
        cols = (cut is None or cut.dim != 2) and in_features % self.block[1] == 0
        return rows, cols


def _merged_block_rows(split: Split | None, size: int, parts: int, block: int, rank: int, world_size: int):
    """``(n,)`` int64: the block row of each of the ``n`` rows rank ``rank`` holds of ``parts`` merged tensors of
    ``size / parts`` rows each, whose scales are merged the same way (part ``p``'s block rows after the earlier
    parts' ``ceil(size / parts / block)`` each)."""
    rows = torch.arange(size)
    if split is not None:
        ranges, _ = split.ranges(size, rank, world_size)
        rows = torch.cat([torch.arange(start, stop) for start, stop in ranges])
    part_rows = size // parts
    return rows // part_rows * -(-part_rows // block) + rows % part_rows // block
