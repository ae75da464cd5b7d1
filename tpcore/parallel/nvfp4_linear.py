"""compressed-tensors' NVFP4 linear layers (``nvfp4-pack-quantized``: llmcompressor's NVFP4A16), computed on a rank's
bytes.

The weight is 4-bit e2m1 floats (a sign bit, magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``), two a byte along the input
features (value ``2k`` in the low nibble), with a float8 e4m3 scale per row and group of ``g = 16`` input features
and one float32 scale for the whole tensor::

    weight_packed        uint8          (out_r, in_r / 2)   this rank's bytes (also ``weight``)
    weight_scale         float8_e4m3fn  (out_r, in / g)     cut with the rows; whole on every rank where the columns are
    weight_global_scale  float32        (1,)                whole on every rank
    W_r[i, j] = bf16( e2m1(c[i, j]) * (bf16(weight_scale[i, group(j)]) / weight_global_scale) )

computed in float32 and rounded once to bfloat16, as compressed-tensors decompresses (its weights are bfloat16 whatever
the model's dtype), then cast to the input's dtype for one matrix product. :class:`NVFP4Linear` is a
:class:`~tpcore.parallel.packed_int_linear.PackedIntLinear` with two values an element and these fields: the plan cuts
the bytes as any weight and a rank looks the group of each of its values up the same way (a cut inside a group leaves
its scale to both ranks), so it keeps half a byte a weight and never the whole model dequantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcore.parallel.comm import all_reduce
from tpcore.parallel.packed_int_linear import PackedIntLinear, RowParallelPackedIntLinear, check_groups

__all__ = ["E2M1_VALUES", "NVFP4Linear", "RowParallelNVFP4Linear", "unpack_e2m1"]

#: the value of each 4-bit e2m1 code: bit 3 the sign, bits 0-2 the magnitude's index
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]).repeat(2) * torch.tensor([1.0] * 8 + [-1.0] * 8)


class NVFP4Linear(PackedIntLinear):
    """``nn.Linear`` whose weight is NVFP4 (module docstring); made from an ``nn.Linear`` in place by
    :meth:`hold_fp4`, told its cut by the plan and its rank by
    :func:`~tpcore.parallel.quantized_linear.localize_quantized`."""

    #: the scales stay float8 and the global scale float32 under a model-wide cast, as transformers keeps them; a
    #: bias follows the model
    keeps_stored_dtypes = ("weight_packed", "weight_scale", "weight_global_scale")
    weight_global_scale: nn.Parameter

    @classmethod
    def hold_fp4(
        cls, linear: nn.Linear, group_size: int, scale_shape: tuple[int, ...], scale_dtype: torch.dtype
    ) -> NVFP4Linear:
        """Make the meta ``linear`` hold NVFP4 in place: a uint8 ``weight_packed`` (also its ``weight``), a
        ``weight_scale`` of ``scale_shape`` and ``scale_dtype`` per ``group_size`` input features, and a
        ``weight_global_scale``."""
        out_features, in_features = linear.out_features, linear.in_features
        check_groups(linear, ("bytes", 2), group_size, scale_shape)
        linear.__class__ = cls
        assert isinstance(linear, NVFP4Linear)
        linear._parameters.pop("weight", None)

        def meta(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)

        linear.weight_packed = meta(out_features, in_features // 2, dtype=torch.uint8)
        linear.weight = linear.weight_packed  # the name policies cut; the stored name comes first
        linear.weight_scale = meta(*scale_shape, dtype=scale_dtype)
        linear.weight_global_scale = meta(1, dtype=torch.float32)
        linear.bits, linear.group_size, linear.packing = 4, group_size, (1, 2)
        linear.whole_shape = (out_features, in_features)
        return linear

    def ready(self) -> None:
        """Nothing to lay out: torch's int4 product takes integers, not e2m1 floats."""

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``W_r`` (module docstring) in ``dtype``."""
        values = unpack_e2m1(self.weight_packed)
        scale = self.weight_scale.to(torch.bfloat16).float() / self.weight_global_scale
        rows, columns = values.shape
        if self.scale_cols is not None:
            return values.mul_(scale.index_select(1, self.scale_cols)).to(torch.bfloat16).to(dtype)
        groups = columns // self.group_size
        scales = scale.narrow(1, self.first_group, groups).unsqueeze(-1)
        grouped = values.view(rows, groups, self.group_size).mul_(scales)
        return grouped.view(rows, columns).to(torch.bfloat16).to(dtype)


class RowParallelNVFP4Linear(RowParallelPackedIntLinear, NVFP4Linear):
    """:class:`NVFP4Linear` holding a shard of the input features; output all-reduced, bias added once. A half-precision
    input's partial product is computed and summed in float32 and rounded once, as the unsplit layer's one product
    accumulates in float32 and rounds once (its weights are bfloat16 values, exact in float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().forward(x)
        partial = F.linear(x.float(), self.dequantized(torch.float32))
        out = all_reduce(partial, self.tp_group).to(x.dtype)
        bias = self._parameters.get("bias")
        return out if bias is None else out + bias


NVFP4Linear.row_parallel_class = RowParallelNVFP4Linear


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``(rows, 2 n)`` float32: the e2m1 values of uint8 ``packed (rows, n)``, value ``2k`` from byte ``k``'s low
    nibble and ``2k + 1`` from its high one."""
    codes = torch.stack([packed.bitwise_and(15), packed.bitwise_right_shift(4)], dim=-1).view(packed.shape[0], -1)
    return E2M1_VALUES.to(packed.device).index_select(0, codes.reshape(-1).long()).view(codes.shape)
