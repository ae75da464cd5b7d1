"""The ranks' decode step under ``torch.compile``: ``parallelize(model, num_gpus, compile=True)``.

A decode step (one new position per row, the rest in the cache) runs the same small graph every token, and in
eager mode most of a rank's step is Python and unfused elementwise kernels, not matrix products (bench/README.md,
``time_breakdown.py``). Each rank wraps its model's ``forward`` in :class:`CompiledDecode`: a call whose
``input_ids`` are ``[batch, 1]`` runs ``torch.compile(forward, dynamic=True)`` (inductor; the collectives are
operators, :mod:`tpcore.parallel.comm`, so the step traces as one graph), every other call runs eager. A
prefill stays eager because inductor's prefill measured slower than eager's on the CPU.

With ``dynamic=True`` the cache's length is a symbol and the batch is specialized only at 1; a step's call
carries an attention mask only where a row is padded. So generations need three graphs: batch 1, batch
above 1, and batch above 1 padded. :func:`compile_ranks` makes them at load with a short greedy ``generate``
of the parallelized model for each (traced from the very calls a ``generate`` sends the ranks), on a bar.
Other callers pass warm-ups of their own calls: ``tpcore serve --compile`` makes the two graphs its running
batch needs (:func:`tpcore.serve.batch.warm_ups`).
A call the graphs do not fit (another cache class, ``output_attentions``) compiles one more on first use, up to
dynamo's ``recompile_limit``; past it that call runs eager. Inductor keeps what it compiled on disk, so a second
load of the same model compiles in less time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tpcore.parallel.quantized_linear import QuantizedLayer
from tpcore.progress import tqdm_lock_leaving_the_start_method
from tpcore.ranks.process import RankContext

__all__ = [
    "COMPILE_TIMEOUT_S",
    "CompiledDecode",
    "compile_forward",
    "compile_ranks",
    "compiled_calls",
    "compiled_graphs",
    "generate_warm_ups",
    "refuse_uncompilable",
]

logger = logging.getLogger("tpcore.parallelize")

#: seconds the ranks may take to compile their graphs at load (at least the call timeout): a 30-layer model
#: took minutes on 2 CPU cores
COMPILE_TIMEOUT_S = 1800.0

#: the prompts :func:`generate_warm_ups` generate from, as (rows, left-padded): one for each graph
WARM_UP_PROMPTS = ((1, False), (2, False), (2, True))

#: a call of the parallelized model that makes one graph of its decode step
WarmUp = Callable[[Any], None]


class CompiledDecode:
    """``forward`` with its decode steps compiled: a call whose ``input_ids`` are ``[batch, 1]`` goes to
    ``torch.compile(forward, dynamic=True, backend=backend)``, any other to ``forward`` itself.
    ``compiled_calls`` counts the calls that went to the compiled one."""

    def __init__(self, forward: Callable[..., Any], backend: str = "inductor"):
        self.eager = forward
        self.compiled = torch.compile(forward, dynamic=True, backend=backend)
        self.compiled_calls = 0

    def __call__(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1:
            self.compiled_calls += 1
            with torch.inference_mode():
                args, kwargs = [_inference(value) for value in args], {k: _inference(v) for k, v in kwargs.items()}
                return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def _inference(value: Any) -> Any:
    """``value``, a tensor made an inference tensor (a copy): dynamo's guards tell inference tensors from others,
    and a rank's steps get both (the caller's inputs arrive as plain tensors, a lookahead's guesses are made
    in inference mode), which would compile each graph twice."""
    if isinstance(value, torch.Tensor) and not value.is_inference():
        return value.clone()
    return value


def refuse_uncompilable(model: nn.Module) -> None:
    """Raise ``ValueError`` unless ``model`` is a decoder that generates: only a decode step is compiled; and
    unless its weights are unquantized (a quantized layer's dequantization is not made for inductor yet)."""
    config, can_generate = getattr(model, "config", None), getattr(model, "can_generate", None)
    generates = callable(can_generate) and can_generate()
    if not generates or getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"compile=True compiles a decoder's decode step; {type(model).__name__} is not a decoder-only model "
            "that generates: parallelize it without compile"
        )
    quantized = next((name for name, module in model.named_modules() if isinstance(module, QuantizedLayer)), None)
    if quantized is not None:
        raise ValueError(
            f"compile=True does not compile quantized layers yet ({quantized} is quantized): parallelize "
            f"{type(model).__name__} without compile"
        )


def compile_forward(context: RankContext, backend: str = "inductor") -> None:
    """On a rank: its kept model's ``forward`` becomes a :class:`CompiledDecode` of it."""
    model = context.store["model"]
    model.forward = CompiledDecode(model.forward, backend)


def compiled_calls(context: RankContext) -> int:
    """On a rank: how many calls its compiled forward has taken."""
    return context.store["model"].forward.compiled_calls


def compiled_graphs(context: RankContext) -> int:
    """On a rank: how many graphs dynamo has compiled in its process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def generate_warm_ups() -> list[WarmUp]:
    """A 3-token greedy ``generate`` from each of :data:`WARM_UP_PROMPTS`: the graphs ``generate`` needs."""

    def generate(rows: int, padded: bool) -> WarmUp:
        def warm_up(model: Any) -> None:
            ids = torch.zeros(rows, 4, dtype=torch.long)
            mask = torch.ones_like(ids)
            mask[0, 0] = 0 if padded else 1
            settings = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
            model.generate(ids, attention_mask=mask, **settings)

        return warm_up

    return [generate(rows, padded) for rows, padded in WARM_UP_PROMPTS]


def compile_ranks(model: Any, backend: str = "inductor", warm_ups: Sequence[WarmUp] | None = None) -> float:
    """In the caller, for a parallelized decoder ``model``: compile every rank's decode step and make its
    graphs by running each of ``warm_ups`` on ``model`` (default :func:`generate_warm_ups`: traced from the very
    calls a ``generate`` sends), under a bar; the seconds it took. The calls may take
    :data:`COMPILE_TIMEOUT_S`, or the model's call timeout if longer. If anything fails, the ranks are stopped
    and ``model`` gets its own methods back (``detach``) before the error is raised."""
    handle = model._tpcore_handle
    try:
        seconds = _compile_and_warm_up(model, handle, backend, warm_ups or generate_warm_ups())
    except BaseException:
        handle.detach()
        raise
    logger.info("compiled the ranks' decode step in %.1f s", seconds)
    return seconds


def _compile_and_warm_up(model: Any, handle: Any, backend: str, warm_ups: Sequence[WarmUp]) -> float:
    from transformers.utils import logging as transformers_logging

    handle.pool.run(compile_forward, backend, timeout=handle.timeout)
    started, timeout = time.monotonic(), handle.timeout
    handle.timeout = max(timeout, COMPILE_TIMEOUT_S)
    tqdm_lock_leaving_the_start_method()
    label = f"tpcore: {handle.pool.world_size} ranks compiling the decode step"
    try:
        with transformers_logging.tqdm(total=len(warm_ups), desc=label, unit="graph", disable=None) as bar:
            for warm_up in warm_ups:
                warm_up(model)
                bar.update(1)
    finally:
        handle.timeout = timeout
    return time.monotonic() - started
