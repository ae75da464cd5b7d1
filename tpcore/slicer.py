"""TensorSlicer: pure functions from a whole tensor to one rank's shard. No I/O, no env, no state.

A tensor of size ``S`` along the split dimension that packs ``n_fused`` tensors (q|k|v) is first
cut into ``n_fused`` blocks of ``S / n_fused``; each block is cut into ``world_size`` pieces and
rank ``r`` keeps piece ``r`` of every block, concatenated along the same dimension::

    [Q | K | V]  --rank r-->  [Q_r | K_r | V_r]       each of size S / (n_fused * world_size)

so a rank's fused output still splits into its own q, k and v heads.

A tensor that packs fewer heads than there are ranks (grouped-query attention with 2 key/value
heads on 4 ranks) is split into its ``heads`` pieces instead, and rank ``r`` keeps piece
``r * heads // world_size``: each head is replicated on ``world_size / heads`` consecutive ranks,
exactly the ranks whose query heads use it.

A vocabulary (embedding rows, LM-head rows) rarely divides by the world size (GPT-2 has 50257
tokens), so it is ``pad``-ded instead: every rank holds ``ceil(V / N)`` rows, rank ``r`` the rows
``[r * ceil(V / N), (r + 1) * ceil(V / N))`` of the table, and the last ranks fill the rows past
``V`` with zeros. Equal shapes keep the all-gather of logits a single fixed-size collective.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tpcore.policy import Layer, ShardingError

__all__ = ["COLUMN", "ROW", "Split", "TensorSlicer", "check_divisible", "shard", "shard_ranges", "split_dims"]

COLUMN = "column"
ROW = "row"


def check_divisible(size: int, world_size: int, n_fused: int = 1, heads: int | None = None) -> None:
    """Raise :class:`ShardingError` unless ``size`` splits into ``n_fused * world_size`` equal pieces
    (or, for a tensor of ``heads`` heads with ``world_size % heads == 0``, into ``n_fused * heads``)."""
    if world_size < 1 or n_fused < 1:
        raise ValueError(f"world_size ({world_size}) and n_fused ({n_fused}) must be at least 1")
    if heads is not None and heads < world_size:
        if world_size % heads:
            raise ShardingError(f"{heads} heads can be neither split nor replicated evenly over {world_size} ranks")
        world_size = heads
    pieces = n_fused * world_size
    if size % pieces:
        fused = f" ({n_fused} fused tensors x {world_size} ranks)" if n_fused > 1 else ""
        raise ShardingError(f"size {size} cannot be split into {pieces} equal pieces{fused}")


class Split(NamedTuple):
    """How one tensor is cut: along ``dim``, packing ``n_fused`` tensors, with ``heads`` (replicated
    when fewer than the ranks) or ``pad``-ded to equal pieces (vocabularies); see the module docstring."""

    dim: int
    n_fused: int = 1
    heads: int | None = None
    pad: bool = False


def shard_ranges(
    size: int, rank: int, world_size: int, n_fused: int = 1, heads: int | None = None, pad: bool = False
) -> tuple[list[tuple[int, int]], int]:
    """Which part of a dimension of ``size`` rank ``rank`` holds: the ``[start, stop)`` ranges to
    concatenate, in order, and how many zero rows follow them (``pad`` only)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if pad:
        if n_fused != 1 or heads is not None:
            raise ValueError("a padded split packs one tensor and no heads")
        piece = -(-size // world_size)
        start = min(rank * piece, size)
        stop = min(start + piece, size)
        return [(start, stop)], piece - (stop - start)
    check_divisible(size, world_size, n_fused, heads)
    if heads is not None and heads < world_size:  # replicate whole heads
        rank, world_size = rank * heads // world_size, heads
    block = size // n_fused
    piece = block // world_size
    return [(b * block + rank * piece, b * block + (rank + 1) * piece) for b in range(n_fused)], 0


def shard(
    tensor: torch.Tensor,
    dim: int,
    rank: int,
    world_size: int,
    n_fused: int = 1,
    heads: int | None = None,
    pad: bool = False,
) -> torch.Tensor:
    """Rank ``rank``'s contiguous shard of ``tensor`` along ``dim`` (see module docstring)."""
    ranges, padding = shard_ranges(tensor.shape[dim], rank, world_size, n_fused, heads, pad)
    pieces = [tensor.narrow(dim, start, stop - start) for start, stop in ranges]
    if padding:
        pieces.append(tensor.new_zeros(tensor.shape[:dim] + (padding,) + tensor.shape[dim + 1 :]))
    # cat copies; a lone piece is a view, cloned so that the whole tensor can be freed
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0].clone(memory_format=torch.contiguous_format)


def split_dims(style: str, layer: Layer) -> tuple[int, int | None]:
    """Split dimensions ``(weight_dim, bias_dim)`` of ``layer`` in a ``style`` group.

    Column parallel splits the output features, row parallel the input features; an ``(out, in)``
    weight (``nn.Linear``) has them at dims 0 and 1, a ``reversed`` ``(in, out)`` weight (``Conv1D``)
    at 1 and 0. A column bias is split along its only dim; a row bias is not split (``None``).
    """
    if style not in (COLUMN, ROW):
        raise ValueError(f"unknown parallel style {style!r}")
    out_dim, in_dim = (1, 0) if layer.reversed else (0, 1)
    if style == COLUMN:
        return out_dim, 0
    return in_dim, None


class TensorSlicer:
    """Slices the tensors of a :class:`Layer` for one rank of a ``world_size`` group."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size

    def column_slice(
        self, layer: Layer, weight: torch.Tensor, bias: torch.Tensor | None, heads: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shard ``weight`` and ``bias`` along the output features (``heads``: see module docstring)."""
        return self._slice(COLUMN, layer, weight, bias, heads)

    def row_slice(
        self, layer: Layer, weight: torch.Tensor, bias: torch.Tensor | None, heads: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shard ``weight`` along the input features; ``bias`` stays whole (added once after the reduce)."""
        return self._slice(ROW, layer, weight, bias, heads)

    def _slice(self, style, layer, weight, bias, heads):
        weight_dim, bias_dim = split_dims(style, layer)
        weight = shard(weight, weight_dim, self.rank, self.world_size, layer.n_fused, heads)
        if bias is not None and bias_dim is not None:
            bias = shard(bias, bias_dim, self.rank, self.world_size, layer.n_fused, heads)
        return weight, bias


# -- interim methods (the layout-words branch replaces this block) --
def _ranges(self, size, rank, world_size):
    return shard_ranges(size, rank, world_size, self.n_fused, self.heads, self.pad)


def _check(self, size, world_size):
    if self.pad:
        return
    check_divisible(size, world_size, self.n_fused, self.heads)


def _shard(self, tensor, rank, world_size):
    return shard(tensor, self.dim % tensor.dim(), rank, world_size, self.n_fused, self.heads, self.pad)


def _shard_size(self, size, world_size):
    ranges, padding = self.ranges(size, 0, world_size)
    return sum(stop - start for start, stop in ranges) + padding


Split.ranges = _ranges
Split.check = _check
Split.shard = _shard
Split.shard_size = _shard_size
