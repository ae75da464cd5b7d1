"""Decode ms/token of a served model with rank 0 polling for its next call (tpcore's default,
``tpcore.ranks.waiting``) against every rank blocking in its wait: the window switched on rank 0 between
interleaved runs of one served model.

The question it answers: between two decode steps the caller runs generate's own work (1.5-4 ms here) while the
ranks wait; a rank blocked in its wait is woken when the next call comes, on a core the scheduler picks and with
cold caches, and the forward's first collective waits for the last rank to start. Does rank 0 polling for the call
(up to ``--window-ms``) change decode speed?

The model, prompts and rounds of ``rank_scheduling.py``: greedy ``generate()`` in this process, ms/token
``(time with T new tokens - time with 1) / (T - 1)``; a round runs both settings back to back (which goes first
alternates); the figures are the median of the rounds' ratios polling / blocking, their range, and in how many
rounds polling was faster.

    python bench/rank_polling.py          # about 4 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import functools

from _common import common_arguments, markdown_table, plain_table, write_result
from generation import prompts, spec_for
from rank_scheduling import paired_rounds, paired_row

import tpcore
from tpcore.ranks.waiting import DEFAULT_POLL_MS


def set_window(context, window_ms: float) -> None:
    """On a rank: rank 0 polls up to ``window_ms`` for its next call (0: blocks); the others keep blocking."""
    if context.rank == 0:
        context.waiter.window = window_ms / 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "rank_polling", "a few tokens, one round")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--window-ms", type=float, default=DEFAULT_POLL_MS)
    args = parser.parse_args(argv)
    new_tokens, rounds, layers = (6, 1, 2) if args.quick else (args.new_tokens, args.rounds, args.layers)
    model = tpcore.parallelize(spec_for(layers).build(), num_gpus=2)
    pool = model._tpcore_handle.pool
    settings = {"polling": functools.partial(pool.run, set_window, args.window_ms)}
    settings["blocking"] = functools.partial(pool.run, set_window, 0.0)
    try:
        rows = []
        for batch in (1, 8):
            ms = paired_rounds(model, prompts(batch), rounds, new_tokens, settings)
            rows.append(paired_row(batch, ms, "polling", "blocking"))
    finally:
        model.deparallelize()
    header = [
        "batch",
        "blocking ms/token",
        f"polling {args.window_ms:g} ms ms/token",
        "polling / blocking: median of rounds (range)",
        "polling faster",
    ]
    print(plain_table(header, rows))
    sections = [
        f"Llama of SmolLM2-135M's widths, {layers} layers, N=2 gloo ranks, greedy, {new_tokens} new tokens after a "
        f"16-token prompt, {rounds} rounds; the caller's loop (`generate()` in this process), rank 0's wait for its "
        "next call switched between runs. ms/token: the median of the rounds.",
        markdown_table(header, rows),
    ]
    write_result(
        "rank_polling",
        "Decode ms/token: rank 0 polling for its next call against blocking",
        sections,
        "gloo",
        args.note,
        args.output,
    )


if __name__ == "__main__":
    main()
