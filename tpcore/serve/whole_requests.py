"""An engine thread that answers each turn's waiting requests whole, in one call of the model (no running batch):
the base of the embedding and transcription engines.

Each turn takes the waiting requests up to ``max_batch`` units (a request's :meth:`WholeRequests.units`: its inputs),
drops those whose client left, and hands the rest to :meth:`WholeRequests.answer`. A lost rank fails them with 503
and starts the ranks again where it can (:meth:`~tpcore.serve.scheduler.Scheduler._lost`); any other failure fails
the requests of that call alone. Under ``torchrun`` (:mod:`tpcore.serve.spmd`) rank 0 sends each call's requests and
a seed to the other ranks, which make the same call (:meth:`WholeRequests.follow`), and an empty plan a second while
idle.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

import torch

from tpcore.serve.requests import Failed, InternalError, Request
from tpcore.serve.scheduler import RANKS_LOST, Scheduler
from tpcore.serve.stats import Throughput

__all__ = ["WholeRequests"]

logger = logging.getLogger("tpcore.serve")


class WholeRequests(Scheduler):
    """Requests answered whole on ``model`` in one engine thread; subclasses say what a call is (:meth:`answer`)."""

    #: what a failed call says it was ("embedding", "transcription")
    task = "request"
    #: what the throughput log counts
    counted = "inputs"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_batch: int = 64,
        max_queue: int = 64,
        reload: Callable[[], Any] | None = None,
    ):
        super().__init__(model, tokenizer, set(), max_batch=max_batch, max_queue=max_queue, reload=reload)
        self.model = model
        self.throughput = Throughput(logger, self.counted)

    def serving_model(self) -> Any:
        return self.model

    def use_model(self, model: Any) -> None:
        self.model = model

    def units(self, request: Request) -> int:
        """How much of ``max_batch`` ``request`` takes."""
        return 1

    def answer(self, requests: list[Request]) -> None:
        """Answer ``requests`` (each gets its :class:`~tpcore.serve.requests.Finished`)."""
        raise NotImplementedError

    def fail(self, requests: list[Request], error: Exception) -> None:
        """Fail ``requests`` of a call that raised ``error`` (not a lost rank)."""
        logger.exception("a %s step failed", self.task)
        for request in requests:
            request.push(Failed(InternalError(f"{self.task} failed: {error}")))

    def _run(self) -> None:
        with torch.inference_mode():
            while (requests := self._take()) is not None:
                requests = [request for request in requests if not request.cancelled]
                if self.turns is not None and not self._shared_call(requests):
                    return
                if not requests:
                    continue
                try:
                    self.answer(requests)
                except RANKS_LOST as error:
                    if not self._lost(f"a rank died or hangs: {error}", requests):
                        return
                except Exception as error:
                    self.fail(requests, error)
        if self.turns is not None:
            self._shared_call(None)

    def _shared_call(self, requests: list[Request] | None) -> bool:
        """Rank 0 under torchrun: send the call's ``requests`` (``None``: stopping) and a seed, which it seeds torch
        with too; whether the other ranks took it (else the requests fail 503 and the engine ends)."""
        seed = secrets.randbits(63) if requests else None
        try:
            self.turns.send(None if requests is None else [(request.id, request.payload) for request in requests],
                            set(), seed)  # fmt: skip
        except Exception as error:  # the other ranks are gone: nothing can be computed any more
            self._others_lost(error, requests or ())
            return False
        if seed is not None:
            torch.manual_seed(seed)
        return True

    def follow(self) -> None:
        """A rank other than 0 under torchrun: make rank 0's calls until it stops."""
        with torch.inference_mode():
            while not (plan := self.turns.receive()).stop:
                if not plan.admitted:
                    continue
                if plan.seed is not None:
                    torch.manual_seed(plan.seed)
                try:
                    self.answer([Request(payload, None, id=request_id) for request_id, payload in plan.admitted])
                except Exception:  # rank 0 meets the same failure and fails the same requests
                    logger.exception("a %s step failed", self.task)

    def _take(self) -> list[Request] | None:
        """The waiting requests up to ``max_batch`` units (at least one); ``None`` when stopping."""
        with self.wake:
            while not self.stopping and not self.waiting:
                self.throughput.idle()
                self.wake.wait(timeout=1.0)
                if self.turns is not None:  # an empty call a second keeps the other ranks' collective alive
                    return []
            if self.stopping:
                self._refuse_waiting()
                return None
            taken: list[Request] = []
            units = 0
            while self.waiting and (not taken or units + self.units(self.waiting[0]) <= self.max_batch):
                taken.append(self.waiting.popleft())
                units += self.units(taken[-1])
            return taken
