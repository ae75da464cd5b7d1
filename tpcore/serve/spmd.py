"""``tpcore serve`` under ``torchrun``: one model split over the world's ranks, on one host or several.

Every rank holds its shard (``ParallelEngine``, each reading its own slices of the directory) and runs the same
engine (:class:`~tpcore.serve.scheduler.Scheduler`); rank 0 alone listens for HTTP. A tensor-parallel forward is a
collective, so every rank must run the same forwards in the same order: each turn of rank 0's engine sends its
plan to the others (:class:`TurnPlan`: the requests it admits, with the sampling seeds it drew; the requests whose
clients left; whether it stops), one ``broadcast_object_list`` over a gloo group, and every rank runs that turn:
the same prefills, the same step, the same rows retired (a row's end of sequence, stop string or ``max_tokens``
is decided alike from the same logits, which every rank holds whole). Only rank 0 answers clients. While idle,
rank 0 sends an empty plan every second, so the others never wait on a collective past its timeout.

Engines that answer requests whole (embeddings, transcriptions: :class:`~tpcore.serve.whole_requests.WholeRequests`)
send the requests each call answers, with a seed drawn for the call that every rank seeds torch with first, so
that a sampled transcription samples alike everywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from tpcore.serve.scheduler import Generation

__all__ = ["TurnPlan", "TurnSync", "torchrun_world"]

logger = logging.getLogger("tpcore.serve")


@dataclass
class TurnPlan:
    """One turn of rank 0's engine: the requests it admits (id and payload, in its order), the ids of requests
    whose clients left (they are dropped before this turn's step), and whether the engine stops."""

    admitted: list[tuple[str, Any]] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    stop: bool = False
    #: the seed of torch's RNG for a call that answers requests whole (``None``: none is set)
    seed: int | None = None


class TurnSync:
    """Rank 0 sends each turn's plan, the other ranks receive it, over ``group`` (gloo, any backend's world)."""

    def __init__(self, group: Any = None):
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.leads = dist.get_rank() == 0

    def send(self, admitted: list[tuple[str, Any]] | None, cancelled: set[str], seed: int | None = None) -> None:
        """Rank 0: send this turn's plan: the requests it admits (``None``: it stops), the seeds of generations drawn
        first so that every rank samples alike, the ids of those whose clients left, and ``seed`` (see
        :class:`TurnPlan`)."""
        admitted_seeded = [(request_id, _seeded(payload)) for request_id, payload in admitted or ()]
        self._broadcast(TurnPlan(admitted_seeded, cancelled, stop=admitted is None, seed=seed))

    def receive(self) -> TurnPlan:
        """A rank other than 0: rank 0's plan of its next turn."""
        return self._broadcast(None)

    def _broadcast(self, plan: TurnPlan | None) -> TurnPlan:
        box: list[Any] = [plan]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def _seeded(payload: Any) -> Any:
    """A generation's ``payload`` with a seed drawn where it asks for none (and samples); any other as it is."""
    if not isinstance(payload, Generation):
        return payload
    params = payload.params
    if params.seed is not None or params.greedy:
        return payload
    payload.params = dataclasses.replace(params, seed=secrets.randbits(63))
    return payload


def torchrun_world() -> tuple[int, int] | None:
    """``(rank, world size)`` where this process is a rank ``torchrun`` started (its environment says so), else
    ``None``."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
