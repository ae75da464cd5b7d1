""":class:`tpcore.parallel.four_bit_linear.FourBitLinear`: the whole layer computes what bitsandbytes' ``Linear4bit``
computes through its dequantizing product, bit for bit (NF4 and FP4, nested scales or not, float32 or bfloat16
compute); column pieces concatenate to it and row-parallel ranks over threads sum to it, cuts inside blocks
included, each rank's nested scales made from its own codes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.four_bit_linear import FourBitLinear, RowParallelFourBitLinear
from tpcore.parallel.threads import ThreadGroup, run_ranks

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes quantizes the weights")

OUT, IN = 20, 192  # 3 blocks of 64 a row: a cut at 2 or 3 ranks falls inside a block


def quantized(kind: str, nested: bool, seed: int = 1):
    """A random weight quantized by bitsandbytes: the packed codes, its quantization state and a bias."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT, IN, generator=generator)
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, quant_type=kind, compress_statistics=nested)
    return packed, state, torch.randn(OUT, generator=generator)


def layer(packed, state, bias, compute_dtype=None, split: Split | None = None, rank: int = 0, world: int = 1):
    """A :class:`FourBitLinear` holding rank ``rank``'s part of ``packed`` as the plan would give it."""
    linear = nn.Linear(IN, OUT, device="meta")
    nested = state.state2 if state.nested else None
    FourBitLinear.hold(
        linear,
        state.quant_type,
        64,
        compute_dtype,
        None if nested is None else nested.absmax.numel(),
        float(state.offset or 0),
    )
    rows = split is not None and split.dim == 0
    codes, absmax = packed.view(OUT, -1), state.absmax.view(OUT, -1)
    linear.weight = nn.Parameter(codes if split is None else split.shard(codes, rank, world), False)
    linear.absmax = nn.Parameter(Split(0).shard(absmax, rank, world) if rows else absmax, False)
    linear.code = nn.Parameter(state.code, False)
    if nested is not None:
        linear.nested_absmax, linear.nested_code = nn.Parameter(nested.absmax, False), nn.Parameter(nested.code, False)
    linear.bias = nn.Parameter(Split(0).shard(bias, rank, world) if rows else bias, False)
    linear.cuts = {} if split is None else ({"weight": split, "absmax": split} if rows else {"weight": split})
    linear.localize(rank, world)
    return linear


def inputs(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(2, 5, IN, generator=torch.Generator().manual_seed(7)).to(dtype)


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["scales", "nested-scales"])
@pytest.mark.parametrize(("dtype", "compute_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                      (torch.bfloat16, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("dequantize", ["bitsandbytes-kernel", "torch-lookup"])
def test_the_whole_layer_is_bitsandbytes_linear4bit_bit_for_bit(
    kind, nested, dtype, compute_dtype, dequantize, monkeypatch
):
    """Against ``Linear4bit``'s dequantizing product (its fused bfloat16 CPU kernel, used on AVX-512-BF16 CPUs after
    a first forward, is turned off: it rounds the input to bfloat16 whatever the compute dtype), dequantized by
    bitsandbytes' kernel or, as where bitsandbytes is not installed, by torch's lookup."""
    if dequantize == "torch-lookup":
        monkeypatch.setattr("tpcore.parallel.four_bit_linear._bitsandbytes_dequantize", lambda: None)
    packed, state, bias = quantized(kind, nested)
    reference = bnb.nn.Linear4bit(IN, OUT, compute_dtype=compute_dtype, quant_type=kind)
    reference.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, bnb_quantized=True)
    reference.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    reference.support_avx512bf16_for_cpu = False
    x = inputs(dtype)
    with torch.no_grad():
        expected = reference.eval()(x)
    got = layer(packed, state, bias.to(dtype), compute_dtype)(x)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("nested", [False, True], ids=["scales", "nested-scales"])
def test_column_pieces_concatenate_to_the_whole_layer(world, nested):
    packed, state, bias = quantized("nf4", nested)
    x = inputs()
    expected = layer(packed, state, bias)(x)
    pieces = [layer(packed, state, bias, None, Split(0), rank, world)(x) for rank in range(world)]
    # the same weights and inputs; a product of fewer rows may sum in another order
    torch.testing.assert_close(torch.cat(pieces, dim=-1), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("nested", [False, True], ids=["scales", "nested-scales"])
def test_row_parallel_ranks_sum_to_the_whole_layer(world, nested):
    """Each rank's bytes (96 or 64 or 48 values: a cut inside a block at 2 and 4 ranks) with the block scales of its
    own values; the partial products all-reduced."""
    packed, state, bias = quantized("fp4", nested)
    x = inputs()
    expected = layer(packed, state, bias)(x)
    group = ThreadGroup(world)

    def rank_output(rank: int) -> torch.Tensor:
        ours = layer(packed, state, bias, None, Split(1), rank, world)
        ours.__class__, ours.tp_group = RowParallelFourBitLinear, group
        return ours(Split(-1).shard(x, rank, world))

    for got in run_ranks(group, rank_output):  # sums of 192 products near 10 in float32, in another order
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_blocks_that_cross_rows_are_refused():
    with pytest.raises(ValueError, match="160 input features are not whole blocks of 64"):
        FourBitLinear.hold(nn.Linear(160, 8, device="meta"), "nf4", 64, None)
