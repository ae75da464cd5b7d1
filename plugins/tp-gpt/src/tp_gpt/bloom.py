"""BLOOM's ALiBi bias, cut to a rank's heads.

``BloomModel`` builds one ALiBi bias for all heads, ``[batch * heads, 1, keys]`` (one slope per
head), and hands it to every block. A rank's attention holds heads ``[r * h, (r + 1) * h)`` of the
``H = N * h`` heads, so it must add only their rows::

    alibi.view(batch, H, 1, keys)[:, r * h : (r + 1) * h].reshape(batch * h, 1, keys)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.models.bloom.modeling_bloom import BloomAttention


def local_alibi(alibi: torch.Tensor, local_heads: int, group) -> torch.Tensor:
    """This rank's rows of the all-heads ALiBi bias (see module docstring)."""
    if group is None or dist.get_world_size(group) == 1:
        return alibi
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    all_heads = local_heads * world_size
    batch = alibi.shape[0] // all_heads
    rows = alibi.view(batch, all_heads, *alibi.shape[1:])[:, rank * local_heads : (rank + 1) * local_heads]
    return rows.reshape(batch * local_heads, *alibi.shape[1:])


class BloomAttentionTP(BloomAttention):
    """``BloomAttention`` that adds only its own heads' ALiBi bias; the math is BLOOM's."""

    tp_group = None

    def forward(self, *args, alibi: torch.Tensor, **kwargs):
        return super().forward(*args, alibi=local_alibi(alibi, self.num_heads, self.tp_group), **kwargs)
