"""Property tests of :class:`tpcore.parallel.nvfp4_linear.NVFP4Linear`: a rank's dequantized shard, made from its own
bytes, its e4m3 group scales and the global scale, is the shard of the whole dequantized weight, exactly, for any cut
(of rows, or of bytes inside a group or not) and world size; the whole layer's weight is compressed-tensors' own
decompression, bit for bit; and column pieces and row partial sums make the whole layer's product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.nvfp4_linear import E2M1_VALUES, NVFP4Linear, unpack_e2m1
from tpcore.parallel.quantized_linear import localize_quantized, ready_quantized

GROUP = 16


def nvfp4(out_features: int, in_features: int, seed: int):
    """Random NVFP4 tensors ``(bytes, e4m3 scales, global scale)`` and the whole weight they stand for, computed here
    from the codes by a table of their own: ``bf16(v * (s / g))``."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = (torch.rand(out_features, in_features // GROUP, generator=generator) * 400 + 0.01).to(torch.float8_e4m3fn)
    global_scale = torch.tensor([3.7])
    magnitude = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes % 8]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    per_value = (scales.float() / global_scale).repeat_interleave(GROUP, dim=1)
    return packed, scales, global_scale, (values * per_value).to(torch.bfloat16)


def layer(packed, scales, global_scale, split: Split | None, rank: int, world: int) -> NVFP4Linear:
    """Rank ``rank``'s layer of ``world``: its bytes (and scale rows where the rows are cut) under ``split``."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    linear = NVFP4Linear.hold_fp4(nn.Linear(in_features, out_features, bias=False, device="meta"), GROUP,
                                  tuple(scales.shape), scales.dtype)  # fmt: skip
    own = packed if split is None else split.shard(packed, rank, world)
    linear.weight_packed = nn.Parameter(own, requires_grad=False)
    linear.weight = linear.weight_packed
    own_scales = scales if split is None or split.dim == 1 else split.shard(scales, rank, world)
    linear.weight_scale = nn.Parameter(own_scales, requires_grad=False)
    linear.weight_global_scale = nn.Parameter(global_scale, requires_grad=False)
    linear.cuts = {} if split is None else {"weight_packed": split.resolved(2)}
    localize_quantized(linear, rank, world)
    ready_quantized(linear)
    return linear


def test_the_e2m1_table_reads_every_code_and_each_nibble_in_order():
    assert E2M1_VALUES.tolist()[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E2M1_VALUES.tolist()[8:] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert unpack_e2m1(torch.tensor([[0x71, 0xF8]], dtype=torch.uint8)).tolist() == [[0.5, 6.0, -0.0, -6.0]]


@settings(max_examples=60, deadline=None)
@given(
    split=st.sampled_from([Split(0), Split(0, heads=3), Split(1), Split(1, heads=2), Split(1, heads=12)]),
    world=st.integers(1, 4),
    groups_per_row=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_a_rank_s_dequantized_bytes_are_its_shard_of_the_dequantized_weight(split, world, groups_per_row, seed):
    """``heads=12`` over 96 features: 4 bytes a head, so cuts fall inside 8-byte groups."""
    in_features = GROUP * groups_per_row * 2 * world
    if split == Split(1, heads=12):
        in_features = 96
    out_features = 3 * 4 * world if split.heads else 5 * world + 1
    packed, scales, global_scale, whole = nvfp4(out_features, in_features, seed)
    value_split = split if split.dim == 0 else split._replace(heads=split.heads or in_features // 2)
    for rank in range(world):
        shard = layer(packed, scales, global_scale, split, rank, world).dequantized(torch.bfloat16)
        assert torch.equal(shard, value_split.shard(whole, rank, world))


def test_the_whole_weight_is_compressed_tensors_decompression_bit_for_bit():
    nvfp4_compressor = pytest.importorskip("compressed_tensors.compressors.nvfp4")
    from compressed_tensors.quantization import preset_name_to_scheme

    packed, scales, global_scale, whole = nvfp4(24, 128, seed=3)
    stored = {"weight_packed": packed, "weight_scale": scales, "weight_global_scale": global_scale}
    expected = nvfp4_compressor.NVFP4PackedCompressor.decompress(stored, preset_name_to_scheme("NVFP4A16", ["Linear"]))
    got = layer(packed, scales, global_scale, None, 0, 1).dequantized(torch.bfloat16)
    assert got.dtype == expected["weight"].dtype and torch.equal(got, expected["weight"])
    assert torch.equal(got, whole)


@pytest.mark.parametrize("style", ["column", "row"])
def test_nvfp4_linear_shards_sum_to_the_dequantized_linear(style):
    """Column pieces concatenate and row partial sums (cuts inside groups: 96 features, 4-byte heads at 3 ranks) add
    up to the whole layer's product."""
    world = 3
    packed, scales, global_scale, whole = nvfp4(12, 96, seed=4)
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(5))
    expected = F.linear(x, whole.float())
    split = Split(0) if style == "column" else Split(1, heads=12)
    outputs = []
    for rank in range(world):
        linear = layer(packed, scales, global_scale, split, rank, world)
        piece = x if style == "column" else Split(-1, heads=12).shard(x, rank, world)
        outputs.append(linear(piece))
    got = torch.cat(outputs, dim=-1) if style == "column" else sum(outputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))  # sums reordered


def test_holding_refuses_what_does_not_fit_its_groups():
    with pytest.raises(ValueError, match="24 input features are not whole bytes of 2 values and groups of 16"):
        NVFP4Linear.hold_fp4(nn.Linear(24, 4, device="meta"), GROUP, (4, 1), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"has \(4, 2\) scales, not \(4, 3\)"):
        NVFP4Linear.hold_fp4(nn.Linear(32, 4, device="meta"), GROUP, (4, 3), torch.float8_e4m3fn)
