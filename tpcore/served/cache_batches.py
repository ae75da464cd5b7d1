"""Batch operations on caches that transformers' ``Cache`` lacks, for a running batch of sequences.

A running batch keeps one cache whose layers are of two kinds, or both at once (a hybrid layer):

- **attention layers** keep keys and values ``(B, heads, L, d)``, left-padded: row ``b``'s ``n_b`` true positions
  at the right end, the ``L - n_b`` before them masked out by the caller's attention mask;
- **state layers** (state-space and linear-attention mixers: Mamba, Mamba2, gated DeltaNet, ...) keep per row a
  convolution window ``(B, channels, k)`` and a recurrent state ``(B, ...)`` of fixed size, and the count of
  positions seen (one for the batch: the longest row's, the width ``L`` of the attention layers and the mask).

Three operations keep it so:

- :func:`concatenate_batches`: sequences join. Attention rows are padded on the left with zeros to the longest
  length ``L = max L_i``, then every tensor is concatenated along the batch; the count becomes ``L``.
- :func:`keep_rows`: only the rows ``indices`` stay, in that order (every tensor indexed along the batch).
- :func:`drop_leading`: the first ``count`` positions of every row are dropped (padding every row no longer
  needs, once the longest sequences have left): attention ``(B, heads, L - count, d)``, the count ``L - count``.

All work on a local ``DynamicCache`` and, through :func:`tpcore.served.caches.batch_operation`, on the cache a split
model's ranks keep (each rank its own heads), with the same code: the caller's stand-in dispatches them.
:func:`batch_cache` makes the empty cache a batch starts from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import (
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

__all__ = ["BATCHED_LAYERS", "OPERATIONS", "attends", "batch_cache", "cache_maker", "concatenate_batches",
           "drop_leading", "keep_rows", "unkept_layer"]  # fmt: skip

#: the cache layer a running batch keeps for each layer type of a config: sliding-window and chunked layers as full
#: ones (the attention mask keeps their window), state layers as transformers makes them
BATCHED_LAYERS: dict[str, type] = {
    "full_attention": DynamicLayer,
    "sliding_attention": DynamicLayer,
    "chunked_attention": DynamicLayer,
    "linear_attention": LinearAttentionLayer,
    "conv": LinearAttentionLayer,
    "hybrid": LinearAttentionAndFullAttentionLayer,
    "hybrid_sliding": LinearAttentionAndFullAttentionLayer,
}
#: layers without attention, as this transformers keeps them (``DummyLayer`` since 5.2x, an unused state layer before)
BATCHED_LAYERS |= {
    kind: cache_utils.DYNAMIC_LAYER_TYPE_MAPPING[kind]
    for kind in ("dummy", "moe", "mlp")
    if kind in cache_utils.DYNAMIC_LAYER_TYPE_MAPPING
}
#: layer types a plain ``DynamicCache`` keeps as they come (each a full-attention layer, made as the model fills it)
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: layer types whose layers keep a state per row
STATE_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
#: whether this transformers' state layers count the positions they have seen (``cumulative_length_linear``)
STATES_COUNT_POSITIONS = hasattr(LinearAttentionLayer(), "cumulative_length_linear")
#: the layer classes that keep nothing (none in a transformers older than 5.2x)
_KEEPS_NOTHING = tuple(getattr(cache_utils, name) for name in ("DummyLayer",) if hasattr(cache_utils, name))


def _layer_types(config: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """The layer types of ``config``'s decoder and each layer's keyword arguments (transformers < 5.2x gives one
    dict for all)."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if isinstance(layer_kwargs, dict):
        layer_kwargs = [layer_kwargs] * len(layer_types)
    return list(layer_types), list(layer_kwargs)


def unkept_layer(config: Any) -> tuple[int, str, str] | None:
    """The first layer of ``config``'s decoder that a running batch cannot keep: ``(index, type, why)``, else
    ``None``. It keeps the types of :data:`BATCHED_LAYERS` and any kind of full-attention layer; state layers only
    where transformers counts the positions they have seen (from which a model takes its next ``cache_position``)."""
    for index, kind in enumerate(_layer_types(config)[0]):
        layer_class = cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.get(kind)
        if kind not in BATCHED_LAYERS and not (layer_class is not None and issubclass(layer_class, DynamicLayer)):
            return index, kind, "a layer the running batch has no operations for"
        if kind in STATE_TYPES and not STATES_COUNT_POSITIONS:
            return index, kind, f"transformers {transformers.__version__}'s state layers count no positions"
    return None


def attends(config: Any) -> bool:
    """Whether ``config``'s decoder has an attention layer (its forward masks the past, ``(B, L + q)``); a decoder of
    state layers alone takes the mask of its new positions ``(B, q)`` (Mamba's mixers multiply their inputs by it)."""
    return any(kind not in ("linear_attention", "conv", "dummy", "moe", "mlp") for kind in _layer_types(config)[0])


def cache_maker(config: Any) -> Callable[[], DynamicCache]:
    """What makes an empty cache for a running batch of ``config``'s decoder (the config read once): a plain
    ``DynamicCache`` where every layer is an attention layer (or of a type :data:`BATCHED_LAYERS` does not name),
    else one layer of :data:`BATCHED_LAYERS` per layer (state layers, layers that keep nothing)."""
    layer_types, layer_kwargs = _layer_types(config)
    if all(kind in ATTENTION_TYPES for kind in layer_types) or not all(kind in BATCHED_LAYERS for kind in layer_types):
        return DynamicCache
    plan = [
        (BATCHED_LAYERS[kind], {key: value for key, value in kwargs.items() if key != "sliding_window"})
        for kind, kwargs in zip(layer_types, layer_kwargs, strict=True)
    ]

    def make() -> DynamicCache:
        cache = DynamicCache()
        cache.layers, cache.layer_class_to_replicate = [layer(**kwargs) for layer, kwargs in plan], None
        return cache

    return make


def batch_cache(config: Any) -> DynamicCache:
    """An empty cache for a running batch of ``config``'s decoder (:func:`cache_maker`)."""
    return cache_maker(config)()


def _has_attention(layer: Any) -> bool:
    return isinstance(layer, DynamicLayer)


def _has_state(layer: Any) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _batched_layers(cache: Any) -> list[Any]:
    """The layers of ``cache``, each checked to be one a running batch keeps: a growing full-attention layer
    (keys and values tensors), a state layer, both, or a layer that keeps nothing."""
    layers = list(getattr(cache, "layers", ()))
    for layer in layers:
        attention_ok = not _has_attention(layer) or (
            not getattr(layer, "is_sliding", False) and isinstance(getattr(layer, "keys", None), torch.Tensor)
        )
        state_ok = not _has_state(layer) or not layer.record_past
        known = _has_attention(layer) or _has_state(layer) or isinstance(layer, _KEEPS_NOTHING)
        if not (attention_ok and state_ok and known):
            raise ValueError(
                f"{type(cache).__name__} layer {type(layer).__name__}: only initialized full-attention layers "
                "(DynamicLayer) and state layers (LinearAttentionLayer) can be batched this way"
            )
    return layers


def _pad_left(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``(B, heads, n, d)`` -> ``(B, heads, length, d)`` with zeros before the ``n`` positions."""
    missing = length - tensor.shape[-2]
    if missing == 0:
        return tensor
    padding = tensor.new_zeros(*tensor.shape[:-2], missing, tensor.shape[-1])
    return torch.cat([padding, tensor], dim=-2)


def _state_tensors(layer: Any) -> list[tuple[str, int]]:
    """The ``(attribute, state index)`` of each initialized state tensor of a state layer."""
    names = []
    for index in range(layer.number_of_states):
        if layer.is_conv_states_initialized[index]:
            names.append(("conv_states", index))
        if layer.is_recurrent_states_initialized[index]:
            names.append(("recurrent_states", index))
    return names


def concatenate_batches(cache: Any, *others: Any) -> None:
    """Append the rows of ``others`` to ``cache``, in place; attention rows left-padded to the longest length."""
    layer_lists = [_batched_layers(each) for each in (cache, *others)]
    if len({len(layers) for layers in layer_lists}) != 1:
        raise ValueError("caches of different numbers of layers cannot be concatenated")
    for index, layer in enumerate(layer_lists[0]):
        parts = [layers[index] for layers in layer_lists]
        if _has_attention(layer):
            length = max(part.keys.shape[-2] for part in parts)
            layer.keys = torch.cat([_pad_left(part.keys, length) for part in parts], dim=0)
            layer.values = torch.cat([_pad_left(part.values, length) for part in parts], dim=0)
        if _has_state(layer):
            for name, state in _state_tensors(layer):
                getattr(layer, name)[state] = torch.cat([getattr(part, name)[state] for part in parts], dim=0)
            if hasattr(layer, "cumulative_length_linear"):  # the positions seen (transformers >= 5.2x)
                layer.cumulative_length_linear.fill_(max(int(part.cumulative_length_linear) for part in parts))


def keep_rows(cache: Any, indices: torch.Tensor) -> None:
    """Keep only the rows ``indices`` ``(k,)`` of ``cache``, in that order, in place."""
    for layer in _batched_layers(cache):
        if _has_attention(layer):
            layer.keys = layer.keys.index_select(0, indices.to(layer.keys.device))
            layer.values = layer.values.index_select(0, indices.to(layer.values.device))
        if _has_state(layer):
            for name, state in _state_tensors(layer):
                tensor = getattr(layer, name)[state]
                getattr(layer, name)[state] = tensor.index_select(0, indices.to(tensor.device))


def drop_leading(cache: Any, count: int) -> None:
    """Drop the first ``count`` positions of every row of ``cache``, in place."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    for layer in _batched_layers(cache):
        if _has_attention(layer):
            layer.keys = layer.keys[..., count:, :].contiguous()
            layer.values = layer.values[..., count:, :].contiguous()
        if _has_state(layer) and hasattr(layer, "cumulative_length_linear"):
            layer.cumulative_length_linear.sub_(count)


#: the operations a stand-in runs on the ranks' cache by name (arguments that are caches travel as their ids)
OPERATIONS = {"concatenate_batches": concatenate_batches, "keep_rows": keep_rows, "drop_leading": drop_leading}
