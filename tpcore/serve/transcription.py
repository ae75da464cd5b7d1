"""The engine thread of a speech-to-text model (Whisper): uploaded audio in, text out.

An upload is read (:func:`read_audio`: any format libsndfile reads, WAV, FLAC, Ogg, MP3; channels averaged to
mono) and resampled to the feature extractor's rate (``scipy.signal.resample_poly``), then turned into the
model's input features ``(mel bins, frames)`` on the HTTP side. Each turn of the engine takes the waiting
requests (up to ``max_batch``), groups those asking alike (language; greedy, or a temperature of their own, then
alone) and runs transformers' own ``generate()`` once a group on their features stacked ``(k, mel bins,
frames)``: Whisper's forced language and task tokens and its suppressions are its generation config's, as in a
``generate()`` of the model alone. Every input is padded to the feature extractor's window (Whisper's 30 s), so
the rows of a group are the same length and each gets the tokens it gets alone.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from math import gcd
from typing import Any

import numpy as np
import torch

from tpcore.serve.requests import Finished, Request, ServeError, Transcript
from tpcore.serve.scheduler import RANKS_LOST
from tpcore.serve.whole_requests import WholeRequests

__all__ = ["Transcription", "TranscriptionScheduler", "read_audio"]


def read_audio(data: bytes, rate: int) -> np.ndarray:
    """The samples of an audio file's bytes, mono, at ``rate`` Hz ``(n,)`` float32; :class:`ServeError` for bytes
    that are no audio libsndfile reads."""
    import soundfile
    from scipy.signal import resample_poly

    try:
        samples, file_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise ServeError(f"the file is no audio this server reads (WAV, FLAC, Ogg, MP3): {error}", "file") from None
    if samples.shape[0] == 0:
        raise ServeError("the audio file holds no samples", "file")
    mono = samples.mean(axis=1)
    if file_rate != rate:
        common = gcd(int(file_rate), int(rate))
        mono = resample_poly(mono, rate // common, int(file_rate) // common).astype(np.float32)
    return mono


@dataclass
class Transcription:
    """A transcription request's input: its features ``(mel bins, frames)``, the audio's seconds, the language
    asked for (``None``: the model's choice), and the sampling temperature (0: greedy)."""

    features: torch.Tensor
    seconds: float
    language: str | None = None
    temperature: float = 0.0

    def group(self) -> tuple[str | None, float]:
        """Requests of one group share a ``generate()`` call."""
        return self.language, self.temperature


class TranscriptionScheduler(WholeRequests):
    """Batches transcription requests (payload :class:`Transcription`) on a speech-to-text ``model``."""

    task, counted = "transcription", "tokens"

    def answer(self, requests: list[Request]) -> None:
        """One ``generate()`` call per group of requests asking alike; a failed call fails its group alone."""
        groups: dict[tuple, list[Request]] = {}
        for request in requests:
            payload: Transcription = request.payload
            key = payload.group() if payload.temperature == 0 else (request.id,)  # sampling: alone
            groups.setdefault(key, []).append(request)
        for group in groups.values():
            try:
                self._transcribe(group)
            except RANKS_LOST:
                raise
            except Exception as error:
                self.fail(group, error)

    def _transcribe(self, requests: list[Request]) -> None:
        first: Transcription = requests[0].payload
        options: dict[str, Any] = {"do_sample": first.temperature > 0}
        if first.temperature > 0:
            options["temperature"] = first.temperature
        if first.language is not None:
            options["language"] = first.language
        self.largest_batch = max(self.largest_batch, len(requests))
        features = torch.stack([request.payload.features for request in requests])
        ids = self.model.generate(input_features=features.to(self.model.dtype), **options)
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        for index, request in enumerate(requests):
            tokens = [token for token in ids[index].tolist() if token not in special]
            self.throughput.add(len(tokens))
            text = self.tokenizer.decode(ids[index], skip_special_tokens=True).strip()
            transcript = Transcript(text, tokens, request.payload.seconds, request.payload.language)
            request.push(Finished("stop", 0, len(tokens), transcript=transcript))
