"""A linear layer whose weight is ``b``-bit integers packed into int32 words, computed on a rank's words.

:class:`PackedIntLinear` holds compressed-tensors' ``pack-quantized`` weights (a scale per group of
``g`` input features; ``g = in`` for one scale a row)::

    weight_packed  int32  (out_r, in_r / p)    this rank's words, p = 32 / b values each (also ``weight``)
    weight_scale   S      (out_r, in / g)      cut with the rows; whole on every rank where the columns are cut
    W_r[i, j] = q[i, j] * weight_scale[i, group(j)],   q = the unsigned b-bit field of value j, minus 2^(b-1)

Asymmetric checkpoints (``symmetric: false``) add a zero point per group and row, packed along the *rows*::

    weight_zero_point  int32  (ceil(out / p), in / g)   row i in word i // p at bit (i % p) b
    W_r[i, j] = (u[i, j] - z[i, group(j)]) * weight_scale[i, group(j)],   u, z the unsigned fields

(compressed-tensors' ``(q - z_q) s`` with both stored offset by ``2^(b-1)``). The zero points take the rows' cut where
every unit it deals is whole words of them (:func:`~tpcore.cut.scale_blocks.deals_whole_elements`), else every rank
holds them whole (``1 / (2 g)`` of the weight's bytes at 4 bits) and :meth:`PackedIntLinear.localize` picks its rows.

Value ``j`` of a row sits in word ``j // p`` at bit ``(j % p) b`` (little-endian words). The plan cuts the words
as any weight (the layer's :attr:`~tpcore.parallel.quantized_linear.QuantizedLayer.packing` makes it measure
heads in values), so a rank holds whole words: ``p`` divides every piece. ``group(j)``
(:func:`~tpcore.cut.scale_blocks.block_index`) is the scale group of value ``j`` of the rank's piece; a cut inside
a group leaves its scale to both ranks. Each forward unpacks the rank's words and multiplies in the scale's dtype,
as compressed-tensors decompresses (``q.to(S) * scale``, then the input's dtype), so a rank keeps ``b / 8`` bytes
a weight and never the whole model dequantized. In bfloat16 (the scales cast so), 4-bit values in groups of a multiple
of 32 compute with torch's CPU int4 product instead (:mod:`tpcore.parallel.int4pack`, ``W = s (u - 8)`` exact in
float32 where decompressing rounds ``q s`` to bfloat16), its copy in place of the rank's words.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from tpcore.cut.scale_blocks import block_index, deals_whole_elements, first_whole_block
from tpcore.cut.split import Split
from tpcore.parallel.int4pack import Int4Packed, int4pack_available
from tpcore.parallel.quantized_linear import QuantizedLinear, RowParallelQuantized

__all__ = ["PackedIntLinear", "RowParallelPackedIntLinear", "check_groups", "pack_words", "unpack_words"]

#: the bit widths whose values never straddle a byte
BIT_WIDTHS = (1, 2, 4, 8)


class PackedIntLinear(QuantizedLinear):
    """``nn.Linear`` whose ``weight`` is packed ``b``-bit integers (module docstring); made from an ``nn.Linear``
    in place by :meth:`hold`, told its cut by the plan and its rank by
    :func:`~tpcore.parallel.quantized_linear.localize_quantized`."""

    #: a model-wide cast casts the scales (and bias), as transformers does for these checkpoints; words stay int32
    keeps_stored_dtypes: bool | tuple[str, ...] = False
    bits = 4
    group_size = 1
    #: the whole weight's ``(out, in)``, in values
    whole_shape: tuple[int, int] = (0, 0)
    weight_packed: nn.Parameter
    weight_scale: nn.Parameter
    #: asymmetric checkpoints' packed zero points (module docstring), and this rank's as unsigned fields
    #: ``(out_r, in / g)`` (:meth:`localize`, a non-persistent buffer)
    weight_zero_point: nn.Parameter
    zero_points: torch.Tensor
    #: the scale group of each value of this rank's rows (:meth:`localize`), or ``None`` where the rank holds
    #: whole groups from :attr:`first_group` on
    scale_cols: torch.Tensor | None = None
    first_group = 0
    #: the rank's layer as torch's CPU int4 product takes it (:meth:`ready`), ``None`` where it decompresses
    int4: Int4Packed | None = None

    @classmethod
    def hold(
        cls,
        linear: nn.Linear,
        bits: int,
        group_size: int,
        scale_shape: tuple[int, ...],
        scale_dtype: torch.dtype,
        zero_points: bool = False,
    ) -> PackedIntLinear:
        """Make the meta ``linear`` hold ``bits``-bit integers in place: an int32 ``weight_packed`` (also its
        ``weight``) and a ``weight_scale`` of ``scale_shape`` and ``scale_dtype``, a scale per ``group_size``
        input features; and, with ``zero_points`` (asymmetric), a packed ``weight_zero_point`` beside them."""
        out_features, in_features = linear.out_features, linear.in_features
        if bits not in BIT_WIDTHS:
            raise ValueError(f"{bits}-bit values straddle bytes; tpcore unpacks {', '.join(map(str, BIT_WIDTHS))} bits")
        per_word = 32 // bits
        check_groups(linear, ("words", per_word), group_size, scale_shape)
        linear.__class__ = cls
        assert isinstance(linear, PackedIntLinear)
        linear._parameters.pop("weight", None)
        packed = torch.empty(out_features, in_features // per_word, dtype=torch.int32, device="meta")
        linear.weight_packed = nn.Parameter(packed, requires_grad=False)
        linear.weight = linear.weight_packed  # the name policies cut; the stored name comes first
        linear.weight_scale = nn.Parameter(
            torch.empty(scale_shape, dtype=scale_dtype, device="meta"), requires_grad=False
        )
        if zero_points:
            words = torch.empty(-(-out_features // per_word), scale_shape[1], dtype=torch.int32, device="meta")
            linear.weight_zero_point = nn.Parameter(words, requires_grad=False)
        linear.bits, linear.group_size, linear.packing = bits, group_size, (1, per_word)
        linear.whole_shape = (out_features, in_features)
        return linear

    @property
    def asymmetric(self) -> bool:
        return "weight_zero_point" in self._parameters

    def follower_cuts(self, split: Split, weight: str = "weight") -> dict[str, Split]:
        """The scales' rows follow the weight's rows, and the zero points' words where the split deals whole words of
        them; a cut of the columns leaves both whole."""
        if split.dim != 0:
            return {}
        follows = {"weight_scale": split}
        if self.asymmetric and deals_whole_elements(split, self.whole_shape[0], self.packing[1]):
            follows["weight_zero_point"] = split
        return follows

    def localize(self, rank: int, world_size: int) -> None:
        """Find the scale group of each value of this rank's rows, where its columns are cut; unpack this rank's
        zero points, where asymmetric."""
        cut = self.cuts.get("weight_packed")
        self.scale_cols, self.first_group = None, 0
        if self.asymmetric:
            zeros = unpack_words(self.weight_zero_point.T, self.bits).T  # (whole or own words * p, in / g)
            if cut is not None and cut.dim == 0 and "weight_zero_point" not in self.cuts:
                rows = block_index(cut, self.whole_shape[0], 1, rank, world_size)
                zeros = zeros.index_select(0, rows.to(zeros.device))
            self.register_buffer("zero_points", zeros[: self.weight_packed.shape[0]].contiguous(), persistent=False)
        if cut is not None and cut.dim == 1:
            if cut.pad:
                raise ValueError("packed values cut with padding: a padding word would read as nonzero values")
            whole_words = self.whole_shape[1] // self.packing[1]
            groups = block_index(cut, whole_words, self.group_size, rank, world_size, self.packing[1])
            first = first_whole_block(groups, self.group_size)
            self.scale_cols = None if first is not None else groups.to(self.weight_packed.device)
            self.first_group = first or 0

    def ready(self) -> None:
        """In bfloat16 (the scales cast so), lay 4-bit values out for torch's CPU int4 product."""
        scale = self.weight_scale
        if self.bits == 4 and scale.dtype == torch.bfloat16 and int4pack_available(scale.device, self.group_size):
            codes = unpack_words(self.weight_packed, 4).T  # (in_r, out_r): q + 8
            if self.asymmetric:
                zero_points = self.zero_points.T
            else:
                zero_points = torch.full((scale.shape[1], scale.shape[0]), 8, dtype=torch.uint8)
            int4 = Int4Packed(codes, self.column_groups(), scale.T, zero_points, self.group_size)
            int4.take_place_of(self, "weight_packed")

    def column_groups(self) -> torch.Tensor:
        """``(in_r,)`` the scale group of each of this rank's input features."""
        if self.scale_cols is not None:
            return self.scale_cols
        columns = self.weight_packed.shape[1] * self.packing[1]
        return self.first_group + torch.arange(columns, device=self.weight_packed.device) // self.group_size

    def as_stored(self, name: str) -> torch.Tensor:
        """``weight_packed``'s words read back from the int4 product's copy where it holds them, else the tensor."""
        if name != "weight_packed" or self.int4 is None:
            return super().as_stored(name)
        return pack_words(self.int4.codes().T, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is None:
            return super().forward(x)
        out = self.int4.linear(x)
        return out if self.bias is None else out + self.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``W_r`` (module docstring) in ``dtype``."""
        scale = self.weight_scale
        words = self.as_stored("weight_packed")  # read back from the int4 product's copy where it holds them
        values = unpack_words(words, self.bits).to(scale.dtype)
        zeros = self.zero_points if self.asymmetric else None
        rows, columns = values.shape
        if self.scale_cols is not None:
            values.sub_(2 ** (self.bits - 1) if zeros is None else zeros.index_select(1, self.scale_cols))
            return values.mul_(scale.index_select(1, self.scale_cols)).to(dtype)
        groups = columns // self.group_size
        grouped = values.view(rows, groups, self.group_size)
        grouped.sub_(2 ** (self.bits - 1) if zeros is None else zeros.narrow(1, self.first_group, groups).unsqueeze(-1))
        scales = scale.narrow(1, self.first_group, groups).unsqueeze(-1)
        return grouped.mul_(scales).view(rows, columns).to(dtype)


class RowParallelPackedIntLinear(RowParallelQuantized, PackedIntLinear):
    """:class:`PackedIntLinear` holding a shard of the input features; output all-reduced, bias added once. With the
    int4 product, its bfloat16 partial products are summed in float32 and rounded once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is None:
            return super().forward(x)
        out = self.int4.linear(x, self.tp_group)
        return out if self.bias is None else out + self.bias


PackedIntLinear.row_parallel_class = RowParallelPackedIntLinear


def check_groups(linear: nn.Linear, element: tuple[str, int], group_size: int, scale_shape: tuple[int, ...]) -> None:
    """Refuse (ValueError) a ``linear`` whose input features are no whole stored elements (``element``: their name
    and values each) and groups of ``group_size``, or whose scales are not ``(out, in / group_size)``."""
    out_features, in_features = linear.out_features, linear.in_features
    (name, per_element) = element
    if in_features % per_element or in_features % group_size:
        raise ValueError(
            f"{in_features} input features are not whole {name} of {per_element} values and groups of {group_size}"
        )
    if tuple(scale_shape) != (out_features, in_features // group_size):
        raise ValueError(
            f"a ({out_features}, {in_features}) weight in groups of {group_size} has "
            f"{(out_features, in_features // group_size)} scales, not {tuple(scale_shape)}"
        )


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """``(rows, n * 32 / bits)`` uint8: the unsigned ``bits``-bit fields of int32 ``words (rows, n)``, value ``j``
    at bit ``j bits`` of its row (little-endian words: the low byte first)."""
    if sys.byteorder != "little":
        raise RuntimeError("packed int32 words are unpacked on little-endian hosts only")
    data = words.contiguous().view(-1).view(torch.uint8).view(words.shape[0], -1)  # (rows, 4 n), low bytes first
    if bits == 8:
        return data
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=words.device)
    fields = data.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_((1 << bits) - 1)
    return fields.view(words.shape[0], -1)


def pack_words(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """``(rows, n)`` int32: unsigned ``bits``-bit ``fields (rows, n * 32 / bits)`` packed as :func:`unpack_words`
    reads them."""
    if sys.byteorder != "little":
        raise RuntimeError("packed int32 words are packed on little-endian hosts only")
    per_byte = 8 // bits
    grouped = fields.to(torch.uint8).view(fields.shape[0], -1, per_byte)
    data = grouped[..., 0].clone()
    for field in range(1, per_byte):
        data.bitwise_or_(grouped[..., field].bitwise_left_shift(field * bits))
    return data.contiguous().view(torch.int32)
