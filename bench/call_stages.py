"""Where the caller's time goes in a served decode step: its CPU and wall time per stage of a call.

The model and the prompts of ``generation.py`` (a Llama of SmolLM2-135M's widths, N=2 CPU ranks), greedy
``generate()`` of 33 tokens, three times; each forward step of the loop is timed in stages, marked by wrapping
tpcore's own functions in this process: the handle's preparation of the call (walks over the inputs, the
call's random state and config changes), pickling it, sending it to each rank, each wait for a reply,
reading each reply, and what follows the last one. ``time.thread_time`` gives the caller's CPU, the wall
time beside it; medians over the steps (the first two calls, prefill and warm-up, left out).

While the ranks compute, the caller sleeps in its waits; every other stage is the caller's CPU on the critical
path of a step. A stage's CPU here is several times its cost in a warm loop: between two steps the ranks'
compute on the same cores leaves the caller's caches cold.

    python bench/call_stages.py              # batch 1 and 8, about a minute
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time

from _common import common_arguments, markdown_table, plain_table, write_result
from generation import prompts, spec_for

import tpcore
from tpcore.ranks import process


def marked(marks: list, label: str, function):
    """``function`` leaving ``(label + " start"/" end", thread CPU ns, wall ns)`` in ``marks`` around each call."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        marks.append((label + " start", time.thread_time_ns(), time.perf_counter_ns()))
        try:
            return function(*args, **kwargs)
        finally:
            marks.append((label + " end", time.thread_time_ns(), time.perf_counter_ns()))

    return wrapper


def stages(batch: int, layers: int, new_tokens: int) -> list[list[str]]:
    marks: list = []
    model = tpcore.parallelize(spec_for(layers).build(), num_gpus=2)
    handle = model._tpcore_handle
    originals = {name: getattr(process, name) for name in ("_encoded", "recv")}
    wait = process._Readable.wait
    send = process.RankPool._send
    per_stage: dict[str, list[tuple[float, float]]] = {}
    steps = 0
    try:
        process._encoded = marked(marks, "pickle", originals["_encoded"])
        process.recv = marked(marks, "read reply", originals["recv"])
        process._Readable.wait = marked(marks, "wait", wait)
        process.RankPool._send = marked(marks, "send", send)
        model.forward = functools.wraps(type(model).forward)(functools.partial(marked(marks, "call", handle.call), ""))
        inputs = prompts(batch)
        for _ in range(3):
            marks.clear()
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            calls, current = [], []
            for mark in marks:
                current.append(mark)
                if mark[0] == "call end":
                    calls.append(current)
                    current = []
            for call in calls[2:]:
                steps += 1
                for (first, cpu0, wall0), (then, cpu1, wall1) in itertools.pairwise(call):
                    own = first.endswith(" start") and then == first.removesuffix(" start") + " end"
                    stage = first.removesuffix(" start") if own else f"{first} -> {then}"
                    per_stage.setdefault(stage, []).append(((cpu1 - cpu0) / 1e6, (wall1 - wall0) / 1e6))
    finally:
        for name, function in originals.items():
            setattr(process, name, function)
        process.RankPool._send = send
        process._Readable.wait = wait
        model.deparallelize()
    rows = []
    for stage, times in per_stage.items():
        cpu, wall = (statistics.median(t[i] for t in times) for i in (0, 1))
        rows.append([str(batch), stage, f"{len(times) / steps:.1f}", f"{cpu:.3f}", f"{wall:.3f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "call_stages", "a few tokens")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args(argv)
    new_tokens = 6 if args.quick else 33
    rows = [row for batch in (1, 8) for row in stages(batch, args.layers, new_tokens)]
    header = ["batch", "stage", "per call", "caller CPU ms (median)", "wall ms (median)"]
    print(plain_table(header, rows))
    sections = [
        f"Llama of SmolLM2-135M's widths, {args.layers} layers, N=2 gloo ranks, greedy, {new_tokens} new tokens, "
        "3 runs; a stage `x` is the time inside `x`, a stage `a -> b` the time between those two marks "
        "(`call start -> pickle start`: the handle's preparation of the call).",
        markdown_table(header, rows),
    ]
    write_result(
        "call_stages", "Where a served call's time goes, in the caller", sections, "gloo", args.note, args.output
    )


if __name__ == "__main__":
    main()
