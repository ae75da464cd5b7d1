"""tpcore beside its peers: the same seeded checkpoints run unsplit, by tpcore (SPMD and ``parallelize()``), by
PyTorch's DTensor TP and by transformers' tp_plan, in one invocation. What each part runs and how it is measured:
bench/README.md.

    python bench/peers.py                        # ~10 min on 2 CPU cores -> bench/results/peers.md, peers.png
    python bench/peers.py --quick --output /tmp  # tiny models: a trial run of a few minutes
    python bench/peers.py --device cuda          # NCCL ranks, one per GPU (the part bench/gpu.sh runs)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import (
    arguments,
    cpu_busy,
    first_line,
    fmt,
    installed_version,
    load_average,
    markdown_table,
    parse,
    result_path,
)
from _memory import MIB, PeakAbove, mib, of_model, settle
from _peer_models import SIZES, TINY, Task, bart_task, gpt2_config, half_task, llama_task, save_checkpoints, vit_task
from _peer_ways import DTensorTP, HFTpPlan, Pools, Proxy, Spmd, Unsplit, Way, backend
from _ways import (
    Entry,
    PartedResult,
    bar_chart,
    collectives_table,
    loading_table,
    max_abs_diff,
    output_of,
    ratio,
    ratios_section,
    run_part,
    spread_table,
    way_table,
)

#: the parts, in the order they run (gpt2 first: the caller must hold no model) and their sections' order
PARTS = ("gpt2", "start", "llama", "half", "bart", "vit", "n4")
SECTIONS = ("llama", "start", "half", "bart", "vit", "n4", "gpt2")

# --- the parts ------------------------------------------------------------------------------------------


def five_ways(args, n: int, pools: Pools) -> list[Way]:
    """Unsplit, tpcore SPMD and parallelize() at N = ``n``, and the peers unless ``--skip-peers``."""
    ways: list[Way] = [
        Unsplit("unsplit", 1, args.device),
        Spmd("tpcore SPMD", n, args.device, pools=pools),
        Proxy("tpcore parallelize()", n, args.device),
    ]
    if not args.skip_peers:
        ways += [
            DTensorTP("DTensor TP", n, args.device, pools=pools),
            HFTpPlan("HF tp_plan", n, args.device, pools=pools),
        ]
    return ways


def llama_part(args, task: Task, pools: Pools, report: PartedResult) -> None:
    """The decoder, five ways at N = ``--ranks``: the full table, ratios, spread, collectives and loading."""
    n = args.ranks
    ways = five_ways(args, n, pools)
    entries = run_part(task, ways, args.rounds, measure_ranks=True)
    report.entries["llama"] = entries
    by_name = {e.way: e for e in entries}
    proxy, spmd = by_name["tpcore parallelize()"], by_name["tpcore SPMD"]
    if not proxy.na:  # its ranks' floor: the SPMD ranks' (the same imports); their loading is not observable
        proxy.floor = spmd.floor
    figures = [
        *task.figures,
        ("rank_bytes", "rank params", lambda e: e.rank_bytes),
        ("peak_above_floor", "rank peak - floor", Entry.peak_above_floor),
        ("ready_s", "checkpoint to ready", lambda e: e.ready_s),
    ]
    text = [
        f"## Llama, N={n}\n\n{task.describe()}\n\n" + way_table(task, entries, task.bytes, with_memory=True),
        ratios_section(entries, figures),
        "### Spread\n\np25 - p75 of the timed calls in ms.\n\n" + spread_table(entries, task.calls),
        "### Collectives in one forward\n\n" + collectives_table(entries),
        "### Loading\n\n" + loading_table(entries, {way.name: way.loaded_by for way in ways}),
    ]
    report.notes += [f"{e.way}: {note}" for e in entries for note in e.notes]
    report.add("llama", "\n\n".join(text))


def other_part(args, task: Task, pools: Pools, report: PartedResult, title: str) -> None:
    """A model through the same five ways, at N = ``--ranks``: timings, rank params and differences."""
    n = args.ranks
    ways = five_ways(args, n, pools)
    entries = run_part(task, ways, args.more_rounds, measure_ranks=False)
    report.entries[task.name] = entries
    report.add(task.name, f"## {title}, N={n}\n\n{task.describe()}\n\n" + way_table(task, entries, task.bytes, False))


def half_part(args, task: Task, pools: Pools, report: PartedResult) -> None:
    """tpcore in fp16 and bf16 against the unsplit model in the same dtype and in fp32; ``fp16=True`` as tpcore
    resolves it on this machine."""
    n = args.ranks
    ways: list[Way] = []
    for dtype in ("float32", "float16", "bfloat16"):
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[dtype]
        ways += [
            Unsplit(f"unsplit {short}", 1, args.device, dtype=dtype),
            Spmd(f"tpcore SPMD {short}", n, args.device, dtype=dtype, pools=pools),
            Proxy(f"tpcore parallelize() {short}", n, args.device, dtype=dtype),
        ]
    ways.append(Spmd("tpcore SPMD fp16=True", n, args.device, fp16=True, pools=pools))
    entries = run_part(task, ways, args.more_rounds, measure_ranks=False)
    report.entries["half"] = entries
    by_name = {e.way: e for e in entries}
    unsplit = {e.dtype: e for e in entries if e.way.startswith("unsplit") and not e.na}
    header = ["way", "dtype on the ranks", *(label for _, label, _ in task.figures)]
    header += [f"{label} x fp32" for _, label, _ in task.figures]
    header += ["logits max diff vs unsplit same dtype", "vs unsplit fp32", "finite", "greedy tokens vs fp32"]
    rows = []
    for entry in entries:
        if entry.na:
            rows.append([entry.way, f"n/a ({entry.na})", *[""] * (len(header) - 2)])
            continue
        fp32 = by_name.get(entry.way.rsplit(" ", 1)[0] + " fp32")  # the same way in fp32
        logits = entry.outputs.get("b1")
        rows.append(
            [
                entry.way,
                entry.dtype or "n/a",
                *(fmt(read(entry), ".1f") for _, _, read in task.figures),
                *(ratio(read, entry, fp32) for _, _, read in task.figures),
                max_abs_diff(logits, output_of(unsplit.get(entry.dtype), "b1")),
                max_abs_diff(logits, output_of(unsplit.get("float32"), "b1")),
                "n/a" if logits is None else ("yes" if bool(torch.isfinite(logits).all()) else "NO"),
                max_abs_diff(entry.outputs.get("genK"), output_of(unsplit.get("float32"), "genK")),
            ]
        )
    text = (
        f"## Half precision, N={n}\n\n{task.describe()} `fp16=True` resolves to **{resolved_fp16()}** on this "
        "machine (`tpcore.load.precision.resolve_dtype`). x fp32: against the same way in fp32.\n\n"
        + markdown_table(header, rows)
    )
    report.add("half", text)


def resolved_fp16() -> str:
    from tpcore.load.precision import resolve_dtype

    dtype = resolve_dtype(True, None, "cpu")
    return "no cast (the model's own dtype)" if dtype is None else str(dtype).removeprefix("torch.")


def wide_part(args, task: Task, pools: Pools, report: PartedResult) -> None:
    """The Llama at N=4 where its heads allow, all ways (on 2 cores the ranks oversubscribe them)."""
    n = 4
    if args.heads % n:
        report.add("n4", f"## Llama, N={n}\n\nskipped: {args.heads} heads do not divide over {n} ranks.")
        return
    if args.device == "cuda" and torch.cuda.device_count() < n:
        report.add("n4", f"## Llama, N={n}\n\nskipped: {torch.cuda.device_count()} GPU(s); NCCL needs one per rank.")
        return
    ways = five_ways(args, n, pools)
    entries = run_part(task, ways, args.more_rounds, measure_ranks=False)
    report.entries["n4"] = entries
    cores = os.cpu_count() or 1
    crowd = (
        f" **{n} ranks on {cores} cores oversubscribe them**: each rank has 1 thread, and a rank waiting in a "
        "collective may hold a core another rank needs; read these timings as what oversubscription costs."
        if args.device == "cpu" and cores < n
        else ""
    )
    pools.close(n)
    report.add("n4", f"## Llama, N={n}\n\n{task.describe()}{crowd}\n\n" + way_table(task, entries, task.bytes, False))


def start_part(args, report: PartedResult) -> None:
    """The bounds of a rank's start: a bare interpreter's ``import torch, transformers``, and with the model's
    modeling module too, each timed alone (median of ``--start-repeats``), beside ``parallelize(dir)``'s ready time."""
    commands = {
        "import torch, transformers": "import torch, transformers",
        "+ modeling_llama": "import torch, transformers; import transformers.models.llama.modeling_llama",
    }
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.start_repeats):  # interleaved, so that drifting load hits both alike
        for name, code in commands.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            seconds[name].append(time.perf_counter() - start)
    report.figures["start"] = {name: statistics.median(values) for name, values in seconds.items()}
    start_section(args, report)


def start_section(args, report: PartedResult) -> None:
    """Ready times of ``parallelize(dir)`` beside the import bounds."""
    rows = [[f"a bare interpreter: {name}", f"{value:.2f}"] for name, value in report.figures.get("start", {}).items()]
    for part in ("llama", "n4"):
        for entry in report.entries.get(part, []):
            if entry.way == "tpcore parallelize()" and not entry.na:
                n = args.ranks if part == "llama" else 4
                rows.append([f"`parallelize(dir, num_gpus={n})`, checkpoint to ready", f"{entry.ready_s:.2f}"])
            if entry.way == "tpcore SPMD" and entry.start_s is not None:
                n = args.ranks if part == "llama" else 4
                rows.append(
                    [f"a `RankPool({n})` started (all ranks joined, imports in the ranks)", f"{entry.start_s:.2f}"]
                )
    if rows:
        report.add(
            "start",
            "## Start\n\nThe bounds of a rank's start: a bare interpreter (`python -c`) importing torch and "
            f"transformers, and also the model's modeling module (median of {args.start_repeats}, each alone), "
            "beside what `parallelize()` takes from the checkpoint folder to a served model.\n\n"
            + markdown_table(["what", "s"], rows),
        )


def gpt2_part(args, checkpoint: str, model_bytes: int, report: PartedResult) -> None:
    """``tpcore.parallelize(checkpoint)`` of a GPT-2 at each N: a rank's tensor bytes and the caller's peak
    RSS above its RSS just before the call, against the model size (run while the caller holds no model)."""
    import tpcore

    rows = []
    for n in args.gpt2_ranks:
        settle()
        model = None
        try:
            with PeakAbove() as caller:
                model = tpcore.parallelize(checkpoint, num_gpus=n, backend=backend(args.device))
            allocated, rank_peaks = model.memory_allocated(), model.memory_peak()
        except Exception as error:
            rows.append([str(n), f"n/a ({first_line(error)})", "", "", "", ""])
            continue
        finally:
            if model is not None:
                model.deparallelize()
            del model
            settle()
        rows.append(
            [
                str(n),
                of_model(max(allocated.values()), model_bytes, 3),
                mib(max(rank_peaks.values())),
                of_model(caller.sampled, model_bytes),
                of_model(caller.by_hwm, model_bytes) if caller.hwm_reset else "n/a (no reset)",
                f"{caller.seconds:.1f}",
            ]
        )
    header = ["N", "rank tensors MiB (x model)", "rank peak MiB", "caller peak above baseline, sampled MiB (x model)",
              "same, VmHWM MiB (x model)", "parallelize() s"]  # fmt: skip
    line = (
        f"Random-init `GPT2LMHeadModel`: vocab {args.gpt2['vocab']}, hidden {args.gpt2['hidden']}, "
        f"{args.gpt2['layers']} layers, {args.gpt2['heads']} heads, tied LM head: "
        f"model size {mib(model_bytes)} MiB."
    )
    report.add("gpt2", "## GPT-2: what a rank and the caller hold\n\n" + line + "\n\n" + markdown_table(header, rows))


def chart_panels(task: Task) -> list:
    """The chart's panels: ``(title, [(label, read, scale)])``."""
    reads = {key: read for key, _, read in task.figures}
    return [
        ("forward latency (ms, median)", [("batch 1", reads["b1"], 1.0), ("large batch", reads["large"], 1.0)]),
        ("greedy decode (ms per new token)", [("batch 1", reads["decode"], 1.0)]),
        (
            "per-rank memory (MiB)",
            [
                ("parameters + buffers", lambda e: e.rank_bytes, 1 / MIB),
                ("peak - floor", Entry.peak_above_floor, 1 / MIB),
            ],
        ),
    ]


def llama_chart(args, task: Task):
    """The result's chart section: the Llama part's figures per way (``chart_panels``), once it has run."""
    title = f"random-init Llama, {task.parameters / 1e6:.3g} M parameters, N={args.ranks} {backend(args.device)} ranks"

    def section(report: PartedResult) -> str | None:
        if "llama" not in report.entries:
            return None
        path = result_path("peers", args.output, ".png")
        error = bar_chart(report.entries["llama"], chart_panels(task), path, title)
        return f"![forward, decode and memory per way]({path.name})" if error is None else error

    return section


# --- main ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    cores = os.cpu_count() or 1
    parser = arguments(__doc__, "peers", "tiny models, 1-2 rounds, GPT-2 at N=2 only")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, in this order (default {','.join(PARTS)})"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo ranks) or cuda (NCCL)")
    parser.add_argument("--layers", type=int, default=8, help="Llama decoder layers (default 8)")
    parser.add_argument("--hidden", type=int, default=768, help="Llama hidden size (default 768)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (= KV heads; default 12)")
    parser.add_argument("--intermediate", type=int, default=2048, help="MLP width (default 2048)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    parser.add_argument("--seq", type=int, default=128, help="forward sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="the large forward batch (default 8)")
    parser.add_argument("--prompt", type=int, default=32, help="generate() prompt length, batch 1 (default 32)")
    parser.add_argument("--new-tokens", type=int, default=16, help="K: decode = (t(1+K) - t(1)) / K (default 16)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds of the Llama part (default 5)")
    parser.add_argument("--more-rounds", type=int, default=2, help="rounds of the other parts (default 2)")
    parser.add_argument("--b1-calls", type=int, default=2, help="batch-1 forwards per round and way (default 2)")
    parser.add_argument(
        "--threads", type=int, default=cores, help=f"torch threads of the unsplit run (default {cores})"
    )
    parser.add_argument("--ranks", type=int, default=2, help="N of the split ways (default 2)")
    parser.add_argument("--gpt2-ranks", default="2,4", help="N of the GPT-2 memory part (default 2,4)")
    parser.add_argument(
        "--start-repeats", type=int, default=3, help="timed interpreter starts of each kind (default 3)"
    )
    parser.add_argument("--budget", type=float, default=None, help="seconds: parts not started by then are skipped")
    parser.add_argument("--skip-peers", action="store_true", help="only unsplit and the two tpcore ways")
    parser.set_defaults(**SIZES)
    quick = {"seq": 32, "prompt": 8, "new_tokens": 4, "rounds": 2, "more_rounds": 1, "start_repeats": 1}
    args = parse(parser, argv, quick={**TINY, **quick, "gpt2_ranks": "2"})
    args.parts = [part for part in args.parts.split(",") if part]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    args.gpt2_ranks = [int(n) for n in args.gpt2_ranks.split(",") if n.strip()]
    if args.device == "cuda":
        args.ranks = min(args.ranks, torch.cuda.device_count())
        args.gpt2_ranks = [n for n in args.gpt2_ranks if n <= torch.cuda.device_count()]
    return args


def main(argv=None) -> int:
    """Run the parts; 1 if a tpcore way could not run or a part failed (a peer that cannot run is only n/a)."""
    args = parse_args(argv)
    wall_start, load_at_start = time.perf_counter(), load_average()
    busy = cpu_busy()  # measured, not the load average, which still counts a script that just ended
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks inherit it
    import transformers
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401  (imported before any memory baseline)
    from transformers.models.llama import modeling_llama  # noqa: F401

    from tpcore.select.plugins import registered_policies

    transformers.utils.logging.disable_progress_bar()
    registered_policies()  # load tpcore's plugins now, so that no memory baseline below pays for it
    torch.set_num_threads(args.threads)
    tasks = {"llama": llama_task(args), "half": half_task(args), "bart": bart_task(args), "vit": vit_task(args)}
    wanted = [task for name, task in tasks.items() if name in args.parts or (name == "llama" and "n4" in args.parts)]
    tmp = tempfile.TemporaryDirectory(prefix="tpcore-peers-")
    gpt2_bytes = save_checkpoints(tmp.name, wanted, gpt2_config(args) if "gpt2" in args.parts else None)

    title = "tpcore and its peers, side by side"
    chart = llama_chart(args, tasks["llama"])
    report = PartedResult("peers", title, SECTIONS, backend(args.device), args.note, args.output, chart)
    report.header = header_line(args, load_at_start, busy)
    if busy is not None and busy > 0.25:
        report.notes.append(
            f"**The machine was busy** when the run started (other processes kept {busy:.0%} of its cores busy): "
            "they hurt the unsplit run's multi-threaded kernels most. Rerun on an idle machine."
        )
    pools = Pools()
    try:
        gpt2 = (str(Path(tmp.name) / "gpt2"), gpt2_bytes)
        failures = report.run_parts(
            args.parts, lambda part: run(part, args, tasks, pools, report, *gpt2), args.budget, wall_start
        )
    finally:
        pools.close()
        tmp.cleanup()
    failures += [f"{e.way} ({part}): {e.na}" for part, entries in report.entries.items() for e in entries
                 if e.na and e.way.startswith("tpcore")]  # fmt: skip
    wall = time.perf_counter() - wall_start
    report.notes += [*failures, f"Whole run: {wall / 60:.1f} min (wall clock, this script from start to end)."]
    report.write()
    print(f"\nwhole run: {wall / 60:.1f} min" + "".join(f"\nFAILED: {failure}" for failure in failures))
    return 1 if failures else 0


def run(part: str, args, tasks: dict, pools: Pools, report: PartedResult, gpt2_dir: str, gpt2_bytes: int) -> None:
    """One part of the run."""
    if part == "gpt2":
        gpt2_part(args, gpt2_dir, gpt2_bytes, report)
    elif part == "start":
        start_part(args, report)
    elif part == "llama":
        llama_part(args, tasks["llama"], pools, report)
        start_section(args, report)
    elif part == "half":
        half_part(args, tasks["half"], pools, report)
    elif part == "bart":
        other_part(args, tasks["bart"], pools, report, "BART generate, beam 4")
    elif part == "vit":
        other_part(args, tasks["vit"], pools, report, "ViT forward")
    elif part == "n4":
        wide_part(args, tasks["llama"], pools, report)
        start_section(args, report)


def header_line(args, load_at_start: str, busy: float | None) -> str:
    import transformers

    cores = os.cpu_count() or 1
    if args.device == "cpu":
        threads = max(1, cores // args.ranks)
        where = f"with {threads} torch thread(s) each; unsplit: this process with {args.threads} threads"
    else:
        where = f"on {args.ranks} GPU(s); unsplit: this process on cuda:0"
    return (
        f"Split ways: N={args.ranks} `{backend(args.device)}` ranks {where}. Peers: torch {torch.__version__} "
        f"(DTensor), transformers {transformers.__version__} with accelerate {installed_version('accelerate')}. "
        f"Load average at the start: {load_at_start}; the other processes' use of the cores over 2 s before it: "
        f"{fmt(None if busy is None else busy * 100, '.0f')}%. Parts: {', '.join(args.parts)}. What runs and how it "
        "is timed: [bench/README.md](../README.md#peerspy-tpcore-beside-pytorchs-and-transformers-tensor-parallelism)."
    )


if __name__ == "__main__":
    sys.exit(main())
