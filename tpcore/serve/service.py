"""The model behind the server: prompts checked and tokenized, requests handed to the engine thread, their
events awaited with a deadline.

A model that generates text (``model.can_generate()``: a decoder LM, or an encoder-decoder whose encoder reads the
prompt) is served by :class:`~tpcore.serve.scheduler.Scheduler` (completions and chat), any other model by
:class:`~tpcore.serve.embeddings.EmbeddingScheduler` (embeddings). The model may be split (``tpcore.parallelize``)
or not: the same code serves both.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from tpcore.errors import WorkerDiedError
from tpcore.serve.batch import check_batching, rope_index, rope_per_axis
from tpcore.serve.embeddings import EmbeddingScheduler, pooling_mode
from tpcore.serve.images import ImageChat, has_images
from tpcore.serve.requests import Delta, Failed, Finished, NotFound, Request, ServeError
from tpcore.serve.scheduler import Generation, Scheduler
from tpcore.serve.schemas import ChatRequest, CompletionRequest
from tpcore.serve.transcription import Transcription, TranscriptionScheduler, read_audio

__all__ = ["Limits", "NotServable", "Service", "check_servable", "eos_ids", "refuse_unbatchable_cache"]

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
    #: fetch ``http(s)`` image URLs of chat messages (else only ``data:`` URLs are read)
    fetch_images: bool = False
    #: the longest audio a transcription takes (over the model's window: transcribed alone, window by window)
    max_audio_seconds: float = 600.0


#: what a model serves, by kind, and the endpoints of each
ENDPOINTS = {
    "generate": "/v1/completions and /v1/chat/completions",
    "embed": "/v1/embeddings",
    "transcribe": "/v1/audio/transcriptions",
}


class Service:
    """``model`` (with ``tokenizer``) served under the name ``name``; ``directory`` is where it was loaded from;
    ``reload`` makes the model again, its ranks started anew, once they are lost (else 503 from then on). A
    speech-to-text model also needs its ``feature_extractor``, a model that reads images in chat its ``processor``
    (else the directory's are loaded)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str,
        limits: Limits | None = None,
        directory: str | None = None,
        reload: Callable[[], Any] | None = None,
        feature_extractor: Any = None,
        processor: Any = None,
    ):
        self.tokenizer, self.name = tokenizer, name
        self.limits = limits or Limits()
        self.created = int(time.time())
        config = getattr(model, "config", None)
        self.kind = _kind(model)
        self.generates = self.kind == "generate"
        self.max_model_len = self.limits.max_model_len or getattr(config, "max_position_embeddings", None) or 2048
        self.scheduler: Scheduler
        generates = self.kind == "generate"
        self.images = _image_chat(model, directory, processor, self.limits.fetch_images) if generates else None
        if self.kind == "generate":
            check_servable(model)
            self.scheduler = Scheduler(
                model, tokenizer, eos_ids(model, tokenizer), self.limits.max_batch, self.limits.max_queue, reload
            )
        elif self.kind == "transcribe":
            self.feature_extractor = _feature_extractor(model, directory, feature_extractor)
            self.scheduler = TranscriptionScheduler(model, tokenizer, self.limits.max_batch, self.limits.max_queue,
                                                    reload)  # fmt: skip
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

    def check_model(self, name: str, kind: str) -> None:
        """Refuse a request for another model than ``name``, or of a ``kind`` (``generate``, ``embed``,
        ``transcribe``) this model does not serve."""
        if name != self.name:
            raise NotFound(f"the model '{name}' does not exist: this server serves '{self.name}'", "model")
        if kind != self.kind:
            raise ServeError(f"'{self.name}' serves {ENDPOINTS[self.kind]} only", "model")

    def transcription(
        self, audio: bytes, language: str | None, temperature: float, prompt: str | None = None,
        timestamps: bool = False,
    ) -> Transcription:  # fmt: skip
        """The input of a transcription request: the upload read, resampled and turned into features (over the
        model's window: unpadded, with their attention mask); ``prompt`` as the tokenizer's prompt ids."""
        extractor = self.feature_extractor
        rate = extractor.sampling_rate
        samples = read_audio(audio, rate)
        if len(samples) > self.limits.max_audio_seconds * rate:
            raise ServeError(
                f"the audio is {len(samples) / rate:.1f} s long; this server transcribes up to "
                f"{self.limits.max_audio_seconds:g} s a request",
                "file",
            )
        if language is not None:
            known = getattr(getattr(self.model, "generation_config", None), "lang_to_id", None) or {}
            if f"<|{language}|>" not in known:
                raise ServeError(f"'{self.name}' knows no language '{language}' (ISO-639-1 codes: en, de, ...)",
                                 "language")  # fmt: skip
        prompt_ids: tuple[int, ...] = ()
        if prompt:
            if not callable(getattr(self.tokenizer, "get_prompt_ids", None)):
                raise ServeError(f"'{self.name}' takes no prompt: its tokenizer makes no prompt ids", "prompt")
            prompt_ids = tuple(int(token) for token in self.tokenizer.get_prompt_ids(prompt))
            most = getattr(self.model.config, "max_target_positions", 448) // 2  # half the decoder's positions
            if len(prompt_ids) > most:
                raise ServeError(f"the prompt is {len(prompt_ids)} tokens; '{self.name}' takes up to {most}", "prompt")
        seconds = len(samples) / rate
        transcription = Transcription(torch.empty(0), seconds, language, temperature, prompt_ids, timestamps)
        if len(samples) <= extractor.n_samples:
            transcription.features = extractor(samples, sampling_rate=rate, return_tensors="pt").input_features[0]
            return transcription
        long = extractor(samples, sampling_rate=rate, return_tensors="pt", truncation=False, padding="longest",
                         return_attention_mask=True)  # fmt: skip
        transcription.features, transcription.attention_mask = long.input_features[0], long.attention_mask[0]
        return transcription

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
        if self.images is not None:  # the processor's template, images or not
            ids, extras = self.images.inputs(body.messages)
            return self._checked(ids, body, "messages", extras or None)
        if has_images(body.messages):
            raise ServeError(f"'{self.name}' reads no images: send text parts only", "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ServeError(f"'{self.name}' has no chat template: use /v1/completions", "messages")
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return self._checked(list(ids), body, "messages")

    def _checked(self, ids: list[int], body: Any, param: str, extras: dict | None = None) -> Generation:
        if not ids:
            raise ServeError("the prompt is empty", param)
        params = body.sampling(self.limits.default_max_tokens)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ServeError(
                f"the prompt ({len(ids)} tokens) and max_tokens ({params.max_tokens}) exceed the model's "
                f"{self.max_model_len} tokens",
                param,
            )
        return Generation(ids, params, extras)

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


def _image_chat(model: Any, directory: str | None, processor: Any, fetch: bool) -> ImageChat | None:
    """Images in chat for ``model``: through ``processor``, else its directory's, where the model takes
    ``pixel_values`` and the processor has an image processor and a chat template; else ``None``."""
    if "pixel_values" not in inspect.signature(type(model).forward).parameters:
        return None
    if rope_per_axis(model) and rope_index(model) is None:  # positions per axis the running batch cannot give
        return None
    if processor is None and directory:
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(directory)
        except (OSError, ValueError, TypeError):
            return None
    if getattr(processor, "image_processor", None) is None or not getattr(processor, "chat_template", None):
        return None
    return ImageChat(processor, fetch)


def _kind(model: Any) -> str:
    """What ``model`` serves: ``generate`` (text from text), ``transcribe`` (text from audio features) or ``embed``;
    :class:`NotServable` for a model that generates from other inputs."""
    if not getattr(model, "can_generate", lambda: False)():
        return "embed"
    main_input = getattr(model, "main_input_name", "input_ids")
    if main_input == "input_ids":
        return "generate"
    if main_input == "input_features":
        return "transcribe"
    raise NotServable(
        f"{type(model).__name__} generates from {main_input}, not text or audio: tpcore serve takes text prompts and "
        "audio uploads; call generate() on it"
    )


def _feature_extractor(model: Any, directory: str | None, given: Any) -> Any:
    """``given``, else the feature extractor saved in ``directory``; :class:`NotServable` where there is none, or
    where the audio libraries are missing."""
    from transformers import AutoFeatureExtractor

    try:
        import scipy.signal  # noqa: F401
        import soundfile  # noqa: F401
    except ImportError as error:
        raise NotServable(f"{type(model).__name__} transcribes audio, which needs tpcore[audio] (soundfile, scipy): "
                          f"{error}") from error  # fmt: skip
    if given is not None:
        return given
    if not directory:
        raise NotServable(f"{type(model).__name__} transcribes audio: give Service its feature_extractor")
    try:
        return AutoFeatureExtractor.from_pretrained(directory)
    except (OSError, ValueError) as error:
        reason = (str(error).splitlines() or [""])[0]
        raise NotServable(f"{type(model).__name__} transcribes audio: its directory needs a feature extractor "
                          f"(preprocessor_config.json): {reason}") from error  # fmt: skip


def refuse_unbatchable_cache(config: Any, architecture: str) -> None:
    """Raise :class:`NotServable` where a decoder's cache has a layer the running batch cannot keep
    (:mod:`tpcore.served.cache_batches`): it keeps attention layers (sliding-window ones as full ones, their window
    kept by the attention mask), state layers (Mamba, Mamba2, gated DeltaNet: one state per row) and layers that
    keep nothing."""
    from tpcore.served.cache_batches import unkept_layer

    unkept = unkept_layer(config)
    if unkept is not None:
        index, kind, why = unkept
        raise NotServable(
            f"{architecture} keeps a cache layer the running batch cannot keep ({kind!r}, layer {index}: {why}): "
            "split it with tpcore.parallelize() and call generate()"
        )


def check_servable(model: Any) -> None:
    """Raise :class:`NotServable` where the running batch cannot drive ``model``'s forward
    (:func:`~tpcore.serve.batch.check_batching`), or whose cache it cannot keep (:func:`refuse_unbatchable_cache`),
    rather than failing every request."""
    if not getattr(model.config, "is_encoder_decoder", False):
        refuse_unbatchable_cache(model.config, type(model).__name__)
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
    if event.transcript is not None:
        return f"{event.transcript.seconds:.1f} s of audio, {event.completion_tokens} tokens"
    if event.embeddings is not None:
        return f"{len(event.embeddings)} embeddings of {event.prompt_tokens} tokens"
    return f"{event.reason}, {event.prompt_tokens} prompt + {event.completion_tokens} new tokens"


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokens that end a sequence: the generation config's, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
