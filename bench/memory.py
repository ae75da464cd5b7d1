"""Peak resident memory of the caller and of each rank under ``tpcore.parallelize()``, against the model size.

A random-init ``BertModel`` (bert-base by default: hidden 768, 12 heads, 12 layers, vocab 30522,
about 110 M parameters) is built in this process, then split with ``tpcore.parallelize()`` over
N = 2 and N = 3 ranks in turn. Measured:

- the caller: its RSS after ``import torch, transformers`` and after building the model (the
  baseline), its peak RSS during ``parallelize()`` (``VmRSS`` of ``/proc/self/status`` sampled
  every ~10 ms from a background thread, and ``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``), and its RSS while the model is served;
- each rank: ``model.memory_allocated()`` (tensor bytes on CPU), ``model.memory_peak()`` (peak
  RSS on CPU) and its own ``VmHWM``, against a floor: the RSS of a rank of the same kind (a
  ``RankPool`` of N ranks in one process group) with torch and transformers' BERT imported but
  no model;
- leftovers after ``deparallelize()``: new entries in ``/dev/shm`` and child processes.

Every figure is also given as a fraction of the model size (parameter and buffer bytes). Writes
``bench/results/memory.md``.

    python bench/memory.py              # about a minute on 2 CPU cores
    python bench/memory.py --ranks 2 --layers 4
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from _common import MIB, arguments, choose_backend, markdown_table, parse, plain_table, write_result
from _memory import (
    PeakAbove,
    child_pids,
    mib,
    of_model,
    proc_status,
    send_by_value,
    settle,
    shm_entries,
    tensor_bytes,
)
from _models import BERT_VOCAB, bert_arguments, bert_spec, parameter_count

# --- run on the ranks (module-level, so cloudpickle sends them by value from __main__) -------------


def rank_floor(context) -> dict[str, int]:
    """A rank with what a served rank imports (torch, transformers' BERT, tpcore's layers), no model."""
    import gc

    import torch
    import transformers  # noqa: F401
    from transformers.models.bert import modeling_bert  # noqa: F401

    import tpcore.parallel.layers  # noqa: F401

    if context.device.type == "cuda":  # a served rank has a CUDA context; so does the floor
        torch.zeros(1, device=context.device)
    gc.collect()
    with open("/proc/self/status") as status:
        lines = {line.partition(":")[0]: line.partition(":")[2] for line in status}
    return {key: int(lines[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


# --- caller side -------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = arguments(__doc__, "memory", "2 layers, hidden 128, N=2")
    parser.add_argument("--ranks", default="2,3", help="world sizes to measure, comma-separated (default 2,3)")
    bert_arguments(parser, 12, "encoder layers (default 12, as bert-base)")
    parser.add_argument("--backend", default=None, help="gloo or nccl; default: NCCL with a GPU per rank, else gloo")
    return parse(parser, argv, quick={"ranks": "2", "layers": 2, "hidden": 128, "heads": 4})


@dataclass
class Tables:
    """The rows of each table, N by N, and the ranks whose ``memory_peak()`` and own ``VmHWM`` disagree."""

    caller: list[list[str]] = field(default_factory=list)
    ranks: list[list[str]] = field(default_factory=list)
    floors: list[list[str]] = field(default_factory=list)
    leftovers: list[list[str]] = field(default_factory=list)
    mismatches: list[tuple] = field(default_factory=list)


def measure_floor(n: int, backend: str, tables: Tables) -> dict[str, int]:
    """The floor of a rank of N: a ``RankPool``'s ranks with a served rank's imports and no model (the largest)."""
    from tpcore.ranks.process import RankPool

    with RankPool(n, backend) as pool:
        floors = pool.run(rank_floor)
    floor = {key: max(f[key] for f in floors) for key in ("VmRSS", "VmHWM")}
    tables.floors.append([str(n), mib(floor["VmRSS"]), mib(floor["VmHWM"])])
    return floor


def measure_split(n: int, model, model_bytes: int, check: tuple, backend: str, floor: dict, tables: Tables) -> None:
    """``parallelize(model)`` over N ranks: the caller's peak while it runs and its RSS while served and after
    ``deparallelize()``, each rank's tensors, peak and RSS against the floor, what is left behind, and the largest
    difference of the served model's output from ``check`` = ``(inputs, reference output)``."""
    import torch

    import tpcore

    settle()
    shm_before = shm_entries()
    with PeakAbove() as caller:
        tpcore.parallelize(model, num_gpus=n, backend=backend)
    pre = caller.before
    settle()
    served = proc_status()["VmRSS"]
    allocated = model.memory_allocated()
    peaks = model.memory_peak()
    host = model._tpcore_handle.pool.run(proc_status)
    inputs, reference = check
    with torch.inference_mode():
        diff = (model(**inputs).last_hidden_state - reference).abs().max().item()
    model.deparallelize()
    time.sleep(0.5)
    new_shm = sorted(shm_entries() - shm_before)
    children = child_pids()
    settle()
    after = proc_status()["VmRSS"]

    tables.caller.append(
        [
            str(n),
            mib(pre),
            of_model(caller.sampled, model_bytes),
            of_model(caller.by_hwm, model_bytes) if caller.hwm_reset else "n/a (no reset)",
            f"{(served - pre) / MIB:+.1f} ({(served - pre) / model_bytes:+.2f}x)",
            f"{(after - pre) / MIB:+.1f}",
            f"{caller.seconds:.1f}",
            str(caller.sampler.samples),
        ]
    )
    for rank, (device, tensors) in enumerate(allocated.items()):
        own_hwm = host[rank]["VmHWM"]
        if device.startswith("cpu"):
            peak, peak_floor = own_hwm, floor["VmHWM"]  # the rank's own peak; see the note on memory_peak()
            if abs(peaks[device] - own_hwm) > 0.05 * own_hwm:
                tables.mismatches.append((n, device, peaks[device], own_hwm, pre))
        else:
            peak, peak_floor = peaks[device], 0
        tables.ranks.append(
            [
                str(n),
                device,
                of_model(tensors, model_bytes, 3),
                mib(peaks[device]),
                mib(own_hwm),
                of_model(peak - peak_floor, model_bytes, 3),
                of_model(host[rank]["VmRSS"] - floor["VmRSS"], model_bytes, 3),
                f"{(peak - peak_floor) / tensors:.2f}",
            ]
        )
    tables.leftovers.append(
        [
            str(n),
            "none" if not new_shm else ", ".join(new_shm),
            "none" if not children else ", ".join(map(str, children)),
            f"{diff:.1e}",
        ]
    )
    print(
        f"N={n}: parallelize {caller.seconds:.1f} s; caller peak +{mib(caller.sampled)} MiB sampled, "
        f"+{mib(caller.by_hwm)} MiB VmHWM; new /dev/shm entries after deparallelize: {new_shm or 'none'}; "
        f"child processes left: {children or 'none'}"
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = proc_status()["VmRSS"]
    import torch
    import transformers  # noqa: F401
    from transformers import BertConfig, BertModel  # noqa: F401  (in the RSS after the imports)

    import tpcore  # noqa: F401
    from tpcore.ranks.process import RankPool  # noqa: F401

    world_sizes = [int(n) for n in args.ranks.split(",") if n.strip()]
    backend = choose_backend(args.backend, max(world_sizes))
    rss_imported = proc_status()["VmRSS"]

    model = bert_spec(args.layers, args.hidden, args.heads).build()
    model_bytes, parameters = tensor_bytes(model), parameter_count(model)
    inputs = {"input_ids": torch.randint(0, BERT_VOCAB, (2, 16)), "attention_mask": torch.ones(2, 16).long()}
    with torch.inference_mode():
        reference = model(**inputs).last_hidden_state
    settle()
    rss_model = proc_status()["VmRSS"]
    print(
        f"BertModel {args.layers} layers, hidden {args.hidden}, {args.heads} heads: {parameters / 1e6:.1f} M "
        f"parameters, {mib(model_bytes)} MiB of parameters and buffers (fp32); backend {backend}"
    )
    print(
        f"caller RSS: {mib(started)} MiB at start, {mib(rss_imported)} MiB after import torch, transformers, "
        f"tpcore; {mib(rss_model)} MiB with the model built\n"
    )

    send_by_value()  # proc_status runs on the ranks too
    tables, notes = Tables(), []
    for n in world_sizes:
        if args.heads % n or args.hidden % n:
            print(f"N={n}: skipped (heads {args.heads} or hidden {args.hidden} not divisible)")
            notes.append(f"N={n} skipped: heads or hidden size not divisible by {n}.")
            continue
        floor = measure_floor(n, backend, tables)
        measure_split(n, model, model_bytes, (inputs, reference), backend, floor, tables)

    caller_header = [
        "N",
        "caller RSS before parallelize() MiB",
        "peak above it, sampled MiB (x model)",
        "peak above it, VmHWM MiB (x model)",
        "while served MiB (x model)",
        "after deparallelize() MiB",
        "parallelize() s",
        "RSS samples",
    ]
    peak_name = "memory_peak()" if backend != "nccl" else "memory_peak() (CUDA max allocated)"
    rank_header = [
        "N",
        "rank",
        "tensors: memory_allocated() MiB (x model)",
        f"{peak_name} MiB",
        "VmHWM MiB",
        "peak - floor MiB (x model)",
        "RSS when loaded - floor MiB (x model)",
        "(peak - floor) / tensors",
    ]
    floor_header = ["N", "floor rank RSS MiB", "floor rank VmHWM MiB"]
    leftover_header = ["N", "new /dev/shm entries after deparallelize()", "child processes left", "max abs diff"]

    for header, rows in (
        (caller_header, tables.caller),
        (rank_header, tables.ranks),
        (floor_header, tables.floors),
        (leftover_header, tables.leftovers),
    ):
        print()
        print(plain_table(header, rows))

    intro = (
        f"Random-init `BertModel`: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, intermediate "
        f"{4 * args.hidden}, vocab 30522: {parameters / 1e6:.1f} M parameters, **model size {mib(model_bytes)} MiB** "
        f"(parameter and buffer bytes, fp32). Backend `{backend}`.\n\n"
        f"Caller RSS: {mib(started)} MiB at start, {mib(rss_imported)} MiB after `import torch, transformers, "
        f"tpcore`, {mib(rss_model)} MiB with the model built (and one forward run for the reference output)."
    )
    caller_text = (
        "## Caller\n\n"
        "Peak during `parallelize()` above the caller's RSS just before it: sampled `VmRSS` (every ~10 ms, "
        "background thread) and `VmHWM` (reset through `/proc/self/clear_refs` just before). "
        "'While served': RSS after `parallelize()` returned, against the same baseline (the caller keeps its "
        "own model; no second copy should remain).\n\n" + markdown_table(caller_header, tables.caller)
    )
    rank_text = (
        "## Ranks\n\n"
        "Floor: a rank of a `RankPool` of the same size and backend, with torch, transformers' BERT and "
        "tpcore's layers imported, no model (largest over its ranks). 'VmHWM' is the rank's own peak RSS "
        "from its `/proc/self/status`, read right after loading; 'peak - floor' is that minus the floor's "
        "VmHWM (on CUDA: `memory_peak()`, the allocator's peak, minus nothing), "
        "'RSS when loaded - floor' the rank's VmRSS minus the floor's. A rank's ideal share is its tensor "
        "bytes; '(peak - floor) / tensors' shows how much more than that the loading needed at its peak.\n\n"
        + markdown_table(rank_header, tables.ranks)
        + "\n\n"
        + markdown_table(floor_header, tables.floors)
    )
    leftover_text = (
        "## After deparallelize()\n\n"
        "`/dev/shm` entries that were not there before `parallelize()`, live child processes of the caller, "
        "and the largest difference of the served model's output from the unsplit model's (batch 2 x 16).\n\n"
        + markdown_table(leftover_header, tables.leftovers)
    )
    if tables.mismatches:
        worst = max(tables.mismatches, key=lambda m: abs(m[2] - m[3]))
        message = (
            f"`memory_peak()` differs from the ranks' own VmHWM ({len(tables.mismatches)} rank(s); e.g. N={worst[0]} "
            f"{worst[1]}: `memory_peak()` {mib(worst[2])} MiB, VmHWM {mib(worst[3])} MiB, while the caller had "
            f"{mib(worst[4])} MiB resident when it started the ranks). On Linux `getrusage().ru_maxrss`, which "
            "`memory_peak()` reads on CPU, keeps the peak RSS of the image the rank was forked from (the caller) "
            "across `exec`; VmHWM is the rank's own. The table uses VmHWM."
        )
        print("\n" + message)
        notes.append("**Note on `memory_peak()`.** " + message)
    sections = [intro, caller_text, rank_text, leftover_text]
    if notes:
        sections.append("\n".join(notes))
    write_result("memory", "Memory of `tpcore.parallelize()`", sections, backend, args.note, args.output)


if __name__ == "__main__":
    main()
