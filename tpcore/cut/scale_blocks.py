"""Scale blocks under a cut: which block of a block-quantized tensor each index a rank holds lies in.

A block-quantized weight (block FP8: e4m3 values ``Q (out, in)`` and one scale per ``B0 x B1`` block,
``S (ceil(out / B0), ceil(in / B1))``) stands for ``W[i, j] = Q[i, j] * S[i // B0, j // B1]``. Its values are
stored one per element, so any :class:`~tpcore.cut.split.Split` cuts ``Q`` as it cuts an unquantized
weight, inside a block or not: a rank's piece along a dimension is its ranges ``[a, b)``, and index ``i`` of
its piece is whole index ``g(i)`` of the dimension. The scales are small (``1 / (B0 B1)`` of the weight's
elements), so every rank holds them whole and looks its blocks up::

    W_r[i, j] = Q_r[i, j] * S[g0(i) // B0, g1(j) // B1]

:func:`block_index` gives ``g(i) // B`` for every index of a rank's piece (a padding index, past the whole
dimension, maps to block 0: its values are zeros). A cut inside a block leaves that block's scale to both
ranks that hold a part of it, which is why the scales are never cut.

A packed format stores ``p`` values an element along a dimension (eight 4-bit integers an int32 word), so a cut
of its stored tensor deals whole elements: index ``i`` of a piece holds the values ``[p g(i), p g(i) + p)``.
``block_index(..., packing=p)`` gives the block of each of those values, for a dimension of ``size`` stored elements.
Where a piece is whole blocks in order (:func:`first_whole_block`), a layer scales it by a slice of the scales
instead of looking each value's block up. A small tensor packed along the *other* dimension (zero points packed
``p`` outputs a word) can take the weight's cut where every unit it deals is whole words (:func:`deals_whole_elements`);
else every rank holds it whole and picks its own.
"""

from __future__ import annotations

import torch

from tpcore.cut.split import Split

__all__ = ["block_index", "deals_whole_elements", "first_whole_block"]


def block_index(
    split: Split | None, size: int, block: int, rank: int, world_size: int, packing: int = 1
) -> torch.Tensor:
    """``(n,)`` int64: the block (of ``block`` values) of each of the ``n`` values rank ``rank`` holds of a
    dimension of ``size`` stored elements of ``packing`` values each, cut by ``split`` (``None``: the whole
    dimension), in the order its piece holds them."""
    if block < 1 or packing < 1:
        raise ValueError(f"a block of {block} values, {packing} values an element")
    ranges, padding = [(0, size)], 0
    if split is not None:
        ranges, padding = split.ranges(size, rank, world_size)
    pieces = [torch.arange(start * packing, stop * packing) // block for start, stop in ranges]
    pieces.append(torch.zeros(padding * packing, dtype=torch.int64))
    return torch.cat(pieces)


def first_whole_block(blocks: torch.Tensor, block: int) -> int | None:
    """The first block of ``blocks`` (:func:`block_index`'s output, blocks of ``block`` values) where they are whole
    blocks in order from it on (``b, b, ..., b + 1, ...``, ``block`` of each), else ``None``; 0 for no values."""
    first = int(blocks[0]) if len(blocks) else 0
    whole = torch.arange(first, first + len(blocks) // block).repeat_interleave(block)
    return first if len(blocks) % block == 0 and torch.equal(blocks, whole) else None


def deals_whole_elements(split: Split, size: int, packing: int) -> bool:
    """Whether every unit ``split`` deals of a dimension of ``size`` values (``heads`` of each of ``n_fused`` tensors)
    is whole elements of ``packing`` values, so that a tensor packing this dimension ``packing`` values an element
    can be cut by the same split."""
    units = (split.heads or 0) * split.n_fused
    return split.parts is None and units > 0 and size % units == 0 and (size // units) % packing == 0
