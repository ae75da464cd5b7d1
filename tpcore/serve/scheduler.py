"""The engine thread of a model that generates text: continuous batching over one running batch
(:class:`~tpcore.serve.batch.RunningBatch` for a decoder LM, an ``EncoderDecoderBatch`` for an encoder-decoder).

One thread owns the model. Each turn of its loop admits the waiting requests (up to ``max_batch`` rows: prefilled
in groups of similar prompt lengths, one forward a group (:func:`prefill_groups`), each first token chosen, then
joined to the batch), runs one decode step for every row, hands each request its token and retires the rows that
finished (end of sequence, a stop string, ``max_tokens``) or whose client left. Requests wait in a bounded queue
(:class:`~tpcore.serve.requests.QueueFull` past ``max_queue``). A rank that dies turns every request in flight into
:class:`~tpcore.serve.requests.Unavailable`; with a ``reload`` (``tpcore serve`` of a directory) the engine starts
the ranks again and serves on, answering 503 meanwhile, else it answers 503 from then on.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tpcore.errors import WorkerDiedError
from tpcore.serve.batch import running_batch
from tpcore.serve.requests import Delta, Failed, Finished, InternalError, QueueFull, Request, ServeError, Unavailable
from tpcore.serve.sampling import SamplingParams, TokenChooser
from tpcore.serve.stats import Throughput
from tpcore.serve.text import TextStream
from tpcore.served.caller_threads import release_openmp_workers

__all__ = ["Generation", "Scheduler", "prefill_groups"]

logger = logging.getLogger("tpcore.serve")
#: what a call to the ranks raises once they are lost (dead, or past the call's timeout: the pool is torn down)
RANKS_LOST = (WorkerDiedError, TimeoutError)
#: the most positions (rows x longest prompt) one prefill forward computes: bounds how long it holds up the
#: running rows' next step
PREFILL_TOKENS = 4096
#: the share of a prefill group's positions that may be padding (prompts shorter than the group's longest)
PREFILL_PADDING = 0.25


@dataclass
class Generation:
    """A generation request's input: the prompt's token ids and its sampling parameters; ``extras``: what else its
    prefill passes to the model (an image's ``pixel_values``), which prefills it alone."""

    prompt_ids: list[int]
    params: SamplingParams
    extras: dict[str, torch.Tensor] | None = None


@dataclass
class _Row:
    """A request in the running batch: its ids so far (prompt + generated), token chooser and text."""

    request: Request
    ids: list[int]
    chooser: TokenChooser
    text: TextStream
    prompt_tokens: int
    generated: int = 0
    done: bool = field(default=False)


class Scheduler:
    """Continuous batching of generation requests on ``model`` (local or split), in one engine thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        eos_ids: set[int],
        max_batch: int = 16,
        max_queue: int = 64,
        reload: Callable[[], Any] | None = None,
    ):
        self.batch = running_batch(model)
        #: makes the model again (its ranks started anew) once they are lost; ``None``: 503 from then on
        self.reload = reload
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_batch, self.max_queue = max_batch, max_queue
        self.waiting: collections.deque[Request] = collections.deque()
        self.wake = threading.Condition()
        self.dead: str | None = None
        self.largest_batch = 0  # the most rows decoded together so far
        self.largest_prefill = 0  # the most prompts prefilled together so far
        self.stopping = False
        #: called (from the engine thread, with the reason) once the ranks are lost and not started again
        self.when_dead: Callable[[str], None] | None = None
        #: under torchrun: each turn's plan, sent by rank 0 to the other ranks (:mod:`tpcore.serve.spmd`)
        self.turns: Any = None
        #: the requests whose clients left, as this turn sees them (under torchrun: as rank 0's plan says)
        self._left: set[str] | None = None
        self.throughput = Throughput(logger, "tokens")
        self.thread = threading.Thread(target=self._run, name="tpcore-serve-engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread; the calling thread gives up its OpenMP workers, which would slow the
        engine's parallel regions (:func:`~tpcore.served.caller_threads.release_openmp_workers`)."""
        release_openmp_workers()
        self.thread.start()

    def submit(self, request: Request) -> None:
        """Queue ``request`` (its payload a :class:`Generation`), or refuse it now."""
        with self.wake:
            if self.dead or self.stopping:
                raise Unavailable(self.dead or "the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting already: retry later")
            self.waiting.append(request)
            self.wake.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is waiting and running, and end the engine thread."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def serving_model(self) -> Any:
        """The model the engine computes with now (another after a restart of the ranks)."""
        return self.batch.model

    def use_model(self, model: Any) -> None:
        """Compute with ``model`` from now on (the ranks started again); nothing is in flight."""
        self.batch = running_batch(model)

    def _run(self) -> None:
        while self._serve_turns():
            pass
        self._fail_running(Unavailable("the server is shutting down"))

    def _serve_turns(self) -> bool:
        """Admit and step until stopping (``False``), or until the ranks are lost: then ``True`` once they are
        started again, ``False`` where they are not."""
        # CPU ranks hold this host's cores: the engine's own work (sampling, stop strings) takes one thread
        handle = getattr(self.batch.model, "_tpcore_handle", None)
        one_thread = handle.one_thread() if handle is not None else contextlib.nullcontext()
        with torch.inference_mode(), one_thread:
            while True:
                admitted = self._admissions()
                if self.turns is not None:
                    try:
                        admitted = self._shared(admitted)
                    except Exception as error:  # the other ranks are gone: nothing can be computed any more
                        self._others_lost(error, admitted or ())
                        return False
                if admitted is None:
                    return False
                try:
                    self._turn(admitted)
                except RANKS_LOST as error:
                    return self._lost(f"a rank died or hangs: {error}", admitted)
                except Exception as error:  # a failed step fails the requests in it, not the server
                    logger.exception("a generation step failed")
                    self._fail_running(InternalError(f"generation failed: {error}"))

    def _turn(self, admitted: list[Request]) -> None:
        """Prefill ``admitted`` in groups, join them, and step every row once."""
        for group in prefill_groups(admitted):
            self._admit_group(group)
        if len(self.batch):
            self._step()

    def _shared(self, admitted: list[Request] | None) -> list[Request] | None:
        """Rank 0 under torchrun: send this turn's plan to the other ranks; the requests to admit (``None``:
        stopping)."""
        live = [*(row.request for row in self.batch.rows), *(admitted or ())]
        self._left = {request.id for request in live if request.cancelled}
        pairs = None if admitted is None else [(request.id, request.payload) for request in admitted]
        self.turns.send(pairs, self._left)
        return admitted

    def follow(self) -> None:
        """A rank other than 0 under torchrun: run rank 0's turns until it stops."""
        with torch.inference_mode():
            while not (plan := self.turns.receive()).stop:
                self._left = plan.cancelled
                admitted = [Request(payload, None, id=request_id) for request_id, payload in plan.admitted]
                try:
                    self._turn(admitted)
                except Exception:  # rank 0 meets the same failure and fails the same requests
                    logger.exception("a generation step failed")
                    self._fail_running(InternalError("generation failed"))

    def _left_client(self, request: Request) -> bool:
        """Whether ``request``'s client left, as this turn sees it (every rank alike under torchrun)."""
        return request.id in self._left if self._left is not None else request.cancelled

    def _others_lost(self, error: Exception, admitted: Sequence[Request] = ()) -> None:
        """Rank 0 under torchrun could not reach the other ranks (``error``): every request fails with 503 and the
        server is told (:attr:`when_dead`)."""
        self._die(f"the other ranks are lost: {error}", admitted)
        if self.when_dead is not None:
            self.when_dead(str(error))

    def _lost(self, reason: str, admitted: Sequence[Request] = ()) -> bool:
        """The ranks are lost: every request in flight (``admitted`` ones too) fails with 503; with :attr:`reload`
        the ranks are started again (503 meanwhile) and the engine serves on (``True``)."""
        self._die(reason, admitted)
        if self.reload is None or self.stopping:
            if self.when_dead is not None:
                self.when_dead(reason)
            return False
        started = time.monotonic()
        handle = getattr(self.serving_model(), "_tpcore_handle", None)
        if handle is not None:
            handle.pool.close()  # whatever of the lost ranks is left
        try:
            model = self.reload()
        except Exception as error:
            logger.exception("starting the ranks again failed")
            with self.wake:
                self.dead = f"{reason}; starting the ranks again failed: {error}"
            return False
        self.use_model(model)
        with self.wake:
            self.dead = None
        logger.warning("the ranks started again in %.1f s: serving again", time.monotonic() - started)
        return True

    def _refuse_waiting(self) -> None:
        """Fail every request still waiting (the server is stopping); called holding ``wake``."""
        for request in self.waiting:
            request.push(Failed(Unavailable("the server is shutting down")))
        self.waiting.clear()

    def _admissions(self) -> list[Request] | None:
        """The requests to admit now (waiting while there is nothing to do); ``None`` when stopping."""
        with self.wake:
            while not self.stopping and not self.waiting and not len(self.batch):
                self.throughput.idle()
                self.wake.wait(timeout=1.0)
                if self.turns is not None:  # an empty turn a second keeps the other ranks' collective alive
                    break
            if self.stopping:
                self._refuse_waiting()
                return None
            room = max(0, self.max_batch - len(self.batch))
            return [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]

    def _admit_group(self, requests: list[Request]) -> None:
        """Prefill ``requests`` together, choose their first tokens and join the batch. A prefill that fails for
        a reason of theirs (not a lost rank) is tried again one request at a time, so that the error fails only
        the request it comes from."""
        rows = [self._new_row(request) for request in requests if not self._left_client(request)]
        if not rows:
            return
        extras = requests[0].payload.extras if len(requests) == 1 else None
        try:
            cache, prefilled, logits = self.batch.prefill([row.ids for row in rows], extras)
        except RANKS_LOST:
            raise
        except Exception as error:
            if len(rows) > 1:
                logger.warning("a prefill of %d prompts failed (%s): admitting them one by one", len(rows), error)
                for row in rows:
                    self._admit_group([row.request])
            else:
                logger.exception("%s: the prompt's step failed", rows[0].request.id)
                rows[0].request.push(Failed(InternalError(f"generation failed: {error}")))
            return
        self.largest_prefill = max(self.largest_prefill, len(rows))
        try:
            tokens = [self._accept(row, logits[index : index + 1]) for index, row in enumerate(rows)]
            going_on = [index for index, row in enumerate(rows) if not row.done]
            if going_on:
                prefilled = self.batch.select(cache, prefilled, going_on)
                self.batch.join([rows[i] for i in going_on], cache, prefilled, [tokens[i] for i in going_on])
        except RANKS_LOST:
            raise
        except Exception as error:
            logger.exception("the first tokens of %d prompts failed", len(rows))
            for row in rows:
                if not row.done:
                    row.request.push(Failed(InternalError(f"generation failed: {error}")))

    def _new_row(self, request: Request) -> _Row:
        generation: Generation = request.payload
        chooser, text = TokenChooser(generation.params), TextStream(self.tokenizer, generation.params.stop)
        return _Row(request, list(generation.prompt_ids), chooser, text, prompt_tokens=len(generation.prompt_ids))

    def _step(self) -> None:
        self.largest_batch = max(self.largest_batch, len(self.batch))
        logits = self.batch.step()
        kept, tokens = [], []
        for index, row in enumerate(self.batch.rows):
            token = self._accept(row, logits[index : index + 1]) if not self._left_client(row.request) else None
            if token is not None and not row.done:
                kept.append(index)
                tokens.append(token)
        self.batch.keep(kept, tokens)

    def _accept(self, row: _Row, logits: torch.Tensor) -> int:
        """Choose the row's next token from ``logits`` ``(1, V)``, hand its text to the request, finish it when
        it ends; the token."""
        token = row.chooser.choose(torch.tensor([row.ids]), logits)
        row.ids.append(token)
        row.generated += 1
        self.throughput.add(1)
        params = row.chooser.params
        if token in self.eos_ids and not params.ignore_eos:
            return self._finish(row, "stop", row.text.flush(), token)
        text, stopped = row.text.add(token)
        if stopped:
            return self._finish(row, "stop", text, token)
        if row.generated >= params.max_tokens:
            return self._finish(row, "length", text + row.text.flush(), token)
        if text:
            row.request.push(Delta(text, token))
        return token

    def _finish(self, row: _Row, reason: str, text: str, token: int) -> int:
        if text:
            row.request.push(Delta(text, token))
        row.request.push(Finished(reason, row.prompt_tokens, row.generated))
        row.done = True
        return token

    def _fail_running(self, error: ServeError) -> None:
        for row in self.batch.rows:
            row.request.push(Failed(error))
        self.batch.keep([], [])

    def _die(self, reason: str, admitted: Sequence[Request] = ()) -> None:
        """Fail every request in flight (``admitted`` ones too: a finished one ignores it) and every later one."""
        after = "starting the ranks again" if self.reload else "answering 503 from now on (restart the server)"
        logger.error("%s; %s", reason, after)
        with self.wake:
            self.dead = f"{reason}; {after}"
            waiting, self.waiting = list(self.waiting), collections.deque()
        self._fail_running(Unavailable(reason))
        for request in [*admitted, *waiting]:
            request.push(Failed(Unavailable(reason)))


def prefill_groups(requests: Sequence[Request]) -> list[list[Request]]:
    """``requests`` (payloads :class:`Generation`) in prefill groups: by prompt length, each group as many as
    fit :data:`PREFILL_TOKENS` positions with at most :data:`PREFILL_PADDING` of them padding; a request with
    ``extras`` (images) alone."""
    groups: list[list[Request]] = [[request] for request in requests if request.payload.extras]  # alone
    group: list[Request] = []
    true_positions = 0
    plain = [request for request in requests if not request.payload.extras]
    for request in sorted(plain, key=lambda request: len(request.payload.prompt_ids)):
        length = len(request.payload.prompt_ids)  # the longest of the group so far: they come sorted
        padded = (len(group) + 1) * length
        if group and (padded > PREFILL_TOKENS or padded - true_positions - length > PREFILL_PADDING * padded):
            groups.append(group)
            group, true_positions = [], 0
        group.append(request)
        true_positions += length
    return groups + [group] if group else groups
