"""ShardPlan: how a model splits over ``world_size`` ranks, as data.

A plan says, for every tensor of the model, how it is cut (a :class:`~tpcore.cut.split.Split`) or that
it is replicated (and why), and for every module it touches, the attributes to set per rank and what it
becomes (a :class:`~tpcore.Style` whose parallel module it takes, or a policy's class). Tensors are named
by their first name in :func:`~tpcore.load.skeleton.named_tensors` and modules by their path, so one plan
applies to any copy of the model: the model itself (sliced in place under ``torchrun``), its meta
skeleton (sent to the ranks of ``parallelize()``), or one built empty from a checkpoint's config::

    plan = plan_for(model, policies, world_size)   # tpcore.plan.build: ShardingError before anything changes
    plan.splits[name]                              # Split, or absent: replicated (plan.kept_whole[name]: why)
    plan.shard(name, tensor, rank)                 # rank's part of a whole tensor
    apply_plan(plan, model, rank, tp_group)        # tpcore.plan.apply: slice in place, rewrite the modules
    print(report(plan))                            # tpcore.plan.report: what is cut how, bytes per rank

Sizes that the world size does not divide are dealt in whole units (heads, features), so ranks may
hold different shares (:mod:`tpcore.cut.shares`): then shapes, attributes (:class:`~tpcore.PerRank`
values) and bytes differ by rank, and :attr:`ShardPlan.uniform` is false.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from tpcore.authoring import Policy, Style
from tpcore.cut.shares import PerRank
from tpcore.cut.split import Split
from tpcore.errors import ShardingError

__all__ = ["Replacement", "ShardPlan", "Whole"]

#: what a module becomes: a style's parallel module (ROW, NORM), a policy's class, or a function of the module
Replacement = Style | type[nn.Module] | Callable[..., type[nn.Module] | None]


class Whole(NamedTuple):
    """Why a tensor stays whole on every rank: the class of the module holding it, and the reason."""

    module_class: str
    reason: str


@dataclass
class ShardPlan:
    """Every tensor's cut and every module's per-rank rewrite for one model and world size.

    Attributes:
        model_name: the model's class name (for messages).
        world_size: the number of ranks.
        shapes: every tensor's whole shape, by first name.
        dtypes: every tensor's dtype, by first name.
        splits: the cut tensors, by first name (a tensor not listed is replicated).
        attributes: per-rank values of module attributes, by path from the model (``"h.0.attn.num_heads"``);
            a :class:`~tpcore.PerRank` value holds one per rank.
        replacements: what modules become, by module path: a :class:`~tpcore.Style` (``ROW``: the row-parallel
            module of its type; ``NORM``: the column-split norm), or a policy's class or function of the module.
        vocab: vocabulary-parallel modules, by path: the whole table's row count.
        resized: modules whose size attributes follow their sliced weight (``in_features``, ...).
        policies: the policies that apply.
        kept_whole: every tensor not cut (replicated on every rank), by first name: why (:class:`Whole`).
    """

    model_name: str
    world_size: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    splits: dict[str, Split] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    replacements: dict[str, Replacement] = field(default_factory=dict)
    vocab: dict[str, int] = field(default_factory=dict)
    resized: list[str] = field(default_factory=list)
    policies: list[type[Policy]] = field(default_factory=list)
    kept_whole: dict[str, Whole] = field(default_factory=dict)

    def error(self, where: str, detail: str) -> ShardingError:
        """A :class:`ShardingError` naming the model, the world size and ``where``."""
        return ShardingError(f"cannot split {self.model_name} over {self.world_size} ranks: {where}: {detail}")

    @property
    def uniform(self) -> bool:
        """Whether every rank holds the same shapes and attribute values (every cut even)."""
        return not any(isinstance(value, PerRank) for value in self.attributes.values()) and all(
            split.even(self.shapes[name][split.dim], self.world_size) for name, split in self.splits.items()
        )

    def shard_shape(self, name: str, rank: int = 0) -> tuple[int, ...]:
        """The shape of rank ``rank``'s part of tensor ``name``."""
        shape = list(self.shapes[name])
        split = self.splits.get(name)
        if split is not None:
            dim = split.dim % len(shape)
            shape[dim] = split.shard_size(shape[dim], self.world_size, rank)
        return tuple(shape)

    def shard(self, name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of the whole tensor ``name``: its slice, or the tensor itself when
        replicated. A slice that is one contiguous block of the tensor is a view (sent without a copy)."""
        tensor = tensor.detach()
        split = self.splits.get(name)
        if split is None:
            return tensor
        dim = split.dim % tensor.dim()
        ranges, padding = split.ranges(tensor.shape[dim], rank, self.world_size)
        if len(ranges) == 1 and not padding:
            ((start, stop),) = ranges
            piece = tensor.narrow(dim, start, stop - start)
            if piece.is_contiguous():
                return piece
        return split.shard(tensor, rank, self.world_size)

    def bytes_per_rank(self, rank: int = 0) -> int:
        """The bytes of tensors rank ``rank`` holds."""
        return sum(math.prod(self.shard_shape(n, rank)) * self.dtypes[n].itemsize for n in self.shapes)

    def tensor_bytes(self, name: str) -> int:
        """The bytes of the whole tensor ``name``."""
        return math.prod(self.shapes[name]) * self.dtypes[name].itemsize

    @property
    def whole_bytes(self) -> int:
        """The bytes of the unsplit model's tensors."""
        return sum(self.tensor_bytes(name) for name in self.shapes)

    @property
    def replicated_bytes(self) -> int:
        """The bytes every rank holds whole (each rank holds all of them)."""
        return sum(self.tensor_bytes(name) for name in self.shapes if name not in self.splits)

    def assemble(self, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor ``name`` from every rank's part of it (``pieces[r]``: rank ``r``'s), the inverse of
        :meth:`shard`: each rank's ranges put back in place (a replicated unit written by each rank that holds it,
        the same values), padding rows dropped."""
        split = self.splits.get(name)
        if split is None:
            return pieces[0]
        dim = split.dim % len(self.shapes[name])
        whole = pieces[0].new_empty(self.shapes[name])
        for rank, piece in enumerate(pieces):
            ranges, _ = split.ranges(self.shapes[name][dim], rank, self.world_size)
            offset = 0
            for start, stop in ranges:
                whole.narrow(dim, start, stop - start).copy_(piece.narrow(dim, offset, stop - start))
                offset += stop - start
        return whole
