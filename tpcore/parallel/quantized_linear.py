"""Quantized linear layers that compute on a rank's shard: its quantized values, dequantized a layer at a time.

:class:`BlockFP8Linear` holds block FP8 (DeepSeek-V3's layout, transformers' ``FineGrainedFP8``)::

    weight            float8_e4m3fn  (out_r, in_r)                  this rank's values (a cut like any weight's)
    weight_scale_inv  float32        (ceil(out / B0), ceil(in / B1)) every block's scale, whole on every rank
    y = x @ W_r.T + b,   W_r[i, j] = weight[i, j] * weight_scale_inv[rows[i], cols[j]]

where ``rows`` and ``cols`` (:func:`tpcore.cut.scale_blocks.block_index`) give the block of each index this rank holds.
A device without FP8 matrix products (a CPU) computes ``W_r`` in float32 and rounds it once to the input's dtype
for each forward, as transformers' dequantization does at load, so the rank keeps 1 byte a weight and never the
whole model dequantized. On a CPU the e4m3 values are widened through float16's bit layout
(:func:`e4m3_as_scaled_float32`), exact and faster than torch's element-by-element conversion there. Column-parallel
use needs nothing more; row-parallel use is :class:`RowParallelBlockFP8Linear`
(:func:`~tpcore.parallel.layers.row_parallel_class` gives it), its output all-reduced and the bias added once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcore.cut.scale_blocks import block_index
from tpcore.cut.split import Split
from tpcore.parallel.layers import reduce_partial_sums
from tpcore.parallel.token_rounding import (
    GatheredGroupMaxima,
    GatheredTokenMaxima,
    GroupRoundedInputs,
    TokenRoundedInputs,
)

__all__ = [
    "BlockFP8Linear",
    "GroupFP8Linear",
    "QuantizedLayer",
    "QuantizedLinear",
    "RowParallelQuantized",
    "TokenFP8Linear",
    "RowFP8Linear",
    "RowParallelBlockFP8Linear",
    "e4m3_as_scaled_float32",
    "localize_quantized",
    "ready_quantized",
]


class QuantizedLayer(nn.Module):
    """What every quantized layer tpcore splits shares (mixin before the layer's own class): its tensors keep their
    stored dtypes under a model-wide cast, the plan cuts the tensors that follow its weight's cut with it
    (:meth:`follower_cuts`) and tells it the cut of each of its own tensors (:attr:`cuts`, by name, the same on every
    rank), and a rank tells it its rank once loaded (:meth:`localize`)."""

    #: the tensors a model-wide cast leaves in their stored dtypes: all (``True``), none, or those named
    keeps_stored_dtypes: bool | tuple[str, ...] = True
    #: the plan's cut of each of this module's own tensors that is cut: ``{name: Split}`` (dims counted from 0)
    cuts: dict[str, Split] = {}
    #: how many values one stored element of ``weight`` holds along each of its dimensions (a packed format's
    #: integers a word): the plan measures heads and layer sizes in values, and cuts ``weight`` in whole elements
    packing: tuple[int, ...] = (1, 1)
    #: ``weight`` is stored ``(in, out)`` (GPTQ's ``qweight``, as HF ``Conv1D``): a policy's cut of ``(out, in)``
    #: dimension ``d`` cuts its dimension ``1 - d``, and ``packing`` counts its dimensions as stored
    transposed = False
    #: the stored key of each of its tensors that the files keep under another name (``{name: key}``, set by the
    #: format that holds it): the checkpoint reads it from there, a flat one as this tensor's shape
    stored_as: dict[str, str] = {}

    def stored_split(self, split: Split, weight: str = "weight") -> Split:
        """A policy's cut of the tensor ``weight`` as the plain layer holds it (``(out, in)``), as a cut of the tensor
        this layer stores in its place (``transposed``: dimension ``d`` is dimension ``1 - d``)."""
        if not self.transposed:
            return split
        return split._replace(dim=1 - split.resolved(2).dim)

    def follower_cuts(self, split: Split, weight: str = "weight") -> dict[str, Split]:
        """The cuts of this module's other tensors that follow ``split``, the cut of its tensor ``weight`` (dims
        counted from 0): ``{name: Split}``; a tensor not named stays whole on every rank."""
        return {}

    def localize(self, rank: int, world_size: int) -> None:
        """Prepare what this rank's forward needs from its shard (called on the rank, once loaded)."""

    def ready(self) -> None:
        """Lay this rank's tensors out for its device's kernels, once the model has its final dtype and device (called
        on the rank after :meth:`localize`, the cast and the move)."""

    def as_stored(self, name: str) -> torch.Tensor:
        """This rank's part of its tensor ``name`` as the files store it (gathered to save or to reassemble): the
        tensor itself, unless :meth:`localize` laid it out otherwise for a kernel."""
        return getattr(self, name)


class QuantizedLinear(QuantizedLayer, nn.Linear):
    """``nn.Linear`` whose weight is stored quantized: :meth:`dequantized` makes the rank's ``W_r`` for each
    forward, ``y = x @ W_r.T + b``."""

    #: the row-parallel class (:func:`~tpcore.parallel.layers.row_parallel_class`), set for each subclass
    row_parallel_class: type[nn.Module] | None = None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's weight ``(out_r, in_r)`` in ``dtype``."""
        raise NotImplementedError

    def quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the format's activation quantization leaves it (default: unchanged)."""
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quantized_input(x), self.dequantized(x.dtype), self.bias)


class RowParallelQuantized(nn.Module):
    """Mixin before a :class:`QuantizedLinear` holding a shard of the input features: output all-reduced, bias
    added once."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products = F.linear(self.quantized_input(x), self.dequantized(x.dtype))  # type: ignore[operator]
        out = reduce_partial_sums(products, self.tp_group)
        bias = self._parameters.get("bias")
        return out if bias is None else out + bias


class BlockFP8Linear(QuantizedLinear):
    """``nn.Linear`` whose ``weight`` is block FP8 (module docstring); made from an ``nn.Linear`` in place by
    :meth:`hold`, told its cut by the plan (:attr:`cuts`) and its rank by :func:`localize_quantized`."""

    #: the whole weight's ``(out, in)`` and its ``(B0, B1)`` blocks
    whole_shape: tuple[int, int] = (0, 0)
    block: tuple[int, int] = (1, 1)
    weight_scale_inv: nn.Parameter
    #: the block of each row and column of ``weight`` (:meth:`localize`)
    scale_rows: torch.Tensor
    scale_cols: torch.Tensor
    whole_column_blocks = False

    @classmethod
    def hold(cls, linear: nn.Linear, block: tuple[int, int], scale_shape: tuple[int, ...]) -> BlockFP8Linear:
        """Make the meta ``linear`` hold block FP8 in place: an e4m3 ``weight`` of its shape, a float32
        ``weight_scale_inv`` of ``scale_shape``."""
        out_features, in_features = linear.weight.shape
        expected = (-(-out_features // block[0]), -(-in_features // block[1]))
        if tuple(scale_shape) != expected:
            raise ValueError(
                f"a ({out_features}, {in_features}) weight in blocks of {block[0]} x {block[1]} has {expected} "
                f"scales, not {tuple(scale_shape)}"
            )
        linear.__class__ = cls
        assert isinstance(linear, BlockFP8Linear)
        linear.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device="meta"))
        linear.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device="meta"))
        linear.whole_shape, linear.block = (out_features, in_features), tuple(block)  # type: ignore[assignment]
        linear.weight.requires_grad_(False)
        linear.weight_scale_inv.requires_grad_(False)
        return linear

    def localize(self, rank: int, world_size: int) -> None:
        """Find the block of each row and column this rank's ``weight`` holds (non-persistent buffers)."""
        splits: list[Split | None] = [None, None]
        cut = self.cuts.get("weight")
        if cut is not None:
            splits[cut.dim] = cut
        rows, cols = (
            block_index(split, size, block, rank, world_size)
            for split, size, block in zip(splits, self.whole_shape, self.block, strict=True)
        )
        self.register_buffer("scale_rows", rows.to(self.weight.device), persistent=False)
        self.register_buffer("scale_cols", cols.to(self.weight.device), persistent=False)
        #: whether this rank holds whole column blocks (``weight`` viewed ``(out_r, in / B1, B1)``)
        self.whole_column_blocks = splits[1] is None and self.whole_shape[1] % self.block[1] == 0

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``W_r`` (module docstring) in ``dtype``: the product in float32, rounded once."""
        scales = self.weight_scale_inv.float()
        if self.weight.device.type == "cpu":  # e4m3 read as 2^-8 of itself, by integer ops: module docstring
            values, scales = e4m3_as_scaled_float32(self.weight), scales * _E4M3_TO_FP16
        else:
            values = self.weight.float()
        scales = scales.index_select(0, self.scale_rows)
        if self.whole_column_blocks:  # a scale per row and column block, broadcast over the block's columns
            out_features, in_features = values.shape
            blocks = values.view(out_features, in_features // self.block[1], self.block[1])
            return blocks.mul_(scales.unsqueeze(-1)).view(out_features, in_features).to(dtype)
        return values.mul_(scales.index_select(1, self.scale_cols)).to(dtype)


#: an e4m3 bit pattern moved into float16's places reads 2^-8 of its value (exponent bias 7 against 15)
_E4M3_TO_FP16 = 2.0**8


def e4m3_as_scaled_float32(values: torch.Tensor) -> torch.Tensor:
    """``2^-8 x values`` (float8_e4m3fn) in float32, exact for every e4m3 number (its NaN reads as +-1.875).

    The sign, exponent and mantissa bits move into float16's places with int16 operations and float16 widens to
    float32 in vectorized code: on a CPU, faster than ``values.float()``, which converts element by element
    (``bench/quantized.py``: 2.2 tok/s before, 5.9 after, at 2 ranks).
    Multiplying by the scale times 2^8 then gives ``values x scale`` rounded once, as ``values.float() * scale`` does.
    """
    wide = values.view(torch.int8).to(torch.int16)  # sign-extended: bit 15 holds the sign
    sign = wide.bitwise_and(-(2**15))
    magnitude = wide.bitwise_left_shift_(7).bitwise_and_(0x3F80)  # exponent and mantissa, bits 7-13
    return magnitude.bitwise_or_(sign).view(torch.float16).float()


class RowParallelBlockFP8Linear(RowParallelQuantized, BlockFP8Linear):
    """:class:`BlockFP8Linear` holding a shard of the input features; output all-reduced, bias added once."""


BlockFP8Linear.row_parallel_class = RowParallelBlockFP8Linear


class RowFP8Linear(BlockFP8Linear):
    """torchao's ``Float8WeightOnlyConfig`` (per row): e4m3 weights with a float32 scale per output row
    (:class:`BlockFP8Linear` of ``(1, in)`` blocks), computed as torchao's ``Float8Tensor`` computes a weight-only
    product: the weight dequantized in float32 and rounded once to the input's dtype, the product, then the bias
    added (not fused into the product)."""

    #: a model-wide cast casts the scales (and bias), as transformers does for torchao; the values stay e4m3
    keeps_stored_dtypes = ("weight",)

    @classmethod
    def hold_rows(cls, linear: nn.Linear) -> RowFP8Linear:
        """Make the meta ``linear`` hold e4m3 values and a float32 ``weight_scale_inv`` ``(out, 1)``."""
        held = cls.hold(linear, (1, linear.in_features), (linear.out_features, 1))
        assert isinstance(held, RowFP8Linear)
        return held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.dequantized(x.dtype))
        return out if self.bias is None else out + self.bias


class RowParallelRowFP8Linear(RowParallelQuantized, RowFP8Linear):
    """:class:`RowFP8Linear` holding a shard of the input features; output all-reduced, bias added once."""


RowFP8Linear.row_parallel_class = RowParallelRowFP8Linear


class TokenFP8Linear(TokenRoundedInputs, BlockFP8Linear):
    """compressed-tensors' ``FP8_DYNAMIC``: e4m3 weights with a scale per output row (:class:`BlockFP8Linear` of
    ``(1, in)`` blocks, the scale stored as ``weight_scale`` and also known as ``weight_scale_inv``), and each
    token's input rounded through e4m3 before the product (:mod:`tpcore.parallel.token_rounding`)."""

    token_values = "e4m3"

    @classmethod
    def hold_rows(cls, linear: nn.Linear, scale_dtype: torch.dtype) -> TokenFP8Linear:
        """Make the meta ``linear`` hold e4m3 values and a ``weight_scale`` ``(out, 1)`` of ``scale_dtype``."""
        held = cls.hold(linear, (1, linear.in_features), (linear.out_features, 1))
        assert isinstance(held, TokenFP8Linear)
        return _scale_stored_as_weight_scale(held, scale_dtype)


class RowParallelTokenFP8Linear(RowParallelQuantized, GatheredTokenMaxima, TokenFP8Linear):
    """:class:`TokenFP8Linear` holding a shard of the input features: each token's maximum gathered from every
    rank, the output all-reduced, the bias added once."""


TokenFP8Linear.row_parallel_class = RowParallelTokenFP8Linear


class GroupFP8Linear(GroupRoundedInputs, BlockFP8Linear):
    """compressed-tensors' ``FP8_BLOCK``: e4m3 weights with a scale per ``(B0, B1)`` block (:class:`BlockFP8Linear`,
    the scale stored as ``weight_scale`` and also known as ``weight_scale_inv``), and each token's input rounded
    through e4m3 per group of ``B1`` features, a group a column block (:mod:`tpcore.parallel.token_rounding`)."""

    @classmethod
    def hold_blocks(
        cls, linear: nn.Linear, block: tuple[int, int], scale_shape: tuple[int, ...], scale_dtype: torch.dtype
    ) -> GroupFP8Linear:
        """Make the meta ``linear`` hold e4m3 values and a ``weight_scale`` of ``scale_shape`` and ``scale_dtype``."""
        held = cls.hold(linear, block, scale_shape)
        assert isinstance(held, GroupFP8Linear)
        return _scale_stored_as_weight_scale(held, scale_dtype)


class RowParallelGroupFP8Linear(RowParallelQuantized, GatheredGroupMaxima, GroupFP8Linear):
    """:class:`GroupFP8Linear` holding a shard of the input features: each group's maximum gathered from every rank
    (a cut may fall inside a group), the output all-reduced, the bias added once."""


GroupFP8Linear.row_parallel_class = RowParallelGroupFP8Linear


def _scale_stored_as_weight_scale(held, scale_dtype: torch.dtype):
    """``held``'s ``weight_scale_inv`` as compressed-tensors stores it: ``weight_scale`` of ``scale_dtype``, the old
    name kept for the same parameter."""
    scale = held._parameters.pop("weight_scale_inv")
    assert scale is not None
    held.weight_scale = nn.Parameter(scale.data.to(scale_dtype), requires_grad=False)  # the stored name first
    held.weight_scale_inv = held.weight_scale
    return held


def ready_quantized(model: nn.Module) -> None:
    """Let every quantized layer of ``model`` (a rank's, cast and on its device) lay its tensors out for its kernels."""
    for module in model.modules():
        if isinstance(module, QuantizedLayer):
            module.ready()


def localize_quantized(model: nn.Module, rank: int, world_size: int) -> int:
    """Tell every quantized layer of ``model`` (rank ``rank``'s shard) its rank; the number of layers."""
    layers = [module for module in model.modules() if isinstance(module, QuantizedLayer)]
    for layer in layers:
        layer.localize(rank, world_size)
    return len(layers)
