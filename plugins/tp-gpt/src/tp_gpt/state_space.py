"""State-space language models: Mamba's mixer split by channels, Mamba2's by groups of heads.

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

Mamba2's mixer has ``num_heads`` heads of ``head_dim`` channels in ``n_groups`` groups, each group's heads
reading one ``B`` and one ``C`` of ``state_size``. Rank ``r`` keeps whole groups (``n_groups`` dealt), with their heads,
channels, ``B`` and ``C``; with fewer groups than ranks, each group's heads are dealt over the ranks sharing
it (up to one head a rank):

- ``in_proj`` column: ``[z | x | B | C | dt]`` packs parts measured in different units (``parts=(heads,
  heads, groups, groups, heads)`` of ``widths=(head_dim, head_dim, state, state, 1)``), each cut by the
  rank's groups; the conv over ``[x | B | C]`` alike (``depthwise_conv``);
- ``dt_bias``, ``A_log``, ``D`` (one per head) and the gated RMSNorm's weight by the rank's heads; the norm
  (its statistic per group of ``intermediate / n_groups`` channels) becomes ``tpcore.ColumnSplitGatedRMSNorm``,
  local where the rank holds whole groups, one all-reduce of the groups' sums where fewer groups than ranks
  are shared (their ``B`` and ``C`` then replicated on the ranks sharing them, each head on one rank);
- ``out_proj`` row; the mixer's ``num_heads``, ``n_groups``, ``intermediate_size`` and ``conv_dim`` the rank's.

The recurrent and conv states of the cache follow the rank's channels (they are made from the first
tensors they get). The embeddings, norms (over ``H``, whole) and LM head are replicated or vocab-split as
usual.
"""

from __future__ import annotations

from tpcore import (
    COLUMN,
    PER_HEAD,
    ROW,
    Layer,
    Policy,
    ShardingError,
    depthwise_conv,
    gated_norm_class,
    linear,
    share,
    transformers_class,
)

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


class FalconMambaMixerPolicy(MambaMixerPolicy):
    """Falcon-Mamba's mixer: Mamba's, with parameter-free RMS norms on the (whole, all-reduced) dt, B and C."""

    layer_class = transformers_class("falcon_mamba", "FalconMambaMixer")


HEADS, GROUPS = "num_heads", "n_groups"


class Mamba2MixerPolicy(Policy):
    """Mamba2's ``Mamba2Mixer``: its ``n_groups`` groups of heads dealt over the ranks (see the module docstring)."""

    layer_class = transformers_class("mamba2", "Mamba2Mixer")

    @staticmethod
    def replace_arguments(config, world_size):
        _refuse_replicated_heads(config, world_size)
        heads = share(config.num_heads, world_size, HEADS, groups=config.n_groups)
        groups = share(config.n_groups, world_size, GROUPS)  # fewer groups than ranks: each rank one, shared
        channels = heads * config.head_dim
        first = share(config.num_heads, world_size, HEADS, groups=config.n_groups, first=True)
        return {
            "num_heads": heads,
            "n_groups": groups,
            "intermediate_size": channels,
            "conv_dim": channels + groups * (2 * config.state_size),
            "norm.first_channel": first * config.head_dim,
            "norm.num_groups": config.n_groups,
            "norm.groups_split": config.n_groups < world_size,
        }

    @staticmethod
    def replace_modules():
        return {"norm": gated_norm_class}

    @staticmethod
    def layers():
        per_head = {"style": PER_HEAD, "heads": HEADS, "groups": GROUPS}
        return [
            linear(
                "in_proj",
                style=COLUMN,
                parts=(HEADS, HEADS, GROUPS, GROUPS, HEADS),
                widths=("head_dim", "head_dim", "state_size", "state_size", 1),
                groups=GROUPS,
            ),
            depthwise_conv(
                "conv1d", parts=(HEADS, GROUPS, GROUPS), widths=("head_dim", "state_size", "state_size"), groups=GROUPS
            ),
            Layer(weight="dt_bias", **per_head),
            Layer(weight="A_log", **per_head),
            Layer(weight="D", **per_head),
            Layer(weight="norm.weight", **per_head),
            linear("out_proj", style=ROW, heads=HEADS, groups=GROUPS),
        ]


def _refuse_replicated_heads(config, world_size: int) -> None:
    """Each head on one rank: where the ranks sharing a group outnumber its heads, they would hold copies."""
    sharing = -(-world_size // config.n_groups)
    if config.num_heads // config.n_groups < sharing:
        raise ShardingError(
            f"Mamba2 over {world_size} ranks: {sharing} ranks would share each of its {config.n_groups} groups of "
            f"{config.num_heads // config.n_groups} heads, more ranks than heads; use at most "
            f"{config.num_heads // config.n_groups * config.n_groups} ranks"
        )


POLICIES = (MambaMixerPolicy, FalconMambaMixerPolicy, Mamba2MixerPolicy)
