"""The engine thread of an encoder: concurrent embedding requests grouped into one padded batch per step.

Each turn takes every waiting request (up to ``max_batch`` inputs in all), tokenizes their inputs together
(padded to the longest, truncated to the model's length), runs one forward and pools each input's last hidden
state ``(T, H)`` into one vector as sentence-transformers does: the mean over its true tokens (or the first
token's, where the model directory's ``1_Pooling/config.json`` says ``pooling_mode_cls_token``), normalized to
length 1.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tpcore.serve.requests import Failed, Finished, InternalError, Request
from tpcore.serve.scheduler import RANKS_LOST, Scheduler
from tpcore.serve.stats import Throughput

__all__ = ["EmbeddingScheduler", "pooling_mode"]

logger = logging.getLogger("tpcore.serve")


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


class EmbeddingScheduler(Scheduler):
    """Batches embedding requests (payload: a list of texts) on an encoder ``model`` in one engine thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_batch: int = 64,
        max_queue: int = 64,
        pooling: str = "mean",
        reload: Callable[[], Any] | None = None,
    ):
        super().__init__(model, tokenizer, set(), max_batch=max_batch, max_queue=max_queue, reload=reload)
        self.model, self.pooling = model, pooling
        self.throughput = Throughput(logger, "inputs")

    def serving_model(self) -> Any:
        return self.model

    def use_model(self, model: Any) -> None:
        self.model = model

    def _run(self) -> None:
        with torch.inference_mode():
            while (requests := self._take()) is not None:
                requests = [request for request in requests if not request.cancelled]
                if not requests:
                    continue
                try:
                    self._embed(requests)
                except RANKS_LOST as error:
                    if not self._lost(f"a rank died or hangs: {error}", requests):
                        return
                except Exception as error:
                    logger.exception("an embedding step failed")
                    for request in requests:
                        request.push(Failed(InternalError(f"embedding failed: {error}")))

    def _take(self) -> list[Request] | None:
        """Every waiting request up to ``max_batch`` inputs (at least one); ``None`` when stopping."""
        with self.wake:
            while not self.stopping and not self.waiting:
                self.throughput.idle()
                self.wake.wait(timeout=1.0)
            if self.stopping:
                self._refuse_waiting()
                return None
            taken: list[Request] = []
            inputs = 0
            while self.waiting and (not taken or inputs + len(self.waiting[0].payload) <= self.max_batch):
                taken.append(self.waiting.popleft())
                inputs += len(taken[-1].payload)
            return taken

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
