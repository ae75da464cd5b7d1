"""Fused MoE experts whose weights are stored quantized: a rank's shard of every expert, dequantized per forward.

A fused experts module holds every expert in two 3-d parameters, ``gate_up_proj`` and ``down_proj``, and its forward
(transformers' own, eager or grouped) reads them whole. :class:`QuantizedExperts` is a mixin placed before such a class
(:func:`quantized_experts_class`): its ``gate_up_proj`` and ``down_proj`` hold what the format stores, and each forward
runs the class's own forward on the experts the tokens are routed to alone: their plain weights, which the format's
:meth:`~QuantizedExperts.dequantized` makes, and their rows of any other per-expert tensor (biases) swapped in,
``num_experts`` their count and each token's expert indices renumbered among them; then the stored tensors are put
back. The rank so keeps its share of the quantized bytes and never more than one layer's routed experts in full
precision, and dequantizes nothing for the experts no token reaches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from tpcore.errors import ShardingError
from tpcore.parallel.quantized_linear import QuantizedLayer

__all__ = ["PROJECTIONS", "QuantizedExperts", "hold_experts", "quantized_experts_class"]

#: the fused experts' weights a quantized experts layer holds as stored
PROJECTIONS = ("gate_up_proj", "down_proj")


class QuantizedExperts(QuantizedLayer):
    """Mixin before a fused experts class (module docstring): subclasses say how a projection dequantizes."""

    #: the tensors it holds beside ``gate_up_proj`` and ``down_proj`` (their scales), which follow their cuts
    companions: tuple[str, ...] = ()

    def dequantized(self, projection: str, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's plain ``projection`` weight of the ``experts`` (indices, ascending) in ``dtype``: its shape in
        the plain module with this rank's share of the features and ``len(experts)`` experts."""
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        stored = dict(self._parameters)
        count = stored[PROJECTIONS[0]].shape[0]  # type: ignore[union-attr]
        experts = top_k_index.unique()  # ascending
        renumbered = torch.empty(count, dtype=top_k_index.dtype, device=top_k_index.device)
        renumbered[experts] = torch.arange(len(experts), dtype=top_k_index.dtype, device=top_k_index.device)
        plain_count = self.__dict__.get("num_experts")
        try:
            for name, tensor in stored.items():
                if name in PROJECTIONS:
                    self._parameters[name] = self.dequantized(name, experts, hidden_states.dtype)  # type: ignore[assignment]
                elif name not in self.companions and tensor is not None and tensor.dim() and tensor.shape[0] == count:
                    self._parameters[name] = tensor[experts]  # type: ignore[assignment]  # a per-expert bias
            self.__dict__["num_experts"] = len(experts)
            return super().forward(hidden_states, renumbered[top_k_index], *args, **kwargs)
        finally:
            self._parameters.update(stored)
            if plain_count is None:
                self.__dict__.pop("num_experts")
            else:
                self.__dict__["num_experts"] = plain_count


@functools.cache
def quantized_experts_class(mixin: type[QuantizedExperts], cls: type[nn.Module]) -> type[nn.Module]:
    """The class of fused experts ``cls`` holding its weights as ``mixin`` stores them; it names ``cls`` as its
    ``plain_class``, so that the policies written for ``cls`` apply to it."""
    doc = f"``{cls.__qualname__}`` holding its weights as {mixin.__name__} stores them, dequantized per forward."
    namespace = {"__doc__": doc, "__module__": mixin.__module__, "plain_class": cls}
    return type(f"{mixin.__name__.removesuffix('Experts')}{cls.__name__}", (mixin, cls), namespace)


Held = TypeVar("Held", bound=QuantizedExperts)


def hold_experts(module: nn.Module, mixin: type[Held], where: str, hold: Callable[[Held], None]) -> Held:
    """Make the meta fused experts ``module`` hold its weights as ``mixin`` stores them, in place: its class becomes
    :func:`quantized_experts_class`'s and ``hold`` gives it the stored tensors; a layout ``hold`` refuses
    (``ValueError``) is a :class:`~tpcore.ShardingError` naming ``where``."""
    module.__class__ = quantized_experts_class(mixin, type(module))  # type: ignore[arg-type]
    assert isinstance(module, mixin)
    try:
        hold(module)
    except ValueError as error:
        raise ShardingError(f"{where}: {error}") from None
    return module
