"""Decode ms/token of a served model with its ranks scheduled as batch work (``SCHED_BATCH``) against the default
policy (``SCHED_OTHER``, what tpcore leaves them): the policy switched on the ranks between interleaved runs of one
served model.

The question it answers: the caller sends a call to each rank in turn, and a rank it woke may take the caller's
core before the next send (``call_stages.py`` shows the sends' mean wall time); a batch rank waits for a free core
instead of preempting. Does that change decode speed?

The model and prompts of ``generation.py`` (a Llama of SmolLM2-135M's widths, N=2 gloo ranks); greedy
``generate()`` in this process, ms/token ``(time with T new tokens - time with 1) / (T - 1)``. A round runs both
policies back to back (which goes first alternates), so the ratio batch / default of each round meets the same
load; the figures are the median of those ratios, their range, and in how many rounds batch was faster (a
count that chance alone keeps near half). Linux only (the policies are Linux's).

    python bench/rank_scheduling.py          # about 4 minutes on 2 CPU cores
"""

from __future__ import annotations

import os
import statistics
import sys

from _common import arguments, parse, printed, write_result
from _decode import caller_generate, prompts
from _models import smollm2_spec
from _ranks import schedule_rank
from _timing import median_range, per_token_ms, rotated

import tpcore

POLICIES = {"batch": getattr(os, "SCHED_BATCH", None), "default": getattr(os, "SCHED_OTHER", None)}


def ms_per_token(model, inputs: dict, new_tokens: int) -> float:
    """ms/token of one pair of runs (``new_tokens`` and 1 new token) of the caller's ``generate()``."""
    long, _ = caller_generate(model, inputs, new_tokens)
    short, _ = caller_generate(model, inputs, 1)
    return per_token_ms([long], [short], new_tokens)


def compare(model, batch: int, rounds: int, new_tokens: int) -> list[str]:
    inputs = prompts(batch)
    pool = model._tpcore_handle.pool
    ms: dict[str, list[float]] = {name: [] for name in POLICIES}
    for round_ in range(rounds + 1):  # the first round warms up
        for name in rotated(sorted(POLICIES), round_):
            pool.run(schedule_rank, POLICIES[name])
            figure = ms_per_token(model, inputs, new_tokens)
            if round_:
                ms[name].append(figure)
    pool.run(schedule_rank, POLICIES["default"])  # as tpcore left them
    ratios = [batch_ms / default_ms for batch_ms, default_ms in zip(ms["batch"], ms["default"], strict=True)]
    faster = sum(ratio < 1 for ratio in ratios)
    return [
        str(batch),
        f"{statistics.median(ms['default']):.2f}",
        f"{statistics.median(ms['batch']):.2f}",
        median_range(ratios),
        f"{faster}/{len(ratios)}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "rank_scheduling", "a few tokens, one round")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=31)
    args = parse(parser, argv, quick={"new_tokens": 6, "rounds": 1, "layers": 2})
    if POLICIES["batch"] is None:
        print("SCHED_BATCH is Linux's: nothing to compare here")
        sys.exit(0)
    new_tokens, rounds, layers = args.new_tokens, args.rounds, args.layers
    model = tpcore.parallelize(smollm2_spec(layers).build(), num_gpus=2)
    try:
        rows = [compare(model, batch, rounds, new_tokens) for batch in (1, 8)]
    finally:
        model.deparallelize()
    header = [
        "batch",
        "default ms/token",
        "batch ms/token",
        "batch / default: median of rounds (range)",
        "batch faster",
    ]
    table = printed(header, rows)
    sections = [
        f"Llama of SmolLM2-135M's widths, {layers} layers, N=2 gloo ranks, greedy, {new_tokens} new tokens after a "
        f"16-token prompt, {rounds} rounds; the caller's loop (`generate()` in this process), the ranks' policy "
        "switched between runs. ms/token: the median of the rounds.",
        table,
    ]
    write_result(
        "rank_scheduling",
        "Decode ms/token: ranks scheduled as batch work against the default",
        sections,
        "gloo",
        args.note,
        args.output,
    )


if __name__ == "__main__":
    main()
