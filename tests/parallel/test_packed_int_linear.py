"""Property tests of :class:`tpcore.parallel.packed_int_linear.PackedIntLinear`: a rank's dequantized shard, made
from its own int32 words and its scales, is the shard of the whole dequantized weight, exactly, for any bit width,
group size, cut (of rows, or of words inside a group or not) and world size; and the whole layer's weight is
compressed-tensors' own decompression, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.packed_int_linear import PackedIntLinear, unpack_words
from tpcore.parallel.quantized_linear import localize_quantized, ready_quantized

FAST = settings(max_examples=60, deadline=None)


def packed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words of unsigned ``bits``-bit fields ``values + 2^(bits-1)``, value ``j`` at bit ``j bits`` of its row:
    the layout written independently of :func:`unpack_words`, by integer arithmetic."""
    per_word = 32 // bits
    fields = (values.long() + 2 ** (bits - 1)).view(values.shape[0], -1, per_word)
    words = (fields << (torch.arange(per_word) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def packed_rows(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit ``fields (rows, columns)`` packed along the rows, as compressed-tensors packs zero points:
    ``(ceil(rows / p), columns)`` words, the rows padded with zeros."""
    per_word = 32 // bits
    padded = torch.cat([fields, fields.new_zeros(-fields.shape[0] % per_word, fields.shape[1])])
    return packed(padded.T.long() - 2 ** (bits - 1), bits).T.contiguous()


def layer(
    words: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group: int,
    split: Split | None,
    rank: int,
    world: int,
    zeros: torch.Tensor | None = None,
):
    """Rank ``rank``'s layer of ``world``: its words (and scale rows where the rows are cut) under ``split``; with
    packed ``zeros``, those too, cut with the rows where the layer says they follow, else whole."""
    out_features, in_features = words.shape[0], words.shape[1] * 32 // bits
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    PackedIntLinear.hold(linear, bits, group, tuple(scales.shape), scales.dtype, zero_points=zeros is not None)
    linear.weight_packed = nn.Parameter(
        words if split is None else split.shard(words, rank, world), requires_grad=False
    )
    linear.weight = linear.weight_packed
    own_scales = scales if split is None or split.dim == 1 else split.shard(scales, rank, world)
    linear.weight_scale = nn.Parameter(own_scales, requires_grad=False)
    linear.cuts = {} if split is None else {"weight_packed": split.resolved(2)}
    if zeros is not None:
        assert linear.weight_zero_point.shape == zeros.shape
        follows = split is not None and "weight_zero_point" in linear.follower_cuts(split.resolved(2))
        linear.weight_zero_point = nn.Parameter(
            split.shard(zeros, rank, world) if follows else zeros, requires_grad=False
        )
        if follows:
            linear.cuts["weight_zero_point"] = split.resolved(2)
    localize_quantized(linear, rank, world)
    ready_quantized(linear)
    return linear


def quantized(out_features: int, in_features: int, bits: int, group: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (out_features, in_features), generator=generator)
    scales = torch.rand(out_features, in_features // group, generator=generator) + 0.01
    whole = values.float() * scales.repeat_interleave(group, dim=1)
    return packed(values, bits), scales, whole


@FAST
@given(
    bits=st.sampled_from([2, 4, 8]),
    split=st.sampled_from([Split(0), Split(0, heads=3), Split(0, parts=(4, 2, 2)), Split(1), Split(1, heads=2)]),
    world=st.integers(1, 4),
    groups_per_row=st.integers(1, 3),
    words_per_group=st.sampled_from([0.5, 1, 2]),
    seed=st.integers(0, 2**16),
)
def test_a_rank_s_dequantized_words_are_its_shard_of_the_dequantized_weight(
    bits, split, world, groups_per_row, words_per_group, seed
):
    per_word = 32 // bits
    group = max(1, int(per_word * words_per_group))
    in_features = group * groups_per_row * 2 * world * (1 if group % per_word == 0 else per_word)
    out_features = 8 * world + 3 if split == Split(0) else 24 * world
    words, scales, whole = quantized(out_features, in_features, bits, group, seed)
    pieces = []
    for rank in range(world):
        shard = layer(words, scales, bits, group, split, rank, world).dequantized(torch.float32)
        expected_cols = split.shard(words, rank, world).shape[1] * per_word
        assert shard.shape[1] == expected_cols
        pieces.append(shard)
    # the words' cut, in values: rank r's words [a, b) are values [a p, b p)
    value_split = split if split.dim == 0 else split._replace(heads=(split.heads or in_features // per_word))
    for rank, piece in enumerate(pieces):
        assert torch.equal(piece, value_split.shard(whole, rank, world))


@FAST
@given(
    bits=st.sampled_from([2, 4, 8]),
    split=st.sampled_from([None, Split(0), Split(0, heads=3), Split(0, parts=(4, 2, 2)), Split(1), Split(1, heads=2)]),
    world=st.integers(1, 4),
    out_features=st.integers(1, 40),
    groups_per_row=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_with_zero_points_a_rank_s_words_are_its_shard_of_the_dequantized_weight(
    bits, split, world, out_features, groups_per_row, seed
):
    """Asymmetric words ``(u - z) s``: the zero points packed along the rows (padded to whole words), cut with the
    rows where every unit is whole words of them (``heads=3`` of 8-row heads at 4 bits), else whole on every rank;
    each rank's dequantized words are its shard of the whole dequantized weight."""
    per_word, group, out_features = 32 // bits, 32, max(out_features, world)
    if split is not None and split.dim == 0 and (split.heads or split.parts):
        out_features = 8 * sum(split.parts or (split.heads,))
    in_features = group * groups_per_row * 2 * world
    generator = torch.Generator().manual_seed(seed)
    fields = torch.randint(0, 2**bits, (out_features, in_features), generator=generator)
    zeros = torch.randint(0, 2**bits, (out_features, groups_per_row * 2 * world), generator=generator)
    scales = torch.rand(zeros.shape, generator=generator) + 0.01
    whole = (fields - zeros.repeat_interleave(group, dim=1)).float() * scales.repeat_interleave(group, dim=1)
    words, zero_words = packed(fields - 2 ** (bits - 1), bits), packed_rows(zeros, bits)
    follows = split == Split(0, heads=3) and bits >= 4
    for rank in range(world):
        linear = layer(words, scales, bits, group, split, rank, world, zero_words)
        assert ("weight_zero_point" in linear.cuts) == follows
        value_split = (
            split if split is None or split.dim == 0 else split._replace(heads=split.heads or in_features // per_word)
        )
        expected = whole if value_split is None else value_split.shard(whole, rank, world)
        assert torch.equal(linear.dequantized(torch.float32), expected)


@pytest.mark.parametrize("group", [32, 64])
def test_with_zero_points_the_whole_weight_is_compressed_tensors_decompression_bit_for_bit(group):
    """compressed-tensors' own packing of asymmetric int4 (zero points packed along the rows, 20 rows: padded) and its
    decompression, in bfloat16; and the int4 product's result within bfloat16's rounding of it."""
    pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    generator = torch.Generator().manual_seed(8)
    q = torch.randint(-8, 8, (20, 128), generator=generator, dtype=torch.int8)
    zero_point = torch.randint(-8, 8, (20, 128 // group), generator=generator, dtype=torch.int8)
    scales = (torch.rand(20, 128 // group, generator=generator) + 0.01).bfloat16()
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    stored = {"weight_packed": pack.pack_to_int32(q, 4), "weight_scale": scales,
              "weight_zero_point": pack.pack_to_int32(zero_point, 4, packed_dim=0),
              "weight_shape": torch.tensor(q.shape)}  # fmt: skip
    expected = pack.PackedQuantizationCompressor.decompress(stored, scheme)["weight"]
    linear = layer(stored["weight_packed"], scales, 4, group, None, 0, 1, stored["weight_zero_point"])
    assert linear.int4 is not None  # bfloat16 scales, groups the product takes
    got = linear.dequantized(torch.bfloat16)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    x = torch.randn(3, 128, generator=generator).bfloat16()
    reference = x.float() @ expected.float().T
    torch.testing.assert_close(linear(x).float(), reference, rtol=2**-7, atol=2e-2 * reference.abs().max())


@pytest.mark.parametrize("style", ["column", "row"])
def test_packed_int_linear_shards_sum_to_the_dequantized_linear(style):
    """Column pieces concatenate and row partial sums (a cut inside a group: 3 words at 3 ranks of 4-word groups)
    add up to the whole layer."""
    bits, group, world = 4, 32, 3
    words, scales, whole = quantized(12, 96, bits, group, seed=5)
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(6))
    expected = F.linear(x, whole)
    split = Split(0) if style == "column" else Split(1)
    outputs = []
    for rank in range(world):
        linear = layer(words, scales, bits, group, split, rank, world)
        piece = x if style == "column" else Split(-1, heads=12).shard(x, rank, world)
        outputs.append(linear(piece))
    got = torch.cat(outputs, dim=-1) if style == "column" else sum(outputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 64), (4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_whole_layer_s_weight_is_compressed_tensors_decompression_bit_for_bit(bits, group, dtype):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    from compressed_tensors.quantization import QuantizationArgs

    generator = torch.Generator().manual_seed(7)
    q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (16, 128), generator=generator, dtype=torch.int8)
    scales = (torch.rand(16, 128 // group, generator=generator) + 0.01).to(dtype)
    words = helpers.pack_to_int32(q, bits)
    assert torch.equal(words, packed(q, bits))
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group)
    expected = forward.dequantize(helpers.unpack_from_int32(words, bits, q.shape), scales, None, args)
    got = layer(words, scales, bits, group, None, 0, 1).dequantized(dtype)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_unpacking_reads_every_field_of_a_word_in_order():
    assert unpack_words(torch.tensor([[0x76543210]], dtype=torch.int32), 4).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unpack_words(torch.tensor([[-1]], dtype=torch.int32), 8).tolist() == [[255, 255, 255, 255]]


@pytest.mark.parametrize(
    ("bits", "in_features", "scale_shape", "message"),
    [
        (3, 96, (4, 3), "3-bit values straddle bytes"),
        (4, 12, (4, 1), "12 input features are not whole words of 8 values"),
        (4, 96, (4, 2), r"has \(4, 3\) scales, not \(4, 2\)"),
    ],
)
def test_holding_refuses_what_does_not_pack(bits, in_features, scale_shape, message):
    linear = nn.Linear(in_features, 4, device="meta")
    with pytest.raises(ValueError, match=message):
        PackedIntLinear.hold(linear, bits, 32 if in_features > 12 else 12, scale_shape, torch.float32)


@FAST
@given(
    split=st.sampled_from([None, Split(0, heads=3), Split(0, parts=(4, 2, 2)), Split(1), Split(1, heads=2)]),
    world=st.integers(1, 3),
    group=st.sampled_from([32, 64, 96]),
    groups_per_row=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_in_bfloat16_a_rank_computes_4_bit_words_with_the_int4_product(split, world, group, groups_per_row, seed):
    """bfloat16 scales (a bfloat16 model): the rank's codes laid out for torch's CPU int4 product in place of its words
    (cut inside a group or not), its product ``x @ (q s).T`` with ``q s`` exact, rounded once to bfloat16; and the
    words read back as stored."""
    world = 1 if split is None else world
    in_features = group * groups_per_row * 2 * world
    words, scales, whole = quantized(24 * world, in_features, 4, group, seed)
    scales = scales.bfloat16()
    whole = unpack_words(words, 4).float().sub(8) * scales.float().repeat_interleave(group, dim=1)
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(seed)).bfloat16()
    for rank in range(world):
        linear = layer(words, scales, 4, group, split, rank, world)
        assert linear.int4 is not None and linear.weight_packed.numel() == 0
        own_words = words if split is None else split.shard(words, rank, world)
        assert torch.equal(linear.as_stored("weight_packed"), own_words)
        value_split = (
            split if split is None or split.dim == 0 else split._replace(heads=split.heads or in_features // 8)
        )
        own = whole if value_split is None else value_split.shard(whole, rank, world)
        columns = x if split is None or split.dim == 0 else value_split._replace(dim=-1).shard(x, rank, world)
        expected = columns.float() @ own.T
        torch.testing.assert_close(linear(columns).float(), expected, rtol=2**-8, atol=1e-3 * expected.abs().max())
