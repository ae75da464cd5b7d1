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

import argparse
import ctypes
import gc
import os
import threading
import time
from pathlib import Path

from _common import MIB, choose_backend, common_arguments, markdown_table, plain_table, write_result

STATUS = Path("/proc/self/status")

# --- run on the ranks (module-level, so cloudpickle sends them by value from __main__) -------------


def proc_status(context=None) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process in bytes (also used in the caller)."""
    figures = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                figures[key] = int(value.split()[0]) * 1024
    return figures


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


class RssSampler:
    """Samples this process's ``VmRSS`` every ``interval`` seconds in a daemon thread; keeps the max."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status()["VmRSS"])
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_status()["VmRSS"])


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def settle() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), so that RSS shows what is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def child_pids() -> list[int]:
    """Live (not zombie) child processes of this process, from /proc."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            children.append(int(entry))
    return children


def mib(value: float) -> str:
    return f"{value / MIB:.1f}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3", help="world sizes to measure, comma-separated (default 2,3)")
    parser.add_argument("--layers", type=int, default=12, help="encoder layers (default 12, as bert-base)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--backend", default=None, help="gloo or nccl; default: NCCL with a GPU per rank, else gloo")
    common_arguments(parser, "memory", "2 layers, hidden 128, N=2")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.layers, args.hidden, args.heads = "2", 2, 128, 4
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = proc_status()["VmRSS"]
    import torch
    import transformers  # noqa: F401
    from transformers import BertConfig, BertModel

    import tpcore
    from tpcore.ranks.process import RankPool

    world_sizes = [int(n) for n in args.ranks.split(",") if n.strip()]
    backend = choose_backend(args.backend, max(world_sizes))
    rss_imported = proc_status()["VmRSS"]

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        vocab_size=30522,
    )
    model = BertModel(config).eval()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    model_bytes = sum(t.numel() * t.element_size() for t in tensors)
    parameters = sum(p.numel() for p in model.parameters())
    inputs = {"input_ids": torch.randint(0, config.vocab_size, (2, 16)), "attention_mask": torch.ones(2, 16).long()}
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

    caller_rows, rank_rows, floor_rows, leftovers, notes, mismatches = [], [], [], [], [], []
    for n in world_sizes:
        if args.heads % n or args.hidden % n:
            print(f"N={n}: skipped (heads {args.heads} or hidden {args.hidden} not divisible)")
            notes.append(f"N={n} skipped: heads or hidden size not divisible by {n}.")
            continue
        with RankPool(n, backend) as pool:
            floors = pool.run(rank_floor)
        floor_hwm = max(f["VmHWM"] for f in floors)
        floor_rss = max(f["VmRSS"] for f in floors)
        floor_rows.append([str(n), mib(floor_rss), mib(floor_hwm)])

        settle()
        shm_before = shm_entries()
        pre = proc_status()["VmRSS"]
        hwm_reset = reset_peak()
        t0 = time.perf_counter()
        with RssSampler() as sampler:
            tpcore.parallelize(model, num_gpus=n, backend=backend)
        seconds = time.perf_counter() - t0
        hwm = proc_status()["VmHWM"]
        settle()
        served = proc_status()["VmRSS"]
        allocated = model.memory_allocated()
        peaks = model.memory_peak()
        host = model._tpcore_handle.pool.run(proc_status)
        with torch.inference_mode():
            diff = (model(**inputs).last_hidden_state - reference).abs().max().item()
        model.deparallelize()
        time.sleep(0.5)
        new_shm = sorted(shm_entries() - shm_before)
        children = child_pids()
        settle()
        after = proc_status()["VmRSS"]

        sampled_extra, hwm_extra = sampler.peak - pre, hwm - pre
        caller_rows.append(
            [
                str(n),
                mib(pre),
                f"{mib(sampled_extra)} ({sampled_extra / model_bytes:.2f}x)",
                f"{mib(hwm_extra)} ({hwm_extra / model_bytes:.2f}x)" if hwm_reset else "n/a (no reset)",
                f"{(served - pre) / MIB:+.1f} ({(served - pre) / model_bytes:+.2f}x)",
                f"{(after - pre) / MIB:+.1f}",
                f"{seconds:.1f}",
                str(sampler.samples),
            ]
        )
        for rank, (device, tensor_bytes) in enumerate(allocated.items()):
            own_hwm = host[rank]["VmHWM"]
            if device.startswith("cpu"):
                peak, peak_floor = own_hwm, floor_hwm  # the rank's own peak; see the note on memory_peak()
                if abs(peaks[device] - own_hwm) > 0.05 * own_hwm:
                    mismatches.append((n, device, peaks[device], own_hwm, pre))
            else:
                peak, peak_floor = peaks[device], 0
            rank_rows.append(
                [
                    str(n),
                    device,
                    f"{mib(tensor_bytes)} ({tensor_bytes / model_bytes:.3f}x)",
                    mib(peaks[device]),
                    mib(own_hwm),
                    f"{mib(peak - peak_floor)} ({(peak - peak_floor) / model_bytes:.3f}x)",
                    f"{mib(host[rank]['VmRSS'] - floor_rss)} ({(host[rank]['VmRSS'] - floor_rss) / model_bytes:.3f}x)",
                    f"{(peak - peak_floor) / tensor_bytes:.2f}",
                ]
            )
        leftovers.append(
            [
                str(n),
                "none" if not new_shm else ", ".join(new_shm),
                "none" if not children else ", ".join(map(str, children)),
                f"{diff:.1e}",
            ]
        )
        print(
            f"N={n}: parallelize {seconds:.1f} s; caller peak +{mib(sampled_extra)} MiB sampled, "
            f"+{mib(hwm_extra)} MiB VmHWM; new /dev/shm entries after deparallelize: {new_shm or 'none'}; "
            f"child processes left: {children or 'none'}"
        )

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
        (caller_header, caller_rows),
        (rank_header, rank_rows),
        (floor_header, floor_rows),
        (leftover_header, leftovers),
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
        "own model; no second copy should remain).\n\n" + markdown_table(caller_header, caller_rows)
    )
    rank_text = (
        "## Ranks\n\n"
        "Floor: a rank of a `RankPool` of the same size and backend, with torch, transformers' BERT and "
        "tpcore's layers imported, no model (largest over its ranks). 'VmHWM' is the rank's own peak RSS "
        "from its `/proc/self/status`, read right after loading; 'peak - floor' is that minus the floor's "
        "VmHWM (on CUDA: `memory_peak()`, the allocator's peak, minus nothing), "
        "'RSS when loaded - floor' the rank's VmRSS minus the floor's. A rank's ideal share is its tensor "
        "bytes; '(peak - floor) / tensors' shows how much more than that the loading needed at its peak.\n\n"
        + markdown_table(rank_header, rank_rows)
        + "\n\n"
        + markdown_table(floor_header, floor_rows)
    )
    leftover_text = (
        "## After deparallelize()\n\n"
        "`/dev/shm` entries that were not there before `parallelize()`, live child processes of the caller, "
        "and the largest difference of the served model's output from the unsplit model's (batch 2 x 16).\n\n"
        + markdown_table(leftover_header, leftovers)
    )
    if mismatches:
        worst = max(mismatches, key=lambda m: abs(m[2] - m[3]))
        message = (
            f"`memory_peak()` differs from the ranks' own VmHWM ({len(mismatches)} rank(s); e.g. N={worst[0]} "
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
