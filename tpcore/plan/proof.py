"""Proof by a trial: a split that no one wrote against the model's forward is used only once it computes the
unsplit outputs on a tiny random copy of the model's config.

The static checks and the shape trial (:mod:`tpcore.plan.trial`) show that every rank's shard runs; they
cannot show that the ranks' partial results add up to the unsplit model's (a norm between a column and a
row layer, an activation that mixes features, a width read elsewhere run fine and compute something else).
For the policies that ask for a proof (``prove_by_trial = True``: the structural policies of
:mod:`tpcore.select.structural`), :func:`check_by_proof` runs the model's tiny copy
(:mod:`tpcore.plan.tiny_copy`: the same head counts) unsplit on a few token ids, then runs every rank's
shard of it at once, each in a thread of a :class:`~tpcore.parallel.threads.ThreadGroup` (the collectives
are real sums across the threads), and compares every output tensor of every rank with the unsplit one:
within ``RTOL`` of its scale (its largest magnitude, at least ``SCALE_FLOOR``). A difference, a rank's
exception, or a tiny copy that cannot be built or run refuses the split (:class:`~tpcore.ShardingError`)
before the user's model is touched; a proof that passes is logged. Outcomes are cached per (model class,
config, policies, world size, vocabulary split).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tpcore.parallel.threads import ThreadGroup, run_ranks
from tpcore.plan.shard_plan import ShardPlan
from tpcore.plan.tiny_copy import Outcome, TinyCopy, first_line, outcome, refusal

__all__ = ["RTOL", "check_by_proof", "needs_proof"]

logger = logging.getLogger("tpcore.plan")

#: the largest difference a proof accepts, relative to each output's scale (fp32, a tiny model)
RTOL = 1e-5
SCALE_FLOOR = 1e-3


def needs_proof(policies: list[Any]) -> bool:
    """Whether some policy asks for its split to be proven on a tiny copy (``prove_by_trial = True``)."""
    return any(getattr(policy, "prove_by_trial", False) for policy in policies)


def check_by_proof(
    model: nn.Module, policies: list[Any], world_size: int, plan_tiny: Callable[[nn.Module], ShardPlan], key: Any = ()
) -> None:
    """Raise :class:`ShardingError` unless the split ``plan_tiny`` makes of a tiny copy of ``model`` computes
    its unsplit outputs on every rank (see the module docstring); log the proof where it does."""
    if world_size < 2:
        return
    failure, difference = outcome(_ranks_agree, model, policies, world_size, plan_tiny, key, unmade_refuses=True)
    names = ", ".join(policy.policy_name() for policy in policies if getattr(policy, "prove_by_trial", False))
    if failure is not None:
        raise refusal(
            model,
            world_size,
            f" by the structural policy it was given ({names}): on a tiny random copy of its config, {failure}; "
            "nothing was split (write a policy, or use a plugin)",
        )
    on_a_rank = torch.distributed.is_available() and torch.distributed.is_initialized()
    logger.log(
        logging.INFO if on_a_rank else logging.WARNING,  # a warning once, where the caller plans
        "%s over %d ranks: split by %s, proven on a tiny random copy of its config (every rank's outputs within "
        "%.0e of the unsplit model's; largest difference %.1e)",
        type(model).__name__,
        world_size,
        names,
        RTOL,
        difference,
    )


def _ranks_agree(tiny: TinyCopy) -> Outcome:
    """Every rank's shard of the tiny copy run at once over a :class:`ThreadGroup`: the largest difference from
    the unsplit outputs when every rank computes every one of them, else what failed."""
    expected = dict(_tensors(tiny.outputs))
    tp_group = ThreadGroup(tiny.plan.world_size)
    shards = [tiny.shard(rank, tp_group) for rank in range(tp_group.world_size)]

    def forward(rank: int) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            return dict(_tensors(shards[rank](**tiny.inputs)))

    try:
        results = run_ranks(tp_group, forward)
    except Exception as error:
        return Outcome(f"a rank fails ({first_line(error)})")
    largest = 0.0
    for rank, outputs in enumerate(results):
        for name, want in expected.items():
            got = outputs.get(name)
            if got is None or got.shape != want.shape:
                return Outcome(f"rank {rank} gives {name} of another shape")
            difference = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
            scale = max(want.abs().max().item() if want.numel() else 0.0, SCALE_FLOOR)
            if not difference <= RTOL * scale:  # a NaN fails too
                return Outcome(f"rank {rank}'s {name} differs from the unsplit model's by {difference:.1e}")
            largest = max(largest, difference)
    return Outcome(None, largest)


def _tensors(value: Any, prefix: str = "output") -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating tensor in a model output (a ``ModelOutput``, tuple or tensor), by where it sits."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield prefix, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _tensors(item, name)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{index}")
