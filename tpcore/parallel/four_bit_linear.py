"""bitsandbytes' 4-bit linear layers (``Linear4bit``: NF4 or FP4 codes, a scale per block), computed on a rank's
bytes.

bitsandbytes flattens a ``(out, in)`` weight row-major, packs two 4-bit codes a byte (the first in the high
nibble) and scales each block of ``B`` consecutive values (``blocksize``, 64 by default) by its absolute maximum.
Where ``B`` divides ``in`` a block never crosses a row, so the flat bytes are rows of ``in / 2`` bytes and the
block scales rows of ``in / B``::

    weight  uint8    (out_r, in_r / 2)   this rank's bytes, two codes each (a cut like any weight's, in whole bytes)
    absmax  float32  (out_r, in / B)     cut with the rows; whole on every rank where the columns are cut
    code    float32  (16,)               the code's values (NF4 or FP4), whole on every rank
    W_r[i, j] = code[c(i, j)] * absmax[i, block(j)]

computed as bitsandbytes dequantizes (``code[c] * absmax`` in float32, then the compute dtype), then one matrix
product in the compute dtype (``bnb_4bit_compute_dtype``). With nested quantization (``bnb_4bit_use_double_quant``)
the block scales are stored as uint8 codes of their own, ``absmax = nested_code[a] * nested_absmax[k // 256] +
offset`` over the flat index ``k`` of each scale; a rank makes its float32 scales once from its codes
(:meth:`FourBitLinear.localize`, kept beside the stored codes), as bitsandbytes does in each forward. ``block(j)``
(:func:`~tpcore.cut.scale_blocks.block_index`) is the block of value ``j`` of a rank's piece; a cut inside a block
leaves its scale to both ranks. A rank keeps half a byte a weight, never the whole model dequantized.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpcore.cut.scale_blocks import block_index, first_whole_block
from tpcore.cut.split import Split
from tpcore.parallel.layers import reduce_partial_sums
from tpcore.parallel.quantized_linear import QuantizedLinear

__all__ = ["FourBitLinear", "RowParallelFourBitLinear"]

#: the block of block scales of nested quantization (bitsandbytes' only one)
NESTED_BLOCK = 256


class FourBitLinear(QuantizedLinear):
    """``nn.Linear`` holding bitsandbytes' packed 4-bit codes and block scales (module docstring); made from an
    ``nn.Linear`` in place by :meth:`hold`, told its cut by the plan and its rank by
    :func:`~tpcore.parallel.quantized_linear.localize_quantized`."""

    #: a model-wide cast casts the bias, as transformers does; codes and scales stay as stored
    keeps_stored_dtypes = ("absmax", "code", "nested_absmax", "nested_code")
    packing = (1, 2)
    blocksize = 64
    #: ``"nf4"`` or ``"fp4"``: which 16 values ``code`` holds
    quant_type = "nf4"
    #: the dtype each product runs in (``bnb_4bit_compute_dtype``); ``None``: the input's
    compute_dtype: torch.dtype | None = None
    nested_offset = 0.0
    whole_shape: tuple[int, int] = (0, 0)
    absmax: nn.Parameter
    code: nn.Parameter
    nested_absmax: nn.Parameter
    nested_code: nn.Parameter
    #: this rank's block scales in float32 (:meth:`localize`: ``absmax``, or made from nested scales)
    block_scales: torch.Tensor
    #: the block of each value of this rank's rows (:meth:`localize`), or ``None`` where the rank holds whole blocks
    #: from :attr:`first_block` on
    block_cols: torch.Tensor | None = None
    first_block = 0

    @classmethod
    def hold(
        cls,
        linear: nn.Linear,
        quant_type: str,
        blocksize: int,
        compute_dtype: torch.dtype | None,
        nested_blocks: int | None = None,
        nested_offset: float = 0.0,
    ) -> FourBitLinear:
        """Make the meta ``linear`` hold ``quant_type`` 4-bit codes in place: a uint8 ``weight`` ``(out, in / 2)``,
        its ``absmax`` ``(out, in / blocksize)`` (float32; uint8 codes where ``nested_blocks`` scales of scales are
        stored too, in ``nested_absmax``, with their ``nested_code`` and ``nested_offset``) and the ``code``."""
        out_features, in_features = linear.out_features, linear.in_features
        if in_features % 2 or in_features % blocksize:
            raise ValueError(
                f"{in_features} input features are not whole blocks of {blocksize}: bitsandbytes' blocks cross rows"
            )
        linear.__class__ = cls
        assert isinstance(linear, FourBitLinear)
        blocks = in_features // blocksize
        linear.weight = _frozen(torch.empty(out_features, in_features // 2, dtype=torch.uint8, device="meta"))
        scale_dtype = torch.float32 if nested_blocks is None else torch.uint8
        linear.absmax = _frozen(torch.empty(out_features, blocks, dtype=scale_dtype, device="meta"))
        linear.code = _frozen(torch.empty(16, dtype=torch.float32, device="meta"))
        if nested_blocks is not None:
            linear.nested_absmax = _frozen(torch.empty(nested_blocks, dtype=torch.float32, device="meta"))
            linear.nested_code = _frozen(torch.empty(256, dtype=torch.float32, device="meta"))
        linear.quant_type, linear.blocksize, linear.compute_dtype = quant_type, blocksize, compute_dtype
        linear.nested_offset = float(nested_offset)
        linear.whole_shape = (out_features, in_features)
        return linear

    def follower_cuts(self, split: Split, weight: str = "weight") -> dict[str, Split]:
        """The block scales' rows follow the weight's rows; a cut of the columns leaves them whole."""
        return {"absmax": split} if split.dim == 0 else {}

    def localize(self, rank: int, world_size: int) -> None:
        """Make this rank's float32 block scales (from nested ones where stored so), and find the block of each
        value of its rows where its columns are cut."""
        nested = "nested_absmax" in self._parameters
        scales = self.unnested_absmax(rank, world_size) if nested else self.absmax.data
        self.register_buffer("block_scales", scales, persistent=False)
        cut = self.cuts.get("weight")
        if cut is None or cut.dim == 0:
            self.block_cols, self.first_block = None, 0
            return
        if cut.pad:
            raise ValueError("4-bit codes cut with padding: a padding byte would read as nonzero values")
        blocks = block_index(cut, self.whole_shape[1] // 2, self.blocksize, rank, world_size, packing=2)
        first = first_whole_block(blocks, self.blocksize)
        self.block_cols = None if first is not None else blocks.to(self.weight.device)
        self.first_block = first or 0

    def unnested_absmax(self, rank: int, world_size: int) -> torch.Tensor:
        """``nested_code[a] * nested_absmax[k // 256] + offset`` (module docstring) for this rank's scale codes."""
        whole_blocks = self.whole_shape[0] * (self.whole_shape[1] // self.blocksize)
        flat_index = torch.arange(whole_blocks).view(self.whole_shape[0], -1)
        cut = self.cuts.get("absmax")
        if cut is not None:
            flat_index = cut.shard(flat_index, rank, world_size)
        codes = self.nested_code[self.absmax.long()]
        return codes * self.nested_absmax[flat_index // NESTED_BLOCK] + self.nested_offset

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``W_r`` (module docstring) in ``dtype``: codes looked up, scaled in float32, then cast; by bitsandbytes'
        own kernel where it is installed and the rank holds whole blocks (the same numbers, several times faster
        than torch's lookup on a CPU)."""
        packed = self.weight
        rows, columns = packed.shape[0], packed.shape[1] * 2
        blocks = columns // self.blocksize
        kernel = _bitsandbytes_dequantize() if self.block_cols is None else None
        if kernel is not None:
            scales = self.block_scales.narrow(1, self.first_block, blocks).contiguous().view(-1)  # the kernel reads
            codes = packed.contiguous().view(-1)  # its tensors' memory in order, whatever their strides
            return kernel(codes, scales, self.blocksize, self.quant_type, [rows, columns], dtype)
        codes = torch.stack([packed.bitwise_right_shift(4), packed.bitwise_and(15)], dim=-1).view(-1)
        values = self.code.index_select(0, codes.long()).view(rows, columns)
        if self.block_cols is not None:
            return values.mul_(self.block_scales.index_select(1, self.block_cols)).to(dtype)
        scales = self.block_scales.narrow(1, self.first_block, blocks).unsqueeze(-1)
        return values.view(rows, blocks, self.blocksize).mul_(scales).view(rows, columns).to(dtype)

    def products(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W_r.T (+ bias)`` in the compute dtype."""
        dtype = self.compute_dtype or x.dtype
        return F.linear(x.to(dtype), self.dequantized(dtype), None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.products(x, self.bias).to(x.dtype)


class RowParallelFourBitLinear(FourBitLinear):
    """:class:`FourBitLinear` holding a shard of the input features: the products all-reduced in the compute dtype,
    the bias added once."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_partial_sums(self.products(x, None), self.tp_group)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype)


FourBitLinear.row_parallel_class = RowParallelFourBitLinear


@functools.cache
def _bitsandbytes_dequantize() -> Any:
    """bitsandbytes' ``dequantize_4bit`` operator, or ``None`` where bitsandbytes is not installed."""
    try:
        import bitsandbytes  # noqa: F401  # registers its operators
    except ImportError:
        return None
    return torch.ops.bitsandbytes.dequantize_4bit.default


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
