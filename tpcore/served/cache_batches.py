"""Batch operations on KV caches that transformers' ``Cache`` lacks, for a running batch of sequences.

A running batch keeps one left-padded cache: every layer's keys and values ``(B, heads, L, d)``, row ``b``'s
``n_b`` true positions at the right end (``L - n_b`` padding positions at the left, masked out by the caller's
attention mask). Two operations keep it so:

- :func:`concatenate_batches`: sequences join. Each cache's rows are padded on the left with zeros to the
  longest length ``L = max L_i``, then all are concatenated along the batch: ``(sum B_i, heads, L, d)``.
- :func:`drop_leading`: the first ``count`` positions of every row are dropped (padding every row no longer
  needs, once the longest sequences have left): ``(B, heads, L - count, d)``.

Both work on a local ``DynamicCache`` and, through :func:`tpcore.served.caches.batch_operation`, on the cache a split
model's ranks keep (each rank its own heads), with the same code: the caller's stand-in dispatches them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OPERATIONS", "concatenate_batches", "drop_leading"]


def _full_attention_layers(cache: Any) -> list[Any]:
    """The layers of ``cache``, each checked to be a growing full-attention layer (keys and values tensors)."""
    layers = list(getattr(cache, "layers", ()))
    for layer in layers:
        if getattr(layer, "is_sliding", False) or not isinstance(getattr(layer, "keys", None), torch.Tensor):
            raise ValueError(
                f"{type(cache).__name__} layer {type(layer).__name__}: only initialized full-attention layers "
                "(DynamicLayer) can be batched this way"
            )
    return layers


def _pad_left(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``(B, heads, n, d)`` -> ``(B, heads, length, d)`` with zeros before the ``n`` positions."""
    missing = length - tensor.shape[-2]
    if missing == 0:
        return tensor
    padding = tensor.new_zeros(*tensor.shape[:-2], missing, tensor.shape[-1])
    return torch.cat([padding, tensor], dim=-2)


def concatenate_batches(cache: Any, *others: Any) -> None:
    """Append the rows of ``others`` to ``cache``, in place; every row left-padded to the longest length."""
    layer_lists = [_full_attention_layers(each) for each in (cache, *others)]
    if len({len(layers) for layers in layer_lists}) != 1:
        raise ValueError("caches of different numbers of layers cannot be concatenated")
    length = max(layers[0].keys.shape[-2] for layers in layer_lists) if layer_lists[0] else 0
    for index, layer in enumerate(layer_lists[0]):
        parts = [layers[index] for layers in layer_lists]
        layer.keys = torch.cat([_pad_left(part.keys, length) for part in parts], dim=0)
        layer.values = torch.cat([_pad_left(part.values, length) for part in parts], dim=0)


def drop_leading(cache: Any, count: int) -> None:
    """Drop the first ``count`` positions of every row of ``cache``, in place."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    for layer in _full_attention_layers(cache):
        layer.keys = layer.keys[..., count:, :].contiguous()
        layer.values = layer.values[..., count:, :].contiguous()


#: the operations a stand-in runs on the ranks' cache by name (arguments that are caches travel as their ids)
OPERATIONS = {"concatenate_batches": concatenate_batches, "drop_leading": drop_leading}
