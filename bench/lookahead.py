"""Decode ms/token of the caller's loop with and without the ranks' lookahead (:mod:`tpcore.served.lookahead`).

In the caller's loop (``generation.py``) a step is serial: the ranks' forward, the reply, generate's own work in
the caller (logits processors, stopping criteria, streamer: 1.5-2.6 ms here), the next call. With the lookahead,
once the ranks have answered a decode step they run the greedy guess of the next one before they wait, and
answer the next call from it when it is that call. Three loops, interleaved in rounds as in ``generation.py``:
the ranks' own loop, the caller's loop with the lookahead switched off on the ranks, and with it on (the default);
ms/token ``(time with T new tokens - time with 1) / (T - 1)``, each round's ratio against the ranks' loop (median
and range), and how many guessed steps answered a call. Greedy; every loop gives the same tokens (checked).

    python bench/lookahead.py                                       # N=2 ranks sharing 2 cores with the caller
    python bench/lookahead.py --ranks 1 --threads-per-rank 1        # a core to spare for the caller
"""

from __future__ import annotations

import os

import torch
from _common import arguments, parse, printed, write_result
from _decode import caller_generate, decode_ms, paired_ratios, prompts, ranks_generate, set_lookahead
from _models import smollm2_spec
from _ranks import load_split
from _timing import median_range, rotated

import tpcore
from tpcore.ranks.process import RankPool

# --- caller side ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "lookahead", "a few tokens, one round")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads-per-rank", type=int, default=None)
    args = parse(parser, argv, quick={"new_tokens": 6, "rounds": 1, "layers": 2})
    new_tokens, rounds, layers = args.new_tokens, args.rounds, args.layers
    spec = smollm2_spec(layers)
    served = tpcore.parallelize(spec.build(), num_gpus=args.ranks, threads_per_rank=args.threads_per_rank)
    served_pool = served._tpcore_handle.pool
    rows = []
    with RankPool(args.ranks, "gloo", threads_per_rank=args.threads_per_rank) as pool:
        pool.run(load_split, spec, device="cpu")
        for batch in (1, 8):
            inputs = prompts(batch)
            times = {way: {1: [], new_tokens: []} for way in ("ranks", "caller", "lookahead")}
            before = served_pool.run(set_lookahead, True)[0]
            for round_ in range(rounds + 1):  # the first round warms up
                for count in (1, new_tokens):
                    seconds, tokens = pool.run(ranks_generate, inputs, count)[0]
                    times["ranks"][count].append(seconds)
                    for way in rotated(("lookahead", "caller"), round_):
                        served_pool.run(set_lookahead, way == "lookahead")
                        seconds, caller_tokens = caller_generate(served, inputs, count)
                        times[way][count].append(seconds)
                        assert torch.equal(tokens, caller_tokens), f"{way}: the caller's tokens differ"
            counts = served_pool.run(set_lookahead, True)[0]
            used = {"run": counts[0] - before[0], "used": counts[1] - before[1]}
            ms = decode_ms(times, new_tokens)
            row = [str(batch), f"{ms['ranks']:.2f}"]
            for way in ("caller", "lookahead"):
                row += [f"{ms[way]:.2f}", median_range(paired_ratios(times, way, new_tokens))]
            rows.append([*row, f"{used['used']}/{used['run']}"])
    served.deparallelize()
    header = [
        "batch",
        "ranks' loop ms/token",
        "lookahead off ms/token",
        "off / ranks (range)",
        "with lookahead ms/token",
        "with lookahead / ranks (range)",
        "guessed forwards used / run",
    ]
    table = printed(header, rows)
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // args.ranks)
    sections = [
        f"Llama of SmolLM2-135M's widths, {layers} layers, N={args.ranks} gloo ranks of {threads} intra-op "
        f"thread(s) each, {os.cpu_count()} CPU cores, greedy, {new_tokens} new tokens after a 16-token prompt, "
        f"{rounds} rounds. ms/token: from the medians of the rounds; ratios: the median of the rounds' own.",
        table,
    ]
    write_result(
        "lookahead", "Decode ms/token with the ranks guessing the next step", sections, "gloo", args.note, args.output
    )


if __name__ == "__main__":
    main()
