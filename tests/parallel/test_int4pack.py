"""Property tests of :class:`tpcore.parallel.int4pack.Int4Packed`: for any rank's rows (a group cut anywhere, act-order
rows in any order, groups the rank lacks) and any number of output features, the kernel's product over its slots is
the product over the rank's rows, exactly, and the packed copy gives the codes back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpcore.parallel.int4pack import INT4PACK_GROUP_SIZES, Int4Packed, int4pack_available, unpack_int4

pytestmark = pytest.mark.skipif(
    not int4pack_available(torch.device("cpu"), 32), reason="this torch build has no CPU int4 product"
)

FAST = settings(max_examples=40, deadline=None)


@st.composite
def rank_rows(draw):
    """A rank's rows: ``(codes, row_groups, scales, zero_points, group_size)``, each group holding at most
    ``group_size`` of them, the rows in any order; a group may be several of the kernel's."""
    group_size = draw(st.sampled_from((*INT4PACK_GROUP_SIZES[:2], 96)))  # 96: 3 of the kernel's groups of 32
    groups = draw(st.integers(1, 4))
    counts = [draw(st.integers(0, group_size)) for _ in range(groups)]
    if sum(counts) % 2:  # the packed layout holds two codes a byte
        counts[counts.index(max(counts))] -= 1
    if sum(counts) == 0:
        counts[0] = 2
    out_features = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    row_groups = torch.cat([torch.full((n,), g + 1) for g, n in enumerate(counts)])  # group 0 and the last: lacked
    if draw(st.booleans()):
        row_groups = row_groups[torch.randperm(len(row_groups), generator=generator)]
    codes = torch.randint(0, 16, (len(row_groups), out_features), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(groups + 2, out_features, generator=generator) / 8).half()
    zero_points = torch.randint(0, 16, (groups + 2, out_features), dtype=torch.int8, generator=generator)
    return codes, row_groups, scales, zero_points, group_size


@FAST
@given(rank_rows())
def test_the_products_over_the_slots_are_those_over_the_rows(rows):
    """A one-hot input a row picks that row of ``W.T = s (q - 8) + t`` (``s`` and ``t = (8 - z) s`` in bfloat16)
    out of the kernel, rounded to bfloat16 once: every row, every output feature, at its place."""
    codes, row_groups, scales, zero_points, group_size = rows
    packed = Int4Packed(codes, row_groups, scales, zero_points, group_size)
    scale = scales.bfloat16().index_select(0, row_groups)
    offset = ((8 - zero_points.bfloat16()) * scales.bfloat16()).index_select(0, row_groups)
    expected = (scale.float() * (codes.float() - 8) + offset.float()).bfloat16()
    got = packed.matmul(torch.eye(len(row_groups)))
    assert got.shape == codes.shape
    assert torch.equal(got, expected)
    padding = packed.slots - len(row_groups)  # less than a kernel group a group the rank holds rows of
    assert padding < packed.group_size * len(row_groups.unique())


@FAST
@given(rank_rows())
def test_the_packed_copy_gives_the_codes_back(rows):
    codes, row_groups, scales, zero_points, group_size = rows
    assert torch.equal(Int4Packed(codes, row_groups, scales, zero_points, group_size).codes(), codes)


@pytest.mark.parametrize(("rows", "columns"), [(16, 2), (48, 64), (64, 130)])
def test_unpacking_reads_what_torch_packed(rows, columns):
    grid = torch.randint(0, 16, (rows, columns), generator=torch.Generator().manual_seed(rows))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(grid.int(), 1)
    assert torch.equal(unpack_int4(packed, rows, columns), grid.to(torch.uint8))


def test_a_group_holding_more_rows_than_its_size_is_refused():
    codes = torch.zeros(34, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="a group holds 34 rows, more than its size 32"):
        Int4Packed(codes, torch.zeros(34, dtype=torch.long), torch.ones(1, 16), torch.zeros(1, 16), 32)
