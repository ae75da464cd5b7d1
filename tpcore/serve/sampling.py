"""Per-request token choice: greedy, or sampling with its own temperature, top-p, top-k and seed.

Each request draws from its own ``torch.Generator`` (seeded with the request's ``seed``, else at random), so
what it draws never depends on the other requests of the batch; the warpers are transformers' own
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``), applied to the request's row of
logits ``(1, V)`` as ``generate()`` applies them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

__all__ = ["SamplingParams", "TokenChooser"]


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for: ``temperature`` 0 is greedy; ``stop`` strings end the text before them."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class TokenChooser:
    """Chooses one request's next token from its row of logits ``(1, V)``."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.warpers = LogitsProcessorList()
        if not params.greedy:
            if params.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(params.top_p))
        self.generator = torch.Generator().manual_seed(secrets.randbits(63) if params.seed is None else params.seed)

    def choose(self, input_ids: torch.Tensor, logits: torch.Tensor) -> int:
        """The next token after ``input_ids`` ``(1, n)`` given ``logits`` ``(1, V)`` (fp32 on the CPU)."""
        logits = logits.float().cpu()
        if self.params.greedy:
            return int(logits.argmax(dim=-1))
        scores = self.warpers(input_ids, logits)  # type: ignore[arg-type]
        probabilities = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probabilities, 1, generator=self.generator))
