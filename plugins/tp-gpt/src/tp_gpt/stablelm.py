"""StableLM's per-head q/k LayerNorms (``qk_layernorm``), for a rank's heads.

``StableLmLayerNormPerHead`` holds one ``LayerNorm(head_dim)`` per head in a ``ModuleList`` and
normalizes head ``i`` of its ``[batch, heads, seq, head_dim]`` input with ``norms[i]``, zipping the
two. A rank's attention holds the heads ``[f, f + h)`` (``first_head``; the key norm's ``f`` is its
first key/value head, a replicated one where there are fewer than the ranks), so it must use
``norms[f : f + h]``: zipped with all the norms, rank ``r > 0`` would normalize its heads with
rank 0's.

The norms stay whole on every rank rather than being cut: they are ``2 * heads * head_dim``
numbers a layer (a LayerNorm's width), and a ``ModuleList`` kept whole keeps its checkpoint keys
(``norms.<head>.weight``), so a rank reads its pieces of a checkpoint as the unsplit model names them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.stablelm.modeling_stablelm import StableLmLayerNormPerHead


class StableLmLayerNormPerHeadTP(StableLmLayerNormPerHead):
    """``StableLmLayerNormPerHead`` normalizing a rank's ``num_heads`` heads from ``first_head`` on."""

    first_head = 0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        norms = self.norms[self.first_head : self.first_head + self.num_heads]
        heads = torch.split(hidden_states, 1, dim=1)
        return torch.cat([norm(head) for norm, head in zip(norms, heads, strict=True)], dim=1)


def per_head_norm_class(module: nn.Module | None) -> type[nn.Module] | None:
    """:class:`StableLmLayerNormPerHeadTP` where the attention has per-head norms (``qk_layernorm``)."""
    return None if module is None else StableLmLayerNormPerHeadTP
