"""Batch operations on a KV cache (``tpcore.served.cache_batches``): rows joined left-padded, leading positions dropped;
the same on a local ``DynamicCache`` and, through a stand-in, on a split model's ranks (tests/serve/test_serve.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tpcore.served.cache_batches import concatenate_batches, drop_leading
from tpcore.served.caches import batch_operation


def filled(batch: int, length: int, layers: int = 2, seed: int = 0) -> DynamicCache:
    torch.manual_seed(seed)
    cache = DynamicCache()
    for layer in range(layers):
        cache.update(torch.randn(batch, 2, length, 4), torch.randn(batch, 2, length, 4), layer)
    return cache


def test_concatenated_rows_are_left_padded_to_the_longest_and_keep_their_positions_at_the_right():
    running, joining = filled(2, 3, seed=0), filled(1, 5, seed=1)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in running.layers]
    batch_operation(running, "concatenate_batches", joining)
    assert running.get_seq_length() == 5 and running.layers[0].keys.shape[0] == 3
    for (keys, values), layer, other in zip(before, running.layers, joining.layers, strict=True):
        assert torch.equal(layer.keys[:2, :, 2:], keys) and torch.equal(layer.values[:2, :, 2:], values)
        assert not layer.keys[:2, :, :2].any()
        assert torch.equal(layer.keys[2:], other.keys) and torch.equal(layer.values[2:], other.values)


def test_dropping_leading_positions_keeps_the_rest():
    cache = filled(2, 6)
    keys = cache.layers[0].keys.clone()
    drop_leading(cache, 4)
    assert cache.get_seq_length() == 2 and torch.equal(cache.layers[0].keys, keys[:, :, 4:])
    with pytest.raises(ValueError, match="count"):
        drop_leading(cache, -1)


def test_a_cache_of_other_layers_is_refused_with_a_clear_message():
    cache, other = filled(1, 2, layers=2), filled(1, 2, layers=3)
    with pytest.raises(ValueError, match="numbers of layers"):
        concatenate_batches(cache, other)
    unfilled = DynamicCache()
    unfilled.layers = [type(cache.layers[0])() for _ in cache.layers]
    with pytest.raises(ValueError, match="full-attention"):
        concatenate_batches(unfilled, cache)
