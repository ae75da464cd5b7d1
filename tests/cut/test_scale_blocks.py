"""Property tests of scale blocks under a cut (:mod:`tpcore.cut.scale_blocks`) and the layer that uses them
(:class:`tpcore.parallel.quantized_linear.BlockFP8Linear`): a rank's dequantized shard is the shard of the dequantized
weight, exactly, for any block size, cut and world size, inside a block or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tpcore.cut.scale_blocks import block_index, deals_whole_elements, first_whole_block
from tpcore.cut.split import Split
from tpcore.parallel.quantized_linear import BlockFP8Linear, e4m3_as_scaled_float32, localize_quantized
from tpcore.testing.quantized_checkpoints import block_fp8

FAST = settings(max_examples=60, deadline=None)


def dequantized(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The whole weight, element by element: ``values[i, j] * scales[i // B0, j // B1]``."""
    rows = torch.arange(values.shape[0]) // block[0]
    cols = torch.arange(values.shape[1]) // block[1]
    return values.float() * scales[rows][:, cols]


def quantized(out_features: int, in_features: int, block: tuple[int, int], seed: int):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return block_fp8(weight, block)


splits = st.sampled_from(
    [Split(0), Split(1), Split(0, heads=3), Split(0, n_fused=2), Split(0, parts=(4, 2, 2)), Split(0, pad=True)]
)


@FAST
@given(
    split=splits,
    world=st.integers(1, 4),
    block=st.tuples(st.integers(1, 7), st.integers(1, 7)),
    units=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_a_rank_s_dequantized_shard_is_the_shard_of_the_dequantized_weight(split, world, block, units, seed):
    size = 24 * units * world if split.parts or split.heads or split.n_fused > 1 else 3 * units + world
    shape = (size, 5) if split.dim == 0 else (5, size)
    values, scales = quantized(*shape, block, seed)
    whole = dequantized(values, scales, block)
    for rank in range(world):
        shard = split.shard(values.float(), rank, world)
        rows = block_index(split if split.dim == 0 else None, shape[0], block[0], rank, world)
        cols = block_index(split if split.dim == 1 else None, shape[1], block[1], rank, world)
        assert rows.shape[0] == shard.shape[0] and cols.shape[0] == shard.shape[1]
        assert torch.equal(shard * scales[rows][:, cols], split.shard(whole, rank, world))


def test_block_index_without_a_cut_counts_blocks_and_refuses_an_empty_block():
    assert block_index(None, 7, 3, 0, 1).tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert block_index(Split(0), 7, 3, 1, 2).tolist() == [1, 1, 2]  # rows 4..6: a block shared with rank 0
    with pytest.raises(ValueError, match="block of 0"):
        block_index(None, 4, 0, 0, 1)


@pytest.mark.parametrize("style", ["column", "row"])
def test_block_fp8_linear_shards_sum_to_the_dequantized_linear(style):
    """Two ranks' layers, run alone here: column pieces concatenate and row partial sums add up to the whole
    layer, each rank's weight dequantized from its own e4m3 values and the whole scales."""
    block, world = (4, 3), 2
    values, scales = quantized(10, 9, block, seed=1)
    bias = torch.randn(10)
    x = torch.randn(2, 3, 9, generator=torch.Generator().manual_seed(2))
    expected = F.linear(x, dequantized(values, scales, block), bias)
    split = Split(0) if style == "column" else Split(1)
    outputs = []
    for rank in range(world):
        linear = nn.Linear(9, 10, device="meta")
        BlockFP8Linear.hold(linear, block, tuple(scales.shape))
        linear.weight = nn.Parameter(split.shard(values, rank, world), requires_grad=False)
        linear.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        own_bias = split.shard(bias, rank, world) if style == "column" else torch.zeros(10)
        linear.bias = nn.Parameter(own_bias, requires_grad=False)
        linear.cuts = {"weight": split.resolved(2)}
        localize_quantized(linear, rank, world)
        piece = x if style == "column" else Split(-1).shard(x, rank, world)
        outputs.append(linear(piece))
    got = torch.cat(outputs, dim=-1) if style == "column" else sum(outputs) + bias
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_e4m3_widened_through_float16_bits_is_exact_for_every_pattern():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    expected, got = every.float(), e4m3_as_scaled_float32(every) * 2.0**8
    numbers = ~expected.isnan()
    assert torch.equal(got[numbers], expected[numbers])
    assert torch.equal(got[~numbers].abs(), torch.tensor([480.0, 480.0]))  # NaN, which no quantized weight holds


@pytest.mark.parametrize(
    ("shape", "block", "split"),
    [
        ((10, 12), (4, 3), Split(0)),  # whole column blocks: the broadcast path
        ((10, 12), (4, 3), Split(1)),  # a row cut inside column blocks: the gathered path
        ((10, 11), (4, 3), Split(0)),  # a last partial column block
        ((12, 12), (5, 5), None),
    ],
)
def test_a_layer_s_dequantized_weight_is_transformers_product_bit_for_bit(shape, block, split):
    """``values.float() * scale`` rounded once, as transformers dequantizes at load, on every path."""
    values, scales = quantized(*shape, block, seed=3)
    world = 1 if split is None else 3
    for rank in range(world):
        linear = nn.Linear(shape[1], shape[0], bias=False, device="meta")
        BlockFP8Linear.hold(linear, block, tuple(scales.shape))
        piece = values if split is None else split.shard(values, rank, world)
        linear.weight = nn.Parameter(piece, requires_grad=False)
        linear.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        linear.cuts = {} if split is None else {"weight": split.resolved(2)}
        linear.localize(rank, world)
        whole = dequantized(values, scales, block)
        expected = whole if split is None else split.shard(whole, rank, world)
        assert torch.equal(linear.dequantized(torch.float32), expected)
        assert torch.equal(linear.dequantized(torch.bfloat16), expected.to(torch.bfloat16))


def test_holding_refuses_scales_of_another_grid():
    linear = nn.Linear(9, 10, device="meta")
    with pytest.raises(ValueError, match=r"has \(3, 3\) scales, not \(2, 3\)"):
        BlockFP8Linear.hold(linear, (4, 3), (2, 3))


@pytest.mark.parametrize(
    ("blocks", "first"),
    [
        ([2, 2, 3, 3], 2),
        ([], 0),
        ([0, 0, 1], None),  # half a block at the end
        ([0, 1, 1, 2], None),  # a cut inside a block at the start
        ([1, 1, 3, 3], None),  # blocks out of order (a piece of two ranges)
    ],
)
def test_first_whole_block_is_found_only_where_a_piece_is_whole_blocks_in_order(blocks, first):
    assert first_whole_block(torch.tensor(blocks, dtype=torch.int64), 2) == first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_fp8_layer_is_torchao_s_float8_weight_only_product_bit_for_bit(dtype):
    """:class:`RowFP8Linear` (torchao's ``Float8WeightOnlyConfig``): the weight dequantized in float32 and rounded
    once, the product, then the bias."""
    pytest.importorskip("torchao")
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerRow

    from tpcore.parallel.quantized_linear import RowFP8Linear

    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(12, 40, generator=generator).to(dtype)
    reference = Float8Tensor.from_hp(weight, granularity=PerRow())
    bias, x = torch.randn(12, generator=generator).to(dtype), torch.randn(3, 40, generator=generator).to(dtype)
    layer = RowFP8Linear.hold_rows(nn.Linear(40, 12, device="meta"))
    layer.weight = nn.Parameter(reference.qdata, requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(reference.scale.float().reshape(-1, 1), requires_grad=False)
    layer.bias = nn.Parameter(bias, requires_grad=False)
    localize_quantized(layer, 0, 1)
    assert torch.equal(layer(x), F.linear(x, reference, bias))


@settings(max_examples=80, deadline=None)
@given(
    heads=st.integers(1, 8),
    n_fused=st.integers(1, 3),
    unit=st.integers(1, 24),
    packing=st.sampled_from([1, 2, 4, 8, 16]),
    world=st.integers(1, 4),
    interleaved=st.booleans(),
)
def test_a_tensor_packed_along_a_dimension_takes_its_cut_exactly_where_whole_elements_are_dealt(
    heads, n_fused, unit, packing, world, interleaved
):
    """Where :func:`deals_whole_elements` says so, the split cuts a tensor packing the dimension ``packing`` values an
    element into exactly the elements holding each rank's values; where it does not, some unit is no whole elements."""
    size = heads * n_fused * unit
    split = Split(0, heads=heads, n_fused=n_fused, interleaved=interleaved)
    follows = deals_whole_elements(split, size, packing)
    assert follows == (unit % packing == 0)
    if follows:
        values, elements = torch.arange(size), torch.arange(size // packing)
        for rank in range(world):
            own = split.shard(elements, rank, world)
            spelled = (own.unsqueeze(-1) * packing + torch.arange(packing)).flatten()
            assert torch.equal(spelled, split.shard(values, rank, world))
    assert not deals_whole_elements(Split(0, parts=(2, 1, 1)), 32, 8)
