"""A gated RMSNorm by groups over a column-split activation (Mamba2's ``MambaRMSNormGated``).

The unsplit norm, on ``x [..., C]`` and a gate ``z [..., C]`` whose ``C`` channels form groups of ``group_size``::

    u = x * silu(z)
    y = w * u / sqrt(mean_{group}(u^2) + eps)        the mean over each channel's own group

A rank holds the channels ``[first_channel, first_channel + C_r)``. Where each rank holds whole groups
(``groups_split`` false) its statistic is its own; where groups span ranks, each rank adds its channels'
squares into a vector of every group's sums, one all-reduce of ``num_groups`` numbers per row gives the
whole sums, and each channel reads its group's (a channel must be held by one rank only: heads of a group
dealt, not replicated). Computed in fp32, cast to the input's dtype before the weight, as the unsplit norm.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from tpcore.errors import ShardingError
from tpcore.parallel.comm import all_reduce

__all__ = ["ColumnSplitGatedRMSNorm", "gated_norm_class"]


class ColumnSplitGatedRMSNorm(nn.Module):
    """The forward of a gated group RMSNorm on a rank's channels (module docstring); set on a norm instance
    through :func:`gated_norm_class`, before the norm's own class."""

    tp_group = None
    first_channel = 0
    num_groups = 1
    groups_split = False
    group_size: int
    variance_epsilon: float
    weight: torch.Tensor

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        if gate is not None:
            x = x * nn.functional.silu(gate.to(torch.float32))
        channels = torch.arange(x.shape[-1], device=x.device) + self.first_channel
        groups = torch.div(channels, self.group_size, rounding_mode="floor")
        sums = x.new_zeros(*x.shape[:-1], self.num_groups).index_add_(-1, groups, x.pow(2))
        if self.groups_split:
            sums = all_reduce(sums, self.tp_group)
        variance = sums.index_select(-1, groups) / self.group_size
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)


def gated_norm_class(module: nn.Module) -> type[nn.Module]:
    """A subclass of ``type(module)`` computing it as :class:`ColumnSplitGatedRMSNorm`, for a gated group
    RMSNorm (a 1-D ``weight``, ``group_size``, ``variance_epsilon``); :class:`ShardingError` otherwise."""
    weight = module._parameters.get("weight")
    if (
        weight is None
        or weight.dim() != 1
        or not isinstance(getattr(module, "group_size", None), int)
        or not isinstance(getattr(module, "variance_epsilon", None), float)
    ):
        raise ShardingError(
            f"no column-split gated norm for a {type(module).__qualname__}: not a gated RMSNorm with a 1-D weight, "
            "group_size and variance_epsilon"
        )
    kind: Any = type(module)  # a class is hashable, whatever mypy reads of type[Module]
    return _subclass(kind)


@functools.cache
def _subclass(cls: type) -> type[nn.Module]:
    attributes = {
        "__doc__": f"``{cls.__qualname__}`` over a column-split activation (:class:`ColumnSplitGatedRMSNorm`).",
        "__module__": __name__,
    }
    return type(f"ColumnSplit{cls.__name__}", (ColumnSplitGatedRMSNorm, cls), attributes)
