"""Where the caller's time goes in a served decode step: its CPU and wall time per stage of a call.

The model and the prompts of ``generation.py`` (a Llama of SmolLM2-135M's widths, N=2 CPU ranks), greedy
``generate()`` of 33 tokens, three times; each forward step of the loop is timed in stages, marked by wrapping
tpcore's own functions in this process: the handle's preparation of the call (walks over the inputs, the
call's random state and config changes), pickling it, sending it to each rank, each wait for a reply,
reading each reply, what follows the last one, and generate's own work between two calls. ``time.thread_time``
gives the caller's CPU, the wall time beside it; medians over the steps (the first two calls, prefill and
warm-up, left out), and the wall time's mean, which a rare long stall moves (as it moves ms/token) where the
median does not.

The ranks mark the start and end of each forward they serve on the same wall clock (``perf_counter``: the host's
monotonic clock, one for all its processes), which splits a call's wall time around rank 0's forward: the last
send's end to rank 0's forward (the ranks waking, reading the call, preparing it), how much later the last rank
starts (rank 0 waits that long in the first collective), the forward, and the forward's end to the call's end
(the report, the reply, the caller waking and reading it); and the call less the forward, paired step by step, is
what serving adds to each step. Rank 0's forward is also given apart for the calls whose last rank started within
50 us of rank 0 and for the others (their share in the column "per call").

While the ranks compute, the caller sleeps in its waits; every other stage is the caller's CPU on the critical
path of a step. A stage's CPU here is several times its cost in a warm loop: between two steps the ranks'
compute on the same cores leaves the caller's caches cold. The ranks' lookahead is off here (every step is a
forward of the ranks, none answered from a guessed step: ``lookahead.py`` measures that).

    python bench/call_stages.py                   # batch 1 and 8, about a minute
    python bench/call_stages.py --batch-policy    # the ranks scheduled as batch work (bench/rank_scheduling.py)
"""

from __future__ import annotations

import functools
import itertools
import os
import statistics
import time

from _common import arguments, parse, printed, write_result
from _decode import prompts, set_lookahead
from _models import smollm2_spec
from _ranks import forward_spans, mark_forwards, schedule_rank

import tpcore
from tpcore.ranks import process, replies


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


def forward_marks(pool) -> list[list[tuple[int, int]]]:
    """Each rank's forwards since the last call (``(start, end)``, :func:`_ranks.forward_spans`), in ns."""
    return [[(round(start * 1e9), round(end * 1e9)) for start, end in spans] for spans in pool.run(forward_spans)]


def around_the_forward(
    calls: list[list[tuple]], forwards: list[tuple[int, int]], last_rank_forwards: list[tuple[int, int]]
) -> dict[str, list[float]]:
    """Wall ms of each call split around rank 0's forward of it (one forward per call, in order), and how much
    later the last rank started it."""
    split: dict[str, list[float]] = {}
    for call, (start, end), (last_start, _) in zip(calls, forwards, last_rank_forwards, strict=True):
        sent = max(wall for label, _, wall in call if label == "send end")
        called, returned = call[0][2], call[-1][2]
        for stage, ns in (
            ("last send end -> rank 0 forward start", start - sent),
            ("rank 0 forward start -> last rank's forward start", last_start - start),
            ("rank 0 forward", end - start),
            ("rank 0 forward end -> call end", returned - end),
            ("call, less rank 0's forward", (returned - called) - (end - start)),
            (f"rank 0 forward, the last rank starting {_skew_class(last_start - start)}", end - start),
        ):
            split.setdefault(stage, []).append(ns / 1e6)
    return split


#: a last rank starting later than this after rank 0 counts as late (``rank 0 forward, ...`` stages)
LATE_START_NS = 50_000


def _skew_class(ns: int) -> str:
    return f"over {LATE_START_NS / 1e3:g} us later" if ns > LATE_START_NS else f"within {LATE_START_NS / 1e3:g} us"


def stages(batch: int, layers: int, new_tokens: int, batch_policy: bool = False) -> list[list[str]]:
    marks: list = []
    model = tpcore.parallelize(smollm2_spec(layers).build(), num_gpus=2)
    handle = model._tpcore_handle
    handle.pool.run(mark_forwards, "model")
    if batch_policy:  # the ranks scheduled as batch work (bench/rank_scheduling.py), not as any process is
        handle.pool.run(schedule_rank, os.SCHED_BATCH)
    handle.pool.run(set_lookahead, False)  # every step a forward of the ranks, none answered from a guess
    encoded, send, read, wait = process._encoded, process.RankPool._send, replies.recv, replies.Readable.wait
    per_stage: dict[str, list[tuple[float, float]]] = {}
    split: dict[str, list[float]] = {}
    steps = 0
    try:
        process._encoded = marked(marks, "pickle", encoded)
        replies.recv = marked(marks, "read reply", read)
        replies.Readable.wait = marked(marks, "wait", wait)
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
            forwards = forward_marks(handle.pool)
            for stage, times in around_the_forward(calls[2:], forwards[0][2:], forwards[-1][2:]).items():
                split.setdefault(stage, []).extend(times)
            for before, after in itertools.pairwise(calls[2:]):
                cpu, wall = ((after[0][i] - before[-1][i]) / 1e6 for i in (1, 2))
                per_stage.setdefault("call end -> next call start (generate's own work)", []).append((cpu, wall))
            for call in calls[2:]:
                steps += 1
                for (first, cpu0, wall0), (then, cpu1, wall1) in itertools.pairwise(call):
                    own = first.endswith(" start") and then == first.removesuffix(" start") + " end"
                    stage = first.removesuffix(" start") if own else f"{first} -> {then}"
                    per_stage.setdefault(stage, []).append(((cpu1 - cpu0) / 1e6, (wall1 - wall0) / 1e6))
    finally:
        process._encoded, process.RankPool._send = encoded, send
        replies.recv = read
        replies.Readable.wait = wait
        model.deparallelize()
    rows = []
    for stage, times in per_stage.items():
        cpu, wall = (statistics.median(t[i] for t in times) for i in (0, 1))
        mean = statistics.fmean(t[1] for t in times)
        rows.append([str(batch), stage, f"{len(times) / steps:.1f}", f"{cpu:.3f}", f"{wall:.3f}", f"{mean:.3f}"])
    calls = len(split["rank 0 forward"])
    for stage, walls in split.items():
        share = f"{len(walls) / calls:.2f}"
        rows.append([str(batch), stage, share, "", f"{statistics.median(walls):.3f}", f"{statistics.fmean(walls):.3f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "call_stages", "a few tokens")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument(
        "--batch-policy", action="store_true", help="the ranks scheduled SCHED_BATCH instead of the default policy"
    )
    args = parse(parser, argv)
    new_tokens = 6 if args.quick else 33
    rows = [row for batch in (1, 8) for row in stages(batch, args.layers, new_tokens, args.batch_policy)]
    header = ["batch", "stage", "per call", "caller CPU ms (median)", "wall ms (median)", "wall ms (mean)"]
    table = printed(header, rows)
    sections = [
        f"Llama of SmolLM2-135M's widths, {args.layers} layers, N=2 gloo ranks, greedy, {new_tokens} new tokens, "
        "3 runs; a stage `x` is the time inside `x`, a stage `a -> b` the time between those two marks "
        "(`call start -> pickle start`: the handle's preparation of the call); the ranks scheduled "
        + ("as batch work (SCHED_BATCH, `--batch-policy`)." if args.batch_policy else "by the default policy."),
        table,
    ]
    write_result(
        "call_stages", "Where a served call's time goes, in the caller", sections, "gloo", args.note, args.output
    )


if __name__ == "__main__":
    main()
