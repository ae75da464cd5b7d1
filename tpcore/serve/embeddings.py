"""The engine thread of an encoder: concurrent embedding requests grouped into one padded batch per step.

Each turn takes every waiting request (up to ``max_batch`` inputs in all), tokenizes their inputs together
(padded to the longest, truncated to the model's length), runs one forward and pools each input's last hidden
state ``(T, H)`` into one vector as sentence-transformers does: the mean over its true tokens (or the first
token's, where the model directory's ``1_Pooling/config.json`` says ``pooling_mode_cls_token``), normalized to
length 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tpcore.serve.requests import Finished, Request
from tpcore.serve.whole_requests import WholeRequests

__all__ = ["EmbeddingScheduler", "pooling_mode"]


def pooling_mode(directory: str | None) -> str:
    """``"cls"`` where a sentence-transformers directory pools the first token, else ``"mean"``."""
    config = Path(directory or "") / "1_Pooling" / "config.json"
    if directory and config.is_file():
        settings = json.loads(config.read_text())
        if settings.get("pooling_mode_cls_token") and not settings.get("pooling_mode_mean_tokens"):
            return "cls"
    return "mean"


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``(B, T, H)`` hidden states, ``(B, T)`` mask -> ``(B, H)`` unit vectors."""
    if mode == "cls":
        vectors = hidden[:, 0]
    else:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        vectors = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(vectors.float(), p=2, dim=-1)


class EmbeddingScheduler(WholeRequests):
    """Batches embedding requests (payload: a list of texts) on an encoder ``model`` in one engine thread."""

    task = "embedding"

    def __init__(self, model: Any, tokenizer: Any, pooling: str = "mean", **options: Any):
        """``options``: :class:`~tpcore.serve.whole_requests.WholeRequests`' (``max_batch``, ``max_queue``,
        ``reload``)."""
        super().__init__(model, tokenizer, **options)
        self.pooling = pooling

    def units(self, request: Request) -> int:
        return len(request.payload)

    def answer(self, requests: list[Request]) -> None:
        self._embed(requests)

    def _embed(self, requests: list[Request]) -> None:
        texts = [text for request in requests for text in request.payload]
        encoded = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        output = self.model(**encoded)
        vectors = pool(output.last_hidden_state, encoded["attention_mask"], self.pooling)
        lengths = encoded["attention_mask"].sum(dim=1).tolist()
        self.throughput.add(len(texts))
        start = 0
        for request in requests:
            count = len(request.payload)
            used = int(sum(lengths[start : start + count]))
            request.push(Finished(None, used, embeddings=vectors[start : start + count].tolist()))
            start += count
