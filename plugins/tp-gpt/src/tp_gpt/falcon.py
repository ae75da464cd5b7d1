"""Falcon's fused ``query_key_value`` layouts and its ALiBi bias, cut to a rank's heads.

Three config flags choose how ``query_key_value`` packs the ``H`` query heads and their key/value
heads, and each is one pack of key/value groups, every group holding its query heads, then its key
and its value head (``Layer(parts=(H, G, G), interleaved=True)``, see :class:`tpcore.Layer`):

====================================  ============================  ==========================
config                                layout                        groups ``G``
====================================  ============================  ==========================
``new_decoder_architecture``          ``[q.. k v | q.. k v | ...]``  ``num_kv_heads``
``multi_query`` (Falcon-7B)           ``[q (H heads) | k | v]``      1
neither (Falcon-RW)                   ``[q0 k0 v0 | q1 k1 v1 | ...]`` ``H``
====================================  ============================  ==========================

So one policy serves all three, ``G`` read from the config flags; a rank's
piece is again such a pack of its own groups, or, with fewer groups than ranks, its query heads of
one group beside that group's key and value head (Falcon-7B's 71 heads over any world up to 71).

With ``alibi``, ``FalconModel`` folds one bias of all ``H`` heads into the attention mask,
``[batch, H, queries, keys]``, and hands it to every layer (before transformers 5.25, the bias,
``[batch * H, 1, keys]``, too, as the attention's ``alibi`` argument); a rank's attention holds the
query heads ``[f, f + h)`` (``first_head``) and must add only theirs.
"""

from __future__ import annotations

import inspect

import torch
from transformers.models.falcon.modeling_falcon import FalconAttention

from tp_gpt.bloom import local_alibi


def own_heads(tensor: torch.Tensor | None, first_head: int, local_heads: int, batch: int) -> torch.Tensor | None:
    """This rank's heads of a per-head bias: ``[batch, H, ...]`` along dim 1, ``[batch * H, ...]`` by rows;
    a tensor with one row per batch entry (a mask shared by all heads) is kept whole."""
    if tensor is None:
        return None
    if tensor.dim() == 4:
        return tensor if tensor.shape[1] == 1 else tensor[:, first_head : first_head + local_heads]
    return local_alibi(tensor, first_head, local_heads, tensor.shape[0] // batch)


#: the arguments of ``FalconAttention.forward`` after ``hidden_states`` (``alibi`` among them before 5.25)
_ARGUMENTS = tuple(inspect.signature(FalconAttention.forward).parameters)[2:]
#: the arguments that carry the all-heads bias
_BIASED = ("alibi", "attention_mask")


class FalconAttentionTP(FalconAttention):
    """``FalconAttention`` that adds only its own heads' ALiBi bias (in ``alibi`` where the attention
    takes it, and in the mask it is folded into); the math is Falcon's."""

    first_head = 0

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        arguments = dict(zip(_ARGUMENTS[: len(args)], args, strict=True)) | kwargs
        batch = hidden_states.shape[0]
        for name in _BIASED:
            if name in arguments:
                arguments[name] = own_heads(arguments[name], self.first_head, self.num_heads, batch)
        return super().forward(hidden_states, **arguments)


def attention_class(module: FalconAttention) -> type[FalconAttention] | None:
    """:class:`FalconAttentionTP` for an ALiBi attention (Falcon's own class, flash or not, otherwise)."""
    return FalconAttentionTP if module.config.alibi else None
