"""Reshapes to the unsplit width inside a split attention become reshapes to the rank's width
(tpcore.parallel.reshapes): exactly those, and nothing else."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tpcore.parallel.reshapes import LocalWidthReshapes, local_width_class

FULL, LOCAL = 12, 4


def test_a_merge_into_the_input_width_keeps_the_local_width():
    heads = torch.randn(5, 2, 2, 2)  # (seq, batch, local heads, head_dim): 4 of the 12 features
    with LocalWidthReshapes(FULL, LOCAL):
        assert heads.view(5, 2, FULL).shape == (5, 2, LOCAL)
        assert heads.reshape(5, 2, FULL).shape == (5, 2, LOCAL)
        assert torch.reshape(heads, (5, 2, FULL)).shape == (5, 2, LOCAL)
        assert heads.contiguous().view((5, 2, FULL)).shape == (5, 2, LOCAL)
        merged = torch.randn(2, 3, 5, LOCAL)  # (batch, streams, seq, local features)
        assert merged.view(2, -1, FULL).shape == (2, 15, LOCAL)  # -1 counts positions, as unsplit


def test_reshapes_whose_sizes_already_match_are_left_alone():
    full = torch.randn(5, 2, FULL)  # the input hidden states: whole width
    with LocalWidthReshapes(FULL, LOCAL):
        assert full.view(10, FULL).shape == (10, FULL)
        assert full.view(5, -1, FULL).shape == (5, 2, FULL)
        assert full.reshape(-1).shape == (5 * 2 * FULL,)
        assert full.view(torch.int32).dtype == torch.int32  # view(dtype) is no shape
        with pytest.raises(RuntimeError):  # a reshape that fits neither width still fails
            torch.randn(7, 5).view(3, FULL)
    with LocalWidthReshapes(FULL, FULL):  # one rank: nothing to change
        with pytest.raises(RuntimeError):
            torch.randn(5, 2, LOCAL).view(5, 2, FULL)


@settings(max_examples=60, deadline=None)
@given(
    leading=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    heads=st.integers(1, 6),
    head_dim=st.integers(1, 4),
    ranks=st.integers(2, 4),
    minus_one=st.booleans(),
)
def test_any_merge_of_local_heads_equals_the_merge_it_stands_for(leading, heads, head_dim, ranks, minus_one):
    """``x.reshape(*leading, W)`` of a rank's ``(*leading, heads, head_dim)`` is ``x.reshape(*leading, w)``
    (the same elements, in the same order); a whole-width tensor reshapes as without the mode."""
    local, full = heads * head_dim, heads * head_dim * ranks
    x = torch.randn(*leading, heads, head_dim)
    requested = (*leading[:-1], -1, full) if minus_one else (*leading, full)
    with LocalWidthReshapes(full, local):
        merged = (x.reshape(*leading, local) if minus_one else x).reshape(requested)
        whole = torch.randn(*leading, full)
        kept = whole.reshape(requested)
    assert torch.equal(merged, x.reshape(*leading, local))
    assert torch.equal(kept, whole.reshape(requested)) and kept.shape[-1] == full
    assert math.prod(merged.shape) == x.numel()


class MergesIntoInputWidth(nn.Module):
    """Merges its heads with ``reshape(batch, seq, hidden)`` of the input's width, as FSMT does."""

    def __init__(self, hidden: int = 8, heads: int = 4):
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        states = self.proj(hidden_states).view(batch, seq, self.num_heads, self.head_dim)
        return states.reshape(batch, seq, hidden)


def test_the_local_width_class_runs_the_forward_under_the_rank_widths():
    module = MergesIntoInputWidth()
    with torch.no_grad():
        module.proj.weight.data, module.proj.bias.data = module.proj.weight[:4], module.proj.bias[:4]  # 2 of 4 heads
    module.num_heads = 2
    new_class = local_width_class(module)
    assert new_class is local_width_class(MergesIntoInputWidth()) and issubclass(new_class, MergesIntoInputWidth)
    assert local_width_class(None) is None  # a layer without the module
    module.__class__ = new_class
    with pytest.raises(RuntimeError, match="set no full_width and local_width"):
        module(torch.randn(2, 3, 8))
    module.full_width, module.local_width = 8, 4
    out = module(torch.randn(2, 3, 8))
    assert out.shape == (2, 3, 4)
