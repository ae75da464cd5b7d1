"""Property tests of :mod:`tpcore.cut.shares`: how counts are dealt to ranks, and per-rank values."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpcore import PerRank, ShardingError, share
from tpcore.cut.shares import deal, per_rank, resolve, runs

FAST = settings(max_examples=150, deadline=None)
worlds = st.integers(1, 8)


@FAST
@given(units=st.integers(0, 64), world=worlds)
def test_deal_gives_every_unit_once_in_near_equal_counts_the_first_ranks_one_more(units, world):
    counts = deal(units, world)
    assert sum(counts) == units and len(counts) == world
    assert max(counts) - min(counts) <= 1
    assert list(counts) == sorted(counts, reverse=True)
    if units % world == 0:
        assert set(counts) == {units // world}


@st.composite
def grouped(draw):
    """``(world, query heads, key/value heads)``: any world, any key/value count, query heads a multiple
    of it and at least the ranks (each rank needs a query head of its own)."""
    world = draw(worlds)
    kv = draw(st.integers(1, 9))
    per_group = draw(st.integers(max(1, -(-world // kv)), 4 + -(-world // kv)))
    return world, kv * per_group, kv


@FAST
@given(shape=grouped())
def test_query_heads_dealt_by_groups_read_only_key_value_heads_their_rank_holds(shape):
    """Each rank's query heads ``[a, a + c)`` use the key/value heads ``q // (Q / G)``; the key/value
    split of the same G heads gives that rank exactly those; query heads are never shared, every one
    is held, and no rank holds more than one group's worth of query heads above the mean."""
    world, q_heads, kv_heads = shape
    q_runs, kv_runs = runs(q_heads, world, kv_heads), runs(kv_heads, world)
    per_group = q_heads // kv_heads
    held = []
    for (q_first, q_count), (kv_first, kv_count) in zip(q_runs, kv_runs, strict=True):
        assert q_count >= 1
        needed = {q // per_group for q in range(q_first, q_first + q_count)}
        assert needed == set(range(kv_first, kv_first + kv_count))
        held.extend(range(q_first, q_first + q_count))
    assert sorted(held) == list(range(q_heads))  # each query head on exactly one rank
    assert max(count for _, count in q_runs) <= q_heads / world + per_group


@FAST
@given(units=st.integers(1, 30), world=worlds)
def test_without_groups_runs_are_the_dealt_counts_in_order_and_fewer_units_than_ranks_are_shared(units, world):
    found = runs(units, world)
    if units >= world:
        assert [count for _, count in found] == list(deal(units, world))
        assert [first for first, _ in found] == [sum(deal(units, world)[:r]) for r in range(world)]
    else:
        assert all(count == 1 for _, count in found) and {first for first, _ in found} == set(range(units))
        assert [first for first, _ in found] == sorted(first for first, _ in found)
        if world % units == 0:  # the equal replication: rank r keeps head r u // N
            assert [first for first, _ in found] == [r * units // world for r in range(world)]


def test_runs_refuses_groups_that_do_not_divide_the_units():
    with pytest.raises(ValueError, match="9 units cannot be dealt in 4 groups"):
        runs(9, 2, 4)


def test_per_rank_values_compute_rank_by_rank_and_fold_when_equal():
    heads = PerRank((6, 3))
    assert heads * 64 == PerRank((384, 192)) and 64 * heads == PerRank((384, 192))
    assert heads + 1 == PerRank((7, 4)) and 10 - heads == PerRank((4, 7))
    assert heads // PerRank((2, 1)) == 3  # equal on every rank: a plain int
    assert heads % 3 == 0 and isinstance(heads % 3, int)
    assert per_rank([5, 5]) == 5 and per_rank([5, 4]) == PerRank((5, 4))
    assert resolve(heads, 1) == 3 and resolve(7, 1) == 7
    assert pickle.loads(pickle.dumps(heads)) == heads and type(pickle.loads(pickle.dumps(heads))) is PerRank
    assert repr(heads) == "PerRank(6, 3)"
    with pytest.raises(ValueError, match="per-rank values of 2 and 3 ranks"):
        heads + PerRank((1, 2, 3))


def test_share_is_an_int_where_the_ranks_divide_and_per_rank_counts_and_offsets_where_not():
    assert share(12, 4, "heads") == 3
    assert share(9, 2, "heads") == PerRank((5, 4))
    assert share(9, 2, "heads", first=True) == PerRank((0, 5))
    assert share(9, 2, "heads", groups=3) == PerRank((6, 3))  # query heads stay with their key/value heads
    assert share(3, 2, "kv heads") == PerRank((2, 1))
    assert share(2, 4, "kv heads") == 1  # replicated: one each
    assert share(2, 4, "kv heads", first=True) == PerRank((0, 0, 1, 1))
    with pytest.raises(ShardingError, match="heads = 9 cannot form 4 equal groups"):
        share(9, 2, "heads", groups=4)
    with pytest.raises(ShardingError, match="n_head = 0 is not a positive count"):
        share(0, 2, "n_head")
