"""Greedy decoding timed two ways, for the decode scripts (generation.py, lookahead.py, rank_scheduling.py,
call_stages.py): ``generate()`` run on every rank of a ``RankPool`` and timed there (the ranks' loop), or called on a
served model and timed in this process (the caller's loop); their prompts; the served ranks' lookahead switched on
or off; each round's ms/token of a way against the ranks' loop.

The rank-side functions travel by value, as a script's own functions do (a rank imports nothing of bench/).
"""

from __future__ import annotations

import statistics
import sys
import time

import cloudpickle
import torch
from _timing import per_token_ms

from tpcore.ranks.worker import synchronize

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: the scripts' model: a Llama of SmolLM2-135M's widths (``_models.smollm2_spec``), vocabulary 49152
VOCAB = 49152


def prompts(batch: int, length: int = 16) -> dict:
    ids = torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(batch))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def ranks_generate(context, inputs: dict, new_tokens: int) -> tuple[float, torch.Tensor | None]:
    """On a rank: greedy ``generate()`` of the model :func:`_ranks.load_split` kept, timed there (and rank 0's
    tokens)."""
    model = context.store["bench_model"]
    inputs = {key: value.to(context.device) for key, value in inputs.items()}
    synchronize(context.device)
    start = time.perf_counter()
    with torch.inference_mode():
        tokens = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    synchronize(context.device)
    return time.perf_counter() - start, (tokens.cpu() if context.rank == 0 else None)


def caller_generate(model, inputs: dict, new_tokens: int) -> tuple[float, torch.Tensor]:
    """Greedy ``generate()`` of a served model, timed in this process (and its tokens)."""
    synchronize(model.device)
    start = time.perf_counter()
    tokens = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    synchronize(tokens.device)
    return time.perf_counter() - start, tokens


def decode_figures(model, batch: int, prompt: int, new_tokens: int, rounds: int) -> tuple[float, float]:
    """TTFT ms and decode ms/token of greedy ``generate()`` (medians of ``rounds`` after a warm-up)."""
    ids = torch.randint(2, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(batch))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    caller_generate(model, inputs, 2)
    short = [caller_generate(model, inputs, 1)[0] for _ in range(rounds)]
    long = [caller_generate(model, inputs, new_tokens)[0] for _ in range(rounds)]
    return statistics.median(short) * 1e3, per_token_ms(long, short, new_tokens)


def set_lookahead(context, on: bool) -> tuple[int, int]:
    """On a served model's rank: its lookahead (``tpcore.served.lookahead``) on or off, a pending guess dropped;
    the guessed steps run and used so far."""
    from tpcore.served.lookahead import rank_lookahead

    lookahead = rank_lookahead(context)
    lookahead.drop()
    lookahead.enabled = on
    lookahead.hitting = {False: on, True: on}
    return lookahead.run_count, lookahead.used_count


def decode_ms(times: dict[str, dict[int, list[float]]], new_tokens: int) -> dict[str, float]:
    """ms/token of each way from ``times[way][count]`` (seconds of each round with ``count`` new tokens, the first
    round a warm-up)."""
    return {way: per_token_ms(t[new_tokens][1:], t[1][1:], new_tokens) for way, t in times.items()}


def paired_ratios(times: dict[str, dict[int, list[float]]], way: str, new_tokens: int) -> list[float]:
    """Each round's ms/token of ``way`` against the ranks' loop (``times[way][count]``: seconds of each round, the
    first a warm-up): the two ran back to back, under the same load."""
    long, short = times[way][new_tokens][1:], times[way][1][1:]
    ranks_long, ranks_short = times["ranks"][new_tokens][1:], times["ranks"][1][1:]
    return [(a - b) / (c - d) for a, b, c, d in zip(long, short, ranks_long, ranks_short, strict=True)]
