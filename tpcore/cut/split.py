"""``Split``: pure functions from a whole tensor to one rank's shard. No I/O, no env, no state.

A :class:`Split` says how one dimension of size ``S`` is cut over ``N`` ranks. It sees the dimension
as consecutive *segments*, each made of equal *units* (heads, or single features), and rank ``r``
keeps, from every segment, in order, a contiguous run of its units, dealt by :func:`tpcore.cut.shares.runs`:

- a segment of ``u >= N`` units gives rank ``r`` ``u // N + (r < u % N)`` of them, so ``[r u / N,
  (r + 1) u / N)`` when ``N`` divides ``u`` (the equal split) and whole units, near-equal, otherwise;
- units in ``groups`` (a key/value head and its query heads) are dealt group by group, a group never
  split between ranks that do not share it; a segment of fewer units (or groups) than ranks is
  replicated whole-unit-wise, each unit kept by the consecutive ranks whose query heads use it.

The layouts are ways to name the segments:

==========================  ==============================  ===================================
split                       segments                        units per segment
==========================  ==============================  ===================================
plain (``n_fused=1``)       the whole dimension             its ``S`` features
``n_fused=k`` (q|k|v)       ``k`` blocks of ``S / k``       ``S / k`` features, or ``heads``
``parts=(p1, ..., pk)``     ``k`` blocks of ``pi S / sum``  ``pi`` heads (head size ``S / sum``),
                                                            in ``gcd(p1, ..., pk)`` groups
``parts`` + ``widths``      ``k`` blocks of ``pi wi``       ``pi`` units of ``wi`` features each
``interleaved`` (``heads``) the whole dimension             ``heads`` groups of ``n_fused`` tensors
``parts`` + ``interleaved``  as ``parts``, stored group by   as ``parts``; a rank's pieces follow
                            group                           the groups (below)
==========================  ==============================  ===================================

So a fused ``[Q | K | V]`` gives rank ``r`` the piece ``[Q_r | K_r | V_r]`` (its fused output still
splits into its own q, k and v), a grouped-query pack ``parts=(9, 3, 3)`` over 2 ranks gives rank 0
two key/value heads with their six query heads and rank 1 the third with its three, a multi-query
pack ``parts=(32, 1, 1)`` gives every rank its query heads and the one key and value head, and a
head-interleaved ``[q0 k0 v0 | q1 k1 v1 | ...]`` gives rank ``r`` its whole heads, each with its q, k
and v: one contiguous block. Where ``N`` divides every count the pieces are the equal ones.

``parts`` with ``interleaved`` stores the ``g`` groups one after another, each packing its
``pi / g`` heads of every part (Falcon's grouped ``query_key_value``, ``parts=(H, G, G)``:
``[q.. k v | q.. k v | ...]``, ``H / G + 2`` heads a group). The heads are dealt as for ``parts``;
rank ``r`` keeps, group by group, its heads of each part, so its piece is again a pack of groups
(whole groups when ``g >= N``: one contiguous block; else its query heads of one group beside the
group's replicated key and value heads).

A vocabulary (embedding rows, LM-head rows) rarely divides by the world size (GPT-2 has 50257
tokens), so it is ``pad``-ded instead: every rank holds ``ceil(V / N)`` rows, rank ``r`` the rows
``[r * ceil(V / N), (r + 1) * ceil(V / N))`` of the table, and the last ranks fill the rows past
``V`` with zeros. Equal shapes keep the all-gather of logits a single fixed-size collective.

A ``summand`` is a term that a module adds inside a sum the ranks then all-reduce (the bias of each
fused expert's down projection, added before the routing weight scales it): rank 0 holds it whole and
every other rank zeros of its shape, so the reduced sum counts it once.
"""

from __future__ import annotations

import collections
import math
from typing import NamedTuple

import torch

from tpcore.cut.shares import runs
from tpcore.errors import ShardingError

__all__ = ["Split"]


class Split(NamedTuple):
    """How one tensor is cut along ``dim`` (any rank; negative counts from the end), see the module docstring.

    Args:
        dim: the dimension to cut.
        n_fused: tensors packed along ``dim`` (3 for q|k|v); with ``interleaved``, tensors per head.
        heads: heads in each packed tensor (replicated when fewer than the ranks); required by ``interleaved``.
        pad: pad to ``ceil(S / N)`` per rank instead of dealing whole units (vocabularies).
        parts: head counts of unequal packed tensors (``(32, 8, 8)`` for q|k|v with 8 KV heads).
        interleaved: heads packed one after another, each holding its ``n_fused`` tensors; with
            ``parts``, groups packed one after another, each holding its share of every part.
        groups: how many groups the heads form, dealt whole (the key/value heads of a query
            projection); must divide every head count. Default: each head its own group, or
            ``gcd(parts)`` for ``parts``.
        widths: with ``parts``, the width of one unit of each part, where the parts are measured in
            different units (Mamba2's ``[z | x | B | C | dt]``: head_dim, head_dim, state, state, 1); the
            parts' sizes ``parts[i] * widths[i]`` must add up to the dimension.
        summand: rank 0 holds the whole tensor, the other ranks zeros (a term of an all-reduced sum).
    """

    dim: int
    n_fused: int = 1
    heads: int | None = None
    pad: bool = False
    parts: tuple[int, ...] | None = None
    interleaved: bool = False
    groups: int | None = None
    widths: tuple[int, ...] | None = None
    summand: bool = False

    def ranges(self, size: int, rank: int, world_size: int) -> tuple[list[tuple[int, int]], int]:
        """Which part of a dimension of ``size`` rank ``rank`` holds: the ``[start, stop)`` ranges to
        concatenate, in order, and how many zero rows follow them (``pad`` only)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if self.pad:
            self._validate(world_size)
            piece = -(-size // world_size)
            start = min(rank * piece, size)
            stop = min(start + piece, size)
            return [(start, stop)], piece - (stop - start)
        if self.summand:
            self._validate(world_size)
            return ([(0, size)], 0) if rank == 0 else ([(0, 0)], size)
        if self.parts is not None and self.interleaved:
            return self._group_ranges(size, rank, world_size), 0
        ranges = []
        for offset, length, units, groups in self._segments(size, world_size):
            unit = length // units if units else 0
            first, count = _runs(units, world_size, groups)[rank]
            ranges.append((offset + first * unit, offset + (first + count) * unit))
        return ranges, 0

    def check(self, size: int, world_size: int) -> None:
        """Raise :class:`ShardingError` (naming ``size``) unless a dimension of ``size`` cuts into whole
        units on every rank over ``world_size`` ranks; :class:`ValueError` if the split itself is malformed."""
        if self.pad or self.summand:
            self._validate(world_size)
        else:
            self._segments(size, world_size)

    def even(self, size: int, world_size: int) -> bool:
        """Whether every rank holds the same share (equal pieces, or each unit replicated equally often)."""
        if self.pad or self.summand:
            return True
        for _, _, units, groups in self._segments(size, world_size):
            dealt = _runs(units, world_size, groups)
            if len({count for _, count in dealt}) > 1 or len(set(collections.Counter(dealt).values())) > 1:
                return False
        return True

    def replicated(self, size: int, world_size: int) -> bool:
        """Whether some rank holds units that another rank holds too (heads fewer than the ranks)."""
        if self.pad or self.summand:
            return False
        return any(
            len(set(_runs(units, world_size, groups))) < world_size
            for _, _, units, groups in self._segments(size, world_size)
        )

    def shard_size(self, size: int, world_size: int, rank: int = 0) -> int:
        """The size of rank ``rank``'s piece of a dimension of ``size`` (checked first)."""
        ranges, padding = self.ranges(size, rank, world_size)
        return sum(stop - start for start, stop in ranges) + padding

    def shard(self, tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """Rank ``rank``'s contiguous shard of ``tensor``; owns its memory (the whole tensor can be freed)."""
        dim = self.resolved(tensor.dim()).dim
        ranges, padding = self.ranges(tensor.shape[dim], rank, world_size)
        pieces = [tensor.narrow(dim, start, stop - start) for start, stop in ranges]
        if padding:
            pieces.append(tensor.new_zeros(tensor.shape[:dim] + (padding,) + tensor.shape[dim + 1 :]))
        # cat copies; a lone piece is a view, cloned so that the whole tensor can be freed
        if len(pieces) > 1:
            return torch.cat(pieces, dim=dim)
        return pieces[0].clone(memory_format=torch.contiguous_format)

    def resolved(self, ndim: int) -> Split:
        """This split with ``dim`` counted from the front of a tensor of ``ndim`` dimensions."""
        if not -ndim <= self.dim < ndim:
            raise ShardingError(f"split dim {self.dim} is outside a tensor of {ndim} dimensions")
        return self._replace(dim=self.dim % ndim)

    def _validate(self, world_size: int) -> None:
        """Raise :class:`ValueError` for a malformed split or world, before any size is looked at."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be a positive int")
        if not isinstance(self.n_fused, int) or self.n_fused < 1:
            raise ValueError(f"n_fused ({self.n_fused}) must be a positive int")
        for name in ("heads", "groups"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} ({value}) must be a positive int")
        if self.parts is not None:
            if not self.parts or not all(isinstance(p, int) and p >= 1 for p in self.parts):
                raise ValueError(f"parts {self.parts} must be positive head counts")
            if self.heads is not None or self.n_fused not in (1, len(self.parts)):
                raise ValueError(f"parts {self.parts} give the head counts; they take no heads or n_fused")
        self._validate_widths()
        if self.interleaved and self.heads is None and self.parts is None:
            raise ValueError("an interleaved split needs heads or parts (what the tensor interleaves)")
        if self.groups is not None and self.heads is None and self.parts is None:
            raise ValueError("groups group heads: a split with groups needs heads or parts")
        if self.pad and (self.n_fused != 1 or self.heads is not None or self.parts or self.interleaved):
            raise ValueError("a padded split packs one tensor and no heads")
        layout = (self.n_fused != 1, self.heads, self.parts, self.interleaved, self.groups, self.widths, self.pad)
        if self.summand and any(layout):
            raise ValueError("a summand is held whole by rank 0: it takes no other layout words")

    def _validate_widths(self) -> None:
        if self.widths is None:
            return
        if self.parts is None or self.interleaved or len(self.widths) != len(self.parts):
            raise ValueError(f"widths {self.widths} give one unit width per part of a packed, not interleaved, split")
        if not all(isinstance(w, int) and w >= 1 for w in self.widths):
            raise ValueError(f"widths {self.widths} must be positive ints")

    def _segments(self, size: int, world_size: int) -> list[tuple[int, int, int, int | None]]:
        """``(offset, length, units, groups)`` of each segment of a dimension of ``size`` (module docstring),
        checked: whole units, groups that divide them, and a unit for every rank in a segment of features."""
        self._validate(world_size)
        groups = self.groups
        if self.parts is not None:
            counts = list(self.parts)
            if self.widths is not None:
                lengths = [count * width for count, width in zip(counts, self.widths, strict=True)]
                if sum(lengths) != size:
                    sizes = " + ".join(f"{c} x {w}" for c, w in zip(counts, self.widths, strict=True))
                    raise ShardingError(f"size {size} is not the parts {sizes} = {sum(lengths)} it packs")
            else:
                head_size, rest = divmod(size, sum(counts))
                if rest:
                    raise ShardingError(f"size {size} cannot be split into {sum(counts)} heads (parts {self.parts})")
                lengths = [count * head_size for count in counts]
            groups = groups or math.gcd(*counts)
        elif self.interleaved:
            counts, lengths = [self.heads], [size]
            if size % (self.heads * self.n_fused):
                raise ShardingError(
                    f"size {size} cannot be split into {self.heads} heads of {self.n_fused} interleaved tensors"
                )
        else:
            length, rest = divmod(size, self.n_fused)
            if rest or (self.heads and length % self.heads):
                if not self.heads:
                    raise ShardingError(f"size {size} cannot be split into {self.n_fused} equal fused tensors")
                fused = f" ({self.n_fused} fused tensors x {self.heads} heads)" if self.n_fused > 1 else ""
                raise ShardingError(f"size {size} cannot be split into {self.n_fused * self.heads} heads{fused}")
            counts, lengths = [self.heads or length] * self.n_fused, [length] * self.n_fused
            if not self.heads and 0 < length < world_size:
                fused = f" (each of its {self.n_fused} packed tensors {length})" if self.n_fused > 1 else ""
                raise ShardingError(f"size {size}{fused} is smaller than the {world_size} ranks to split it over")
        for count in counts:
            if groups is not None and count % groups:
                raise ShardingError(f"size {size}: {count} heads cannot form {groups} equal groups")
        offsets = [sum(lengths[:index]) for index in range(len(lengths))]
        return [(offset, length, count, groups) for offset, length, count in zip(offsets, lengths, counts, strict=True)]

    def _group_ranges(self, size: int, rank: int, world_size: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s ranges of a ``parts`` pack stored group by group (module docstring): for each
        group in order, its heads of each part there, adjacent ranges merged."""
        segments = self._segments(size, world_size)
        groups = segments[0][3] or 1  # always set for parts: gcd(parts) by default
        counts = [units for _, _, units, _ in segments]
        head_size = size // sum(counts)
        per_group = [count // groups for count in counts]
        dealt = [_runs(count, world_size, groups)[rank] for count in counts]
        ranges: list[tuple[int, int]] = []
        for group in range(groups):
            offset = group * sum(per_group) * head_size
            for (first, count), per in zip(dealt, per_group, strict=True):
                low, high = max(first, group * per), min(first + count, (group + 1) * per)
                if low < high:
                    start, stop = offset + (low - group * per) * head_size, offset + (high - group * per) * head_size
                    if ranges and ranges[-1][1] == start:
                        start = ranges.pop()[0]
                    ranges.append((start, stop))
                offset += per * head_size
        return ranges


def _runs(units: int, world_size: int, groups: int | None) -> tuple[tuple[int, int], ...]:
    """:func:`tpcore.cut.shares.runs`, with an empty dimension giving every rank nothing."""
    return runs(units, world_size, groups) if units else ((0, 0),) * world_size
