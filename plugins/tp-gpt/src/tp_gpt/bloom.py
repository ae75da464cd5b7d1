"""BLOOM's ALiBi bias, cut to a rank's heads.

``BloomModel`` builds one ALiBi bias for all ``H`` heads, ``[batch * H, 1, keys]`` (one slope per
head), and hands it to every block. A rank's attention holds the ``h`` heads ``[f, f + h)``
(``first_head``; ``h`` differs by rank where the ranks do not divide ``H``), so it must add only their
rows::

    alibi.view(batch, H, 1, keys)[:, f : f + h].reshape(batch * h, 1, keys)
"""

from __future__ import annotations

import torch
from transformers.models.bloom.modeling_bloom import BloomAttention


def local_alibi(alibi: torch.Tensor, first_head: int, local_heads: int, all_heads: int) -> torch.Tensor:
    """This rank's rows of the all-heads ALiBi bias (see module docstring)."""
    if local_heads == all_heads:
        return alibi
    batch = alibi.shape[0] // all_heads
    rows = alibi.view(batch, all_heads, *alibi.shape[1:])[:, first_head : first_head + local_heads]
    return rows.reshape(batch * local_heads, *alibi.shape[1:])


class BloomAttentionTP(BloomAttention):
    """``BloomAttention`` that adds only its own heads' ALiBi bias; the math is BLOOM's."""

    tp_group = None
    first_head = 0

    def forward(self, hidden_states: torch.Tensor, *args, alibi: torch.Tensor, **kwargs):
        all_heads = alibi.shape[0] // hidden_states.shape[0]
        alibi = local_alibi(alibi, self.first_head, self.num_heads, all_heads)
        return super().forward(hidden_states, *args, alibi=alibi, **kwargs)
