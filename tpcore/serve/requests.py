"""What a request is while the engine works on it, the events it sends back, and the errors the server answers.

The engine thread pushes events (:class:`Delta`, :class:`Finished`, :class:`Failed`) into the request's asyncio
queue through its event loop (thread-safe); the HTTP handler awaits them. ``cancel()`` (a client gone, a timeout)
makes the engine drop the request before its next step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Delta",
    "Failed",
    "Finished",
    "InternalError",
    "NotFound",
    "QueueFull",
    "Request",
    "Segment",
    "ServeError",
    "Transcript",
    "Unavailable",
]

_ids = itertools.count(1)


class ServeError(Exception):
    """An error the server answers with ``status`` and an OpenAI-style error body of ``kind``."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotFound(ServeError):
    status = 404


class QueueFull(ServeError):
    status = 429
    kind = "rate_limit_error"


class InternalError(ServeError):
    status = 500
    kind = "server_error"


class Unavailable(ServeError):
    status = 503
    kind = "service_unavailable"


@dataclass(frozen=True)
class Delta:
    """New text of a generation (and the token that made it, ``token_id``)."""

    text: str
    token_id: int


@dataclass(frozen=True)
class Transcript:
    """A transcription's result: its text, the tokens of it (special ones left out), the audio's seconds, the
    language asked for and, where timestamps were asked for, its segments."""

    text: str
    tokens: list[int]
    seconds: float
    language: str | None = None
    segments: list[Segment] | None = None


@dataclass(frozen=True)
class Segment:
    """A stretch of a transcript between two of the model's timestamps: seconds from the audio's start, its text
    and tokens."""

    start: float
    end: float
    text: str
    tokens: list[int]


@dataclass(frozen=True)
class Finished:
    """The end of a request: ``reason`` (``"stop"``, ``"length"``; ``None`` for embeddings), its counts and,
    for embeddings, the vectors, for a transcription its :class:`Transcript`."""

    reason: str | None
    prompt_tokens: int
    completion_tokens: int = 0
    embeddings: list[list[float]] | None = None
    transcript: Transcript | None = None


@dataclass(frozen=True)
class Failed:
    error: ServeError


@dataclass
class Request:
    """One request in flight: its id, its input, and the queue its events go to (owned by ``loop``; ``None``: a
    request that answers nobody, as another rank's copy of rank 0's under torchrun)."""

    payload: Any
    loop: asyncio.AbstractEventLoop | None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def push(self, event: Delta | Finished | Failed) -> None:
        """From the engine thread: hand ``event`` to the handler awaiting it."""
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is gone
            self.cancel()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
