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

import argparse
import os
import statistics
import sys

from _common import common_arguments, markdown_table, plain_table, write_result
from generation import caller_generate, per_token_ms, prompts, spec_for

import tpcore

POLICIES = {"batch": getattr(os, "SCHED_BATCH", None), "default": getattr(os, "SCHED_OTHER", None)}


def schedule_rank(context, policy: int) -> None:
    """On a rank: ``policy`` for each of its threads."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(thread), policy, os.sched_param(0))
        except OSError:  # a thread that has just ended
            pass


def decode_ms(model, inputs: dict, new_tokens: int) -> float:
    """ms/token of one pair of runs (``new_tokens`` and 1 new token) of the caller's ``generate()``."""
    long, _ = caller_generate(model, inputs, new_tokens)
    short, _ = caller_generate(model, inputs, 1)
    return per_token_ms([long], [short], new_tokens)


def compare(model, batch: int, rounds: int, new_tokens: int) -> list[str]:
    inputs = prompts(batch)
    pool = model._tpcore_handle.pool
    ms: dict[str, list[float]] = {name: [] for name in POLICIES}
    for round_ in range(rounds + 1):  # the first round warms up
        for name in sorted(POLICIES, reverse=round_ % 2 == 1):
            pool.run(schedule_rank, POLICIES[name])
            figure = decode_ms(model, inputs, new_tokens)
            if round_:
                ms[name].append(figure)
    pool.run(schedule_rank, POLICIES["default"])  # as tpcore left them
    ratios = [batch_ms / default_ms for batch_ms, default_ms in zip(ms["batch"], ms["default"], strict=True)]
    faster = sum(ratio < 1 for ratio in ratios)
    return [
        str(batch),
        f"{statistics.median(ms['default']):.2f}",
        f"{statistics.median(ms['batch']):.2f}",
        f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
        f"{faster}/{len(ratios)}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "rank_scheduling", "a few tokens, one round")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args(argv)
    if POLICIES["batch"] is None:
        print("SCHED_BATCH is Linux's: nothing to compare here")
        sys.exit(0)
    new_tokens, rounds, layers = (6, 1, 2) if args.quick else (args.new_tokens, args.rounds, args.layers)
    model = tpcore.parallelize(spec_for(layers).build(), num_gpus=2)
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
    print(plain_table(header, rows))
    sections = [
        f"Llama of SmolLM2-135M's widths, {layers} layers, N=2 gloo ranks, greedy, {new_tokens} new tokens after a "
        f"16-token prompt, {rounds} rounds; the caller's loop (`generate()` in this process), the ranks' policy "
        "switched between runs. ms/token: the median of the rounds.",
        markdown_table(header, rows),
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
