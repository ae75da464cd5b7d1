"""How counts are dealt out to ranks: equal pieces where they divide, near-equal whole units where not.

Every cut in tpcore deals *units* (heads, or single features) to ``N`` ranks, each rank keeping a
contiguous run of them. :func:`deal` gives the counts, ``u // N + (r < u % N)`` for rank ``r``, so
equal pieces when ``N`` divides ``u`` and otherwise the first ``u % N`` ranks hold one unit more.

Heads may come in *groups* that must stay together: a key/value head and the query heads that read
it (grouped-query attention, ``groups = kv heads``). :func:`runs` deals the groups, never splitting
one, when there are at least as many groups as ranks; with fewer, it deals the ranks over the groups
instead (``N // g + (j < N % g)`` ranks share group ``j``) and each group's units over its ranks, a
group holding fewer units than ranks (its one key/value head) replicating them. So a rank's query
heads always read key/value heads that the same rank holds.

A per-rank quantity that policies compute from such counts (local head counts, widths, offsets) is a
:class:`PerRank`: one value per rank, with arithmetic applied rank by rank; :func:`per_rank` folds it
to a plain int when every rank has the same value, so equal splits keep plain ints.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from typing import Any

__all__ = ["PerRank", "deal", "per_rank", "resolve", "runs"]


def deal(units: int, world_size: int) -> tuple[int, ...]:
    """How many of ``units`` each of ``world_size`` ranks holds: ``units // N + (r < units % N)``."""
    base, extra = divmod(units, world_size)
    return tuple(base + (rank < extra) for rank in range(world_size))


def runs(units: int, world_size: int, groups: int | None = None) -> tuple[tuple[int, int], ...]:
    """``(first, count)`` of the units each rank holds, rank by rank (module docstring).

    ``groups`` (default: one per unit) must divide ``units``; the ``units / groups`` consecutive units
    of a group are dealt together (``groups >= N``) or over the ranks that share the group. A run
    shared by several ranks (a group with fewer units than ranks) is a replicated one.
    """
    groups = units if groups is None else groups
    if units < 1 or groups < 1 or units % groups:
        raise ValueError(f"{units} units cannot be dealt in {groups} groups")
    per_group = units // groups
    if groups >= world_size:
        counts = deal(groups, world_size)
        starts = itertools.accumulate(counts, initial=0)
        return tuple((start * per_group, count * per_group) for start, count in zip(starts, counts, strict=False))
    found: list[tuple[int, int]] = []
    for group, members in enumerate(deal(world_size, groups)):
        first = group * per_group
        if per_group >= members:
            counts = deal(per_group, members)
            starts = itertools.accumulate(counts, initial=0)
            found.extend((first + start, count) for start, count in zip(starts, counts, strict=False))
        else:  # fewer units than ranks in this group: each rank keeps one, shared
            found.extend((first + member * per_group // members, 1) for member in range(members))
    return tuple(found)


def _rank_by_rank(op, swap: bool = False):
    """A binary operator method of :class:`PerRank` applying ``op`` rank by rank (``swap``: reflected)."""

    def method(self, other):
        return self._map(other, op, swap)

    return method


class PerRank(tuple):
    """One value per rank (rank ``r`` reads ``values[r]``); ``+ - * // %`` with an int or another
    ``PerRank`` of the same length apply rank by rank and fold back with :func:`per_rank`."""

    __slots__ = ()

    def _map(self, other: Any, op, swap: bool = False) -> int | PerRank:
        if isinstance(other, PerRank):
            if len(other) != len(self):
                raise ValueError(f"per-rank values of {len(self)} and {len(other)} ranks do not combine")
            pairs = zip(self, other, strict=True)
        else:
            pairs = zip(self, itertools.repeat(other), strict=False)
        return per_rank(op(b, a) if swap else op(a, b) for a, b in pairs)

    __add__ = _rank_by_rank(operator.add)
    __radd__ = _rank_by_rank(operator.add, swap=True)
    __sub__ = _rank_by_rank(operator.sub)
    __rsub__ = _rank_by_rank(operator.sub, swap=True)
    __mul__ = _rank_by_rank(operator.mul)
    __rmul__ = _rank_by_rank(operator.mul, swap=True)
    __floordiv__ = _rank_by_rank(operator.floordiv)
    __rfloordiv__ = _rank_by_rank(operator.floordiv, swap=True)
    __mod__ = _rank_by_rank(operator.mod)

    def __repr__(self) -> str:
        return f"PerRank({', '.join(map(repr, self))})"


def per_rank(values: Iterable[Any]) -> Any:
    """``values`` (one per rank) as a :class:`PerRank`, or the one value every rank shares."""
    values = tuple(values)
    if values and all(value == values[0] for value in values[1:]):
        return values[0]
    return PerRank(values)


def resolve(value: Any, rank: int) -> Any:
    """Rank ``rank``'s value of ``value``: its entry if it is a :class:`PerRank`, else ``value`` itself."""
    return value[rank] if isinstance(value, PerRank) else value
