"""The ranks' decode step compiled (``parallelize(..., compile=True)``) against the eager ranks and the unsplit model.

A random-init Llama of SmolLM2-135M's widths (30 layers by default), fp32, greedy, a ``--prompt``-token prompt at
batch 1 and 8, three ways in this one process:

- **unsplit**: transformers in this process, on all cores (``--threads``, default 2);
- **tpcore eager**: ``tpcore.parallelize(model, num_gpus=2)`` (gloo ranks, the cores split between them);
- **tpcore compiled**: the same with ``compile=True``, its compile cold (inductor's cache in a new directory); after
  the rounds it is loaded once more, its compile warm (that cache kept).

For each: the seconds ``parallelize`` took (the compile included), TTFT (``generate()`` of one new token), decode
tokens/s (from ``(time with T new - time with 1) / (T - 1)``, medians of ``--rounds``), each rank's peak resident
memory, and whether its tokens equal the unsplit model's. The ways take turns, round by round, under the same load.

    python bench/compiled.py             # about 15 minutes on 2 CPU cores -> bench/results/compiled.md
    python bench/compiled.py --quick     # a smoke run
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
from _common import arguments, parse, printed, write_result
from _decode import VOCAB, caller_generate, decode_figures
from _memory import mib, proc_status, send_by_value
from _models import smollm2_spec

import tpcore

WAYS = ("unsplit", "tpcore eager", "tpcore compiled")


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "compiled", "2 layers, few tokens, one round")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=32, help="prompt length")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the unsplit way")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=3)
    args = parse(parser, argv, quick={"layers": 2, "new_tokens": 4, "rounds": 1})
    torch.set_num_threads(args.threads)
    send_by_value()
    spec = smollm2_spec(args.layers)
    models, load_s = {"unsplit": spec.build().eval()}, {"unsplit": None}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the ranks inherit it: a cold compile
        for way, compile_ in (("tpcore eager", False), ("tpcore compiled", True)):
            started = time.perf_counter()
            models[way] = tpcore.parallelize(spec.build(), num_gpus=2, compile=compile_)  # the same seeded weights
            load_s[way] = time.perf_counter() - started
            print(f"{way}: parallelize {load_s[way]:.1f} s", flush=True)
        try:
            rows = measure(models, load_s, args)
        finally:
            for way in WAYS[1:]:
                models[way].deparallelize()
        started = time.perf_counter()
        tpcore.parallelize(spec.build(), num_gpus=2, compile=True).deparallelize()
        warm_s = time.perf_counter() - started
    sections = [
        f"Llama of SmolLM2-135M's widths, {args.layers} layers, fp32, greedy, {args.prompt}-token prompts. unsplit: "
        f"this process, {args.threads} threads; tpcore: `parallelize(model, num_gpus=2)`, gloo, the cores split "
        "between the ranks, with `compile=True` or without. Load: seconds of `parallelize` (a cold compile; "
        f"{warm_s:.0f} s loaded again with inductor's cache warm). "
        f"TTFT: `generate()` of one new token; decode: over {args.new_tokens - 1} new tokens; medians of "
        f"{args.rounds} rounds. Peak RSS: the highest of the ranks' `VmHWM`.\n\n"
        + printed(["way", "batch", "load s", "TTFT ms", "decode tok/s", "x eager", "peak RSS MiB", "same tokens"], rows)
    ]
    write_result("compiled", "The ranks' decode step compiled", sections, "gloo", None, args.output)


def measure(models: dict, load_s: dict, args) -> list[list[str]]:
    rows = []
    for batch in (1, 8):
        ids = torch.randint(2, VOCAB, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        figures, tokens = {}, {}
        for way in WAYS:
            with torch.inference_mode():
                tokens[way] = caller_generate(models[way], inputs, args.new_tokens)[1]
        for _ in range(args.rounds):
            for way in WAYS:
                with torch.inference_mode():
                    ttft, per_token = decode_figures(models[way], batch, args.prompt, args.new_tokens, 1)
                figures.setdefault(way, []).append((ttft, per_token))
        eager = statistics.median(p for _, p in figures["tpcore eager"])
        for way in WAYS:
            ttft = statistics.median(t for t, _ in figures[way])
            per_token = statistics.median(p for _, p in figures[way])
            if way == "unsplit":
                peak = None
            else:
                peak = max(status["VmHWM"] for status in models[way]._tpcore_handle.pool.run(proc_status))
            load = "-" if load_s[way] is None else f"{load_s[way]:.0f}"
            rows.append(
                [way, str(batch), load, f"{ttft:.0f}", f"{batch * 1e3 / per_token:.1f}", f"{eager / per_token:.2f}",
                 "-" if peak is None else mib(peak), str(torch.equal(tokens[way], tokens["unsplit"]))]
            )  # fmt: skip
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
