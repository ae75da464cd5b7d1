"""The running batch of an encoder-decoder (T5, BART, M2M100): cohorts of rows that started together.

A request's prompt is the encoder's input; its tokens are the decoder's. Waiting prompts are prefilled together:
one forward runs the encoder over them, right-padded to the longest ``S`` (``attention_mask`` ``(k, S)`` hides the
padding, and every true token keeps its position, as ``generate()`` pads a batch), and the decoder's first step
from the decoder start token, filling an ``EncoderDecoderCache``: the decoder's keys and values, and the
cross-attention's keys and values of the encoder's states ``(k, heads, S, d)``. Those rows are a *cohort*: they
keep the encoder's states ``(k, S, hidden)`` and mask, and every later step feeds each row's last token with them.

Rows of one cohort are at the same decoder position, so a step needs no decoder mask and every decoder's position
embeddings (T5's relative bias, BART's learned, M2M100's sinusoidal) see what they see alone. Cohorts are not
merged: rows of different decoder lengths would need per-row positions that not every decoder takes. A step runs
one forward a cohort, and rows that finish leave their cohort (the cache's own ``batch_select_indices``, on the
ranks for a split model). The interface is :class:`~tpcore.serve.batch.RunningBatch`'s, so the engine thread drives
both alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from tpcore.served.caches import cache_keyword

__all__ = ["Cohort", "EncoderDecoderBatch"]


@dataclass
class Cohort:
    """Rows prefilled together: their cache, the encoder's states ``(k, S, hidden)`` and mask ``(k, S)``, and
    each row's next decoder input."""

    cache: Any
    encoder_states: torch.Tensor
    encoder_mask: torch.Tensor
    rows: list[Any] = field(default_factory=list)
    last_tokens: list[int] = field(default_factory=list)

    def select(self, indices: list[int]) -> None:
        """Keep the rows ``indices`` (in that order) of the cache and the encoder's states."""
        if len(indices) < self.encoder_states.shape[0]:
            self.cache.batch_select_indices(torch.tensor(indices))
            self.encoder_states = self.encoder_states[indices]
            self.encoder_mask = self.encoder_mask[indices]


class EncoderDecoderBatch:
    """The rows in flight (opaque objects, cohort after cohort) of an encoder-decoder ``model`` (local or split)."""

    def __init__(self, model: Any):
        self.model = model
        self.keyword = cache_keyword(model)
        config, generation = model.config, getattr(model, "generation_config", None)
        start = getattr(generation, "decoder_start_token_id", None)
        self.start_token = start if start is not None else config.decoder_start_token_id
        if self.start_token is None:
            raise ValueError(f"{type(model).__name__} names no decoder_start_token_id: its decoder cannot start")
        #: the first token the generation config forces (mBART's and M2M100's target language), else None
        self.forced_first = getattr(generation, "forced_bos_token_id", None)
        self.pad_token = getattr(config, "pad_token_id", None) or 0
        self.cohorts: list[Cohort] = []

    @property
    def rows(self) -> list[Any]:
        return [row for cohort in self.cohorts for row in cohort.rows]

    @property
    def last_tokens(self) -> list[int]:
        return [token for cohort in self.cohorts for token in cohort.last_tokens]

    def __len__(self) -> int:
        return sum(len(cohort.rows) for cohort in self.cohorts)

    def prefill(self, prompts: list[list[int]], extras: dict | None = None) -> tuple[Cohort, None, torch.Tensor]:
        """Encode ``prompts`` (``k`` of them, right-padded to the longest) and run the decoder's first step: their
        cohort (no rows yet), no decoder mask, and the logits ``(k, V)`` of each row's first token. (``extras``:
        none is taken; an encoder-decoder reads text alone here.)"""
        if extras:
            raise ValueError(f"an encoder-decoder takes no {', '.join(extras)} here")
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.tensor([prompt + [self.pad_token] * (width - len(prompt)) for prompt in prompts])
        mask = torch.tensor([[1] * len(prompt) + [0] * (width - len(prompt)) for prompt in prompts])
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        start = torch.full((len(prompts), 1), self.start_token)
        with torch.inference_mode():
            output = self.model(input_ids=input_ids, attention_mask=mask, decoder_input_ids=start,
                                **{self.keyword: cache, "use_cache": True})  # fmt: skip
        logits = output.logits[:, -1]
        if self.forced_first is not None:  # as transformers' ForcedBOSTokenLogitsProcessor
            forced = torch.full_like(logits, -float("inf"))
            forced[:, self.forced_first] = 0.0
            logits = forced
        return Cohort(cache, output.encoder_last_hidden_state, mask), None, logits

    def select(self, cohort: Cohort, mask: None, indices: list[int]) -> None:
        """Keep the rows ``indices`` of a prefilled ``cohort`` (those that go on after their first token)."""
        cohort.select(indices)

    def join(self, rows: list[Any], cohort: Cohort, mask: None, last_tokens: list[int]) -> None:
        """Add a prefilled ``cohort`` of ``rows``, whose next decoder inputs are ``last_tokens``."""
        cohort.rows, cohort.last_tokens = list(rows), list(last_tokens)
        self.cohorts.append(cohort)

    def step(self) -> torch.Tensor:
        """One decoder step of every row, a forward per cohort: the logits ``(B, V)`` of each row's next token."""
        logits = []
        for cohort in self.cohorts:
            kwargs = {self.keyword: cohort.cache, "use_cache": True}
            with torch.inference_mode():
                output = self.model(
                    decoder_input_ids=torch.tensor(cohort.last_tokens).unsqueeze(1),
                    encoder_outputs=(cohort.encoder_states,),
                    attention_mask=cohort.encoder_mask,
                    **kwargs,
                )
            logits.append(output.logits[:, -1])
        return torch.cat(logits)

    def keep(self, indices: list[int], last_tokens: list[int]) -> None:
        """Keep only the rows ``indices`` (ascending, as the engine gives them), whose next inputs are
        ``last_tokens``; a cohort left without rows is dropped."""
        wanted, offset = dict(zip(indices, last_tokens, strict=True)), 0
        for cohort in self.cohorts:
            size = len(cohort.rows)
            local = [index - offset for index in range(offset, offset + size) if index in wanted]
            if local:
                cohort.select(local)
                cohort.rows = [cohort.rows[index] for index in local]
                cohort.last_tokens = [wanted[offset + index] for index in local]
            else:
                cohort.rows = []
            offset += size
        self.cohorts = [cohort for cohort in self.cohorts if cohort.rows]
