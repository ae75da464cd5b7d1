"""Where generation's time goes: the prefill and the decode step by kind of work, unsplit and split, and the caller's
share of a split model's decode.

A random-init Llama of SmolLM2-135M's widths (30 layers by default), fp32, greedy, ``--prompts`` tokens (32 and
512) at batch 1 and 8 (``--batches``), two ways:

- **unsplit**: transformers in this process, on all cores (``--threads``, default 2);
- **tpcore**: ``tpcore.parallelize(model, num_gpus=2)`` (gloo ranks, the cores split between them).

For each: TTFT (``generate()`` of one new token), decode ms/token (``(time with T new - time with 1) / (T - 1)``),
and one prefill forward and a decode step (``model(...)`` with a ``DynamicCache``, ``logits_to_keep=1`` for the
prefill as generate asks) taken apart: their wall time (median of ``--steps`` steps) and, from ``torch.profiler``
(the ops' own time, on rank 0 for the split model), matrix products (``aten::mm``/``addmm``/``bmm``), attention
(``scaled_dot_product_*``), the other aten ops (norms, rotary, activations, the KV cache's ``cat``, copies),
tpcore's collectives (wall time of ``all_reduce``/``all_gather``, the wait for the other ranks included; timed
without the profiler), and the rest: Python and dispatch, the wall time less all of these. The split model's
forwards run on the ranks as ``ParallelEngine`` runs them (no caller); the caller's share of a decoded token is
tpcore's decode ms/token less the ranks' step.

    python bench/time_breakdown.py              # about 10 minutes on 2 CPU cores -> bench/results/time_breakdown.md
    python bench/time_breakdown.py --quick      # a smoke run
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import cloudpickle
import torch
from _common import arguments, parse, printed, write_result
from _decode import VOCAB, decode_figures
from _models import smollm2_spec

import tpcore

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
KINDS = ("matmul", "attention", "other ops", "collectives", "python")

# --- run in this process and on the ranks (module-level, so cloudpickle sends them by value) ----------------------


def timed_collectives() -> tuple[list[float], Callable[[], None]]:
    """Time every collective tpcore's layers call in this process: the list the seconds go to, and the undo."""
    from tpcore.parallel import comm

    spent: list[float] = []
    originals = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather}

    def timed(function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        return wrapper

    patched = []
    for module in [m for name, m in sys.modules.items() if name.startswith("tpcore.") and m is not None]:
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                setattr(module, name, timed(original))
                patched.append((module, name, original))

    def undo() -> None:
        for module, name, original in patched:
            setattr(module, name, original)

    return spent, undo


def taken_apart(model, batch: int, prompt: int, steps: int, top: int = 0) -> dict:
    """``{"prefill" | "step": {"wall": ms, kind: ms, ...}}`` of ``model``'s forwards, as the module docstring says,
    and ``"ops"``: the prefill's ``top`` aten ops by their own time, ``[(name, calls, ms), ...]``."""
    from transformers import DynamicCache

    ids = torch.randint(2, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(batch))

    def forwards(collect=None):
        cache = DynamicCache()
        with torch.inference_mode():
            start = time.perf_counter()
            token = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = token.logits[:, -1:].argmax(-1)
            prefill = time.perf_counter() - start
            if collect is not None:
                collect("prefill")
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - start)
        return prefill, times

    forwards()  # warm-up
    walls = [forwards() for _ in range(3)]
    result = {
        "prefill": {"wall": statistics.median(w[0] for w in walls) * 1e3},
        "step": {"wall": statistics.median(t for w in walls for t in w[1]) * 1e3},
    }
    spent, undo = timed_collectives()
    marks = {}
    try:
        forwards(lambda phase: marks.setdefault(phase, len(spent)))
    finally:
        undo()
    result["prefill"]["collectives"] = sum(spent[: marks["prefill"]]) * 1e3
    result["step"]["collectives"] = sum(spent[marks["prefill"] :]) * 1e3 / steps
    for phase, count in (("prefill", 1), ("step", steps)):
        ops = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
        events = _profiled(model, ids, phase, steps)
        if phase == "prefill":
            ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
            result["ops"] = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in ranked]
        for event in events:
            kind = (
                "matmul" if event.key in MATMUL else "attention" if "scaled_dot_product" in event.key else "other ops"
            )
            ops[kind] += event.self_cpu_time_total / 1e3 / count
        result[phase].update(ops)
        accounted = sum(result[phase][kind] for kind in ("matmul", "attention", "other ops", "collectives"))
        result[phase]["python"] = max(0.0, result[phase]["wall"] - accounted)
    return result


def _profiled(model, ids, phase: str, steps: int):
    """The profiler's per-op averages of the prefill, or of ``steps`` decode steps after it (only those profiled)."""
    from torch.profiler import profile
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        if phase == "prefill":
            with profile() as prof:
                model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return [e for e in prof.key_averages() if e.key.startswith("aten::")]
        token = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        with profile() as prof:
            for _ in range(steps):
                token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return [e for e in prof.key_averages() if e.key.startswith("aten::")]


def ranks_taken_apart(context, batch: int, prompt: int, steps: int, top: int):
    """On a rank of a served model: :func:`taken_apart` of the model it keeps (rank 0's figures)."""
    result = taken_apart(context.store["model"], batch, prompt, steps, top)
    return result if context.rank == 0 else None


# --- caller side ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "time_breakdown", "2 layers, short prompts, few steps")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompts", default="32,512", help="prompt lengths, comma-separated")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the unsplit way")
    parser.add_argument("--steps", type=int, default=8, help="decode steps taken apart")
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", type=int, default=0, help="list the prefill's top N aten ops by own time")
    args = parse(parser, argv, quick={"layers": 2, "prompts": "8", "steps": 2, "new_tokens": 3, "rounds": 1})
    torch.set_num_threads(args.threads)
    spec = smollm2_spec(args.layers)
    model = spec.build().eval()
    split = tpcore.parallelize(spec.build(), num_gpus=2)  # the same seeded weights
    pool = split._tpcore_handle.pool
    rows, kinds_rows, ops_rows = [], [], []
    try:
        for prompt in [int(p) for p in args.prompts.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                figures = {}
                for way in ("unsplit", "tpcore"):
                    served = model if way == "unsplit" else split
                    ttft, per_token = decode_figures(served, batch, prompt, args.new_tokens, args.rounds)
                    if way == "unsplit":
                        with torch.inference_mode():
                            parts = taken_apart(model, batch, prompt, args.steps, args.ops)
                    else:
                        parts = pool.run(ranks_taken_apart, batch, prompt, args.steps, args.ops)[0]
                    ops_rows += [
                        [way, f"{batch}x{prompt}", name, str(calls), f"{ms:.1f}"] for name, calls, ms in parts["ops"]
                    ]
                    figures[way] = (ttft, per_token, parts)
                    caller = f"{per_token - parts['step']['wall']:.1f}" if way == "tpcore" else "-"
                    rows.append(
                        [way, f"{batch}x{prompt}", f"{ttft:.0f}", f"{per_token:.1f}", f"{batch * 1e3 / per_token:.1f}",
                         f"{parts['prefill']['wall']:.0f}", f"{parts['step']['wall']:.1f}", caller]
                    )  # fmt: skip
                    for phase in ("prefill", "step"):
                        kinds_rows.append(
                            [way, f"{batch}x{prompt}", phase, f"{parts[phase]['wall']:.1f}"]
                            + [f"{parts[phase][kind]:.1f} ({parts[phase][kind] / parts[phase]['wall']:.0%})"
                               for kind in KINDS]
                        )  # fmt: skip
                print(rows[-2:], flush=True)
    finally:
        split.deparallelize()
    sections = [
        f"Llama of SmolLM2-135M's widths, {args.layers} layers, fp32, greedy. unsplit: this process, "
        f"{args.threads} threads; tpcore: `parallelize(model, num_gpus=2)`, gloo, the cores split between the ranks.",
        "## Generation\n\nTTFT: `generate()` of one new token; decode: ms per new token over "
        f"{args.new_tokens - 1} tokens; forwards as taken apart below (rank 0 for tpcore); caller's share: "
        "tpcore's decode ms/token less the ranks' step.\n\n"
        + printed(
            [
                "way",
                "batch x prompt",
                "TTFT ms",
                "decode ms/token",
                "tok/s",
                "prefill fwd ms",
                "step ms",
                "caller's share ms/token",
            ],
            rows,
        ),  # fmt: skip
        "## Forwards by kind of work\n\nms (share of the wall time); collectives include the wait for the other "
        "rank; python: the wall time less the rest.\n\n"
        + printed(["way", "batch x prompt", "forward", "wall ms", *KINDS], kinds_rows),
    ]
    if ops_rows:
        sections.append(
            f"## The prefill's top {args.ops} ops\n\nOwn time under the profiler (rank 0 for tpcore), one prefill.\n\n"
            + printed(["way", "batch x prompt", "op", "calls", "ms"], ops_rows)
        )
    write_result("time_breakdown", "Where generation's time goes", sections, "gloo", args.note, args.output)


if __name__ == "__main__":
    main()
