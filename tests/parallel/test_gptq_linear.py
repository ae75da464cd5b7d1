""":class:`tpcore.parallel.gptq_linear.GPTQLinear`: the whole layer computes what GPTQModel's torch kernel computes,
bit for bit (2-, 4- and 8-bit values, asymmetric zero points, act-order ``g_idx``, v1 and v2 zero points); column
pieces concatenate to it bit for bit, and row-parallel ranks over threads sum to it, cuts inside groups included.
With torch's CPU int4 product (``int4_kernel``), the whole layer is GPTQModel's default CPU kernel bit for bit, and a
rank still gives back its words as stored."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.gptq_linear import AWQLinear, GPTQLinear, RowParallelAWQLinear, RowParallelGPTQLinear
from tpcore.parallel.int4pack import int4pack_available
from tpcore.parallel.packed_int_linear import unpack_words
from tpcore.parallel.threads import ThreadGroup, run_ranks

pytest.importorskip("gptqmodel", reason="GPTQModel packs the weights and computes the reference")
from gptqmodel.nn_modules.qlinear.torch import TorchLinear  # noqa: E402

OUT, IN, GROUP = 40, 96, 32  # 3 groups of 32: a cut at 2 ranks falls inside one


def quantized(bits: int, act_order: bool, seed: int = 1, out: int = OUT) -> TorchLinear:
    """A random float16 weight and bias packed by GPTQModel (asymmetric min-max groups), ready to compute."""
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(IN, out).half()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out, IN, generator=generator) / 10)
        linear.bias.copy_(torch.randn(out, generator=generator))
    order = torch.randperm(IN, generator=generator) if act_order else torch.arange(IN)
    g_idx = torch.empty(IN, dtype=torch.int32)
    g_idx[order] = torch.arange(IN, dtype=torch.int32) // GROUP
    weight, top = linear.weight.float(), 2**bits - 1
    low = torch.stack([weight[:, g_idx == g].amin(1).clamp(max=0) for g in range(IN // GROUP)], 1)
    high = torch.stack([weight[:, g_idx == g].amax(1).clamp(min=0) for g in range(IN // GROUP)], 1)
    scales = (high - low) / top
    zeros = (-low / scales).round().clamp(0, top).to(torch.int32)
    packed = TorchLinear(bits, GROUP, False, act_order, IN, out, bias=True)
    packed.pack_original(linear, scales.half(), zeros, g_idx)
    packed.optimized = True  # its eager dequantization, not torch.compile's
    packed.post_init()
    return packed.eval()


def layer(
    packed: TorchLinear,
    split: Split | None = None,
    rank: int = 0,
    world: int = 1,
    v1: bool = False,
    follow: bool = True,
    int4: bool = False,
    out: int = OUT,
):
    """A :class:`GPTQLinear` holding rank ``rank``'s part of ``packed``'s tensors as the plan would give it: the
    tensors its :meth:`~GPTQLinear.follower_cuts` name cut with the weight (``follow=False``: the scales of a column
    cut alone, the rank picking its zero points and groups from whole tensors); ``v1``: its zero points stored as GPTQ
    v1 stores them, less one; ``int4``: computing with torch's CPU int4 product."""
    linear = GPTQLinear.hold(nn.Linear(IN, out, device="meta"), packed.bits, GROUP, torch.float16, int(v1))
    linear.int4_kernel = int4
    qzeros = packed.qzeros - 0x11111111 if v1 else packed.qzeros  # 4-bit fields
    tensors = {"qweight": packed.qweight, "qzeros": qzeros, "scales": packed.scales, "g_idx": packed.g_idx}
    cuts = {}
    if split is not None:
        followers = linear.follower_cuts(split) if follow else {"scales": split} if split.dim == 1 else {}
        cuts = {"qweight": split, **followers}
    for name, tensor in tensors.items():
        setattr(linear, name, nn.Parameter(cuts[name].shard(tensor, rank, world) if name in cuts else tensor, False))
    linear.weight = linear.qweight
    bias = packed.bias.to(torch.float16)
    columns = split is not None and split.dim == 1
    linear.bias = nn.Parameter(Split(0, heads=out // 8).shard(bias, rank, world) if columns else bias, False)
    linear.cuts = cuts
    linear.localize(rank, world)
    linear.ready()
    return linear


def inputs(dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(2, 5, IN, generator=torch.Generator().manual_seed(7)).to(dtype)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("act_order", [False, True], ids=["sorted-groups", "act-order"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_whole_layer_is_gptqmodels_torch_kernel_bit_for_bit(bits, act_order, dtype):
    packed = quantized(bits, act_order)
    x = inputs(dtype)
    with torch.no_grad():
        expected = packed(x)
    got = layer(packed)(x)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)


def test_v1_zero_points_are_read_one_less():
    packed = quantized(4, False)
    assert unpack_words(packed.qzeros, 4).min() >= 1  # so that one less is a field less one, no borrow
    x = inputs()
    assert torch.equal(layer(packed, v1=True)(x), layer(packed)(x))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("act_order", [False, True], ids=["sorted-groups", "act-order"])
@pytest.mark.parametrize("follow", [True, False], ids=["zeros-cut", "zeros-picked"])
def test_column_pieces_concatenate_to_the_whole_layer(world, act_order, follow):
    """Output features dealt in runs of 8 (a word of zero points), the scales with them, the zero points cut in
    words or picked from whole ones."""
    packed = quantized(4, act_order)
    x = inputs()
    expected = layer(packed)(x)
    pieces = [layer(packed, Split(1, heads=OUT // 8), rank, world, follow=follow)(x) for rank in range(world)]
    assert torch.equal(torch.cat(pieces, dim=-1), expected)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("act_order", [False, True], ids=["sorted-groups", "act-order"])
@pytest.mark.parametrize("follow", [True, False], ids=["g_idx-cut", "g_idx-picked"])
def test_row_parallel_ranks_sum_to_the_whole_layer(world, act_order, follow):
    """Each rank's words (48, 32 or 24 input features: a cut inside a group at 2 and 4 ranks), each row's group
    from ``g_idx`` (cut with the words, or picked from the whole); the float16 partial products summed in float32
    and rounded once."""
    packed = quantized(4, act_order)
    x = inputs()
    expected = layer(packed)(x)
    group = ThreadGroup(world)

    def rank_output(rank: int) -> torch.Tensor:
        ours = layer(packed, Split(0, heads=IN // 8), rank, world, follow=follow)
        ours.__class__, ours.tp_group = RowParallelGPTQLinear, group
        rows = Split(-1, heads=IN // 8)
        return ours(rows.shard(x, rank, world))

    for got in run_ranks(group, rank_output):  # one rounding of a float32 sum in another order: at most an ulp
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=2e-3)


def test_bit_widths_that_straddle_words_and_partial_words_are_refused():
    with pytest.raises(ValueError, match="3-bit values straddle int32 words"):
        GPTQLinear.hold(nn.Linear(96, 8, device="meta"), 3, 32, torch.float16)
    with pytest.raises(ValueError, match="100 input features are not whole words of 8 values"):
        GPTQLinear.hold(nn.Linear(100, 8, device="meta"), 4, 32, torch.float16)


# -- AWQ ------------------------------------------------------------------------------------------------------


def awq_quantized(seed: int = 1, out: int = OUT):
    """A random float16 weight and bias packed by GPTQModel's AWQ packer (GEMM layout, min-max groups)."""
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear

    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(IN, out).half()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out, IN, generator=generator) / 10)
        linear.bias.copy_(torch.randn(out, generator=generator))
    groups = linear.weight.float().view(out, -1, GROUP)
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scales = (high - low) / 15
    packed = AwqTorchLinear(bits=4, group_size=GROUP, sym=False, desc_act=False, in_features=IN, out_features=out,
                            bias=True)  # fmt: skip
    packed.pack(linear, scales.half(), (-low / scales).round().clamp(0, 15).to(torch.int32))
    packed.post_init()
    return packed.eval()


def awq_layer(
    packed, split: Split | None = None, rank: int = 0, world: int = 1, int4: bool = False, out: int = OUT
) -> AWQLinear:
    """An :class:`AWQLinear` holding rank ``rank``'s part of ``packed``'s tensors as the plan would give it."""
    linear = AWQLinear.hold_awq(nn.Linear(IN, out, device="meta"), GROUP, torch.float16)
    linear.int4_kernel = int4
    cuts = {} if split is None else {"qweight": split, **linear.follower_cuts(split)}
    for name in ("qweight", "qzeros", "scales"):
        tensor = getattr(packed, name)
        setattr(linear, name, nn.Parameter(cuts[name].shard(tensor, rank, world) if name in cuts else tensor, False))
    linear.weight = linear.qweight
    columns = split is not None and split.dim == 1
    linear.bias = nn.Parameter(Split(0, heads=out // 8).shard(packed.bias, rank, world) if columns else packed.bias,
                               False)  # fmt: skip
    linear.cuts = cuts
    linear.localize(rank, world)
    linear.ready()
    return linear


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_whole_awq_layer_is_gptqmodels_awq_torch_kernel_bit_for_bit(dtype):
    packed = awq_quantized()
    ours = awq_layer(packed)  # first: GPTQModel's forward rounds its own scales to the input's dtype in place
    x = inputs(dtype)
    with torch.no_grad():
        expected = packed(x)
    assert packed.scales.dtype == (torch.float16 if dtype == torch.float32 else dtype)
    got = ours(x)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("world", [2, 3])
def test_awq_column_pieces_concatenate_to_the_whole_layer(world):
    """Whole words of 8 output features (their order inside the word undone), the scales and zero points with
    them."""
    packed = awq_quantized()
    x = inputs()
    expected = awq_layer(packed)(x)
    pieces = [awq_layer(packed, Split(1, heads=OUT // 8), rank, world)(x) for rank in range(world)]
    assert torch.equal(torch.cat(pieces, dim=-1), expected)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_awq_row_parallel_ranks_sum_to_the_whole_layer(world):
    """Input features in runs of 8 (48, 32 or 24: a cut inside a group at 2 and 4 ranks), each row's group found
    from its index; float32 partial sums, rounded once."""
    packed = awq_quantized()
    x = inputs()
    expected = awq_layer(packed)(x)
    group = ThreadGroup(world)

    def rank_output(rank: int) -> torch.Tensor:
        ours = awq_layer(packed, Split(0, heads=IN // 8), rank, world)
        ours.__class__, ours.tp_group = RowParallelAWQLinear, group
        return ours(Split(-1, heads=IN // 8).shard(x, rank, world))

    for got in run_ranks(group, rank_output):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=2e-3)


def test_awq_layouts_that_are_no_whole_words_or_groups_are_refused():
    with pytest.raises(ValueError, match="44 output features are not whole words of 8"):
        AWQLinear.hold_awq(nn.Linear(96, 44, device="meta"), 32, torch.float16)
    with pytest.raises(ValueError, match="80 input features are not whole groups of 32"):
        AWQLinear.hold_awq(nn.Linear(80, 8, device="meta"), 32, torch.float16)


# -- torch's CPU int4 product ---------------------------------------------------------------------------------


#: output features GPTQModel's default CPU kernel takes (a multiple of 16; tpcore pads others)
KERNEL_OUT = 48


def default_kernel(packed, kernel_class: str = "TorchAtenLinear"):
    """GPTQModel's default CPU kernel holding ``packed``'s tensors (it repacks them in its first forward)."""
    from gptqmodel.nn_modules.qlinear import torch_aten_kernel, torch_aten_kernel_awq

    module = torch_aten_kernel if kernel_class == "TorchAtenLinear" else torch_aten_kernel_awq
    kernel = getattr(module, kernel_class)(4, GROUP, False, packed.desc_act, IN, KERNEL_OUT, bias=True)
    for name, tensor in packed.state_dict().items():
        getattr(kernel, name).data = tensor.clone()
    kernel.post_init()
    return kernel.eval()


@pytest.mark.parametrize("act_order", [False, True], ids=["sorted-groups", "act-order"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_with_the_int4_product_the_whole_layer_is_gptqmodels_default_cpu_kernel_bit_for_bit(act_order, dtype):
    packed = quantized(4, act_order, out=KERNEL_OUT)
    ours = layer(packed, int4=True, out=KERNEL_OUT)
    assert ours.int4 is not None and ours.qweight.numel() == 0  # the kernel's copy in place of the words
    x = inputs(dtype)
    with torch.no_grad():
        expected = default_kernel(packed)(x)
    got = ours(x)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_with_the_int4_product_the_whole_awq_layer_is_gptqmodels_default_cpu_kernel_bit_for_bit(dtype):
    packed = awq_quantized(out=KERNEL_OUT)
    x = inputs(dtype)
    with torch.no_grad():
        expected = default_kernel(packed, "TorchAtenAwqLinear")(x)
    assert torch.equal(awq_layer(packed, int4=True, out=KERNEL_OUT)(x), expected)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("act_order", [False, True], ids=["sorted-groups", "act-order"])
def test_with_the_int4_product_column_pieces_concatenate_to_the_whole_layer(world, act_order):
    packed = quantized(4, act_order)
    x = inputs()
    expected = layer(packed, int4=True)(x)
    pieces = [layer(packed, Split(1, heads=OUT // 8), rank, world, int4=True)(x) for rank in range(world)]
    assert torch.equal(torch.cat(pieces, dim=-1), expected)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("act_order", [False, True], ids=["sorted-groups", "act-order"])
def test_with_the_int4_product_row_parallel_ranks_sum_to_the_whole_layer(world, act_order):
    """A rank's rows laid out group by group (a group cut by two ranks, act-order rows in any order): its bfloat16
    partial products summed in float32 and rounded once, within a bfloat16 rounding of each partial."""
    packed = quantized(4, act_order)
    x = inputs(torch.bfloat16)
    expected = layer(packed, int4=True)(x)
    group = ThreadGroup(world)

    def rank_output(rank: int) -> torch.Tensor:
        ours = layer(packed, Split(0, heads=IN // 8), rank, world, int4=True)
        ours.__class__, ours.tp_group = RowParallelGPTQLinear, group
        return ours(Split(-1, heads=IN // 8).shard(x, rank, world))

    for got in run_ranks(group, rank_output):
        torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=world * 2**-8 * expected.abs().max().item())


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dim", [0, 1], ids=["rows", "columns"])
@pytest.mark.parametrize("form", ["gptq", "awq"])
def test_a_rank_computing_with_the_int4_product_gives_back_its_words_as_stored(world, dim, form):
    packed = quantized(4, act_order=True) if form == "gptq" else awq_quantized()
    make = layer if form == "gptq" else awq_layer
    split = None if world == 1 else Split(dim, heads=(IN if dim == 0 else OUT) // 8)
    for rank in range(world):
        plain, ours = make(packed, split, rank, world), make(packed, split, rank, world, int4=True)
        assert ours.int4 is not None
        assert torch.equal(ours.as_stored("qweight"), plain.qweight)
        assert ours.as_stored("scales") is ours.scales


def test_a_layer_the_int4_product_cannot_take_computes_dequantizing():
    """8-bit values, and groups of 16 (no whole groups of the product's 32): the torch kernels' product."""
    eight_bit = layer(quantized(8, False), int4=True)
    assert eight_bit.int4 is None and eight_bit.qweight.numel() > 0
    assert not int4pack_available(torch.device("cpu"), 16)
    assert int4pack_available(torch.device("cpu"), 96)  # a group of 3 of the product's
