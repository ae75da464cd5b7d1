"""One pure property per layout word of :class:`Layer` / :class:`Split`: cut a tensor for every rank, then
run what the model computes with the pieces and compare with the unsplit computation (no process spawn)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tpcore import COLUMN, ROW, Layer, ShardingError, share
from tpcore.cut.shares import resolve
from tpcore.cut.split import Split

FAST = settings(max_examples=25, deadline=None)
ATOL = 1e-5

worlds = st.integers(min_value=1, max_value=4)
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def head_counts(world: int, most: int = 8) -> st.SearchStrategy[int]:
    """Head counts a world of ``world`` ranks can hold: split evenly, or replicated evenly."""
    return st.sampled_from([h for h in range(1, most + 1) if h % world == 0 or world % h == 0])


def rank_heads(heads: int, rank: int, world: int) -> list[int]:
    """The heads rank ``rank`` holds: its ``heads / world`` heads, or the one head it shares with its neighbours."""
    if heads >= world:
        per = heads // world
        return list(range(rank * per, (rank + 1) * per))
    return [rank * heads // world]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of ``q`` ``(T, Hq, d)`` over ``k, v`` ``(T, Hkv, d)`` (``Hq / Hkv`` query heads per
    key/value head), as ``(T, Hq * d)``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).flatten(1)


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """``got`` equals ``expected`` within ``ATOL`` times its scale (fp32)."""
    assert got.shape == expected.shape
    difference = (got - expected).abs().max().item() if got.numel() else 0.0
    assert difference <= ATOL * max(1.0, expected.abs().max().item()), f"max |difference| {difference}"


# -- explicit dim: tensors of any rank ----------------------------------------------------------


@FAST
@given(world=worlds, ndim=st.integers(1, 4), per_rank=st.integers(1, 3), n_fused=st.integers(1, 3), data=st.data())
def test_an_explicit_dim_cuts_a_tensor_of_any_rank_and_its_pieces_reassemble(world, ndim, per_rank, n_fused, data):
    dim = data.draw(st.integers(-ndim, ndim - 1), label="dim")
    shape = data.draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim), label="shape")
    shape[dim] = n_fused * world * per_rank
    tensor = randn(*shape, seed=data.draw(seeds, label="seed"))
    split = Layer(weight="w", dim=dim, n_fused=n_fused).styled(COLUMN).splits()[0]

    pieces = [split.shard(tensor, rank, world) for rank in range(world)]

    assert all(piece.shape[dim] == split.shard_size(shape[dim], world) == n_fused * per_rank for piece in pieces)
    blocks = [torch.cat([piece.chunk(n_fused, dim)[index] for piece in pieces], dim) for index in range(n_fused)]
    assert torch.equal(torch.cat(blocks, dim), tensor)


@FAST
@given(
    world=worlds,
    experts=st.integers(1, 3),
    hidden=st.integers(1, 5),
    inter_per_rank=st.integers(1, 3),
    tokens=st.integers(1, 4),
    stored_transposed=st.booleans(),
    seed=seeds,
)
def test_fused_moe_experts_cut_on_their_intermediate_dim_sum_to_the_whole_experts(
    world, experts, hidden, inter_per_rank, tokens, stored_transposed, seed
):
    """``gate_up (E, 2I, H)`` on dim 1 as two packed halves and ``down (E, H, I)`` on dim 2 (or both stored
    transposed, on dims -1 and 1): x -> gate/up -> silu(gate) * up -> down, weighted by the router, summed
    over ranks (the all-reduce) equals the unsplit experts."""
    inter = inter_per_rank * world
    gate_up, down = randn(experts, 2 * inter, hidden, seed=seed), randn(experts, hidden, inter, seed=seed + 1)
    x, routing = randn(tokens, hidden, seed=seed + 2), randn(tokens, experts, seed=seed + 3).softmax(-1)
    if stored_transposed:  # (E, H, 2I) and (E, I, H)
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        gate_up_layer, down_layer = Layer(weight="gate_up_proj", dim=-1, n_fused=2), Layer(weight="down_proj", dim=1)
    else:
        gate_up_layer, down_layer = Layer(weight="gate_up_proj", dim=1, n_fused=2), Layer(weight="down_proj", dim=2)

    def experts_forward(gate_up, down):
        if stored_transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out = torch.zeros(tokens, hidden)
        for e in range(experts):
            gate, up = (x @ gate_up[e].T).chunk(2, dim=-1)
            out += routing[:, e, None] * ((nn.functional.silu(gate) * up) @ down[e].T)
        return out

    gate_up_split, _ = gate_up_layer.styled(COLUMN).splits()
    down_split, _ = down_layer.styled(ROW).splits()
    partial = [
        experts_forward(gate_up_split.shard(gate_up, rank, world), down_split.shard(down, rank, world))
        for rank in range(world)
    ]
    assert_close(sum(partial), experts_forward(gate_up, down))


@FAST
@given(
    world=worlds,
    experts=st.integers(1, 3),
    hidden=st.integers(1, 5),
    inter_per_rank=st.integers(1, 3),
    tokens=st.integers(1, 4),
    seed=seeds,
)
def test_element_interleaved_moe_gate_up_with_biases_sums_to_the_whole_experts(
    world, experts, hidden, inter_per_rank, tokens, seed
):
    """GPT-OSS stores ``gate_up_proj (E, H, 2I)`` with gate and up interleaved (``[..., ::2]``, ``[..., 1::2]``)
    and a bias ``(E, 2I)``: ``interleaved`` with ``heads=I`` of ``n_fused=2`` on dim -1, the bias on dim -1;
    ``down_proj (E, I, H)`` row parallel on dim 1, its bias ``(E, H)`` whole, added once after the sum."""
    inter = inter_per_rank * world
    config = SimpleNamespace(intermediate_size=inter)
    gate_up, gate_up_bias = randn(experts, hidden, 2 * inter, seed=seed), randn(experts, 2 * inter, seed=seed + 1)
    down, down_bias = randn(experts, inter, hidden, seed=seed + 2), randn(experts, hidden, seed=seed + 3)
    x, routing = randn(tokens, hidden, seed=seed + 4), randn(tokens, experts, seed=seed + 5).softmax(-1)

    def experts_forward(gate_up, gate_up_bias, down, down_bias):
        out = torch.zeros(tokens, hidden)
        for e in range(experts):
            both = x @ gate_up[e] + gate_up_bias[e]
            out += routing[:, e, None] * (
                (nn.functional.silu(both[..., ::2]) * both[..., 1::2]) @ down[e] + down_bias[e]
            )
        return out

    gate_up_layer = Layer(
        weight="experts.gate_up_proj",
        bias="experts.gate_up_proj_bias",
        dim=-1,
        bias_dim=-1,
        n_fused=2,
        interleaved=True,
        heads="intermediate_size",
    )
    gate_up_split, gate_up_bias_split = gate_up_layer.styled(COLUMN).splits(config)
    down_split, down_bias_split = (
        Layer(weight="experts.down_proj", bias="experts.down_proj_bias", dim=1).styled(ROW).splits(config)
    )
    assert down_bias_split is None
    no_bias = torch.zeros_like(down_bias)
    partial = [
        experts_forward(
            gate_up_split.shard(gate_up, rank, world),
            gate_up_bias_split.shard(gate_up_bias, rank, world),
            down_split.shard(down, rank, world),
            no_bias,
        )
        for rank in range(world)
    ]
    assert_close(sum(partial) + routing @ down_bias, experts_forward(gate_up, gate_up_bias, down, down_bias))


@FAST
@given(
    world=worlds,
    heads_per_rank=st.integers(1, 2),
    head_dim=st.integers(1, 3),
    d_model=st.integers(1, 5),
    tokens=st.integers(1, 4),
    seed=seeds,
)
def test_xlnet_per_head_3d_projections_cut_on_their_heads_dim_sum_to_the_whole_attention(
    world, heads_per_rank, head_dim, d_model, tokens, seed
):
    """XLNet's q/k/v/o are ``(d_model, n_head, d_head)`` and its ``r_w_bias`` ``(n_head, d_head)``: q/k/v
    column parallel on dim 1, o row parallel on dim 1; the ranks' outputs sum to the whole attention's."""
    heads = heads_per_rank * world
    config = SimpleNamespace(n_head=heads)
    q, k, v, o = (randn(d_model, heads, head_dim, seed=seed + i) for i in range(4))
    r_w_bias, x = randn(heads, head_dim, seed=seed + 4), randn(tokens, d_model, seed=seed + 5)

    def xlnet_attention(q, k, v, o, r_w_bias):
        q_head = torch.einsum("ih,hnd->ind", x, q) + r_w_bias
        k_head, v_head = torch.einsum("ih,hnd->ind", x, k), torch.einsum("ih,hnd->ind", x, v)
        scores = torch.einsum("ind,jnd->nij", q_head, k_head) / math.sqrt(head_dim)
        attn_vec = torch.einsum("nij,jnd->ind", scores.softmax(-1), v_head)
        return torch.einsum("ind,hnd->ih", attn_vec, o)

    qkv_split, _ = Layer(weight="q", dim=1).styled(COLUMN).splits(config)
    o_split, _ = Layer(weight="o", dim=1).styled(ROW).splits(config)
    bias_split, _ = Layer(weight="r_w_bias", heads="n_head").styled(COLUMN).splits(config)
    partial = [
        xlnet_attention(
            *(qkv_split.shard(t, rank, world) for t in (q, k, v)),
            o_split.shard(o, rank, world),
            bias_split.shard(r_w_bias, rank, world),
        )
        for rank in range(world)
    ]
    assert_close(sum(partial), xlnet_attention(q, k, v, o, r_w_bias))


# -- parts: packed tensors with unequal head counts -------------------------------------------


@st.composite
def grouped_heads(draw):
    """``(world, query heads, key/value heads)`` of a grouped-query attention: any world and key/value
    count, the query heads a multiple of it and at least as many as the ranks (even or not)."""
    world = draw(worlds)
    kv_heads = draw(st.integers(1, 4))
    least = -(-world // kv_heads)
    return world, kv_heads * draw(st.integers(least, least + 1)), kv_heads


@FAST
@given(
    shape=grouped_heads(), head_dim=st.integers(1, 3), hidden=st.integers(1, 5), tokens=st.integers(1, 4), seed=seeds
)
def test_a_qkv_pack_with_fewer_kv_heads_cut_by_parts_gives_each_rank_its_heads_of_the_whole_attention(
    shape, head_dim, hidden, tokens, seed
):
    """Phi-3 ``qkv_proj`` (q 32 heads, k 8, v 8), GPT-BigCode/Falcon multi-query (k and v one head): the parts
    are dealt by key/value groups, evenly or not, key/value heads replicated when fewer than the ranks; each
    rank's attention over its ``[Q_r | K_r | V_r]`` gives its query heads' columns of the whole attention."""
    world, q_heads, kv_heads = shape
    config = SimpleNamespace(num_attention_heads=q_heads, num_key_value_heads=kv_heads)
    layer = Layer(
        weight="qkv_proj.weight",
        bias="qkv_proj.bias",
        parts=("num_attention_heads", "num_key_value_heads", "num_key_value_heads"),
    )
    size = (q_heads + 2 * kv_heads) * head_dim
    weight, bias, x = randn(size, hidden, seed=seed), randn(size, seed=seed + 1), randn(tokens, hidden, seed=seed + 2)

    def packed_attention(weight, bias, q_heads):
        kv_width = (weight.shape[0] - q_heads * head_dim) // 2
        q, k, v = (x @ weight.T + bias).split([q_heads * head_dim, kv_width, kv_width], -1)
        return attention(*(t.unflatten(-1, (-1, head_dim)) for t in (q, k, v)))

    weight_split, bias_split = layer.styled(COLUMN).splits(config)
    local = share(q_heads, world, "num_attention_heads", groups=kv_heads)
    assert weight_split == Split(0, parts=(q_heads, kv_heads, kv_heads))
    assert bias_split == weight_split
    outputs = [
        packed_attention(weight_split.shard(weight, r, world), bias_split.shard(bias, r, world), resolve(local, r))
        for r in range(world)
    ]
    assert_close(torch.cat(outputs, -1), packed_attention(weight, bias, q_heads))


@FAST
@given(
    shape=grouped_heads(), head_dim=st.integers(1, 3), hidden=st.integers(1, 5), tokens=st.integers(1, 4), seed=seeds
)
def test_a_pack_of_kv_groups_cut_by_interleaved_parts_gives_each_rank_its_heads_of_the_whole_attention(
    shape, head_dim, hidden, tokens, seed
):
    """Falcon's grouped ``query_key_value`` stores each key/value group's query heads, then its key and
    value head (``view(T, groups, H / G + 2, d)``): cut group by group, each rank's piece is again such a
    pack (whole groups, or its query heads of one group beside the group's replicated k and v), and its
    attention gives its query heads' columns of the whole attention, the ranks dividing the heads or not."""
    world, q_heads, kv_heads = shape
    config = SimpleNamespace(num_attention_heads=q_heads, num_kv_heads=kv_heads)
    parts = ("num_attention_heads", "num_kv_heads", "num_kv_heads")
    layer = Layer(weight="query_key_value.weight", parts=parts, interleaved=True)
    size = (q_heads + 2 * kv_heads) * head_dim
    weight, x = randn(size, hidden, seed=seed), randn(tokens, hidden, seed=seed + 1)

    def falcon_attention(weight, q_heads, kv_heads):
        packed = (x @ weight.T).unflatten(-1, (kv_heads, q_heads // kv_heads + 2, head_dim))
        return attention(packed[:, :, :-2].flatten(1, 2), packed[:, :, -2], packed[:, :, -1])

    split, _ = layer.styled(COLUMN).splits(config)
    assert split == Split(0, parts=(q_heads, kv_heads, kv_heads), interleaved=True)
    local_q = share(q_heads, world, "num_attention_heads", groups=kv_heads)
    local_kv = share(kv_heads, world, "num_kv_heads")
    outputs = [
        falcon_attention(split.shard(weight, r, world), resolve(local_q, r), resolve(local_kv, r)) for r in range(world)
    ]
    assert_close(torch.cat(outputs, -1), falcon_attention(weight, q_heads, kv_heads))
    if kv_heads >= world:  # whole groups: each rank's piece is one block of the tensor
        assert all(len(split.ranges(size, r, world)[0]) == 1 for r in range(world))


# -- interleaved: [q0 k0 v0 | q1 k1 v1 | ...] --------------------------------------------------


@FAST
@given(
    world=worlds,
    extra_heads=st.integers(0, 5),
    head_dim=st.integers(1, 3),
    hidden=st.integers(1, 5),
    tokens=st.integers(1, 4),
    seed=seeds,
)
def test_a_head_interleaved_pack_gives_each_rank_whole_heads_of_the_whole_attention(
    world, extra_heads, head_dim, hidden, tokens, seed
):
    """DeBERTa v1 ``in_proj`` packs each head's q, k, v together (``view(T, heads, 3 d).chunk(3)``), and adds
    the per-head ``q_bias``/``v_bias`` ``(heads * d,)``: each rank's attention gives its heads' columns,
    for head counts the ranks divide or not."""
    heads = world + extra_heads
    config = SimpleNamespace(num_attention_heads=heads)
    in_proj = randn(3 * heads * head_dim, hidden, seed=seed)
    q_bias, v_bias = randn(heads * head_dim, seed=seed + 1), randn(heads * head_dim, seed=seed + 2)
    x = randn(tokens, hidden, seed=seed + 3)

    def deberta_attention(in_proj, q_bias, v_bias):
        q, k, v = (x @ in_proj.T).unflatten(-1, (-1, 3 * head_dim)).chunk(3, dim=-1)
        return attention(q + q_bias.view(-1, head_dim), k, v + v_bias.view(-1, head_dim))

    in_proj_split, _ = Layer(weight="in_proj.weight", n_fused=3, interleaved=True, heads=heads).styled(COLUMN).splits()
    bias_split, _ = Layer(weight="q_bias", heads="num_attention_heads").styled(COLUMN).splits(config)
    outputs = [
        deberta_attention(
            *(s.shard(t, r, world) for s, t in ((in_proj_split, in_proj), (bias_split, q_bias), (bias_split, v_bias)))
        )
        for r in range(world)
    ]
    assert_close(torch.cat(outputs, -1), deberta_attention(in_proj, q_bias, v_bias))


# -- per-head parameters wherever the heads dimension sits -------------------------------------


@FAST
@given(world=worlds, data=st.data(), head_dim=st.integers(1, 4), hidden=st.integers(1, 5), tokens=st.integers(1, 3))
def test_per_head_norm_weights_follow_the_heads_of_their_projection(world, data, head_dim, hidden, tokens):
    """Cohere/StableLM ``q_norm``/``k_norm`` hold a ``(heads, d)`` weight (fewer key heads than ranks are
    replicated): norming a rank's heads of the projection with its rows equals those heads of the whole."""
    heads = data.draw(head_counts(world), label="heads")
    seed = data.draw(seeds, label="seed")
    proj, norm_weight, x = (
        randn(heads * head_dim, hidden, seed=seed),
        randn(heads, head_dim, seed=seed + 1),
        randn(tokens, hidden, seed=seed + 2),
    )

    def normed_heads(proj, norm_weight):
        states = (x @ proj.T).unflatten(-1, (-1, head_dim))
        return nn.functional.layer_norm(states, (head_dim,)) * norm_weight

    proj_split, _ = Layer(weight="k_proj.weight", heads=heads).styled(COLUMN).splits()
    norm_split, _ = Layer(weight="k_norm.weight", heads=heads).styled(COLUMN).splits()
    whole = normed_heads(proj, norm_weight)
    for rank in range(world):
        got = normed_heads(proj_split.shard(proj, rank, world), norm_split.shard(norm_weight, rank, world))
        assert_close(got, whole[:, rank_heads(heads, rank, world)])


@FAST
@given(world=worlds, data=st.data(), window=st.integers(1, 3), entries=st.integers(1, 6))
def test_a_per_head_table_split_on_its_last_dim_gives_each_rank_its_heads_of_the_position_bias(
    world, data, window, entries
):
    """Swin's ``relative_position_bias_table (entries, heads)`` and WavLM's ``rel_attn_embed (buckets, heads)``:
    the bias a rank looks up from its columns equals its heads of the whole bias ``(heads, W, W)``."""
    heads = data.draw(head_counts(world), label="heads")
    seed = data.draw(seeds, label="seed")
    table = randn(entries, heads, seed=seed)
    index = torch.randint(entries, (window * window,), generator=torch.Generator().manual_seed(seed))

    def position_bias(table):
        return table[index].view(window, window, -1).permute(2, 0, 1)

    split, bias = (
        Layer(weight="relative_position_bias_table", dim=-1, heads="num_heads")
        .styled(COLUMN)
        .splits(SimpleNamespace(num_heads=heads))
    )
    assert bias is None or bias.dim == 0
    whole = position_bias(table)
    for rank in range(world):
        assert torch.equal(position_bias(split.shard(table, rank, world)), whole[rank_heads(heads, rank, world)])


# -- Layer: fields, aliases, validation, splits() ----------------------------------------------


@pytest.mark.parametrize(("new", "old"), [("transposed", "reversed"), ("optional", "ignore_checker")])
def test_the_clear_spelling_and_its_old_alias_are_one_attribute(new, old):
    assert getattr(Layer(weight="w"), new) is False and getattr(Layer(weight="w"), old) is False
    for value in (True, False):
        for given_name in (new, old):
            layer = Layer(weight="w", **{given_name: value})
            assert getattr(layer, new) is value and getattr(layer, old) is value
        assert Layer(weight="w", **{new: value, old: value}) == Layer(weight="w", **{old: value})
    with pytest.raises(ValueError, match=rf"{new}=True and its alias {old}=False disagree"):
        Layer(weight="w", **{new: True, old: False})
    with pytest.raises(TypeError, match=rf"{new} must be a bool"):
        Layer(weight="w", **{old: "yes"})


def test_old_positional_layer_fields_keep_their_meaning():
    layer = Layer("c_attn.weight", "c_attn.bias", 3, True, None, True, "n_head")
    assert (layer.n_fused, layer.transposed, layer.optional, layer.heads) == (3, True, True, "n_head")


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"n_fused": 0}, ValueError, "n_fused must be a positive int"),
        ({"n_fused": True}, ValueError, "n_fused must be a positive int"),
        ({"weight": 3}, TypeError, "weight must be an attribute path"),
        ({"dim": "1"}, TypeError, "dim must be an int"),
        ({"dim": True}, TypeError, "dim must be an int"),
        ({"heads": 0}, TypeError, "heads must be a positive int, a config attribute name or a function"),
        ({"heads": ""}, TypeError, "heads must be a positive int, a config attribute name or a function"),
        ({"parts": ("num_heads",)}, ValueError, "at least two"),
        ({"parts": ("a", 0)}, ValueError, "parts must list the head counts"),
        ({"parts": (4, 2), "heads": 4}, ValueError, "drop heads="),
        ({"parts": (4, 2, 2), "n_fused": 2}, ValueError, "n_fused=2 disagrees with the 3 parts"),
        ({"interleaved": True}, ValueError, "interleaved pack needs heads= or parts="),
        ({"interleaved": 1, "heads": 2}, TypeError, "interleaved must be a bool"),
        ({"dim": 1, "transposed": True}, ValueError, "dim= fixes the split dimension"),
        ({"bias_dim": 1}, ValueError, "bias_dim= without a bias"),
        ({"replace": int}, TypeError, "replace must be an nn.Module subclass"),
    ],
)
def test_layer_refuses_malformed_fields_when_built(fields, error, message):
    with pytest.raises(error, match=message):
        Layer(weight="w", **fields) if "weight" not in fields else Layer(**fields)


def test_parts_given_as_a_list_are_kept_as_a_tuple():
    layer = Layer(weight="w", parts=["num_attention_heads", 2, 2], n_fused=3)
    assert layer.parts == ("num_attention_heads", 2, 2)
    hash(layer)


@pytest.mark.parametrize(
    ("fields", "style", "expected"),
    [
        ({}, COLUMN, (Split(0), Split(0))),  # Linear (out, in): out features, bias split
        ({}, ROW, (Split(1), None)),  # in features, bias whole
        ({"transposed": True}, COLUMN, (Split(1), Split(0))),  # Conv1D (in, out)
        ({"reversed": True}, ROW, (Split(0), None)),
        ({"n_fused": 3, "heads": 2}, COLUMN, (Split(0, 3, 2), Split(0, 3, 2))),
        ({"heads": "num_key_value_heads"}, COLUMN, (Split(0, heads=2), Split(0, heads=2))),
        ({"dim": 1, "n_fused": 2}, COLUMN, (Split(1, 2), Split(0, 2))),  # (E, 2I, H) experts, 1-D bias
        ({"dim": 1, "n_fused": 2, "bias_dim": 1}, COLUMN, (Split(1, 2), Split(1, 2))),  # (E, 2I) bias
        ({"dim": -1}, ROW, (Split(-1), None)),
        ({"parts": ("num_attention_heads", 2)}, COLUMN, (Split(0, parts=(8, 2)), Split(0, parts=(8, 2)))),
        (
            {"n_fused": 3, "interleaved": True, "heads": "num_attention_heads"},
            COLUMN,
            (Split(0, 3, 8, interleaved=True), Split(0, 3, 8, interleaved=True)),
        ),
        (  # a count config flags choose: a function of the config
            {"heads": "num_attention_heads", "groups": lambda config: config.num_key_value_heads // 2},
            ROW,
            (Split(1, heads=8, groups=1), None),
        ),
        (
            {"parts": ("num_attention_heads", "num_key_value_heads", "num_key_value_heads"), "interleaved": True},
            COLUMN,
            (Split(0, parts=(8, 2, 2), interleaved=True), Split(0, parts=(8, 2, 2), interleaved=True)),
        ),
    ],
)
def test_splits_gives_the_weight_and_bias_split_of_each_style(fields, style, expected):
    config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2)
    assert Layer(weight="w", bias="b", **fields).styled(style).splits(config) == expected
    assert Layer(weight="w", bias="b", **fields).styled(style).dims() == (
        expected[0].dim,
        expected[1] and expected[1].dim,
    )


@pytest.mark.parametrize(
    ("fields", "config", "message"),
    [
        ({"heads": "num_kv"}, SimpleNamespace(), "names heads 'num_kv', but the config SimpleNamespace lacks it"),
        ({"heads": "num_kv"}, None, "names heads 'num_kv', but the config NoneType lacks it"),
        ({"heads": "num_kv"}, SimpleNamespace(num_kv=2.0), "holds 2.0, not a positive int"),
        ({"heads": "num_kv"}, SimpleNamespace(num_kv=True), "holds True, not a positive int"),
        ({"parts": ("num_q", "num_kv")}, SimpleNamespace(num_q=4), "names parts 'num_kv'"),
        ({"heads": lambda config: 0}, SimpleNamespace(), "names heads <function.*holds 0, not a positive int"),
    ],
)
def test_splits_names_the_config_attribute_it_cannot_read(fields, config, message):
    with pytest.raises(ShardingError, match=message):
        Layer(weight="attn.k.weight", **fields).styled(COLUMN).splits(config)


def test_splits_refuses_a_row_bias_dim_and_an_unknown_style():
    with pytest.raises(ValueError, match="a row-parallel bias is added whole"):
        Layer(weight="w", bias="b", bias_dim=1).styled(ROW).splits()
    with pytest.raises(ValueError, match="unknown parallel style 'diagonal'"):
        Layer(weight="w").styled("diagonal").splits()


# -- a depthwise convolution cut by channels -----------------------------------------------------------


@FAST
@given(
    world=worlds,
    per_rank=st.integers(1, 3),
    extra=st.integers(0, 3),
    multiplier=st.integers(1, 2),
    kernel=st.integers(1, 4),
    seed=seeds,
)
def test_a_depthwise_conv_cut_by_channels_gives_each_rank_the_conv_of_its_channels(
    world, per_rank, extra, multiplier, kernel, seed
):
    """``depthwise_conv``: over channels dealt as a column cut deals them (even or not), each rank's conv
    (its ``in_channels``/``groups`` following its weight) on its channels is the whole conv's output there."""
    from tpcore import depthwise_conv
    from tpcore.parallel.layers import set_layer_size

    channels = per_rank * world + extra
    torch.manual_seed(seed)
    whole = nn.Conv1d(channels, channels * multiplier, kernel, groups=channels, padding=kernel - 1)
    x = randn(2, channels, 5, seed=seed)
    expected = whole(x)
    weight_split, bias_split = depthwise_conv("conv", heads=channels).splits(SimpleNamespace())
    start = 0
    for rank in range(world):
        conv = nn.Conv1d(channels, channels * multiplier, kernel, groups=channels, padding=kernel - 1)
        conv.load_state_dict(whole.state_dict())
        conv.weight.data = weight_split.shard(conv.weight.data, rank, world)
        conv.bias.data = bias_split.shard(conv.bias.data, rank, world)
        set_layer_size(conv)
        mine = conv.groups
        assert conv.in_channels == mine and conv.out_channels == mine * multiplier
        got = conv(x[:, start : start + mine])
        assert_close(got, expected[:, start * multiplier : (start + mine) * multiplier])
        start += mine
    assert start == channels


# -- parts measured in different units -----------------------------------------------------------------


@FAST
@given(
    world=worlds,
    groups=st.integers(1, 4),
    per_group=st.lists(st.integers(1, 3), min_size=2, max_size=5),
    widths=st.lists(st.integers(1, 4), min_size=5, max_size=5),
    seed=seeds,
)
def test_parts_of_different_widths_give_each_rank_the_same_groups_of_every_part(world, groups, per_group, widths, seed):
    """``parts`` with ``widths`` (Mamba2's ``[z | x | B | C | dt]``): rank ``r``'s piece of each part is whole
    units of that part's width, from the same groups in every part, and the ranks' pieces cover every part."""
    parts = tuple(groups * count for count in per_group)
    widths = tuple(widths[: len(parts)])
    size = sum(p * w for p, w in zip(parts, widths, strict=True))
    rows = randn(size, 3, seed=seed)
    weight_split, _ = Layer(weight="w", style=COLUMN, parts=parts, widths=widths, groups=groups).splits(None)
    starts = [sum(p * w for p, w in zip(parts[:i], widths[:i], strict=True)) for i in range(len(parts))]
    covered = [set() for _ in parts]
    for rank in range(world):
        piece, offset = weight_split.shard(rows, rank, world), 0
        held_groups = []
        for index, (count, width) in enumerate(zip(parts, widths, strict=True)):
            ranges, _ = weight_split.ranges(size, rank, world)
            start, stop = ranges[index]
            assert start >= starts[index] and stop <= starts[index] + count * width
            assert (start - starts[index]) % width == 0 and (stop - start) % width == 0
            units = range((start - starts[index]) // width, (stop - starts[index]) // width)
            covered[index] |= set(units)
            held_groups.append({unit // (count // groups) for unit in units})
            assert torch.equal(piece[offset : offset + stop - start], rows[start:stop])
            offset += stop - start
        assert all(found == held_groups[0] for found in held_groups)
    assert all(found == set(range(count)) for found, count in zip(covered, parts, strict=True))


def test_parts_of_different_widths_that_do_not_add_up_name_the_sizes():
    split, _ = Layer(weight="w", style=COLUMN, parts=(4, 4, 2), widths=(8, 8, 16), groups=2).splits(None)
    with pytest.raises(ShardingError, match=r"size 90 is not the parts 4 x 8 \+ 4 x 8 \+ 2 x 16 = 96 it packs"):
        split.check(90, 2)


# -- a gated norm by groups over split channels ------------------------------------------------------------


def gated_group_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mamba2's ``MambaRMSNormGated``: ``w * u / rms(u)`` per group of ``group_size`` channels, ``u = x silu(z)``."""
    u = x * nn.functional.silu(gate)
    grouped = u.view(*u.shape[:-1], -1, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * grouped.view(u.shape)


@FAST
@given(
    world=worlds, groups=st.integers(1, 4), heads_per_group=st.integers(1, 4), head_dim=st.integers(1, 3), seed=seeds
)
def test_a_gated_norm_by_groups_over_split_heads_gives_each_rank_its_channels_of_the_whole_norm(
    world, groups, heads_per_group, head_dim, seed
):
    """``ColumnSplitGatedRMSNorm``: heads dealt in their groups (whole groups, or each group's heads over the
    ranks sharing it), every rank's output is the whole norm's on its channels (groups spanning ranks summed by
    one all-reduce over threads acting as ranks)."""
    from tpcore import gated_norm_class
    from tpcore.cut.shares import runs
    from tpcore.parallel.threads import ThreadGroup, run_ranks

    heads = groups * heads_per_group
    if heads_per_group < -(-world // groups):
        return  # more ranks than heads in a group: the policy refuses it (a head on two ranks)
    channels, group_size = heads * head_dim, heads_per_group * head_dim
    x, gate, weight = randn(2, 3, channels, seed=seed), randn(2, 3, channels, seed=seed + 1), randn(channels, seed=seed)
    expected = gated_group_norm(x, gate, weight, group_size)
    group = ThreadGroup(world)

    def rank_norm(rank: int) -> tuple[int, torch.Tensor]:
        first, count = runs(heads, world, groups)[rank]
        start, stop = first * head_dim, (first + count) * head_dim
        norm = nn.Module()
        norm.weight, norm.variance_epsilon, norm.group_size = nn.Parameter(weight[start:stop]), 1e-6, group_size
        norm.__class__ = gated_norm_class(norm)
        norm.tp_group, norm.first_channel, norm.num_groups, norm.groups_split = group, start, groups, groups < world
        return start, norm(x[..., start:stop], gate[..., start:stop])

    for start, got in run_ranks(group, rank_norm):
        assert_close(got, expected[..., start : start + got.shape[-1]])
