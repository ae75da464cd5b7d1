"""Dynamic per-token activation quantization, as compressed-tensors fake-quantizes a layer's input at run time
(``FP8_DYNAMIC``, ``W8A8``): each token's input is rounded through 8-bit values with a scale of its own::

    s_t = max_j |x[t, j]| / h       (h = 448 for e4m3, 127.5 for int8; the dtype's epsilon where 0)
    x'[t, j] = round(clamp(x[t, j] / s_t, lo, hi)) * s_t

``round`` is e4m3's (lo, hi = -448, 448) or the nearest integer (-128, 127). The maximum runs over the token's whole
input: a row-parallel layer, holding some of its features, gathers every rank's maximum
(:class:`GatheredTokenMaxima`, one all-gather of a float a token) and rounds its features as the whole layer does.
"""

from __future__ import annotations

import torch
from torch import nn

from tpcore.parallel.comm import all_gather

__all__ = ["E4M3_MAX", "GatheredTokenMaxima", "TokenRoundedInputs", "rounded_per_token"]

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
