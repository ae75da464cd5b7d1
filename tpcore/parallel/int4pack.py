"""torch's CPU int4 product (``aten._weight_int4pack_mm_for_cpu``) on a rank's 4-bit codes, the product GPTQModel's
default CPU kernels compute (``TorchAtenLinear``, ``TorchAtenAwqLinear``).

The kernel takes ``x (M, K)`` bfloat16, the codes ``q (N, K)`` packed by ``aten._convert_weight_to_int4pack_for_cpu``
and ``scales_and_zeros (K / g, N, 2)`` bfloat16, and computes ``x @ W.T`` with::

    W[n, k] = s[k // g, n] * (q[n, k] - 8) + t[k // g, n],    t = bf16(bf16(8 - z) * s),  s = bf16(scale)

which is ``s (q - z)`` up to the rounding of ``t``, as GPTQModel builds it. It takes groups of 32, 64, 128 or 256
consecutive input features and ``N % 16 == 0``. A rank's rows need not be that: a cut may fall inside a group,
act-order rows (``g_idx``) come in any order, and a format's group may be larger (a whole row). :class:`Int4Packed` lays
a rank's rows out group by group, each group's rows in the fewest kernel groups of ``k`` (:func:`kernel_group`, which
divides ``g``) that hold them, sharing its scale (a slot no row fills reads a zero input), and pads the outputs to a
multiple of 16 with zero weights, so the product over the rank's rows is the kernel's over its slots.

The packed layout interleaves the codes (it is the kernel's, not a slice-friendly one): :func:`unpack_int4` reads the
codes back through the positions :func:`_nibble_sources` finds by packing probes, so a rank keeps only the packed
copy and still gives its words back (``save_pretrained``, ``deparallelize``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpcore.parallel.comm import all_reduce

__all__ = ["INT4PACK_GROUP_SIZES", "Int4Packed", "int4pack_available", "kernel_group", "unpack_int4"]

#: the group sizes the CPU kernel takes
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)
#: the kernel's output features come in multiples of this
_OUT_MULTIPLE = 16
#: the code the kernel centres on
_CENTRE = 8


def kernel_group(group_size: int) -> int | None:
    """The largest group the kernel takes that divides ``group_size`` (its groups are whole kernel groups), if any."""
    return next((size for size in reversed(INT4PACK_GROUP_SIZES) if group_size % size == 0), None)


def int4pack_available(device: torch.device, group_size: int) -> bool:
    """Whether torch's CPU int4 product runs groups of ``group_size`` on ``device``."""
    ops = torch.ops.aten
    return (
        device.type == "cpu"
        and kernel_group(group_size) is not None
        and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")
        and hasattr(ops, "_weight_int4pack_mm_for_cpu")
    )


class Int4Packed:
    """A rank's 4-bit linear as the CPU kernel takes it.

    Args:
        codes: ``(in_r, out_r)`` integers in ``[0, 16)``, the rank's rows in its order.
        row_groups: ``(in_r,)`` the group of each row (indices into ``scales`` and ``zero_points``).
        scales, zero_points: ``(groups, out_r)``, ``W.T[i, o] = scales[g(i), o] * (codes[i, o] - zero_points[g(i), o])``
            with ``g = row_groups``.
        group_size: the rows a group holds at most: whole kernel groups (:func:`kernel_group`).
    """

    def __init__(
        self,
        codes: torch.Tensor,
        row_groups: torch.Tensor,
        scales: torch.Tensor,
        zero_points: torch.Tensor,
        group_size: int,
    ) -> None:
        kernel_size = kernel_group(group_size)
        if kernel_size is None:
            raise ValueError(f"groups of {group_size} are no whole groups of {INT4PACK_GROUP_SIZES}")
        in_r, out_r = codes.shape
        present, group_of_row = torch.unique(row_groups, sorted=True, return_inverse=True)
        counts = torch.bincount(group_of_row, minlength=len(present))
        if int(counts.max()) > group_size:
            raise ValueError(f"a group holds {int(counts.max())} rows, more than its size {group_size}")
        chunks = -(-counts // kernel_size)  # the kernel groups that hold each group's rows (one scale for all)
        starts = kernel_size * (torch.cumsum(chunks, 0) - chunks)
        firsts = torch.cumsum(counts, 0) - counts
        order = torch.argsort(group_of_row, stable=True)
        sorted_groups = group_of_row[order]
        slot = torch.empty(in_r, dtype=torch.long)
        slot[order] = starts[sorted_groups] + torch.arange(in_r) - firsts[sorted_groups]
        slots = kernel_size * int(chunks.sum())
        padded_out = -(-out_r // _OUT_MULTIPLE) * _OUT_MULTIPLE
        #: the input column each slot reads (``in_r``: a zero column), or ``None`` where slot ``k`` is row ``k``
        self.source: torch.Tensor | None = None
        if slots != in_r or not torch.equal(slot, torch.arange(in_r)):
            source = torch.full((slots,), in_r, dtype=torch.long)
            source[slot] = torch.arange(in_r)
            self.source = source
        self.slot, self.slots, self.group_size = slot, slots, kernel_size
        self.in_features, self.out_features = in_r, out_r
        grid = torch.full((padded_out, slots), _CENTRE, dtype=torch.int32)
        grid[:out_r, slot] = codes.T.to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(grid, 1).contiguous()
        scale = torch.zeros(len(present), padded_out, dtype=torch.bfloat16)
        scale[:, :out_r] = scales.index_select(0, present).to(torch.bfloat16)
        offset = torch.zeros_like(scale)
        offset[:, :out_r] = (_CENTRE - zero_points.index_select(0, present).to(torch.bfloat16)) * scale[:, :out_r]
        self.scales_and_zeros = torch.stack([scale, offset], dim=2).repeat_interleave(chunks, dim=0).contiguous()

    def take_place_of(self, module: nn.Module, name: str) -> None:
        """Become ``module.int4``, its tensors ``module``'s non-persistent buffers (``int4_weight``,
        ``int4_scales_and_zeros``), and empty ``module``'s tensor ``name``, whose codes this copy holds."""
        module.__dict__["int4"] = self  # a plain attribute, not a parameter or submodule
        module.register_buffer("int4_weight", self.packed, persistent=False)
        module.register_buffer("int4_scales_and_zeros", self.scales_and_zeros, persistent=False)
        replaced = getattr(module, name)
        replaced.data = replaced.data.new_empty(0)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``(M, out_r)`` bfloat16: ``x (M, in_r)`` rounded to bfloat16, times the rank's ``W.T``."""
        x = x.to(torch.bfloat16)
        if self.source is not None:
            x = torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1).index_select(1, self.source)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, self.group_size, self.scales_and_zeros
        )
        return out[:, : self.out_features]

    def linear(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        """``(..., out_r)`` in ``x``'s dtype: ``x (..., in_r)`` times the rank's ``W.T`` (:meth:`matmul`); with a
        tensor-parallel ``group``, this rank's partial product summed over the group in float32 and rounded once to
        bfloat16, as the unsplit product rounds its sum."""
        out = self.matmul(x.reshape(-1, x.shape[-1]))
        if group is not None:
            out = all_reduce(out.float(), group).to(torch.bfloat16)
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])

    def codes(self) -> torch.Tensor:
        """``(in_r, out_r)`` uint8: the codes it was made from, read back from the packed copy."""
        grid = unpack_int4(self.packed, self.scales_and_zeros.shape[1], self.slots)
        return grid[: self.out_features].index_select(1, self.slot).T.contiguous()


def _nibble_sources(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the packed copy of a ``(rows, columns)`` grid: the flat grid index whose code each byte holds in its low
    and in its high 4 bits (``(rows * columns / 2,)`` each). Found by packing probes whose codes are the base-16
    digits of each index, one probe a digit, so it holds for whatever layout this torch build packs."""
    size = rows * columns
    wide = torch.int32 if size < 2**31 else torch.int64
    index = torch.arange(size, dtype=wide)
    low, high = torch.zeros(size // 2, dtype=wide), torch.zeros(size // 2, dtype=wide)
    for digit in range(max(1, -(-int(size - 1).bit_length() // 4))):
        probe = index.bitwise_right_shift(4 * digit).bitwise_and_(15).to(torch.int32).view(rows, columns)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1).reshape(-1).to(wide)
        low.bitwise_or_(packed.bitwise_and(15).bitwise_left_shift_(4 * digit))
        high.bitwise_or_(packed.bitwise_right_shift_(4).bitwise_left_shift_(4 * digit))
    return low, high


def unpack_int4(packed: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """``(rows, columns)`` uint8: the codes ``aten._convert_weight_to_int4pack_for_cpu`` packed into ``packed``."""
    low, high = _nibble_sources(rows, columns)
    data = packed.reshape(-1)
    grid = torch.empty(rows * columns, dtype=torch.uint8)
    grid[low] = data.bitwise_and(15)
    grid[high] = data.bitwise_right_shift(4)
    return grid.view(rows, columns)
