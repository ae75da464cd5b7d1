"""The model behind the server: prompts checked and tokenized, requests handed to the engine thread, their
events awaited with a deadline.

A model that generates text (``model.can_generate()``: a decoder LM, or an encoder-decoder whose encoder reads the
prompt) is served by :class:`~tpcore.serve.scheduler.Scheduler` (completions and chat), any other model by
:class:`~tpcore.serve.embeddings.EmbeddingScheduler` (embeddings). The model may be split (``tpcore.parallelize``)
or not: the same code serves both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from tpcore.errors import WorkerDiedError
from tpcore.serve.batch import check_batching
from tpcore.serve.embeddings import EmbeddingScheduler, pooling_mode
from tpcore.serve.requests import Delta, Failed, Finished, NotFound, Request, ServeError
from tpcore.serve.scheduler import Generation, Scheduler
from tpcore.serve.schemas import ChatRequest, CompletionRequest

__all__ = ["Limits", "NotServable", "Service"]

logger = logging.getLogger("tpcore.serve")


class NotServable(ValueError):
    """A model or an option the server refuses at start, before it listens; its message is one line."""


@dataclass
class Limits:
    """How much the server takes: rows decoded together, requests waiting, seconds a request may take,
    tokens of a sequence (prompt and generated; default: the config's ``max_position_embeddings``),
    ``max_tokens`` when a request names none."""

    max_batch: int = 16
    max_queue: int = 64
    request_timeout: float = 300.0
    max_model_len: int | None = None
    default_max_tokens: int = 256


class Service:
    """``model`` (with ``tokenizer``) served under the name ``name``; ``directory`` is where it was loaded from;
    ``reload`` makes the model again, its ranks started anew, once they are lost (else 503 from then on)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str,
        limits: Limits | None = None,
        directory: str | None = None,
        reload: Callable[[], Any] | None = None,
    ):
        self.tokenizer, self.name = tokenizer, name
        self.limits = limits or Limits()
        self.created = int(time.time())
        config = getattr(model, "config", None)
        self.generates = bool(getattr(model, "can_generate", lambda: False)())
        if self.generates and getattr(model, "main_input_name", "input_ids") != "input_ids":
            raise NotServable(
                f"{type(model).__name__} generates from {model.main_input_name}, not text: tpcore serve takes text "
                "prompts; call generate() on it"
            )
        self.max_model_len = self.limits.max_model_len or getattr(config, "max_position_embeddings", None) or 2048
        if self.generates:
            _check_batching(model)
            self.scheduler: Scheduler = Scheduler(
                model, tokenizer, _eos_ids(model, tokenizer), self.limits.max_batch, self.limits.max_queue, reload
            )
        else:
            self.scheduler = EmbeddingScheduler(
                model, tokenizer, max_queue=self.limits.max_queue, pooling=pooling_mode(directory), reload=reload
            )

    @property
    def model(self) -> Any:
        """The model served now (the ranks started again after a loss are another model object)."""
        return self.scheduler.serving_model()

    @property
    def healthy(self) -> bool:
        return self.scheduler.dead is None and self.scheduler.thread.is_alive()

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def check_model(self, name: str, generation: bool) -> None:
        if name != self.name:
            raise NotFound(f"the model '{name}' does not exist: this server serves '{self.name}'", "model")
        if generation and not self.generates:
            raise ServeError(f"'{self.name}' is an encoder: it serves /v1/embeddings only", "model")
        if not generation and self.generates:
            raise ServeError(f"'{self.name}' generates text: it serves completions, not embeddings", "model")

    def completion(self, body: CompletionRequest) -> Generation:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and all(isinstance(item, str) for item in prompt):
            if len(prompt) != 1:
                raise ServeError("one prompt per request (n=1)", "prompt")
            prompt = prompt[0]
        ids: list[int] = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if any(not 0 <= token < len(self.tokenizer) for token in ids):
            raise ServeError("the prompt holds token ids outside the vocabulary", "prompt")
        return self._checked(ids, body, "prompt")

    def chat(self, body: ChatRequest) -> Generation:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ServeError(f"'{self.name}' has no chat template: use /v1/completions", "messages")
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return self._checked(list(ids), body, "messages")

    def _checked(self, ids: list[int], body: Any, param: str) -> Generation:
        if not ids:
            raise ServeError("the prompt is empty", param)
        params = body.sampling(self.limits.default_max_tokens)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ServeError(
                f"the prompt ({len(ids)} tokens) and max_tokens ({params.max_tokens}) exceed the model's "
                f"{self.max_model_len} tokens",
                param,
            )
        return Generation(ids, params)

    def embedding_inputs(self, texts: list[str]) -> list[str]:
        if any(not text for text in texts):
            raise ServeError("an input is empty", "input")
        return texts

    async def events(self, payload: Any) -> AsyncGenerator[Delta | Finished, None]:
        """Run ``payload`` on the engine: its events, until :class:`Finished`; a :class:`Failed` one raised."""
        request = Request(payload, asyncio.get_running_loop())
        self.scheduler.submit(request)
        deadline = time.monotonic() + self.limits.request_timeout
        logger.debug("%s queued", request.id)
        try:
            while True:
                event = await asyncio.wait_for(request.events.get(), max(0.0, deadline - time.monotonic()))
                if isinstance(event, Failed):
                    logger.warning("%s failed: %s", request.id, event.error)
                    raise event.error
                if isinstance(event, Finished):  # logged first: the caller may not resume this generator after it
                    logger.info("%s finished: %s", request.id, _counts(event))
                yield event
                if isinstance(event, Finished):
                    return
        except asyncio.TimeoutError:
            logger.warning("%s timed out after %.0f s", request.id, self.limits.request_timeout)
            raise TimedOut(f"the request took longer than {self.limits.request_timeout:.0f} s") from None
        finally:
            request.cancel()


def _check_batching(model: Any) -> None:
    """Raise :class:`NotServable` where the running batch cannot drive ``model``'s forward
    (:func:`~tpcore.serve.batch.check_batching`), rather than failing every request."""
    try:
        check_batching(model)
    except (WorkerDiedError, TimeoutError):
        raise
    except Exception as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise NotServable(
            f"{type(model).__name__} cannot be served: a running batch's step fails on it ({reason}); split it with "
            "tpcore.parallelize() and call generate()"
        ) from error


class TimedOut(ServeError):
    status = 504
    kind = "timeout"


def _counts(event: Finished) -> str:
    if event.embeddings is not None:
        return f"{len(event.embeddings)} embeddings of {event.prompt_tokens} tokens"
    return f"{event.reason}, {event.prompt_tokens} prompt + {event.completion_tokens} new tokens"


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokens that end a sequence: the generation config's, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
