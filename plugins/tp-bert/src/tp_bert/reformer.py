"""Reformer: LSH attention's random rotations drawn for every head, kept for the rank's."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tpcore import IfHeld, Policy, linear, share, subclassing, transformers_class

_HEADS = "num_attention_heads"


class _RankHeadsDraws(TorchFunctionMode):
    """While active, ``torch.randn`` of a shape that starts with the rank's ``local`` heads draws for all
    ``full`` heads and keeps the rank's, from ``first``: the random numbers every head gets, and how
    many the generator gives out, are the unsplit model's."""

    def __init__(self, full: int, first: int, local: int):
        super().__init__()
        self.full, self.first, self.local = full, first, local

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.randn and self.full != self.local:
            shape = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if shape and shape[0] == self.local:
                return func((self.full, *shape[1:]), **kwargs)[self.first : self.first + self.local]
        return func(*args, **kwargs)


def rank_rotations_lsh_attention(module: nn.Module | None) -> type[nn.Module] | None:
    """For Reformer's LSH attention, which hashes with random rotations ``(heads, head_size, hashes,
    buckets / 2)`` drawn in every forward (from ``hash_seed``, or the global generator): a subclass whose
    ``_hash_vectors`` draws them for all ``full_heads`` heads and keeps the rank's (from ``first_head``),
    so each head hashes as it does unsplit. ``None`` for the local attention, which draws nothing."""
    return _rank_rotations(module) if hasattr(module, "_hash_vectors") else None


@subclassing("RankRotations")
def _rank_rotations(base: type) -> dict:
    """Reformer's LSH attention drawing every head's rotations and keeping the rank's
    (:func:`rank_rotations_lsh_attention`)."""

    def _hash_vectors(self, *args, **kwargs):
        with _RankHeadsDraws(self.full_heads, self.first_head, self.num_attention_heads):
            return base._hash_vectors(self, *args, **kwargs)

    return {"_hash_vectors": _hash_vectors, "full_heads": None, "first_head": None}


class ReformerPolicy(Policy):
    """A Reformer layer (reversible: its attention and feed-forward each add to one half of the
    stream): LSH attention (``query_key``, ``value``; rotations per :func:`rank_rotations_lsh_attention`)
    or local attention (``query``, ``key``, ``value``), ``output.dense`` row parallel;
    ``feed_forward.dense.dense`` and ``feed_forward.output.dense``."""

    layer_class = transformers_class("reformer", "ReformerLayer")

    @staticmethod
    def replace_arguments(config, world_size):
        heads = share(config.num_attention_heads, world_size, _HEADS)
        first = share(config.num_attention_heads, world_size, _HEADS, first=True)
        attention, lsh = "attention.self_attention", "attention.self_attention.query_key"
        arguments = {f"{attention}.num_attention_heads": heads}
        arguments[f"{attention}.all_head_size"] = heads * config.attention_head_size
        arguments[f"{attention}.full_heads"] = IfHeld(config.num_attention_heads, lsh)
        arguments[f"{attention}.first_head"] = IfHeld(first, lsh)
        return arguments

    @staticmethod
    def replace_modules():
        return {"attention.self_attention": rank_rotations_lsh_attention}

    @staticmethod
    def attn_qkv():
        names = ("query_key", "value", "query", "key")  # LSH: query_key, value; local: query, key, value
        return [linear(f"attention.self_attention.{name}", optional=True, heads=_HEADS) for name in names]

    @staticmethod
    def attn_out():
        return [linear("attention.output.dense", heads=_HEADS)]

    @staticmethod
    def mlp_in():
        return [linear("feed_forward.dense.dense")]

    @staticmethod
    def mlp_out():
        return [linear("feed_forward.output.dense")]
