"""Why ``compile=True`` compiles only the decode step, and without freezing: one process as one rank runs it (one
thread, ``transpose_linear_weights`` applied), the whole forward eager and under ``torch.compile(dynamic=True)``,
with inductor's ``freezing`` off and on.

A random-init Llama of SmolLM2-135M's widths (``--layers``, default 6), fp32, a 32-token prompt at batch 1 and 8:
the prefill forward's ms and the median decode step's ms (``--steps`` steps of greedy decoding with a
``DynamicCache``), eager and compiled in turns (``--rounds``), the compile's seconds (cold: inductor's cache in a new
directory) and this process's resident memory before and after it, and whether the tokens are equal.

    python bench/compile_options.py           # about 5 minutes on 2 CPU cores -> bench/results/compile_options.md
    python bench/compile_options.py --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from _common import arguments, parse, printed, write_result
from _decode import VOCAB
from _memory import mib, proc_status


def timed_generation(forward, batch: int, prompt: int, steps: int) -> tuple[float, float, torch.Tensor]:
    """Prefill ms, median decode step ms and the greedy tokens of ``forward`` from a seeded prompt."""
    from transformers import DynamicCache

    ids = torch.randint(2, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(batch))
    with torch.inference_mode():
        cache = DynamicCache()
        start = time.perf_counter()
        output = forward(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - start
        token = output.logits[:, -1:].argmax(-1)
        tokens, times = [token], []
        for _ in range(steps):
            start = time.perf_counter()
            output = forward(input_ids=token, past_key_values=cache, use_cache=True)
            token = output.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
            tokens.append(token)
    return prefill * 1e3, statistics.median(times[2:]) * 1e3, torch.cat(tokens, 1)


def one_setting(freezing: bool, args) -> list[list[str]]:
    """In a process of its own (``--setting``): the rows of one ``freezing`` setting."""
    import torch._inductor.config as inductor_config
    from _models import smollm2_spec

    from tpcore.parallel.cpu_layout import transpose_linear_weights

    torch.set_num_threads(1)
    model = smollm2_spec(args.layers).build().eval().requires_grad_(False)
    transpose_linear_weights(model)
    inductor_config.freezing = freezing
    compiled = torch.compile(model.forward, dynamic=True)
    rows = []
    for batch in (1, 8):
        before = proc_status()["VmRSS"]
        start = time.perf_counter()
        timed_generation(compiled, batch, args.prompt, 3)
        seconds = time.perf_counter() - start
        after = proc_status()["VmRSS"]
        figures = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            for way, forward in (("eager", model.forward), ("compiled", compiled)):
                figures[way].append(timed_generation(forward, batch, args.prompt, args.steps))
        same = torch.equal(figures["eager"][0][2], figures["compiled"][0][2])
        prefill = {way: statistics.median(f[0] for f in figures[way]) for way in figures}
        step = {way: statistics.median(f[1] for f in figures[way]) for way in figures}
        rows.append(
            [str(freezing), str(batch), f"{prefill['eager']:.0f}", f"{prefill['compiled']:.0f}",
             f"{step['eager']:.1f}", f"{step['compiled']:.1f}", f"{step['eager'] / step['compiled']:.2f}",
             f"{seconds:.0f}", f"{mib(before)} -> {mib(after)}", str(same)]
        )  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "compile_options", "2 layers, few steps, one round")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setting", choices=("frozen", "unfrozen"), help=argparse.SUPPRESS)
    args = parse(parser, argv, quick={"layers": 2, "steps": 4, "rounds": 1})
    if args.setting:
        for row in one_setting(args.setting == "frozen", args):
            print("ROW\t" + "\t".join(row), flush=True)
        return
    rows = []
    for setting in ("unfrozen", "frozen"):  # each in a fresh process: a compile's memory and caches stay apart
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--setting", setting]
            lines = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.splitlines()
        rows += [line.split("\t")[1:] for line in lines if line.startswith("ROW\t")]
    header = ["freezing", "batch", "prefill ms eager", "prefill ms compiled", "step ms eager", "step ms compiled",
              "step x", "compile s", "RSS MiB before -> after compile", "same tokens"]  # fmt: skip
    sections = [
        f"Llama of SmolLM2-135M's widths, {args.layers} layers, fp32, one thread, {args.prompt}-token prompt, the "
        f"whole forward under `torch.compile(dynamic=True)`; medians of {args.rounds} rounds.\n\n"
        + printed(header, rows)
    ]
    write_result("compile_options", "Compiling a rank's forward: the prefill, the step, freezing", sections, "-", None,
                 args.output)  # fmt: skip


if __name__ == "__main__":
    main()
