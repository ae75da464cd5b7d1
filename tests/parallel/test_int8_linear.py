""":class:`tpcore.parallel.int8_linear.Int8Linear`: a rank's product from its int8 rows or columns, scaled per row,
makes the whole layer's output (column pieces concatenated, row partial sums all-reduced then scaled), and the
whole layer computes what torchao's per-row ``Int8Tensor`` computes, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.int8_linear import Int8Linear, RowParallelInt8Linear


def quantized(out_features: int, in_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = torch.rand(out_features, 1, generator=generator) / 100 + 1e-3
    bias = torch.randn(out_features, generator=generator)
    return values, scales, bias


def layer(values, scales, bias, split: Split | None, rank: int, world: int, row_parallel: bool = False):
    linear = nn.Linear(values.shape[1], values.shape[0], device="meta")
    Int8Linear.hold(linear, scales.dtype)
    rows = split is not None and split.dim == 0

    def own(tensor):
        return split.shard(tensor, rank, world) if rows else tensor

    linear._weight_qdata = nn.Parameter(values if split is None else split.shard(values, rank, world), False)
    linear.weight = linear._weight_qdata
    linear._weight_scale = nn.Parameter(own(scales), requires_grad=False)
    linear._weight_zero_point = nn.Parameter(torch.zeros_like(own(scales), dtype=torch.int8), requires_grad=False)
    linear.bias = nn.Parameter(own(bias), requires_grad=False)
    if row_parallel:
        linear.__class__ = RowParallelInt8Linear
    return linear


@pytest.mark.parametrize("world", [2, 3])
def test_column_pieces_concatenate_to_the_whole_layer(world):
    values, scales, bias = quantized(12, 10, seed=1)
    x = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(2))
    expected = F.linear(x, values.float() * scales, bias)
    got = torch.cat([layer(values, scales, bias, Split(0), rank, world)(x) for rank in range(world)], dim=-1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_row_partial_products_are_scaled_once_after_the_sum(monkeypatch):
    """Each rank's unscaled ``x_r @ q_r.T`` is what the all-reduce adds (here: summed by hand), then the whole
    row scale and the bias once."""
    world = 3
    values, scales, bias = quantized(8, 12, seed=3)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(4))
    partials = [
        F.linear(Split(-1).shard(x, rank, world), Split(1).shard(values, rank, world).float()) for rank in range(world)
    ]
    total = sum(partials)
    monkeypatch.setattr("tpcore.parallel.int8_linear.reduce_partial_sums", lambda partial, group: total)
    got = layer(values, scales, bias, Split(1), 0, world, row_parallel=True)(Split(-1).shard(x, 0, world))
    torch.testing.assert_close(got, total * scales.flatten() + bias, rtol=0, atol=0)
    torch.testing.assert_close(got, F.linear(x, values.float() * scales, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_whole_layer_is_torchao_s_per_row_product_bit_for_bit(dtype):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8Tensor
    from torchao.quantization.granularity import PerRow

    weight = torch.randn(16, 32, generator=torch.Generator().manual_seed(5), dtype=dtype)
    reference = Int8Tensor.from_hp(weight, PerRow())
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(6), dtype=dtype)
    bias = torch.randn(16, dtype=dtype)
    expected = F.linear(x, reference, bias)
    scales = reference.scale.reshape(-1, 1)
    ours = layer(reference.qdata, scales, bias, None, 0, 1)
    assert torch.equal(ours(x), expected)


def test_nonzero_zero_points_are_refused():
    values, scales, bias = quantized(4, 6, seed=7)
    linear = layer(values, scales, bias, None, 0, 1)
    linear._weight_zero_point.data[2] = 3
    with pytest.raises(ValueError, match="nonzero zero points"):
        linear.localize(0, 1)
