"""The hypothesis strategies of ``tpcore.testing`` draw what they promise (pure: no rank is started)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

from tpcore.testing import padded_batch, padded_batches, split_sizes, with_choices

FAST = settings(max_examples=60, deadline=None)


@FAST
@given(sizes=split_sizes(grouped_kv=True))
def test_split_sizes_divide_over_their_world_size(sizes):
    world = sizes.world_size
    assert world in (1, 2, 3, 4) and sizes.heads % world == 0 and sizes.intermediate % world == 0
    assert sizes.heads // world in (1, 2, 3) and sizes.hidden == sizes.heads * sizes.head_dim
    assert sizes.heads % sizes.kv_heads == 0
    assert sizes.kv_heads % world == 0 or world % sizes.kv_heads == 0  # split, or replicated
    assert 1 <= sizes.layers <= 2 and sizes.head_dim in (2, 4, 8)


@FAST
@given(sizes=split_sizes(world_sizes=(2, 5), grouped_kv=True, uneven=True))
def test_uneven_split_sizes_are_any_counts_the_ranks_can_hold(sizes):
    world = sizes.world_size
    assert world <= sizes.heads <= 3 * world and world <= sizes.intermediate <= 24 * world
    assert sizes.heads % sizes.kv_heads == 0 and sizes.hidden == sizes.heads * sizes.head_dim


def test_uneven_split_sizes_reach_counts_the_ranks_do_not_divide_and_replicated_kv_heads():
    found = find(
        split_sizes(world_sizes=(2, 5), grouped_kv=True, uneven=True),
        lambda s: s.heads % s.world_size != 0 and s.kv_heads < s.world_size and s.intermediate % s.world_size != 0,
        settings=settings(max_examples=500, database=None),
    )
    assert found.heads % found.world_size and found.kv_heads < found.world_size


@FAST
@given(sizes=split_sizes(world_sizes=(3,)))
def test_without_grouped_kv_every_head_has_its_own_kv_head(sizes):
    assert sizes.world_size == 3 and sizes.kv_heads == sizes.heads


@pytest.mark.parametrize("padding", ["right", "left"])
@FAST
@given(data=st.data())
def test_padded_batches_hold_real_tokens_within_the_vocabulary_and_pad_the_rest(padding, data):
    inputs = data.draw(padded_batches(50, batch=(2, 3), seq=(1, 6), padding=padding))
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    steps = mask.diff(dim=1)
    assert ((steps <= 0) if padding == "right" else (steps >= 0)).all()  # real tokens on one side
    assert ids.shape == mask.shape and ids.dtype == mask.dtype == torch.long
    assert 2 <= ids.shape[0] <= 3 and 1 <= ids.shape[1] <= 6
    assert ((mask == 0) | (mask == 1)).all() and (mask.sum(1) >= 1).all()
    assert ((ids[mask.bool()] >= 3) & (ids[mask.bool()] < 50)).all() and (ids[~mask.bool()] == 0).all()


@pytest.mark.parametrize(("padding", "mask"), [("right", [[1, 1, 1], [1, 0, 0]]), ("left", [[1, 1, 1], [0, 0, 1]])])
def test_padded_batch_pads_on_the_side_asked(padding, mask):
    batch = padded_batch([3, 1], 3, vocab_size=40, seed=5, padding=padding, pad_token_id=7)
    assert batch["attention_mask"].tolist() == mask
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 7).all()
    assert torch.equal(batch["input_ids"], padded_batch([3, 1], 3, 40, 5, padding=padding, pad_token_id=7)["input_ids"])


@FAST
@given(inputs=padded_batches(30, decoder_seq=(1, 4)))
def test_encoder_decoder_batches_carry_decoder_ids_for_every_row(inputs):
    decoder = inputs["decoder_input_ids"]
    assert decoder.shape[0] == inputs["input_ids"].shape[0] and 1 <= decoder.shape[1] <= 4
    assert ((decoder >= 3) & (decoder < 30)).all()


def test_with_choices_repeats_each_row_per_choice():
    inputs = {**padded_batch([2, 1], 2, 20), "output_hidden_states": True}
    choices = with_choices(inputs, choices=3)
    assert choices["input_ids"].shape == (2, 3, 2) and choices["output_hidden_states"] is True
    assert all(torch.equal(choices["attention_mask"][:, c], inputs["attention_mask"]) for c in range(3))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: padded_batch([1], 2, 40, padding="middle"), "padding must be"),
        (lambda: padded_batch([1], 2, vocab_size=3), "no token id"),
        (lambda: padded_batch([0, 2], 2, 40), "1 to seq=2"),
    ],
)
def test_impossible_batches_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
