"""The plan's last check, for forwards tpcore has not read: a trial run on a tiny copy of the config.

The static checks of :func:`~tpcore.plan.plan_for` see tensors and attributes, not the forward that reads
them: a forward that reshapes with a head count or width of its own (``view(b, s, -1, width)`` over a cut
that is not whole heads of that width, a count read from its config) passes them and fails on the ranks.
For the policies that ask for it (``verify_by_trial = True``: those derived from a transformers tp plan,
whose forward no one wrote a policy against), :func:`check_by_trial` plans the model's tiny copy the same
way (:mod:`tpcore.plan.tiny_copy`: the same head counts, every width small), makes one copy each rank's
shard with no process group (the collectives are no-ops, so every shape and reshape runs though the sums
do not) and runs a forward on a few token ids. A rank's exception refuses the split
(:class:`~tpcore.ShardingError` naming the model, the world size, the rank and the error) before any rank
starts or the model is touched. A trial that cannot be made (the tiny copy does not build, its unsplit
forward does not run, its plan differs) refuses nothing.

The outcome is cached per (model class, config, policies, world size, vocabulary split). Where
torch.distributed is initialized (a rank of an SPMD world), no trial runs: a module without a group would
use the default one there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tpcore.plan.shard_plan import ShardPlan
from tpcore.plan.tiny_copy import Outcome, TinyCopy, first_line, is_config, outcome, refusal

__all__ = ["check_by_trial", "needs_trial"]


def needs_trial(policies: list[Any]) -> bool:
    """Whether some policy asks for a trial run of its split (``verify_by_trial = True``)."""
    return any(getattr(policy, "verify_by_trial", False) for policy in policies)


def check_by_trial(
    model: nn.Module, policies: list[Any], world_size: int, plan_tiny: Callable[[nn.Module], ShardPlan], key: Any = ()
) -> None:
    """Raise :class:`ShardingError` when the split ``plan_tiny`` makes of a tiny copy of ``model`` fails on a
    rank; nothing when it runs everywhere or no trial can be made (see the module docstring). ``key``: what
    else ``plan_tiny`` depends on (cached with it)."""
    if world_size < 2 or not needs_trial(policies) or not is_config(getattr(model, "config", None)):
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    failure = outcome(_ranks_run_alone, model, policies, world_size, plan_tiny, key, unmade_refuses=False).failure
    if failure is not None:
        raise refusal(
            model,
            world_size,
            ": the plan is accepted, but a trial of it on a tiny copy of its config (the same head counts) fails "
            f"on {failure}; its forward reads a size the split does not give it (use a world size that divides its "
            "head counts, or a plugin policy)",
        )


def _ranks_run_alone(tiny: TinyCopy) -> Outcome:
    """``"rank r: <error>"`` for the first rank whose shard of the tiny copy, run alone, fails its forward."""
    for rank in range(tiny.plan.world_size):
        try:
            shard = tiny.shard(rank)
            with torch.inference_mode():
                shard(**tiny.inputs)
        except Exception as error:
            return Outcome(f"rank {rank}: {first_line(error)}")
    return Outcome()
