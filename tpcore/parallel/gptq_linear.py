"""Linear layers stored as GPTQ and AWQ store them (GPTQModel's, AutoGPTQ's and AutoAWQ's layouts), computed on a
rank's words.

:class:`GPTQLinear` holds ``b``-bit integers packed ``p = 32 / b`` to an int32 word along the input features, with a
scale and a zero point per group of input features and output feature::

    qweight  int32  (in_r / p, out_r)    this rank's words (also ``weight``; stored ``(in, out)``: ``transposed``)
    scales   S      (groups, out_r)      cut with the output features; whole where the input features are cut
    qzeros   int32  (groups, out_r / p)  zero points packed along the outputs, cut with them (in whole words)
    g_idx    int32  (in_r,)              the group of each input feature, cut with them
    W_r.T[i, o] = scales[g(i), o] * (q[i, o] - z[g(i), o]),   g(i) = g_idx of the rank's input feature i

Value ``i`` of a column sits in word ``i // p`` at bit ``(i % p) b``. The plan cuts the words as any weight (measured
in values through :attr:`~tpcore.parallel.quantized_linear.QuantizedLayer.packing`), so a rank holds whole words
and any cut of the groups: act-order checkpoints (``desc_act``, ``g_idx`` not sorted) included, since each row finds
its own group. Where a cut leaves them whole (the other dimension's cut, or output units that are no whole words of
zero points), :meth:`GPTQLinear.localize` picks the rank's own: they cost ``1 / (2 g)`` and ``4 / out`` of a weight's
bytes. GPTQ v1 checkpoints (``checkpoint_format: gptq``) store ``z - 1``, v2 ``z``.

:class:`AWQLinear` holds AWQ's GEMM layout: the same formula with ``g(i) = i // g`` (no ``g_idx``), 4-bit values packed
along the output features, each word's 8 values in the order :data:`AWQ_ORDER`::

    qweight  int32  (in_r, out_r / 8)     this rank's words (stored ``(in, out)``: ``transposed``)
    scales   S      (groups, out_r)       cut with the output features; whole where the input features are cut
    qzeros   int32  (groups, out_r / 8)   packed as ``qweight``, cut with its columns

A rank computes as transformers would unsplit. Where :attr:`GPTQLinear.int4_kernel` asks (GPTQModel's default CPU
kernels) and the layer is 4-bit in groups torch's CPU int4 product takes, the rank's :meth:`GPTQLinear.ready` lays its
codes out for that product (:class:`~tpcore.parallel.int4pack.Int4Packed`, in place of ``qweight``: the same bytes)
and each forward is that product in bfloat16. Otherwise each forward computes ``W_r`` as GPTQModel's torch kernels do
(``q - z`` in int8 or int16, times the scale: GPTQ's in the scales' dtype, then rounded to the input's; AWQ's with the
scales rounded to the input's half dtype first, a float32 input computed in float16) and ``x @ W_r.T``, the bias added
after the product. Either way a rank keeps ``b / 8`` bytes a weight and never the whole model dequantized.
"""

from __future__ import annotations

import torch
from torch import nn

from tpcore.cut.scale_blocks import block_index, deals_whole_elements
from tpcore.cut.split import Split
from tpcore.parallel.comm import all_reduce
from tpcore.parallel.int4pack import Int4Packed, int4pack_available
from tpcore.parallel.packed_int_linear import pack_words, unpack_words
from tpcore.parallel.quantized_linear import QuantizedLinear, RowParallelQuantized

__all__ = ["AWQ_ORDER", "AWQLinear", "GPTQ_BIT_WIDTHS", "GPTQLinear", "RowParallelAWQLinear", "RowParallelGPTQLinear"]

#: the bit widths whose values fill whole int32 words (GPTQ's 3 bits straddle them)
GPTQ_BIT_WIDTHS = (2, 4, 8)


class GPTQLinear(QuantizedLinear):
    """``nn.Linear`` whose weight is GPTQ's packed integers (module docstring); made from an ``nn.Linear`` by
    :meth:`hold`, told its cut by the plan and its rank by
    :func:`~tpcore.parallel.quantized_linear.localize_quantized`."""

    transposed = True
    bits = 4
    group_size = 1
    #: what the stored zero points lack: 1 for GPTQ v1 (``z - 1`` stored), 0 for v2
    zero_offset = 0
    #: the whole weight's ``(out, in)``, in values
    whole_shape: tuple[int, int] = (0, 0)
    qweight: nn.Parameter
    qzeros: nn.Parameter
    scales: nn.Parameter
    g_idx: nn.Parameter
    #: this rank's zero points ``(groups, out_r)`` and the group of each of its input features (:meth:`localize`)
    zero_points: torch.Tensor
    row_groups: torch.Tensor
    #: compute with torch's CPU int4 product where the rank can (:mod:`tpcore.parallel.int4pack`: 4-bit values, its
    #: group sizes, a CPU), as GPTQModel's default CPU kernels do; else the torch kernels' dequantizing product
    int4_kernel = False
    #: the rank's layer as that product takes it (:meth:`ready`), ``None`` where it computes dequantizing
    int4: Int4Packed | None = None

    @classmethod
    def hold(
        cls,
        linear: nn.Linear,
        bits: int,
        group_size: int,
        scale_dtype: torch.dtype,
        zero_offset: int = 0,
    ) -> GPTQLinear:
        """Make the meta ``linear`` hold GPTQ's tensors in place (module docstring) for ``bits``-bit values, a scale
        per ``group_size`` input features in ``scale_dtype``, and zero points stored ``zero_offset`` less."""
        out_features, in_features = linear.out_features, linear.in_features
        if bits not in GPTQ_BIT_WIDTHS:
            raise ValueError(
                f"{bits}-bit values straddle int32 words; tpcore unpacks {', '.join(map(str, GPTQ_BIT_WIDTHS))} bits"
            )
        per_word = 32 // bits
        if in_features % per_word:
            raise ValueError(f"{in_features} input features are not whole words of {per_word} values")
        groups = -(-in_features // group_size)
        bias = linear._parameters.get("bias")
        linear.__class__ = cls
        assert isinstance(linear, GPTQLinear)
        linear._parameters.pop("weight", None)
        linear._parameters.pop("bias", None)

        def meta(*shape: int, dtype: torch.dtype = torch.int32) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)

        linear.qweight = meta(in_features // per_word, out_features)
        linear.qzeros = meta(groups, -(-out_features // per_word))
        linear.scales = meta(groups, out_features, dtype=scale_dtype)
        linear.g_idx = meta(in_features)
        linear.weight = linear.qweight  # the name policies cut; the stored name comes first
        linear.bias = bias  # type: ignore[assignment]  # after the stored tensors, as the files list them
        linear.bits, linear.group_size, linear.zero_offset = bits, group_size, zero_offset
        linear.packing = (per_word, 1)
        linear.whole_shape = (out_features, in_features)
        return linear

    def follower_cuts(self, split: Split, weight: str = "weight") -> dict[str, Split]:
        """The scales' columns follow the output features, and the zero points' words where every unit the split
        deals is whole words of them; ``g_idx`` follows the input features (the plan deals packed layers' features
        in units of whole words, so the same units cut values and words alike). What does not follow stays whole."""
        if split.dim == 0:
            proportional = (split.heads is not None or split.parts is not None) and split.widths is None
            return {"g_idx": split} if proportional else {}
        follows = {"scales": split}
        if deals_whole_elements(split, self.whole_shape[0], self.packing[0]):
            follows["qzeros"] = split
        return follows

    def localize(self, rank: int, world_size: int) -> None:
        """Pick this rank's zero points and the group of each of its input features where they came whole
        (non-persistent buffers)."""
        cut = self.cuts.get("qweight")
        if cut is not None and cut.pad:
            raise ValueError("packed values cut with padding: a padding word would read as nonzero values")
        out_features, in_features = self.whole_shape
        device = self.qweight.device
        zeros = unpack_words(self.qzeros, self.bits).to(self.codes_dtype)
        if self.zero_offset:
            zeros = zeros.add_(self.zero_offset)
        row_groups = self.g_idx.long()
        if cut is not None and cut.dim == 1 and "qzeros" not in self.cuts:
            columns = block_index(cut, out_features, 1, rank, world_size).to(device)
            zeros = zeros.index_select(1, columns)
        elif cut is not None and cut.dim == 0 and "g_idx" not in self.cuts:
            rows = block_index(cut, in_features // self.packing[0], 1, rank, world_size, self.packing[0])
            row_groups = row_groups.index_select(0, rows.to(device))
        self.register_buffer("zero_points", zeros[:, : self.qweight.shape[1]].contiguous(), persistent=False)
        self.register_buffer("row_groups", row_groups, persistent=False)

    def ready(self) -> None:
        """Where :attr:`int4_kernel` asks and the rank can, lay its codes out for torch's CPU int4 product and keep
        that copy in place of ``qweight`` (the same bytes; :meth:`as_stored` gives the words back)."""
        if not (self.int4_kernel and self.bits == 4 and int4pack_available(self.qweight.device, self.group_size)):
            return
        int4 = Int4Packed(self.unpacked(), self.row_groups, self.scales, self.zero_points, self.group_size)
        int4.take_place_of(self, "qweight")

    def as_stored(self, name: str) -> torch.Tensor:
        """``qweight``'s words read back from the int4 product's copy where it holds them, else the tensor."""
        if name != "qweight" or self.int4 is None:
            return super().as_stored(name)
        return self.words(self.int4.codes())

    def words(self, codes: torch.Tensor) -> torch.Tensor:
        """``(in_r / 8, out_r)`` int32: 4-bit ``codes (in_r, out_r)`` packed 8 to a word along the input features."""
        return pack_words(codes.T, 4).T.contiguous()

    @property
    def codes_dtype(self) -> torch.dtype:
        """The integers ``q - z`` is computed in, as GPTQModel computes it: int8, int16 for 8-bit values."""
        return torch.int16 if self.bits == 8 else torch.int8

    def unpacked(self) -> torch.Tensor:
        """``(in_r, out_r)`` :attr:`codes_dtype`: the unsigned ``b``-bit fields of this rank's words, value ``i`` of
        each column at bit ``(i % p) b`` of word ``i // p``."""
        words = self.qweight
        shifts = torch.arange(0, 32, self.bits, dtype=torch.int32, device=words.device).view(1, -1, 1)
        fields = words.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_((1 << self.bits) - 1)
        return fields.to(self.codes_dtype).view(-1, words.shape[1])

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the product of an input of ``dtype`` is computed in: the input's."""
        return dtype

    def dequantized_columns(self, dtype: torch.dtype) -> torch.Tensor:
        """``W_r.T`` ``(in_r, out_r)`` in ``dtype``: computed in the scales' dtype, then rounded (GPTQModel's torch
        kernel)."""
        groups = self.row_groups
        scales = self.scales.index_select(0, groups)
        return (scales * (self.unpacked() - self.zero_points.index_select(0, groups))).to(dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``W_r`` ``(out_r, in_r)`` in ``dtype``: a transposed view."""
        return self.dequantized_columns(dtype).T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None:  # GPTQModel's CPU kernel: the bfloat16 product in the input's dtype, then the bias
            return self.biased_as_stored(self.int4.linear(x))
        compute = self.compute_dtype(x.dtype)
        out = torch.matmul(x.reshape(-1, x.shape[-1]).to(compute), self.dequantized_columns(compute))
        return self.biased(out).to(x.dtype).view(*x.shape[:-1], out.shape[-1])

    def biased(self, out: torch.Tensor) -> torch.Tensor:
        """``out + b``, the bias rounded to ``out``'s dtype first (as GPTQModel's torch kernels add it)."""
        return out if self.bias is None else out.add_(self.bias.to(out.dtype))

    def biased_as_stored(self, out: torch.Tensor) -> torch.Tensor:
        """``out + b`` computed in the dtypes' promotion (float32 for bfloat16 and float16), rounded once to
        ``out``'s (as GPTQModel's CPU kernels add it)."""
        return out if self.bias is None else out.add_(self.bias)


class RowParallelGPTQLinear(RowParallelQuantized, GPTQLinear):
    """:class:`GPTQLinear` holding a shard of the input features; output all-reduced, bias added once. A float16 or
    bfloat16 input's partial products are summed in float32 and rounded once, as the unsplit product rounds its
    float32 sum once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None:  # bfloat16 partials summed in float32, rounded once to the kernel's bfloat16
            return self.biased_as_stored(self.int4.linear(x, self.tp_group))
        compute = self.compute_dtype(x.dtype)
        wide = torch.float32 if compute in (torch.float16, torch.bfloat16) else compute
        weight = self.dequantized_columns(compute).to(wide)
        partial = torch.matmul(x.reshape(-1, x.shape[-1]).to(compute).to(wide), weight)
        out = self.biased(all_reduce(partial, self.tp_group).to(compute))
        return out.to(x.dtype).view(*x.shape[:-1], partial.shape[-1])


GPTQLinear.row_parallel_class = RowParallelGPTQLinear


#: the output feature (within its word's 8) each 4-bit field of an AWQ word holds, field ``k`` at bit ``4 k``
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: the field holding each output feature of a word: ``AWQ_ORDER[_AWQ_FIELD[c]] == c``
_AWQ_FIELD = tuple(AWQ_ORDER.index(feature) for feature in range(8))


class AWQLinear(GPTQLinear):
    """``nn.Linear`` whose weight is AWQ's GEMM layout (module docstring): GPTQ's formula, groups in order, 4-bit values
    packed along the output features in :data:`AWQ_ORDER`."""

    @classmethod
    def hold_awq(cls, linear: nn.Linear, group_size: int, scale_dtype: torch.dtype) -> AWQLinear:
        """Make the meta ``linear`` hold AWQ's tensors in place for 4-bit values, a scale and zero point per
        ``group_size`` input features in ``scale_dtype``."""
        out_features, in_features = linear.out_features, linear.in_features
        if out_features % 8:
            raise ValueError(f"{out_features} output features are not whole words of 8 values")
        if in_features % group_size:
            raise ValueError(f"{in_features} input features are not whole groups of {group_size}")
        bias = linear._parameters.get("bias")
        linear.__class__ = cls
        assert isinstance(linear, AWQLinear)
        for name in ("weight", "bias"):
            linear._parameters.pop(name, None)
        groups = in_features // group_size

        def meta(*shape: int, dtype: torch.dtype = torch.int32) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)

        linear.qweight = meta(in_features, out_features // 8)
        linear.qzeros = meta(groups, out_features // 8)
        linear.scales = meta(groups, out_features, dtype=scale_dtype)
        linear.weight = linear.qweight
        linear.bias = bias  # type: ignore[assignment]  # after the stored tensors, as the files list them
        linear.bits, linear.group_size, linear.zero_offset = 4, group_size, 0
        linear.packing = (1, 8)
        linear.whole_shape = (out_features, in_features)
        return linear

    def follower_cuts(self, split: Split, weight: str = "weight") -> dict[str, Split]:
        """The scales and the zero points' words follow the output features (the plan deals whole words); a cut of
        the input features leaves them whole."""
        return {"scales": split, "qzeros": split} if split.dim == 1 else {}

    def localize(self, rank: int, world_size: int) -> None:
        """Find the group of each of this rank's input features and unpack its zero points (non-persistent
        buffers)."""
        cut = self.cuts.get("qweight")
        if cut is not None and cut.pad:
            raise ValueError("packed values cut with padding: a padding word would read as nonzero values")
        in_features = self.whole_shape[1]
        rows = cut if cut is not None and cut.dim == 0 else None
        row_groups = block_index(rows, in_features, self.group_size, rank, world_size)
        self.register_buffer("zero_points", self.in_feature_order(self.qzeros), persistent=False)
        self.register_buffer("row_groups", row_groups.to(self.qweight.device), persistent=False)

    def in_feature_order(self, words: torch.Tensor) -> torch.Tensor:
        """``(rows, 8 n)`` int8: the 4-bit fields of int32 ``words (rows, n)``, each word's put back in the order
        of its output features."""
        fields = unpack_words(words, 4).to(torch.int8)
        order = torch.tensor(_AWQ_FIELD, device=words.device)
        return fields.view(words.shape[0], -1, 8).index_select(2, order).view(words.shape[0], -1)

    def unpacked(self) -> torch.Tensor:
        return self.in_feature_order(self.qweight)

    def words(self, codes: torch.Tensor) -> torch.Tensor:
        """``(in_r, out_r / 8)`` int32: ``codes (in_r, out_r)`` packed 8 output features to a word in
        :data:`AWQ_ORDER`, field ``k`` at bit ``4 k``."""
        fields = codes.view(codes.shape[0], -1, 8).index_select(2, torch.tensor(AWQ_ORDER))
        return pack_words(fields.reshape(codes.shape[0], -1), 4)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The input's half dtype, or float16 (GPTQModel's AWQ torch kernel computes a float32 input so)."""
        return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16

    def dequantized_columns(self, dtype: torch.dtype) -> torch.Tensor:
        """``W_r.T`` ``(in_r, out_r)`` in ``dtype``, the scales rounded to it first (GPTQModel's AWQ torch kernel)."""
        groups = self.row_groups
        scales = self.scales.to(dtype).index_select(0, groups)
        return scales * (self.unpacked() - self.zero_points.index_select(0, groups))


class RowParallelAWQLinear(RowParallelGPTQLinear, AWQLinear):
    """:class:`AWQLinear` holding a shard of the input features; output all-reduced, bias added once."""


AWQLinear.row_parallel_class = RowParallelAWQLinear
