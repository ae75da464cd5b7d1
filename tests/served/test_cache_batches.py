"""Batch operations on a cache (``tpcore.served.cache_batches``): attention rows joined left-padded, state layers'
rows concatenated, rows kept, leading positions dropped; the same on a local ``DynamicCache`` and, through a stand-in,
on a split model's ranks (tests/serve/test_serve.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, JambaConfig, LlamaConfig, MambaConfig
from transformers.cache_utils import DynamicLayer, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

from tpcore.served.cache_batches import attends, batch_cache, concatenate_batches, drop_leading, keep_rows
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


def with_states(batch: int, length: int, seed: int = 0) -> DynamicCache:
    """A filled cache of three layers: a state layer (a conv window of 4 and a recurrent state), an attention layer,
    and a hybrid layer of both; ``length`` positions seen."""
    torch.manual_seed(seed)
    cache = DynamicCache()
    cache.layers = [LinearAttentionLayer(), DynamicLayer(), LinearAttentionAndFullAttentionLayer()]
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionLayer):
            cache.update_conv_state(torch.randn(batch, 6, length), index, conv_kernel_size=4)
            cache.update_recurrent_state(torch.randn(batch, 6, 8), index)
        if isinstance(layer, DynamicLayer):
            cache.update(torch.randn(batch, 2, length, 4), torch.randn(batch, 2, length, 4), index)
    return cache


def states(cache: DynamicCache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[index]
    return layer.conv_states[0].clone(), layer.recurrent_states[0].clone()


#: whether a state layer counts the positions it has seen (transformers >= 5.2x)
COUNTS = hasattr(LinearAttentionLayer(), "cumulative_length_linear")


def seen(layer) -> int | None:
    """The positions a layer has seen: its keys' length, a state layer's count (``None`` where it keeps none)."""
    if isinstance(layer, DynamicLayer):
        return layer.keys.shape[-2]
    return int(layer.cumulative_length_linear) if COUNTS else None


def test_state_layers_rows_are_concatenated_kept_and_their_count_follows_the_attention_layers():
    """Each row's state travels with its row; the positions seen (what ``get_seq_length`` of a state layer answers,
    and a model's next ``cache_position``) are the batch's width, as the attention layers' length."""
    running, joining = with_states(2, 3, seed=0), with_states(1, 5, seed=1)
    before = {index: states(running, index) for index in (0, 2)}
    joined = {index: states(joining, index) for index in (0, 2)}
    keys = running.layers[2].keys.clone()
    batch_operation(running, "concatenate_batches", joining)
    for index in (0, 2):
        conv, recurrent = states(running, index)
        assert torch.equal(conv, torch.cat([before[index][0], joined[index][0]]))
        assert torch.equal(recurrent, torch.cat([before[index][1], joined[index][1]]))
        assert seen(running.layers[index]) in (5, None)
    assert torch.equal(running.layers[2].keys[:2, :, 2:], keys) and running.layers[2].keys.shape[-2] == 5
    whole = {index: states(running, index) for index in (0, 2)}
    keep_rows(running, torch.tensor([2, 0]))
    for index in (0, 2):
        assert torch.equal(states(running, index)[0], whole[index][0][[2, 0]])
        assert torch.equal(states(running, index)[1], whole[index][1][[2, 0]])
    assert running.layers[1].keys.shape[0] == 2
    drop_leading(running, 2)
    assert [seen(layer) for layer in running.layers] == [3 if COUNTS else None, 3, 3]


def test_a_batch_starts_from_the_config_s_state_layers_and_plain_attention_otherwise():
    """A decoder of attention layers alone keeps the plain ``DynamicCache`` (sliding-window layers served as full
    ones); a state-space or hybrid decoder gets one layer of its kind per layer."""
    assert batch_cache(LlamaConfig(num_hidden_layers=2)).layers == []  # made as the model fills them
    mamba = batch_cache(MambaConfig(num_hidden_layers=2))
    assert [type(layer) for layer in mamba.layers] == [LinearAttentionLayer] * 2
    jamba = batch_cache(JambaConfig(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1))
    assert [type(layer) for layer in jamba.layers] == [LinearAttentionLayer, DynamicLayer] * 2
    assert attends(LlamaConfig()) and attends(JambaConfig()) and not attends(MambaConfig())
