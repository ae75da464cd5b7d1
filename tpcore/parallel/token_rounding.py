"""Dynamic per-token activation quantization, as compressed-tensors fake-quantizes a layer's input at run time
(``FP8_DYNAMIC``, ``W8A8``): each token's input is rounded through 8-bit values with a scale of its own::

    s_t = max_j |x[t, j]| / h       (h = 448 for e4m3, 127.5 for int8; the dtype's epsilon where 0)
    x'[t, j] = round(clamp(x[t, j] / s_t, lo, hi)) * s_t

``round`` is e4m3's (lo, hi = -448, 448) or the nearest integer (-128, 127). The maximum runs over the token's whole
input: a row-parallel layer, holding some of its features, gathers every rank's maximum
(:class:`GatheredTokenMaxima`, one all-gather of a float a token) and rounds its features as the whole layer does.

``FP8_BLOCK`` rounds per group of ``G`` input features instead (:class:`GroupRoundedInputs`): ``s_{t,g}`` is the
maximum over the features ``j`` of group ``g = j // G``, the group of each feature a rank holds given by its layer
(``scale_cols``); a row-parallel layer, whose cut may fall inside a group, gathers every rank's group maxima
(:class:`GatheredGroupMaxima`, one all-gather of ``in / G`` floats a token).
"""

from __future__ import annotations

import torch
from torch import nn

from tpcore.parallel.comm import all_gather

__all__ = [
    "E4M3_MAX", "GatheredGroupMaxima", "GatheredTokenMaxima", "GroupRoundedInputs", "TokenRoundedInputs",
    "rounded_per_token",
]  # fmt: skip

#: the largest finite float8_e4m3fn value
E4M3_MAX = 448.0
#: each kind of 8-bit value: ``(h, lo, hi)`` of the module docstring
_RANGES = {"e4m3": (E4M3_MAX, -E4M3_MAX, E4M3_MAX), "int8": (127.5, -128.0, 127.0)}


def rounded_per_token(x: torch.Tensor, maxima: torch.Tensor, values: str) -> torch.Tensor:
    """``x (..., in)`` rounded through ``values`` (``"e4m3"`` or ``"int8"``) with each token's scale from its
    ``maxima (..., 1)``, ``max_j |x[t, j]|`` over the whole input (module docstring)."""
    half_range, low, high = _RANGES[values]
    scale = maxima / half_range
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    scaled = (x / scale).clamp_(low, high)
    rounded = scaled.to(torch.float8_e4m3fn).to(x.dtype) if values == "e4m3" else scaled.round_()
    return rounded * scale


class TokenRoundedInputs(nn.Module):
    """Mixin before a :class:`~tpcore.parallel.quantized_linear.QuantizedLinear`: its input rounded per token
    through :attr:`token_values`."""

    token_values = "e4m3"

    def token_maxima(self, x: torch.Tensor) -> torch.Tensor:
        """``max_j |x[..., j]|`` over each token's whole input, ``(..., 1)``."""
        return x.abs().amax(dim=-1, keepdim=True)

    def quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        return rounded_per_token(x, self.token_maxima(x), self.token_values)


class GatheredTokenMaxima(TokenRoundedInputs):
    """Mixin for a row-parallel layer's class: each token's maximum over every rank's features."""

    tp_group = None

    def token_maxima(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(super().token_maxima(x), self.tp_group).amax(dim=-1, keepdim=True)


class GroupRoundedInputs(nn.Module):
    """Mixin before a :class:`~tpcore.parallel.quantized_linear.BlockFP8Linear`: its input rounded through
    :attr:`token_values` per token and group of input features, a group being a column block of its weight
    (``scale_cols``: the block of each feature this rank holds, out of ``weight_scale_inv``'s columns)."""

    token_values = "e4m3"
    scale_cols: torch.Tensor
    weight_scale_inv: nn.Parameter
    whole_column_blocks: bool

    def group_maxima(self, x: torch.Tensor) -> torch.Tensor:
        """``max |x[..., j]|`` over each group's features this rank holds, ``(..., groups)``."""
        magnitudes = x.abs()
        groups = self.weight_scale_inv.shape[1]
        if self.whole_column_blocks:  # every group whole, in order
            return magnitudes.view(*x.shape[:-1], groups, -1).amax(dim=-1)
        maxima = magnitudes.new_zeros(*x.shape[:-1], groups)
        return maxima.scatter_reduce_(-1, self.scale_cols.expand_as(magnitudes), magnitudes, "amax")

    def quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        maxima = self.group_maxima(x).index_select(-1, self.scale_cols)  # each feature's group maximum
        return rounded_per_token(x, maxima, self.token_values)


class GatheredGroupMaxima(GroupRoundedInputs):
    """Mixin for a row-parallel layer's class: each group's maximum over every rank's features."""

    tp_group = None

    def group_maxima(self, x: torch.Tensor) -> torch.Tensor:
        local = super().group_maxima(x)
        gathered = all_gather(local, self.tp_group)  # (..., world * groups), rank by rank
        return gathered.view(*local.shape[:-1], -1, local.shape[-1]).amax(dim=-2)
