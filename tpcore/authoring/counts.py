"""Per-rank counts for policies: how many heads (features) each rank holds, and per-rank configs.

:func:`share` deals a count as every :class:`~tpcore.Layer` with the same ``heads`` and ``groups``
is cut (:func:`tpcore.cut.shares.runs`): ``value // N`` where ``N`` divides it, else a
:class:`~tpcore.cut.shares.PerRank` of near-equal whole counts. :func:`divide` is for counts that
must split evenly, and :func:`local_config` copies a config with a rank's counts in it.
"""

from __future__ import annotations

import copy
from typing import Any

from tpcore.cut.shares import PerRank, per_rank, resolve, runs
from tpcore.errors import ShardingError

__all__ = ["PerRank", "divide", "local_config", "share"]


def divide(value: int, world_size: int, what: str) -> int:
    """Return ``value // world_size``; raise :class:`ShardingError` naming ``what`` if it is not exact.

    For a count that may be dealt unevenly (heads, MLP features), use :func:`share`.
    """
    if value % world_size:
        raise ShardingError(
            f"{what} = {value} cannot be split evenly over {world_size} ranks "
            "(a policy that deals it unevenly uses tpcore.share)"
        )
    return value // world_size


def share(value: int, world_size: int, what: str, *, groups: int | None = None, first: bool = False) -> int | PerRank:
    """How many of ``value`` units (heads, features) each rank holds: ``value // world_size`` when it
    divides, else :class:`PerRank` counts dealt as :func:`tpcore.cut.shares.runs` deals them, the ones
    every :class:`Layer` with the same ``heads`` and ``groups`` is cut by (so ``share(heads, N, ...,
    groups=kv_heads)`` for query heads that stay with their key/value heads). A count of fewer
    units than ranks gives each rank one (replicated key/value heads). ``first=True`` gives the index
    of each rank's first unit instead (a rank's rows of a per-head table).

    The result is an int or a :class:`PerRank`, with arithmetic applied per rank
    (``share(heads, N, "n_head") * head_dim`` is each rank's width); :class:`ShardingError` names
    ``what`` when ``value`` is not a positive count or ``groups`` does not divide it.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ShardingError(f"{what} = {value!r} is not a positive count to split over {world_size} ranks")
    try:
        dealt = runs(value, world_size, groups)
    except ValueError:
        raise ShardingError(f"{what} = {value} cannot form {groups} equal groups") from None
    return per_rank([start if first else count for start, count in dealt])


def local_config(config: Any, world_size: int, **counts: int | PerRank) -> Any:
    """A copy of ``config`` whose attributes ``counts`` hold each rank's values (ints, or
    :class:`PerRank` from :func:`share`), for a :meth:`Policy.replace_arguments` value
    ``{"config": ...}`` where a module's forward reads a head count from ``self.config``: one copy
    when every rank's values are equal, else a :class:`PerRank` of copies."""

    def copy_for(rank: int) -> Any:
        copied = copy.copy(config)
        for name, value in counts.items():
            setattr(copied, name, resolve(value, rank))
        return copied

    if not any(isinstance(value, PerRank) for value in counts.values()):
        return copy_for(0)
    return PerRank(copy_for(rank) for rank in range(world_size))
