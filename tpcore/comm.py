"""Collectives of the tensor-parallel group. Inference only: no autograd through them."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "group_rank", "group_size"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 when torch.distributed is not initialized."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 when torch.distributed is not initialized."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place and return it; a no-op for a group of one."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
