"""The engine thread of a speech-to-text model (Whisper): uploaded audio in, text out.

An upload is read (:func:`read_audio`: any format libsndfile reads, WAV, FLAC, Ogg, MP3; channels averaged to
mono) and resampled to the feature extractor's rate (``scipy.signal.resample_poly``), then turned into the
model's input features ``(mel bins, frames)`` on the HTTP side. Each turn of the engine takes the waiting
requests (up to ``max_batch``), groups those asking alike (language, prompt, timestamps; greedy, or a temperature
of their own, then alone) and runs transformers' own ``generate()`` once a group on their features stacked
``(k, mel bins, frames)``: Whisper's forced language and task tokens and its suppressions are its generation
config's, as in a ``generate()`` of the model alone. Audio within the feature extractor's window (Whisper's 30 s)
is padded to it, so the rows of a group are the same length and each gets the tokens it gets alone.

Longer audio is transcribed alone, its features unpadded with their attention mask: ``generate()``'s long-form
transcription, which decodes the window at a time and moves on by the last timestamp the model gives. Where a
request asks for segments (timestamps), or its audio is long, ``generate()`` predicts timestamp tokens and returns
its segments, each with its start and end in seconds; the text leaves the timestamp tokens out. A ``prompt`` is
given as ``generate()``'s ``prompt_ids`` (the tokenizer's ``get_prompt_ids``: Whisper's previous-text token, then
the prompt's words), conditioning the first window.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from math import gcd
from typing import Any

import numpy as np
import torch

from tpcore.serve.requests import Finished, Request, Segment, ServeError, Transcript
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
    asked for (``None``: the model's choice), the sampling temperature (0: greedy), the prompt's ids (empty: none),
    whether segments with timestamps are asked for, and, for audio over the window, the features' attention mask
    ``(frames,)``."""

    features: torch.Tensor
    seconds: float
    language: str | None = None
    temperature: float = 0.0
    prompt_ids: tuple[int, ...] = ()
    timestamps: bool = False
    attention_mask: torch.Tensor | None = None

    @property
    def long(self) -> bool:
        """Longer than the window: transcribed alone, window by window."""
        return self.attention_mask is not None

    def group(self) -> tuple:
        """Requests of one group share a ``generate()`` call."""
        return self.language, self.temperature, self.prompt_ids, self.timestamps


class TranscriptionScheduler(WholeRequests):
    """Batches transcription requests (payload :class:`Transcription`) on a speech-to-text ``model``."""

    task, counted = "transcription", "tokens"

    def answer(self, requests: list[Request]) -> None:
        """One ``generate()`` call per group of requests asking alike; a failed call fails its group alone."""
        groups: dict[tuple, list[Request]] = {}
        for request in requests:
            payload: Transcription = request.payload
            alone = payload.temperature > 0 or payload.long  # sampling, or window by window
            groups.setdefault((request.id,) if alone else payload.group(), []).append(request)
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
        if first.prompt_ids:
            options["prompt_ids"] = torch.tensor(first.prompt_ids)
        if first.attention_mask is not None:  # long: alone
            options["attention_mask"] = first.attention_mask.unsqueeze(0)
        if first.timestamps or first.long:
            options.update(return_timestamps=True, return_segments=True)
        self.largest_batch = max(self.largest_batch, len(requests))
        features = torch.stack([request.payload.features for request in requests])
        output = self.model.generate(input_features=features.to(self.model.dtype), **options)
        timed = isinstance(output, dict)  # with its segments
        sequences = output["sequences"] if timed else output
        for index, request in enumerate(requests):
            tokens = self._text_tokens(sequences[index].tolist(), timed)
            self.throughput.add(len(tokens))
            transcript = Transcript(
                self._decode(tokens), tokens, request.payload.seconds, request.payload.language,
                [self._segment(segment) for segment in output["segments"][index]] if timed else None,
            )  # fmt: skip
            request.push(Finished("stop", 0, len(tokens), transcript=transcript))

    def _text_tokens(self, ids: list[int], timed: bool) -> list[int]:
        """``ids`` less the special tokens and, where ``timed``, the timestamps (every id from Whisper's first
        timestamp, the one after ``<|notimestamps|>``, on)."""
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        no_timestamps = getattr(self.model.generation_config, "no_timestamps_token_id", None)
        first_timestamp = no_timestamps + 1 if timed and no_timestamps is not None else float("inf")
        return [token for token in ids if token not in special and token < first_timestamp]

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def _segment(self, segment: dict[str, Any]) -> Segment:
        """One of ``generate()``'s segments (``start`` and ``end`` in seconds, its ``tokens``)."""
        tokens = self._text_tokens(segment["tokens"].tolist(), timed=True)
        return Segment(float(segment["start"]), float(segment["end"]), self._decode(tokens), tokens)
