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
"""

from __future__ import annotations

import torch

from tpcore.policy import Layer, ShardingError

__all__ = ["COLUMN", "ROW", "TensorSlicer", "check_divisible", "shard", "split_dims"]

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


def shard(
    tensor: torch.Tensor, dim: int, rank: int, world_size: int, n_fused: int = 1, heads: int | None = None
) -> torch.Tensor:
    """Rank ``rank``'s contiguous shard of ``tensor`` along ``dim`` (see module docstring)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    check_divisible(tensor.shape[dim], world_size, n_fused, heads)
    if heads is not None and heads < world_size:  # replicate whole heads
        rank, world_size = rank * heads // world_size, heads
    blocks = tensor.chunk(n_fused, dim=dim)
    pieces = [block.chunk(world_size, dim=dim)[rank] for block in blocks]
    # cat copies; a lone piece is a view, cloned so that the whole tensor can be freed
    return torch.cat(pieces, dim=dim) if n_fused > 1 else pieces[0].clone(memory_format=torch.contiguous_format)


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
