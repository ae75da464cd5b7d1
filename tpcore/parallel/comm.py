"""Collectives of the tensor-parallel group. Inference only: no autograd through them.

A group with shared-memory collectives attached (the gloo ranks of one host, see :mod:`tpcore.parallel.shm`)
uses them for every tensor that fits; the rest goes through the group's backend.

Under ``torch.compile`` each collective is one opaque operator, ``tpcore::all_reduce_`` (in place) or
``tpcore::all_gather``, so a compiled forward keeps its graph whole around them and calls the same transports
when it runs; the group travels as a number (:func:`_group_number`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tpcore.parallel import shm
from tpcore.parallel.memfd import gathered_empty
from tpcore.parallel.threads import ThreadGroup

__all__ = ["all_gather", "all_reduce", "count_collectives", "group_rank", "group_size"]

_COUNTERS: list[collections.Counter] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[collections.Counter]:
    """Count the collectives tpcore's layers issue in this process while inside, by operation
    (``{"all_reduce": n, "all_gather": m}``), whichever transport carries them."""
    counts: collections.Counter = collections.Counter()
    _COUNTERS.append(counts)
    try:
        yield counts
    finally:
        _COUNTERS.remove(counts)


def _counted(operation: str) -> None:
    for counts in _COUNTERS:
        counts[operation] += 1


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 when torch.distributed is not initialized."""
    if isinstance(group, ThreadGroup):
        return group.world_size
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 when torch.distributed is not initialized."""
    if isinstance(group, ThreadGroup):
        return group.rank
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place and return it; a no-op for a group of one."""
    if torch.compiler.is_compiling():
        if group_size(group) > 1:
            torch.ops.tpcore.all_reduce_(tensor, _group_number(group))
        return tensor
    if group_size(group) > 1:
        _counted("all_reduce")
        if isinstance(group, ThreadGroup):
            return group.all_reduce(tensor)
        fast = shm.for_group(group)
        if fast is not None and fast.fits(tensor):
            return fast.all_reduce(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Every rank's ``tensor`` (all of one shape), concatenated along ``dim`` in rank order."""
    world_size = group_size(group)
    if world_size == 1:
        return tensor
    if torch.compiler.is_compiling():
        return torch.ops.tpcore.all_gather(tensor, _group_number(group), dim)
    _counted("all_gather")
    if isinstance(group, ThreadGroup):
        return group.all_gather(tensor, dim)
    fast = shm.for_group(group)
    if fast is not None and fast.fits(tensor):
        return fast.all_gather(tensor, dim)
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim, out=gathered_empty(tensor, dim, world_size))


# --- the collectives as operators, for torch.compile ---------------------------------------------------------

_GROUPS: list = []


@torch.compiler.assume_constant_result  # run while tracing: the graph holds the number
def _group_number(group) -> int:
    """A number standing for ``group`` in a compiled graph (the same group, the same number)."""
    for number, known in enumerate(_GROUPS):
        if known is group:
            return number
    _GROUPS.append(group)
    return len(_GROUPS) - 1


@torch.library.custom_op("tpcore::all_reduce_", mutates_args=("tensor",))
def _all_reduce_operator(tensor: torch.Tensor, group: int) -> None:
    all_reduce(tensor, _GROUPS[group])


@torch.library.custom_op("tpcore::all_gather", mutates_args=())
def _all_gather_operator(tensor: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    return all_gather(tensor, _GROUPS[group], dim)


@_all_gather_operator.register_fake
def _(tensor: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] *= group_size(_GROUPS[group])
    return tensor.new_empty(shape)
