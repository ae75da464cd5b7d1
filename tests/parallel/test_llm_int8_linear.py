""":class:`tpcore.parallel.llm_int8_linear.LLMInt8Linear`: the whole layer computes what bitsandbytes'
``Linear8bitLt`` computes, bit for bit, outlier columns included; column pieces concatenate to it, and a
row-parallel layer over threads acting as ranks (each token's maximum gathered, integer and outlier products
summed) gives it within float rounding, wherever the outlier columns fall."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.llm_int8_linear import LLMInt8Linear, RowParallelLLMInt8Linear
from tpcore.parallel.threads import ThreadGroup, run_ranks


def quantized(out_features: int, in_features: int, seed: int):
    """bitsandbytes' row quantization of a random weight: int8 values, each row's absolute maximum, and a bias."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    scales = weight.abs().amax(dim=1)
    values = torch.round(weight * (127 / scales.unsqueeze(1))).to(torch.int8)
    return values, scales, torch.randn(out_features, generator=generator)


def layer(values, scales, bias, threshold: float, split: Split | None = None, rank: int = 0, world: int = 1):
    linear = nn.Linear(values.shape[1], values.shape[0], device="meta")
    LLMInt8Linear.hold(linear, threshold)
    rows = split is not None and split.dim == 0
    linear.weight = nn.Parameter(values if split is None else split.shard(values, rank, world), False)
    linear.SCB = nn.Parameter(Split(0).shard(scales, rank, world) if rows else scales, False)
    linear.bias = nn.Parameter(Split(0).shard(bias, rank, world) if rows else bias, False)
    return linear


def inputs(in_features: int, seed: int, dtype=torch.float32, outlier_columns=(1, 7)) -> torch.Tensor:
    """``(2, 5, in)`` inputs, those of ``outlier_columns`` above the default threshold in some tokens."""
    x = torch.randn(2, 5, in_features, generator=torch.Generator().manual_seed(seed))
    for column in outlier_columns:
        x[0, column % 5, column] = 9.0 + column
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_the_whole_layer_is_bitsandbytes_linear8bitlt_bit_for_bit(dtype, threshold):
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes computes the reference")
    weight = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
    reference = bnb.nn.Linear8bitLt(32, 24, has_fp16_weights=False, threshold=threshold)
    reference.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    reference.bias = nn.Parameter(torch.randn(24), requires_grad=False)
    reference = reference.to("cpu").eval()  # quantizes the weight
    x = inputs(32, seed=2, dtype=dtype)
    with torch.no_grad():
        expected = reference(x)
    ours = layer(reference.state.CB, reference.state.SCB, reference.bias.float(), threshold)
    got = ours(x)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("world", [2, 3])
def test_column_pieces_concatenate_to_the_whole_layer(world):
    """The integer part is exact; the outlier columns' float product may round differently for fewer rows."""
    values, scales, bias = quantized(14, 20, seed=3)
    x = inputs(20, seed=4)
    expected = layer(values, scales, bias, 6.0)(x)
    pieces = [layer(values, scales, bias, 6.0, Split(0), rank, world)(x) for rank in range(world)]
    torch.testing.assert_close(torch.cat(pieces, dim=-1), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    ("threshold", "outlier_columns"), [(6.0, (1, 7)), (6.0, (15,)), (6.0, ()), (0.0, (1, 7)), (2.5, (0, 9, 18))]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_parallel_ranks_sum_to_the_whole_layer(world, threshold, outlier_columns, dtype):
    """Outlier columns on one rank, on several, on none; a token's largest input on one rank: each rank's rounding
    is the whole layer's."""
    values, scales, bias = quantized(12, 19, seed=5)
    x = inputs(19, seed=6, dtype=dtype, outlier_columns=outlier_columns)
    x[1, 2, 4] = 5.5  # below the threshold, the largest input of its token: its rank's maximum is every rank's
    expected = layer(values, scales, bias, threshold)(x)
    group = ThreadGroup(world)

    def rank_output(rank: int) -> torch.Tensor:
        ours = layer(values, scales, bias, threshold, Split(1), rank, world)
        ours.__class__, ours.tp_group = RowParallelLLMInt8Linear, group
        return ours(Split(-1).shard(x, rank, world))

    for got in run_ranks(group, rank_output):
        assert got.dtype == dtype
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
