"""The running batch of a decoder LM: one left-padded KV cache that sequences join and leave between steps.

Rows are sequences. The cache holds ``(B, heads, L, d)`` per layer, row ``b``'s ``n_b`` positions at the right;
``mask`` ``(B, L)`` is 1 on true positions. A sequence is prefilled alone (batch 1, its own cache: the unsplit
model's first step exactly), then joins: its cache and the batch's are padded on the left to the longer length
and concatenated (:func:`tpcore.served.cache_batches.concatenate_batches`). One decode step feeds every row's last
token at position ``n_b`` (``position_ids = mask.sum(-1)``) with the mask extended by one column, which hides
each row's padding. Rows that finish are dropped (``batch_select_indices``), then the leading columns no row
needs any more (:func:`tpcore.served.cache_batches.drop_leading`). The same code runs a local model and a split one,
whose ranks keep the cache (:func:`tpcore.served.caches.batch_operation`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from tpcore.served.caches import batch_operation, cache_keyword

__all__ = ["RunningBatch"]


class RunningBatch:
    """The rows in flight (opaque objects, in cache order), their cache, attention mask and last tokens."""

    def __init__(self, model: Any):
        self.model = model
        self.keyword = cache_keyword(model)
        self.rows: list[Any] = []
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.last_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def prefill(self, prompt_ids: list[int]) -> tuple[Any, torch.Tensor]:
        """Run one prompt alone: its new cache and the logits ``(1, V)`` of the token after it."""
        cache = DynamicCache()
        input_ids = torch.tensor([prompt_ids])
        output = self._forward(input_ids, torch.ones_like(input_ids), None, cache)
        return cache, output.logits[:, -1]

    def join(self, row: Any, cache: Any, length: int, last_token: int) -> None:
        """Add a prefilled sequence of ``length`` positions (its cache) whose next input is ``last_token``."""
        if not self.rows:
            self.cache, self.mask = cache, torch.ones(1, length, dtype=torch.long)
        else:
            width = max(self.mask.shape[1], length)
            batch_operation(self.cache, "concatenate_batches", cache)
            self.mask = torch.cat(
                [_pad_left(self.mask, width), _pad_left(torch.ones(1, length, dtype=torch.long), width)]
            )
        self.rows.append(row)
        self.last_tokens.append(last_token)

    def step(self) -> torch.Tensor:
        """One decode step of every row: the logits ``(B, V)`` of each row's next token."""
        positions = self.mask.sum(dim=-1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=torch.long)], dim=1)
        output = self._forward(torch.tensor(self.last_tokens).unsqueeze(1), self.mask, positions, self.cache)
        return output.logits[:, -1]

    def keep(self, indices: list[int], last_tokens: list[int]) -> None:
        """Keep only the rows ``indices`` (in that order), whose next inputs are ``last_tokens``."""
        if not indices:
            self.rows, self.cache, self.last_tokens = [], None, []
            self.mask = torch.zeros(0, 0, dtype=torch.long)
            return
        if len(indices) < len(self.rows):
            batch_operation_select(self.cache, indices)
            self.mask = self.mask[indices]
        self.rows = [self.rows[index] for index in indices]
        self.last_tokens = list(last_tokens)
        unused = int((self.mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # leading columns no row needs
        if unused:
            batch_operation(self.cache, "drop_leading", unused)
            self.mask = self.mask[:, unused:]

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        kwargs = {self.keyword: cache, "use_cache": True, "attention_mask": attention_mask, "logits_to_keep": 1}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        with torch.inference_mode():
            return self.model(input_ids=input_ids, **kwargs)


def batch_operation_select(cache: Any, indices: list[int]) -> None:
    """Keep the rows ``indices`` of ``cache`` (transformers' own ``batch_select_indices``; on the ranks for a
    split model's stand-in)."""
    cache.batch_select_indices(torch.tensor(indices))


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)
