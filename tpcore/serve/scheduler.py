"""The engine thread of a decoder LM: continuous batching over one :class:`~tpcore.serve.batch.RunningBatch`.

One thread owns the model. Each turn of its loop admits the waiting requests (up to ``max_batch`` rows: each
prefilled alone, its first token chosen, then joined to the batch), runs one decode step for every row, hands each
request its token and retires the rows that finished (end of sequence, a stop string, ``max_tokens``) or whose
client left. Requests wait in a bounded queue (:class:`~tpcore.serve.requests.QueueFull` past ``max_queue``). A rank
that dies turns every request in flight, and every later one, into :class:`~tpcore.serve.requests.Unavailable`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tpcore.errors import WorkerDiedError
from tpcore.serve.batch import RunningBatch
from tpcore.serve.requests import Delta, Failed, Finished, InternalError, QueueFull, Request, ServeError, Unavailable
from tpcore.serve.sampling import SamplingParams, TokenChooser
from tpcore.serve.stats import Throughput
from tpcore.serve.text import TextStream

__all__ = ["Generation", "Scheduler"]

logger = logging.getLogger("tpcore.serve")
#: what a call to the ranks raises once they are lost (dead, or past the call's timeout: the pool is torn down)
RANKS_LOST = (WorkerDiedError, TimeoutError)


@dataclass
class Generation:
    """A generation request's input: the prompt's token ids and its sampling parameters."""

    prompt_ids: list[int]
    params: SamplingParams


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

    def __init__(self, model: Any, tokenizer: Any, eos_ids: set[int], max_batch: int = 16, max_queue: int = 64):
        self.batch = RunningBatch(model)
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_batch, self.max_queue = max_batch, max_queue
        self.waiting: collections.deque[Request] = collections.deque()
        self.wake = threading.Condition()
        self.dead: str | None = None
        self.largest_batch = 0  # the most rows decoded together so far
        self.stopping = False
        self.throughput = Throughput(logger, "tokens")
        self.thread = threading.Thread(target=self._run, name="tpcore-serve-engine", daemon=True)

    def start(self) -> None:
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

    def _run(self) -> None:
        # CPU ranks hold this host's cores: the engine's own work (sampling, stop strings) takes one thread
        handle = getattr(self.batch.model, "_tpcore_handle", None)
        one_thread = handle.one_thread() if handle is not None else contextlib.nullcontext()
        with torch.inference_mode(), one_thread:
            while True:
                admitted = self._admissions()
                if admitted is None:
                    break
                try:
                    for request in admitted:
                        self._admit_alone(request)
                    if len(self.batch):
                        self._step()
                except RANKS_LOST as error:
                    self._die(f"a rank died or hangs: {error}", admitted)
                    return
                except Exception as error:  # a failed step fails the requests in it, not the server
                    logger.exception("a generation step failed")
                    self._fail_running(InternalError(f"generation failed: {error}"))
        self._fail_running(Unavailable("the server is shutting down"))

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
            if self.stopping:
                self._refuse_waiting()
                return None
            room = max(0, self.max_batch - len(self.batch))
            return [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]

    def _admit_alone(self, request: Request) -> None:
        """Admit one request; an error of its own (not a dead rank) fails it alone."""
        try:
            self._admit(request)
        except RANKS_LOST:
            raise
        except Exception as error:
            logger.exception("%s: the prompt's step failed", request.id)
            request.push(Failed(InternalError(f"generation failed: {error}")))

    def _admit(self, request: Request) -> None:
        if request.cancelled:
            return
        generation: Generation = request.payload
        row = _Row(
            request,
            list(generation.prompt_ids),
            TokenChooser(generation.params),
            TextStream(self.tokenizer, generation.params.stop),
            prompt_tokens=len(generation.prompt_ids),
        )
        cache, logits = self.batch.prefill(row.ids)
        token = self._accept(row, logits)
        if not row.done:
            self.batch.join(row, cache, len(row.ids) - 1, token)

    def _step(self) -> None:
        self.largest_batch = max(self.largest_batch, len(self.batch))
        logits = self.batch.step()
        kept, tokens = [], []
        for index, row in enumerate(self.batch.rows):
            token = self._accept(row, logits[index : index + 1]) if not row.request.cancelled else None
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
        logger.error("%s; answering 503 from now on (restart the server)", reason)
        with self.wake:
            self.dead = reason
            waiting, self.waiting = list(self.waiting), collections.deque()
        self._fail_running(Unavailable(reason))
        for request in [*admitted, *waiting]:
            request.push(Failed(Unavailable(reason)))
