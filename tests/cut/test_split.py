"""Property tests of the cut: :class:`tpcore.cut.split.Split` and the parallelformers functions over it
(:mod:`tpcore.compat.parallelformers`: ``shard``, ``split_dims``, ``TensorSlicer``), pure (tensor, rank, world)
-> shard."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpcore import Layer, ShardingError
from tpcore.compat.parallelformers import COLUMN, ROW, TensorSlicer, check_divisible, shard, shard_ranges, split_dims
from tpcore.cut.split import Split
from tpcore.plan.shard_plan import ShardPlan

FAST = settings(max_examples=40, deadline=None)

worlds = st.integers(min_value=1, max_value=4)
small = st.integers(min_value=1, max_value=5)
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def mentions(message: str, number: int) -> bool:
    return re.search(rf"(?<!\d){number}(?!\d)", message) is not None


# -- shard -------------------------------------------------------------------------------------


@FAST
@given(world=worlds, per_rank=small, other=small, ndim=st.integers(1, 3), data=st.data(), seed=seeds)
def test_shards_of_all_ranks_reassemble_the_tensor(world, per_rank, other, ndim, data, seed):
    dim = data.draw(st.integers(min_value=-ndim, max_value=ndim - 1), label="dim")
    shape = [other] * ndim
    shape[dim] = per_rank * world
    tensor = randn(*shape, seed=seed)

    shards = [shard(tensor, dim, rank, world) for rank in range(world)]

    for piece in shards:
        expected = list(shape)
        expected[dim] = per_rank
        assert list(piece.shape) == expected
        assert piece.is_contiguous()
    assert torch.equal(torch.cat(shards, dim=dim), tensor)


@FAST
@given(world=worlds, per_rank=small, other=small, seed=seeds)
def test_shard_is_the_rank_th_contiguous_block(world, per_rank, other, seed):
    tensor = randn(per_rank * world, other, seed=seed)
    for rank in range(world):
        assert torch.equal(shard(tensor, 0, rank, world), tensor[rank * per_rank : (rank + 1) * per_rank])
        assert torch.equal(shard(tensor.T, 1, rank, world), tensor.T[:, rank * per_rank : (rank + 1) * per_rank])


@FAST
@given(
    world=worlds,
    heads_per_rank=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    hidden=small,
    reversed_layout=st.booleans(),
)
def test_fused_qkv_keeps_each_heads_q_k_v_on_one_rank(world, heads_per_rank, head_dim, hidden, reversed_layout):
    heads = heads_per_rank * world
    size = 3 * heads * head_dim
    # Row i of the (out, in) weight holds the value i; element j of head h of part p (q, k, v)
    # is row p * heads * head_dim + h * head_dim + j.
    labels = torch.arange(size, dtype=torch.float64)
    weight = labels[:, None].expand(size, hidden).clone()
    dim = 0
    if reversed_layout:  # Conv1D stores (in, out)
        weight, dim = weight.T.contiguous(), 1

    for rank in range(world):
        piece = shard(weight, dim, rank, world, n_fused=3)
        assert piece.shape[dim] == size // world
        q, k, v = weight.chunk(3, dim=dim)
        expected = torch.cat([part.chunk(world, dim=dim)[rank] for part in (q, k, v)], dim=dim)
        assert torch.equal(piece, expected)

        rows = piece.select(1 - dim, 0).view(3, heads_per_rank, head_dim)
        for part in range(3):
            for local_head in range(heads_per_rank):
                head = rank * heads_per_rank + local_head
                start = part * heads * head_dim + head * head_dim
                assert rows[part, local_head].tolist() == list(range(start, start + head_dim))


@FAST
@given(world=worlds, per_rank=small, other=small, n_fused=st.integers(1, 4), seed=seeds)
def test_fused_shards_reassemble_per_block(world, per_rank, other, n_fused, seed):
    tensor = randn(other, n_fused * world * per_rank, seed=seed)
    shards = [shard(tensor, 1, rank, world, n_fused=n_fused) for rank in range(world)]
    blocks = tensor.chunk(n_fused, dim=1)
    for index, block in enumerate(blocks):
        rebuilt = torch.cat([piece.chunk(n_fused, dim=1)[index] for piece in shards], dim=1)
        assert torch.equal(rebuilt, block)


@FAST
@given(world=st.integers(2, 5), n_fused=st.integers(1, 3), per_tensor=st.integers(1, 40), other=small, seed=seeds)
def test_a_size_the_ranks_do_not_divide_is_dealt_in_near_equal_contiguous_pieces(
    world, n_fused, per_tensor, other, seed
):
    """Each packed tensor of ``S`` features gives rank ``r`` ``S // N + (r < S % N)`` of them, in order;
    a size too small for every rank to hold one is refused, naming it; ``check_divisible`` stays strict."""
    size = n_fused * per_tensor
    tensor = randn(other, size, seed=seed)
    if per_tensor < world:
        with pytest.raises(ShardingError) as info:
            shard(tensor, 1, 0, world, n_fused=n_fused)
        assert mentions(str(info.value), size) and mentions(str(info.value), world)
        return
    shards = [shard(tensor, 1, rank, world, n_fused=n_fused) for rank in range(world)]
    counts = [per_tensor // world + (rank < per_tensor % world) for rank in range(world)]
    for index, block in enumerate(tensor.chunk(n_fused, dim=1)):
        pieces = [piece.split(count, dim=1)[index] for piece, count in zip(shards, counts, strict=True)]
        assert [piece.shape[1] for piece in pieces] == counts
        assert torch.equal(torch.cat(pieces, dim=1), block)
    if per_tensor % world:
        with pytest.raises(ShardingError) as info:
            check_divisible(size, world, n_fused)
        assert mentions(str(info.value), size) and f"{world} ranks" in str(info.value)


def test_a_size_that_is_not_whole_packed_tensors_is_refused():
    # 8 features cannot hold 3 fused tensors of equal width
    with pytest.raises(ShardingError, match=r"size 8 cannot be split into 3 equal fused tensors"):
        shard(torch.zeros(8, 2), 0, 0, 2, n_fused=3)
    with pytest.raises(ShardingError, match=r"size 12 cannot be split into 10 heads \(2 fused tensors x 5 heads\)"):
        Split(0, 2, heads=5).check(12, 2)


@pytest.mark.parametrize(("size", "world", "n_fused"), [(12, 4, 3), (8, 2, 1), (0, 3, 1), (6, 1, 3)])
def test_check_divisible_accepts_exact_sizes(size, world, n_fused):
    assert check_divisible(size, world, n_fused) is None


@pytest.mark.parametrize(("rank", "world"), [(-1, 2), (2, 2), (5, 4), (0, 0)])
def test_bad_rank_raises(rank, world):
    tensor = torch.zeros(8, 8)
    with pytest.raises(ValueError, match=rf"rank {rank} is outside a world of {world}"):
        shard(tensor, 0, rank, world)
    with pytest.raises(ValueError, match=rf"rank {rank} is outside a world of {world}"):
        TensorSlicer(rank, world)


# -- split_dims --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("style", "reversed_layout", "expected"),
    [
        (COLUMN, False, (0, 0)),  # Linear (out, in): split out features; bias split
        (COLUMN, True, (1, 0)),  # Conv1D (in, out): out features are dim 1; bias split
        (ROW, False, (1, None)),  # Linear: split in features; bias whole
        (ROW, True, (0, None)),  # Conv1D: in features are dim 0; bias whole
    ],
)
def test_split_dims(style, reversed_layout, expected):
    assert split_dims(style, Layer(weight="w", bias="b", reversed=reversed_layout)) == expected
    # n_fused does not change the dimension
    assert split_dims(style, Layer(weight="w", n_fused=3, reversed=reversed_layout)) == expected


def test_split_dims_rejects_unknown_style():
    with pytest.raises(ValueError, match="unknown parallel style 'diagonal'"):
        split_dims("diagonal", Layer(weight="w"))


@FAST
@given(
    world=worlds,
    specs=st.lists(st.tuples(st.sampled_from([COLUMN, ROW]), st.booleans()), min_size=2, max_size=6),
    seed=seeds,
)
def test_split_dim_is_never_carried_over_to_the_next_tensor(world, specs, seed):
    """A slicer used for a reversed tensor and then a plain one splits each along its own dimension."""
    out_features, in_features = 2 * world, 3 * world
    for rank in range(world):
        slicer = TensorSlicer(rank, world)
        for index, (style, reversed_layout) in enumerate(specs):
            layer = Layer(weight="w", bias="b", reversed=reversed_layout)
            weight = randn(out_features, in_features, seed=seed + index)  # (out, in)
            bias = randn(out_features, seed=seed + index + 1)
            stored = weight.T.contiguous() if reversed_layout else weight
            slice_fn = slicer.column_slice if style == COLUMN else slicer.row_slice
            got_weight, got_bias = slice_fn(layer, stored, bias)
            # Compare in (out, in) layout whatever the storage layout
            got = got_weight.T if reversed_layout else got_weight
            if style == COLUMN:
                per = out_features // world
                assert torch.equal(got, weight[rank * per : (rank + 1) * per])
                assert torch.equal(got_bias, bias[rank * per : (rank + 1) * per])
            else:
                per = in_features // world
                assert torch.equal(got, weight[:, rank * per : (rank + 1) * per])
                assert got_bias is bias


# -- TensorSlicer ------------------------------------------------------------------------------


@FAST
@given(world=worlds, out_per=small, in_per=small, reversed_layout=st.booleans(), with_bias=st.booleans(), seed=seeds)
def test_column_slices_reassemble(world, out_per, in_per, reversed_layout, with_bias, seed):
    out_features, in_features = out_per * world, in_per * world
    layer = Layer(weight="w", bias="b" if with_bias else None, reversed=reversed_layout)
    weight = (
        randn(in_features, out_features, seed=seed) if reversed_layout else randn(out_features, in_features, seed=seed)
    )
    bias = randn(out_features, seed=seed + 1) if with_bias else None
    weight_dim = 1 if reversed_layout else 0

    pieces = [TensorSlicer(rank, world).column_slice(layer, weight, bias) for rank in range(world)]

    for piece_weight, _ in pieces:
        assert piece_weight.shape[weight_dim] == out_per
        assert piece_weight.shape[1 - weight_dim] == in_features
    assert torch.equal(torch.cat([w for w, _ in pieces], dim=weight_dim), weight)
    if with_bias:
        assert all(b.shape == (out_per,) for _, b in pieces)
        assert torch.equal(torch.cat([b for _, b in pieces]), bias)
    else:
        assert all(b is None for _, b in pieces)


@FAST
@given(world=worlds, out_per=small, in_per=small, reversed_layout=st.booleans(), seed=seeds)
def test_row_slices_reassemble_and_keep_bias_whole(world, out_per, in_per, reversed_layout, seed):
    out_features, in_features = out_per * world, in_per * world
    layer = Layer(weight="w", bias="b", reversed=reversed_layout)
    weight = (
        randn(in_features, out_features, seed=seed) if reversed_layout else randn(out_features, in_features, seed=seed)
    )
    bias = randn(out_features, seed=seed + 1)
    weight_dim = 0 if reversed_layout else 1
    bias_before = bias.clone()

    pieces = [TensorSlicer(rank, world).row_slice(layer, weight, bias) for rank in range(world)]

    for piece_weight, piece_bias in pieces:
        assert piece_weight.shape[weight_dim] == in_per
        assert piece_weight.shape[1 - weight_dim] == out_features
        assert piece_bias is bias
    assert torch.equal(torch.cat([w for w, _ in pieces], dim=weight_dim), weight)
    assert torch.equal(bias, bias_before)


@FAST
@given(world=worlds, heads_per_rank=st.integers(1, 3), head_dim=st.integers(1, 3), hidden=small, seed=seeds)
def test_fused_column_slice_of_conv1d_qkv_matches_per_rank_q_k_v(world, heads_per_rank, head_dim, hidden, seed):
    size = heads_per_rank * world * head_dim  # per q, k or v
    layer = Layer(weight="c_attn.weight", bias="c_attn.bias", n_fused=3, reversed=True)
    weight = randn(hidden, 3 * size, seed=seed)  # Conv1D (in, out)
    bias = randn(3 * size, seed=seed + 1)
    per = size // world
    for rank in range(world):
        got_weight, got_bias = TensorSlicer(rank, world).column_slice(layer, weight, bias)
        assert got_weight.shape == (hidden, 3 * per)
        assert got_bias.shape == (3 * per,)
        for part in range(3):
            columns = slice(part * size + rank * per, part * size + (rank + 1) * per)
            assert torch.equal(got_weight[:, part * per : (part + 1) * per], weight[:, columns])
            assert torch.equal(got_bias[part * per : (part + 1) * per], bias[columns])


def test_slicer_deals_uneven_tensors_and_reports_unsplittable_ones_through_column_and_row_slice():
    weights = [TensorSlicer(rank, 4).column_slice(Layer(weight="w", bias="b"), torch.zeros(10, 8), torch.zeros(10))[0]
               for rank in range(4)]  # fmt: skip
    assert [w.shape[0] for w in weights] == [3, 3, 2, 2]
    assert TensorSlicer(3, 4).row_slice(Layer(weight="w"), torch.zeros(8, 6), None)[0].shape == (8, 1)
    slicer = TensorSlicer(0, 4)
    with pytest.raises(ShardingError, match=r"size 3 is smaller than the 4 ranks"):
        slicer.column_slice(Layer(weight="w", bias="b"), torch.zeros(3, 8), torch.zeros(3))
    with pytest.raises(ShardingError, match=r"size 10 cannot be split into 3 heads"):
        slicer.row_slice(Layer(weight="w", reversed=True, heads=3), torch.zeros(10, 8), None)


def test_slicing_does_not_modify_the_input():
    weight = torch.arange(24.0).view(6, 4)
    before = weight.clone()
    for rank in range(2):
        TensorSlicer(rank, 2).column_slice(Layer(weight="w", n_fused=3), weight, None)
        TensorSlicer(rank, 2).row_slice(Layer(weight="w"), weight, None)
    assert torch.equal(weight, before)


def test_shard_does_not_keep_the_whole_tensor_alive():
    tensor = torch.randn(64, 32)
    piece = shard(tensor, 0, 1, 4)
    assert piece.untyped_storage().nbytes() == piece.numel() * piece.element_size()


# -- padded (vocabulary) shards ------------------------------------------------------------------


@FAST
@given(world=worlds, rows=st.integers(1, 23), cols=small, seed=seeds)
def test_padded_shards_are_equal_sized_and_reassemble_the_rows_then_zeros(world, rows, cols, seed):
    tensor = randn(rows, cols, seed=seed)
    shards = [shard(tensor, 0, rank, world, pad=True) for rank in range(world)]
    per_rank = -(-rows // world)
    assert all(piece.shape == (per_rank, cols) for piece in shards)
    whole = torch.cat(shards)
    assert torch.equal(whole[:rows], tensor)
    assert not whole[rows:].any()  # only zero rows pad the last ranks
    assert all(piece.untyped_storage().nbytes() == piece.numel() * piece.element_size() for piece in shards)


@FAST
@given(world=worlds, rows=st.integers(1, 23), rank_seed=seeds)
def test_padded_ranges_name_the_rows_each_rank_holds(world, rows, rank_seed):
    rank = rank_seed % world
    ((start, stop),) = shard_ranges(rows, rank, world, pad=True)[0]
    per_rank = -(-rows // world)
    assert (start, stop) == (min(rank * per_rank, rows), min((rank + 1) * per_rank, rows))
    assert shard_ranges(rows, rank, world, pad=True)[1] == per_rank - (stop - start)


def test_a_padded_split_refuses_fused_tensors_and_heads():
    with pytest.raises(ValueError, match="padded"):
        shard(torch.zeros(6, 2), 0, 0, 2, n_fused=3, pad=True)
    with pytest.raises(ValueError, match="padded"):
        shard_ranges(6, 0, 2, heads=2, pad=True)


@FAST
@given(world=worlds, shape=st.lists(small, min_size=1, max_size=3), dim=st.integers(0, 2), seed=seeds)
def test_a_summand_is_whole_on_rank_0_and_zeros_elsewhere_so_the_shards_sum_to_it(world, shape, dim, seed):
    tensor, split = randn(*shape, seed=seed), Split(dim % len(shape), summand=True)
    shards = [split.shard(tensor, rank, world) for rank in range(world)]
    assert torch.equal(shards[0], tensor) and not any(piece.any() for piece in shards[1:])
    assert torch.equal(sum(shards), tensor)  # what an all-reduce of a sum holding it adds: the tensor, once
    size = tensor.shape[split.dim]
    assert [split.shard_size(size, world, rank) for rank in range(world)] == [size] * world
    assert split.even(size, world) and not split.replicated(size, world)
    plan = ShardPlan("M", world, shapes={"b": tuple(shape)}, dtypes={"b": tensor.dtype}, splits={"b": split})
    assert torch.equal(plan.assemble("b", shards), tensor)  # save_pretrained's gather: rank 0's values


def test_a_summand_takes_no_other_layout_words():
    for words in ({"n_fused": 2}, {"heads": 2}, {"pad": True}, {"parts": (2, 1)}):
        with pytest.raises(ValueError, match="summand"):
            Split(0, summand=True, **words).ranges(4, 0, 2)


# -- Split: check, ranges, shard_size for every layout ------------------------------------------

head_numbers = st.integers(1, 6)
splits = st.one_of(
    st.builds(lambda n_fused, heads: Split(0, n_fused, heads), st.integers(1, 3), st.none() | head_numbers),
    st.lists(head_numbers, min_size=2, max_size=3).map(lambda parts: Split(0, parts=tuple(parts))),
    st.builds(lambda n, heads: Split(0, n, heads, interleaved=True), st.integers(1, 3), head_numbers),
    st.just(Split(0, pad=True)),
)


def accepts(split: Split, size: int, world: int) -> bool:
    """Whether ``size`` cuts into whole units on every rank over ``world`` ranks, restated from the layouts' rules."""
    if split.pad:
        return True
    if split.parts:
        return size % sum(split.parts) == 0
    if split.interleaved:
        return size % (split.heads * split.n_fused) == 0
    if split.heads:
        return size % (split.n_fused * split.heads) == 0
    return size % split.n_fused == 0 and (size == 0 or size // split.n_fused >= world)


def old_equal_ranges(split: Split, size: int, rank: int, world: int) -> list[tuple[int, int]] | None:
    """The ranges of the equal split (no parts), or ``None`` where the ranks do not divide the counts:
    each of the ``n_fused`` segments (one if interleaved) of ``u`` units gives rank ``r`` the units
    ``[r u / N, (r + 1) u / N)``, or the one unit ``r u // N`` when ``N`` is a multiple of ``u``."""
    segments = 1 if split.interleaved else split.n_fused
    units = split.heads or world
    if size % (segments * units) or not (units % world == 0 or world % units == 0):
        return None
    length = size // segments
    unit = length // units
    first, many = (rank * units // world, max(units // world, 1))
    return [(offset * length + first * unit, offset * length + (first + many) * unit) for offset in range(segments)]


@settings(max_examples=200, deadline=None)
@given(split=splits, size=st.integers(0, 48), world=st.integers(1, 5))
def test_what_check_accepts_cuts_into_whole_balanced_pieces_and_what_it_refuses_names_the_size(split, size, world):
    if not accepts(split, size, world):
        for attempt in (
            lambda: split.check(size, world),
            lambda: split.ranges(size, world - 1, world),
            lambda: split.shard_size(size, world),
        ):
            with pytest.raises(ShardingError) as info:
                attempt()
            assert mentions(str(info.value), size)
        return
    split.check(size, world)
    tensor = torch.arange(float(size))[:, None].expand(size, 2)
    covered = Counter()
    sizes = []
    for rank in range(world):
        ranges, padding = split.ranges(size, rank, world)
        sizes.append(split.shard_size(size, world, rank))
        assert sum(stop - start for start, stop in ranges) + padding == sizes[-1]
        assert all(0 <= start <= stop <= size for start, stop in ranges)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # in order, disjoint
        covered.update(i for start, stop in ranges for i in range(start, stop))
        assert split.shard(tensor, rank, world).shape == (sizes[-1], 2)
    assert set(covered) == set(range(size))  # nothing is lost
    if not split.replicated(size, world):  # then nothing is held twice
        assert set(covered.values()) <= {1}
    if split.even(size, world):
        assert len(set(sizes)) == 1
    elif not split.replicated(size, world):  # near-equal: within one unit (head, group) per packed tensor
        segments = len(split.parts or ()) or (1 if split.interleaved else split.n_fused)
        assert max(sizes) - min(sizes) <= segments * max(1, size // segments)


@settings(max_examples=120, deadline=None)
@given(split=splits, size=st.integers(1, 48), world=st.integers(1, 5))
def test_where_the_ranks_divide_every_count_the_pieces_are_the_equal_ones(split, size, world):
    """Equal splits stay bit for bit what they were: rank ``r`` holds units ``[r u / N, (r + 1) u / N)``
    of every segment (or the one unit ``r u // N`` it shares, when fewer units than ranks divide them)."""
    if split.pad or split.parts or not accepts(split, size, world) or old_equal_ranges(split, size, 0, world) is None:
        return
    assert split.even(size, world)
    for rank in range(world):
        assert split.ranges(size, rank, world)[0] == old_equal_ranges(split, size, rank, world)


@pytest.mark.parametrize(
    ("split", "message"),
    [
        (Split(0, parts=(2, 2), heads=2), "take no heads"),
        (Split(0, n_fused=2, parts=(2, 2, 2)), "take no heads or n_fused"),
        (Split(0, parts=(2, 0)), "must be positive head counts"),
        (Split(0, n_fused=3, interleaved=True), "interleaved split needs heads"),
        (Split(0, pad=True, n_fused=2), "padded"),
        (Split(0, heads=0), "heads"),
        (Split(0, n_fused=0), "n_fused"),
    ],
)
def test_a_malformed_split_is_a_value_error_not_a_sharding_error(split, message):
    with pytest.raises(ValueError, match=message) as info:
        split.check(12, 2)
    assert not isinstance(info.value, ShardingError)


@FAST
@given(ndim=st.integers(1, 4), world=worlds, data=st.data(), seed=seeds)
def test_a_negative_dim_counts_from_the_end_of_a_tensor_of_any_rank(ndim, world, data, seed):
    dim = data.draw(st.integers(-ndim, -1), label="dim")
    shape = [2] * ndim
    shape[dim] = 2 * world
    tensor = randn(*shape, seed=seed)
    assert Split(dim).resolved(ndim) == Split(dim + ndim)
    for rank in range(world):
        assert torch.equal(Split(dim, 2).shard(tensor, rank, world), Split(dim + ndim, 2).shard(tensor, rank, world))
    with pytest.raises(ShardingError, match=rf"split dim {-ndim - 1} is outside a tensor of {ndim} dimensions"):
        Split(-ndim - 1).shard(tensor, 0, world)


def test_heads_the_ranks_do_not_divide_are_dealt_whole_and_fewer_heads_than_ranks_are_shared():
    # 6 heads of 4 over 4 ranks: two ranks hold two heads, two hold one; never 1.5 heads
    assert [Split(0, heads=6).ranges(24, r, 4)[0] for r in range(4)] == [[(0, 8)], [(8, 16)], [(16, 20)], [(20, 24)]]
    # 3 heads over 4 ranks: head 0 on ranks 0 and 1, heads 1 and 2 on one rank each
    assert [Split(0, heads=3).ranges(12, r, 4)[0] for r in range(4)] == [[(0, 4)], [(0, 4)], [(4, 8)], [(8, 12)]]
    assert Split(0, heads=3).replicated(12, 4) and not Split(0, heads=3).even(12, 4)
    with pytest.raises(ShardingError, match="size 24: 6 heads cannot be split evenly over 4 ranks"):
        check_divisible(24, 4, heads=6)


def test_the_old_functions_are_the_split_methods():
    assert shard_ranges(12, 1, 2, 3) == Split(0, 3).ranges(12, 1, 2) == ([(2, 4), (6, 8), (10, 12)], 0)
    assert shard_ranges(8, 3, 4, heads=2) == Split(0, heads=2).ranges(8, 3, 4) == ([(4, 8)], 0)
