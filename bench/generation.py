"""Decode ms/token of ``generate()`` on a split model: the loop in the caller against the loop on the ranks.

A random-init Llama (SmolLM2-135M's widths: hidden 576, 9 query and 3 key/value heads, fewer layers by
default) split over ``--ranks`` ranks (2 CPU processes on gloo; ``--device cuda``: a GPU each, NCCL), greedy decoding
of ``--new-tokens`` tokens at batch 1 and 8:

- **ranks' loop**: ``model.generate()`` run on every rank of a ``RankPool`` (``ParallelEngine``), timed there:
  the loop tpcore served before generation moved to the caller, without its one round trip;
- **caller's loop**: ``tpcore.parallelize(model).generate()``, timed in this process: transformers' loop runs
  here and each forward step is one round trip to the ranks, which keep the KV cache and answer a step from the
  greedy guess they computed while the caller worked (``tpcore.served.lookahead``; ``lookahead.py`` compares it
  switched off). The caller's tensors stay
  on the CPU (with CUDA ranks too: the caller needs no CUDA context), or with ``--caller-on-device`` go where
  ``inputs.to(model.device)`` puts them (CUDA ranks: the caller's GPU runs generate's tensor work).

ms/token is ``(time with T new tokens - time with 1 new token) / (T - 1)``: the prefill cancels out. The two
ways run interleaved in rounds; ms/token from the medians, and the ratio as the median of each round's own
ratio (a round runs both ways back to back, so a change in the machine's load falls on both), with its range.
Both give the same tokens (checked).

The overhead of a served call is measured apart, on bare decode steps (``model(next_token, cache=...)``, no
``generate()``): the median step timed in this process, against the median of the same steps run on the ranks
and timed there (the forward alone), and against the same steps with every rank asleep for a while before each
(a control: whether a forward is slower for the ranks idling between steps, as they do in the caller's loop). Rank
0's forwards in both loops are timed by hooks, which splits the difference between the loops: the forward itself,
and the time between two forwards. Writes
``bench/results/generation.md``.

    python bench/generation.py            # about 3 minutes on 2 CPU cores
    python bench/generation.py --quick    # a smoke run
    python bench/generation.py --device cuda --ranks 1   # a world of one GPU: the round trip against CUDA steps
    python bench/generation.py --device cuda --ranks 1 --caller-on-device   # the caller's tensors on cuda:0 too
"""

from __future__ import annotations

import itertools
import os
import statistics
import time

import torch
from _common import arguments, parse, printed, write_result
from _decode import caller_generate, decode_ms, paired_ratios, prompts, ranks_generate, set_lookahead
from _models import smollm2_spec
from _ranks import forward_spans, load_split, mark_forwards
from _timing import median_range

import tpcore
from tpcore.ranks.process import RankPool
from tpcore.ranks.worker import synchronize
from tpcore.served.caches import cache_keyword

#: how long the ranks sleep before each step of the control run: about a caller's loop's time between two forwards
ASLEEP_MS = 2.5

# --- run on the ranks (module-level, so cloudpickle sends them by value) -------------------------------


def ranks_steps(context, prompt: torch.Tensor, steps: int, asleep_ms: float = 0.0) -> float:
    """The median ms of a decode step run on the ranks (timed on rank 0): the forward alone; with ``asleep_ms``,
    each rank sleeps that long before each step (as the ranks do while a caller's loop does its own work)."""
    from transformers import DynamicCache

    model = context.store["bench_model"]
    cache, keyword = DynamicCache(), cache_keyword(model)
    times = []
    with torch.inference_mode():
        token = model(input_ids=prompt.to(context.device), **{keyword: cache}, use_cache=True)
        token = token.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            if asleep_ms:
                time.sleep(asleep_ms / 1e3)
            start = time.perf_counter()
            token = model(input_ids=token, **{keyword: cache}, use_cache=True).logits[:, -1:].argmax(-1)
            synchronize(context.device)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# --- caller side -------------------------------------------------------------------------------------


def caller_steps(model, prompt: torch.Tensor, steps: int) -> float:
    """The median ms of a decode step of the served model, timed in this process (the round trip included),
    the caller in one intra-op thread as in its ``generate()`` (the ranks hold the cores)."""
    from transformers import DynamicCache

    cache, times, keyword = DynamicCache(), [], cache_keyword(model)
    with torch.inference_mode(), model._tpcore_handle.one_thread():
        token = model(input_ids=prompt, **{keyword: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            token = model(input_ids=token, **{keyword: cache}, use_cache=True).logits[:, -1:].argmax(-1)
            synchronize(token.device)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_forwards(spans: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The ms of each decode forward of a rank (the prefill left out) and of each time between two of them."""
    forwards = [(end - start) * 1e3 for start, end in spans]
    between = [(start - end) * 1e3 for (_, end), (start, _) in itertools.pairwise(spans)]
    return forwards[1:], between[1:]


def loops(pools: dict, served, inputs: dict, caller_inputs: dict, rounds: int, new_tokens: int) -> tuple[dict, dict]:
    """The two loops in rounds, the ranks' first: the seconds of each round and token count ``{way: {count:
    [s]}}``, and rank 0's decode forwards and the times between two (the loop's own work, and in the caller's loop
    each served step's round trip) ``{way: (forward ms, between ms)}``, the first round a warm-up."""
    times = {"ranks": {1: [], new_tokens: []}, "caller": {1: [], new_tokens: []}}
    parts: dict[str, tuple[list[float], list[float]]] = {"ranks": ([], []), "caller": ([], [])}
    for round_ in range(rounds + 1):  # the first round warms up
        for count in (1, new_tokens):
            seconds, ranks_tokens = pools["ranks"].run(ranks_generate, inputs, count)[0]
            times["ranks"][count].append(seconds)
            seconds, caller_tokens = caller_generate(served, caller_inputs, count)
            times["caller"][count].append(seconds)
            assert torch.equal(ranks_tokens, caller_tokens.cpu()), "the two loops gave different tokens"
            for way, ranks in pools.items():
                forwards, between = decode_forwards(ranks.run(forward_spans)[0])
                if round_ and count == new_tokens:
                    parts[way][0].extend(forwards)
                    parts[way][1].extend(between)
    return times, parts


def bare_steps(pool, served, inputs: dict, caller_inputs: dict, rounds: int, new_tokens: int) -> tuple[float, ...]:
    """Median ms of a bare decode step: on the ranks, on the ranks asleep before each, served (one call each, the
    lookahead off); the first round a warm-up."""
    steps = {"ranks": [], "asleep": [], "caller": []}
    for _ in range(rounds + 1):
        steps["ranks"].append(pool.run(ranks_steps, inputs["input_ids"], new_tokens)[0])
        steps["asleep"].append(pool.run(ranks_steps, inputs["input_ids"], new_tokens, ASLEEP_MS)[0])
        served._tpcore_handle.pool.run(set_lookahead, False)  # one served call each, none guessed
        steps["caller"].append(caller_steps(served, caller_inputs["input_ids"], new_tokens))
        served._tpcore_handle.pool.run(set_lookahead, True)
    return tuple(statistics.median(steps[way][1:]) for way in steps)


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "generation", "a few tokens, one round")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--caller-threads",
        type=int,
        default=None,
        help="torch intra-op threads of this process in its loops (default: what tpcore sets while it serves)",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks compute (cuda: NCCL, a GPU each)"
    )
    parser.add_argument(
        "--caller-on-device",
        action="store_true",
        help="the caller's inputs on model.device, as `inputs.to(model.device)` puts them (default: on the CPU)",
    )
    args = parse(parser, argv, quick={"new_tokens": 6, "rounds": 1, "layers": 2})
    new_tokens, rounds, layers = args.new_tokens, args.rounds, args.layers
    spec = smollm2_spec(layers)
    backend = "nccl" if args.device == "cuda" else "gloo"
    served = tpcore.parallelize(spec.build(), num_gpus=args.ranks, backend=backend, device=args.device)
    if args.caller_threads is not None:  # instead of tpcore's own setting (one thread while the ranks compute)
        served._tpcore_handle.one_thread.enabled = False
        torch.set_num_threads(args.caller_threads)
    caller_device = served.device if args.caller_on_device else torch.device("cpu")
    rows, parts_rows = [], []
    served._tpcore_handle.pool.run(mark_forwards, "model")
    with RankPool(args.ranks, backend, device=args.device) as pool:
        pool.run(load_split, spec, device=args.device)
        pool.run(mark_forwards, "bench_model")
        pools = {"caller": served._tpcore_handle.pool, "ranks": pool}
        for batch in (1, 8):
            inputs = prompts(batch)
            caller_inputs = {key: value.to(caller_device) for key, value in inputs.items()}
            times, parts = loops(pools, served, inputs, caller_inputs, rounds, new_tokens)
            parts_rows.append(
                [
                    str(batch),
                    *(
                        f"{statistics.median(parts[way][i]):.2f} / {statistics.fmean(parts[way][i]):.2f}"
                        for i in (0, 1)
                        for way in ("ranks", "caller")
                    ),
                ]
            )
            ms = decode_ms(times, new_tokens)
            paired = paired_ratios(times, "caller", new_tokens)
            forward, asleep, served_step = bare_steps(pool, served, inputs, caller_inputs, rounds, new_tokens)
            rows.append(
                [
                    str(batch),
                    f"{ms['ranks']:.1f}",
                    f"{ms['caller']:.1f}",
                    median_range(paired),
                    f"{forward:.2f}",
                    f"{asleep:.2f}",
                    f"{served_step:.2f}",
                    f"{served_step - forward:.2f}",
                ]
            )
    caller_threads = (
        f"{args.caller_threads} intra-op threads" if args.caller_threads is not None else "tpcore's thread setting"
    )
    caller_place = f"on {caller_device} (model.device)" if args.caller_on_device else "on the CPU"
    served.deparallelize()
    header = [
        "batch",
        "ranks' loop ms/token",
        "caller's loop ms/token",
        "caller / ranks: median of rounds (range)",
        "step on the ranks ms",
        f"step on the ranks, {ASLEEP_MS:g} ms asleep before each, ms",
        "served step ms",
        "overhead per call ms",
    ]
    parts_header = [
        "batch",
        "forward in the ranks' loop ms (median / mean)",
        "forward in the caller's loop ms",
        "between two forwards, ranks' loop ms",
        "between two forwards, caller's loop ms",
    ]
    table, parts_table = printed(header, rows), printed(parts_header, parts_rows)
    sections = [
        f"Llama of SmolLM2-135M's widths, {layers} layers, N={args.ranks} {backend} ranks on {args.device}, greedy, "
        f"{new_tokens} new tokens after a 16-token prompt, {rounds} rounds; the caller's inputs and outputs "
        f"{caller_place}, {os.cpu_count()} CPU cores, {caller_threads} in the caller's loops.",
        table,
        "Where the difference is: rank 0's decode forwards in each loop's `generate()` (the hooks' wall time; CUDA "
        "ranks: the host's part), and the time between two forwards: the loop's own work, and in the caller's loop "
        "each served step's round trip. Median and mean over the decode steps of every round (a rare slow step moves "
        "the mean, and ms/token with it). The control column of the first table: the same steps on the ranks, each "
        f"rank asleep {ASLEEP_MS:g} ms before each step, as between the steps of a caller's loop.",
        parts_table,
    ]
    write_result(
        "generation",
        "Decode ms/token: the caller's loop against the ranks' loop",
        sections,
        backend,
        args.note,
        args.output,
    )


if __name__ == "__main__":
    main()
