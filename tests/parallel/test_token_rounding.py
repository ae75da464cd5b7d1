"""Per-token input rounding (:mod:`tpcore.parallel.token_rounding`, compressed-tensors' ``FP8_DYNAMIC`` and ``W8A8``):
each token's input rounded through e4m3 or int8 as compressed-tensors rounds it, bit for bit, and a row-parallel rank
of :class:`~tpcore.parallel.quantized_linear.TokenFP8Linear`, holding some of the token's features, rounds them with
the scale of the whole token (the maximum gathered from every rank)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.quantized_linear import (
    GroupFP8Linear,
    RowParallelGroupFP8Linear,
    RowParallelTokenFP8Linear,
    TokenFP8Linear,
)
from tpcore.parallel.token_rounding import rounded_per_token


def layer(in_features: int = 12, cls: type = TokenFP8Linear) -> TokenFP8Linear:
    linear = nn.Linear(in_features, 4, device="meta")
    held = TokenFP8Linear.hold_rows(linear, torch.float32)
    held.__class__ = cls
    return held


def inputs(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    x[0, 1] = 0  # a token of zeros: the machine epsilon as its scale
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("preset", "values"), [("FP8_DYNAMIC", "e4m3"), ("W8A8", "int8")])
def test_a_token_is_rounded_as_compressed_tensors_rounds_it(dtype, preset, values):
    forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = preset_name_to_scheme(preset, ["Linear"]).input_activations
    x = inputs(dtype)
    scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=nn.Linear(12, 4))
    expected = forward.fake_quantize(x, scale, zero_point, args)
    got = rounded_per_token(x, x.abs().amax(-1, keepdim=True), values)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_a_row_parallel_rank_rounds_its_features_with_the_whole_token_s_scale(monkeypatch):
    world, x = 3, inputs()
    whole = layer().quantized_input(x)
    pieces = [Split(-1).shard(x, rank, world) for rank in range(world)]
    maxima = torch.cat([piece.abs().amax(-1, keepdim=True) for piece in pieces], dim=-1)
    monkeypatch.setattr("tpcore.parallel.token_rounding.all_gather", lambda tensor, group: maxima)
    for rank, piece in enumerate(pieces):
        got = layer(cls=RowParallelTokenFP8Linear).quantized_input(piece)
        assert torch.equal(got, Split(-1).shard(whole, rank, world))


def group_layer(rank: int, world: int, cut: Split | None, cls: type = GroupFP8Linear) -> GroupFP8Linear:
    """A 12-feature ``FP8_BLOCK`` layer of 4 x 4 blocks (3 input groups) as rank ``rank`` of ``world`` holds it,
    its input features cut by ``cut`` (``None``: whole)."""
    held = GroupFP8Linear.hold_blocks(nn.Linear(12, 4, device="meta"), (4, 4), (1, 3), torch.float32)
    held.to_empty(device="cpu")  # its block indices on the inputs' device
    held.__class__ = cls
    held.cuts = {} if cut is None else {"weight": cut}
    held.localize(rank, world)
    return held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_s_groups_are_rounded_as_compressed_tensors_rounds_them(dtype):
    """FP8_BLOCK's inputs: a scale per token and group of 4 features, bit for bit compressed-tensors' own."""
    forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).input_activations.model_copy(update={"group_size": 4})
    x = inputs(dtype)
    x[1, 2, 4:8] = 0  # a group of zeros
    scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=nn.Linear(12, 4))
    expected = forward.fake_quantize(x, scale, zero_point, args)
    got = group_layer(0, 1, None).quantized_input(x)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_a_row_parallel_rank_rounds_its_features_with_their_whole_groups_scales(monkeypatch):
    """4 heads of 3 features dealt 2, 1, 1 over 3 ranks (features 0-5 | 6-8 | 9-11: cuts inside the second and third
    groups of 4): each rank's features rounded with the maxima of their whole groups, the other ranks' parts of a
    group gathered."""
    world, x, cut = 3, inputs(), Split(-1, heads=4)
    whole = group_layer(0, 1, None).quantized_input(x)
    local = [group_layer(rank, world, cut, RowParallelGroupFP8Linear) for rank in range(world)]
    pieces = [cut.shard(x, rank, world) for rank in range(world)]
    assert [piece.shape[-1] for piece in pieces] == [6, 3, 3]
    maxima = [GroupFP8Linear.group_maxima(layer_, piece) for layer_, piece in zip(local, pieces, strict=True)]
    monkeypatch.setattr("tpcore.parallel.token_rounding.all_gather", lambda tensor, group: torch.cat(maxima, -1))
    for rank, piece in enumerate(pieces):
        assert torch.equal(local[rank].quantized_input(piece), cut.shard(whole, rank, world))
