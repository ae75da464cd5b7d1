"""State-space language models: Mamba's mixer split by channels.

A Mamba mixer widens the hidden state ``H`` to ``I`` channels (``in_proj``: ``[x | gate]``, ``2 I``), runs
a depthwise causal convolution and a selective scan that never mix channels, and narrows back
(``out_proj``). Only ``x_proj`` reads every channel: it makes the scan's time step (``R`` features) and its
``B`` and ``C`` (``S`` each) shared by all channels. So rank ``r`` keeps its channels of everything that is
per channel, and ``x_proj`` and ``out_proj`` are row parallel (one all-reduce each):

- ``in_proj`` column, ``[x | gate]`` cut in each half; the conv (``depthwise_conv``) by channel;
- ``x_proj`` row: its partial sums over the rank's channels all-reduced into the whole ``[dt | B | C]``;
- ``dt_proj`` (``R -> I``) column; ``A_log`` ``(I, S)`` and ``D`` ``(I,)`` by channel (``PER_HEAD`` of
  ``I`` one-channel heads);
- ``out_proj`` row.

The recurrent and conv states of the cache follow the rank's channels (they are made from the first
tensors they get). The embeddings, norms (over ``H``, whole) and LM head are replicated or vocab-split as
usual.
"""

from __future__ import annotations

from tpcore import COLUMN, PER_HEAD, ROW, Layer, Policy, depthwise_conv, linear, share, transformers_class

CHANNELS = "intermediate_size"


class MambaMixerPolicy(Policy):
    """Mamba's ``MambaMixer``: its ``intermediate_size`` channels dealt over the ranks (see the module docstring)."""

    layer_class = transformers_class("mamba", "MambaMixer")

    @staticmethod
    def replace_arguments(config, world_size):
        return {"intermediate_size": share(config.intermediate_size, world_size, CHANNELS)}

    @staticmethod
    def layers():
        return [
            linear("in_proj", style=COLUMN, n_fused=2),
            depthwise_conv("conv1d"),
            linear("x_proj", style=ROW),
            linear("dt_proj", style=COLUMN),
            Layer(weight="A_log", style=PER_HEAD, heads=CHANNELS),
            Layer(weight="D", style=PER_HEAD, heads=CHANNELS),
            linear("out_proj", style=ROW),
        ]


POLICIES = (MambaMixerPolicy,)
