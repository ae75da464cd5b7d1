"""The OpenAI API's request bodies (pydantic; unknown fields are accepted and ignored) and response shapes."""

from __future__ import annotations

import base64
import struct
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tpcore.serve.sampling import SamplingParams

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "embedding_response",
    "transcription_response",
]


#: a string or a list with at least one character or item, said in each branch of a union so that the OpenAPI
#: document says it too (a ``min_length`` on the union is checked but lands in no branch's schema)
_Text = Annotated[str, Field(min_length=1)]
_Texts = Annotated[list[str], Field(min_length=1)]
_TokenIds = Annotated[list[int], Field(min_length=1)]


class _Sampled(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: Literal[1] = 1
    ignore_eos: bool = False

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self._max_tokens() or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Sampled):
    prompt: _Text | _TokenIds | _Texts


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatRequest(_Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: _Text | _Texts
    encoding_format: Literal["float", "base64"] = "float"

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(request_id: str, kind: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}


def completion_response(request_id: str, model: str, text: str, reason: str, prompt: int, completion: int) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {**_envelope(request_id, "text_completion", model, [choice]), "usage": _usage(prompt, completion)}


def completion_chunk(request_id: str, model: str, text: str, reason: str | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return _envelope(request_id, "text_completion", model, [choice])


def chat_response(request_id: str, model: str, text: str, reason: str, prompt: int, completion: int) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
    return {**_envelope(request_id, "chat.completion", model, [choice]), "usage": _usage(prompt, completion)}


def chat_chunk(request_id: str, model: str, delta: dict[str, str], reason: str | None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    return _envelope(request_id, "chat.completion.chunk", model, [choice])


def embedding_response(model: str, vectors: list[list[float]], encoding: str, prompt_tokens: int) -> dict:
    def encoded(vector: list[float]) -> list[float] | str:
        if encoding == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def transcription_response(transcript: Any, response_format: str, temperature: float) -> Any:
    """A transcription as ``response_format`` asks: ``json`` ``{"text"}``, ``verbose_json`` (the language asked
    for, the audio's duration, the segments with their tokens: the model's, else one over the whole audio), or plain
    text: ``text``, or ``srt`` / ``vtt``, a cue a segment."""
    from fastapi.responses import PlainTextResponse

    text, seconds = transcript.text, transcript.seconds
    if response_format == "json":
        return {"text": text}
    spans = [(s.start, s.end, s.text, s.tokens) for s in transcript.segments or ()] or [
        (0.0, seconds, text, transcript.tokens)
    ]
    if response_format == "verbose_json":
        segments = [
            {"id": index, "seek": 0, "start": start, "end": end, "text": words, "tokens": tokens,
             "temperature": temperature} for index, (start, end, words, tokens) in enumerate(spans)
        ]  # fmt: skip
        language = transcript.language or ""
        return {"task": "transcribe", "language": language, "duration": seconds, "text": text, "segments": segments}
    if response_format == "srt":
        cues = [f"{index}\n{_clock(start, ',')} --> {_clock(end, ',')}\n{words}\n"
                for index, (start, end, words, _) in enumerate(spans, 1)]  # fmt: skip
        return PlainTextResponse("\n".join(cues))
    if response_format == "vtt":
        cues = [f"{_clock(start, '.')} --> {_clock(end, '.')}\n{words}\n" for start, end, words, _ in spans]
        return PlainTextResponse("WEBVTT\n\n" + "\n".join(cues))
    return PlainTextResponse(text)


def _clock(seconds: float, separator: str) -> str:
    """``hh:mm:ss<separator>mmm``."""
    millis = round(seconds * 1000)
    return f"{millis // 3600000:02d}:{millis // 60000 % 60:02d}:{millis // 1000 % 60:02d}{separator}{millis % 1000:03d}"
