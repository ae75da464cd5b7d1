"""The running batch of a decoder LM: one left-padded cache that sequences join and leave between steps.

Rows are sequences. The cache holds ``(B, heads, L, d)`` per attention layer, row ``b``'s ``n_b`` positions at the
right, and per state layer (state-space, linear attention) each row's state (:mod:`tpcore.served.cache_batches`);
``mask`` ``(B, L)`` is 1 on true positions. Waiting prompts are prefilled together in one forward, left-padded to
the longest (``position_ids`` = ``cumsum(mask) - 1``, as ``generate()`` gives a padded batch; a prompt alone is
the unsplit model's first step exactly), then join: their cache and the batch's are padded on the left to the
longer length and concatenated (:func:`tpcore.served.cache_batches.concatenate_batches`). One decode step feeds
every row's last token at position ``n_b`` (``position_ids = mask.sum(-1)``) with the mask extended by one
column, which hides each row's padding. Under multimodal RoPE (Qwen2-VL's rotary positions per axis: time, height,
width) a prompt with images is prefilled at the positions the model's ``get_rope_index`` gives ``(3, 1, L)``; its
image tokens span fewer positions than they are tokens, so the row keeps that difference, its *offset*, and decodes
at ``n_b + offset`` on every axis (as ``generate()`` adds its ``rope_deltas``). Rows that finish are dropped
(:func:`~tpcore.served.cache_batches.keep_rows`), then the leading columns no row needs any more
(:func:`~tpcore.served.cache_batches.drop_leading`). The same code runs a local model and a split one, whose ranks
keep the cache (:func:`tpcore.served.caches.batch_operation`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tpcore.served.cache_batches import attends, cache_maker
from tpcore.served.caches import batch_operation, cache_keyword

__all__ = [
    "Prefilled", "RunningBatch", "check_batching", "rope_index", "rope_per_axis", "running_batch", "select_rows",
    "warm_ups",
]  # fmt: skip


class Prefilled(NamedTuple):
    """Prefilled rows as the running batch takes them in: their attention ``mask`` ``(k, L)`` and each row's position
    ``offsets`` ``(k,)`` (0 but after images under multimodal RoPE)."""

    mask: torch.Tensor
    offsets: torch.Tensor


class RunningBatch:
    """The rows in flight (opaque objects, in cache order), their cache, attention mask and last tokens."""

    def __init__(self, model: Any):
        self.model = model
        self.keyword = cache_keyword(model)
        self.masks_past = attends(model.config)  # else a step's mask is its new column alone
        self.new_cache = cache_maker(model.config)
        self.rope_index = rope_index(model)
        #: the arguments ``rope_index`` takes by name (the image inputs it is given of a prompt's extras)
        self.rope_index_takes = set(inspect.signature(self.rope_index).parameters) if self.rope_index else set()
        self.rows: list[Any] = []
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.offsets = torch.zeros(0, dtype=torch.long)
        self.last_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def prefill(
        self, prompts: list[list[int]], extras: dict[str, torch.Tensor] | None = None
    ) -> tuple[Any, Prefilled, torch.Tensor]:
        """Run ``prompts`` (``k`` of them) in one forward, left-padded to the longest ``L``: their new cache, its
        mask ``(k, L)`` with their offsets, and the logits ``(k, V)`` of the token after each prompt. ``extras`` (one
        prompt's image inputs) go to the forward too."""
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.tensor([[0] * (width - len(prompt)) + prompt for prompt in prompts])
        mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        offsets = torch.zeros(len(prompts), dtype=torch.long)
        if extras and self.rope_index is not None:
            positions, offsets = self._positions_per_axis(input_ids, mask, extras)
        cache = self.new_cache()
        output = self._forward(input_ids, mask, positions, cache, **(extras or {}))
        return cache, Prefilled(mask, offsets), output.logits[:, -1]

    def join(self, rows: list[Any], cache: Any, prefilled: Prefilled, last_tokens: list[int]) -> None:
        """Add prefilled sequences: ``rows``, their ``cache`` and ``prefilled`` mask ``(k, L)`` and offsets, whose
        next inputs are ``last_tokens``."""
        mask, offsets = prefilled
        if not self.rows:
            self.cache, self.mask = cache, mask
        else:
            width = max(self.mask.shape[1], mask.shape[1])
            batch_operation(self.cache, "concatenate_batches", cache)
            self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        self.offsets = torch.cat([self.offsets, offsets])
        self.rows.extend(rows)
        self.last_tokens.extend(last_tokens)

    def step(self) -> torch.Tensor:
        """One decode step of every row: the logits ``(B, V)`` of each row's next token."""
        positions = self.mask.sum(dim=-1, keepdim=True) + self.offsets.unsqueeze(1)
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=torch.long)], dim=1)
        mask = self.mask if self.masks_past else self.mask[:, -1:]
        output = self._forward(torch.tensor(self.last_tokens).unsqueeze(1), mask, positions, self.cache)
        return output.logits[:, -1]

    def select(self, cache: Any, prefilled: Prefilled, indices: list[int]) -> Prefilled:
        """Keep the rows ``indices`` of a prefilled ``cache`` (those that go on after their first token): their
        mask (:func:`select_rows`) and offsets."""
        return Prefilled(select_rows(cache, prefilled.mask, indices), prefilled.offsets[indices])

    def keep(self, indices: list[int], last_tokens: list[int]) -> None:
        """Keep only the rows ``indices`` (in that order), whose next inputs are ``last_tokens``."""
        if not indices:
            self.rows, self.cache, self.last_tokens = [], None, []
            self.mask = torch.zeros(0, 0, dtype=torch.long)
            self.offsets = torch.zeros(0, dtype=torch.long)
            return
        self.mask = select_rows(self.cache, self.mask, indices)
        self.offsets = self.offsets[indices]
        self.rows = [self.rows[index] for index in indices]
        self.last_tokens = list(last_tokens)

    def _positions_per_axis(self, input_ids, mask, extras) -> tuple[torch.Tensor, torch.Tensor]:
        """The multimodal RoPE positions ``(3, k, L)`` of prompts with images and each row's offset ``(k,)``: the
        next position past its prompt less its length."""
        assert self.rope_index is not None
        named = {key: value for key, value in extras.items() if key in self.rope_index_takes}
        positions, deltas = self.rope_index(input_ids, attention_mask=mask, **named)
        return positions, deltas.reshape(-1).long()

    def _forward(self, input_ids, attention_mask, position_ids, cache, **extras):
        kwargs = {self.keyword: cache, "use_cache": True, "logits_to_keep": 1, **extras}
        kwargs.update(attention_mask=attention_mask, position_ids=position_ids)
        with torch.inference_mode():
            return self.model(input_ids=input_ids, **kwargs)


def warm_ups() -> list[Callable[[Any], None]]:
    """The calls of a running batch that make a compiled decode step's graphs
    (:func:`tpcore.served.compiled.compile_ranks`): two steps of one row, and two steps of two rows of different
    lengths (every step carries a mask, so these are all the graphs it needs)."""

    def run(prompts: list[list[int]]) -> Callable[[Any], None]:
        def warm_up(model: Any) -> None:
            batch = RunningBatch(model)
            cache, prefilled, _ = batch.prefill(prompts)
            batch.join(list(range(len(prompts))), cache, prefilled, [0] * len(prompts))
            for _ in range(2):
                batch.step()
            batch.keep([], [])

        return warm_up

    return [run([[0, 0, 0]]), run([[0, 0, 0], [0, 0, 0, 0, 0]])]


def rope_per_axis(model: Any) -> bool:
    """Whether the model's rotary positions run per axis (Qwen2-VL's multimodal RoPE: ``mrope_section``)."""
    text = model.config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return isinstance(rope, dict) and "mrope_section" in rope


def rope_index(model: Any) -> Callable | None:
    """The positions per axis of a prompt with images (the model's ``get_rope_index(input_ids, ..., image_grid_thw,
    attention_mask)``: positions ``(3, k, L)`` and each row's delta ``(k, 1)``) where its rotary positions run per
    axis; else ``None``."""
    if not rope_per_axis(model):
        return None
    for owner in (model, getattr(model, "model", None)):
        method = getattr(owner, "get_rope_index", None)
        if callable(method):
            return method
    return None


def running_batch(model: Any) -> Any:
    """The running batch for ``model``: an :class:`~tpcore.serve.encoder_decoder_batch.EncoderDecoderBatch` for an
    encoder-decoder, else a :class:`RunningBatch`."""
    if getattr(model.config, "is_encoder_decoder", False):
        from tpcore.serve.encoder_decoder_batch import EncoderDecoderBatch

        return EncoderDecoderBatch(model)
    return RunningBatch(model)


def check_batching(model: Any) -> None:
    """Run each operation of a running batch once on ``model``: two prompts of different lengths prefilled
    together, a step, a third (longer) joining, a step of the three, the first leaving (its leading columns
    dropped), a last step. Raises what the model raises where its forward cannot run a batch (a cache class of its
    own, a layer that needs what the batch does not pass)."""
    batch = running_batch(model)
    cache, prefilled, _ = batch.prefill([[0, 0], [0, 0, 0]])
    batch.join([0, 1], cache, prefilled, [0, 0])
    batch.step()
    cache, prefilled, _ = batch.prefill([[0, 0, 0, 0, 0]])
    batch.join([2], cache, prefilled, [0])
    batch.step()
    batch.keep([1, 2], [0, 0])
    batch.step()
    batch.keep([], [])


def select_rows(cache: Any, mask: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Keep the rows ``indices`` of ``cache`` (on the ranks for a split model's stand-in), then drop the leading
    columns no kept row needs; the kept rows' mask."""
    if len(indices) < mask.shape[0]:
        batch_operation(cache, "keep_rows", torch.tensor(indices))
        mask = mask[indices]
    unused = int((mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # leading columns no row needs
    if unused:
        batch_operation(cache, "drop_leading", unused)
        mask = mask[:, unused:]
    return mask


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)
