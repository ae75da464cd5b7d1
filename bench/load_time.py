"""Load time from a directory: ``tpcore.parallelize(dir)`` against transformers loading it unsplit, in one process.

The checkpoint is a random-init Llama of SmolLM2-135M's widths (``--layers``, 30 by default) saved as
``bench/quantized.py`` saves it (``--format``: ``fp32`` the model unquantized, or any of that script's formats).
Each figure is the wall time from the call to the end of a first one-token forward, the page cache warm (the files
were just written) or, with ``--cold``, emptied before every load (Linux, as root: ``/proc/sys/vm/drop_caches``),
as a checkpoint read once from disk finds it; ``--rounds`` rounds interleaved:

- **transformers**: ``AutoModelForCausalLM.from_pretrained(dir)`` (``--threads`` torch threads), each round;
- **tpcore, first start**: the process's first ``parallelize(dir, num_gpus=N)``: CPU ranks fork from a warm
  interpreter (:mod:`tpcore.ranks.zygote`) that this call starts, so it pays that interpreter's imports once;
- **tpcore**: each later ``parallelize(dir, num_gpus=N)`` in the process (ranks forked from that interpreter);
- **tpcore, fresh interpreters**: ``TPCORE_RANK_START=spawn``, every rank a new ``python`` importing torch and
  transformers itself (how every start went before the zygote).

    python bench/load_time.py                  # about 2 minutes on 2 CPU cores -> bench/results/load_time.md
    python bench/load_time.py --cold           # -> bench/results/load_time_cold.md
    python bench/load_time.py --format fp8     # -> bench/results/load_time_fp8.md
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import arguments, parse, printed, write_result
from _models import smollm2_spec
from quantized import FORMATS, reference_options

import tpcore
from tpcore.ranks.zygote import START_ENV

FP32 = "fp32"
DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache() -> None:
    """Write back and drop the kernel's clean page cache, so that the next load reads the files from the disk."""
    os.sync()
    with open(DROP_CACHES, "w") as control:
        control.write("1")


def proportional_mib(pid: int) -> float:
    """A process's proportional set size (its private pages, and its share of those it shares), in MiB (Linux)."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no Pss in /proc/{pid}/smaps_rollup")


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def ranks_memory(model) -> tuple[list[float], float]:
    """Each rank's proportional set size, and their parent's where that is not this process (the zygote)."""
    pids = model._tpcore_handle.pool.pids
    parent = parent_pid(pids[0])
    return [proportional_mib(pid) for pid in pids], (proportional_mib(parent) if parent != os.getpid() else 0.0)


def load_and_forward(load, ids: torch.Tensor, cold: bool) -> tuple[float, torch.nn.Module]:
    """Seconds from ``load()`` to the end of the loaded model's one-token forward, and the model."""
    if cold:
        drop_page_cache()
    start = time.perf_counter()
    model = load()
    with torch.no_grad():
        model(ids[:, :1])
    return time.perf_counter() - start, model


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "load_time", "2 layers, 2 rounds")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--format", choices=[FP32, *sorted(FORMATS)], default=FP32)
    parser.add_argument("--block", type=int, default=64, help="fp8: the blocks' side")
    parser.add_argument("--group", type=int, default=64, help="w4a16 and gptq: input features a scale")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the transformers way")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every load (root, Linux)")
    args = parse(parser, argv, quick={"layers": 2, "rounds": 2})
    if os.environ.get(START_ENV):
        parser.error(f"unset {START_ENV}: this script sets it for its last way")
    if args.cold and not os.access(DROP_CACHES, os.W_OK):
        parser.error(f"--cold writes {DROP_CACHES}: run as root on Linux")
    torch.set_num_threads(args.threads)
    import transformers

    ids = torch.randint(2, 49152, (1, 8), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / args.format
        if args.format == FP32:
            smollm2_spec(args.layers).build().save_pretrained(directory)
            options: dict = {}
        else:
            save = FORMATS[args.format][0]
            directory = save(smollm2_spec(args.layers).build(), directory, args)
            options = reference_options(args.format)
        stored = sum(f.stat().st_size for f in directory.glob("*.safetensors"))

        def unsplit():
            return transformers.AutoModelForCausalLM.from_pretrained(directory, **options).eval()

        def split():
            return tpcore.parallelize(str(directory), num_gpus=args.world_size, dtype=options.get("dtype"))

        times: dict[str, list[float]] = {"transformers": [], "first": [], "forked": [], "spawned": []}
        memory: dict[str, tuple[list[float], float]] = {}
        first, model = load_and_forward(split, ids, args.cold)
        times["first"].append(first)
        model.deparallelize()
        for _ in range(args.rounds):  # interleaved: a drift of the machine's load falls on both
            seconds, model = load_and_forward(unsplit, ids, args.cold)
            times["transformers"].append(seconds)
            del model
            seconds, model = load_and_forward(split, ids, args.cold)
            times["forked"].append(seconds)
            memory["forked"] = ranks_memory(model)
            model.deparallelize()
        os.environ[START_ENV] = "spawn"
        try:
            for _ in range(args.rounds):
                seconds, model = load_and_forward(split, ids, args.cold)
                times["spawned"].append(seconds)
                memory["spawned"] = ranks_memory(model)
                model.deparallelize()
        finally:
            del os.environ[START_ENV]
    reference = statistics.median(times["transformers"])
    labels = {
        "transformers": "transformers, unsplit",
        "first": f"tpcore N={args.world_size}, the process's first start (starts the warm interpreter)",
        "forked": f"tpcore N={args.world_size}, later starts (ranks forked)",
        "spawned": f"tpcore N={args.world_size}, TPCORE_RANK_START=spawn (fresh interpreters)",
    }
    rows = []
    for way, label in labels.items():
        median = statistics.median(times[way])
        spread = f"{min(times[way]):.2f}-{max(times[way]):.2f}" if len(times[way]) > 1 else "-"
        rows.append([label, str(len(times[way])), f"{median:.2f}", spread, f"{median / reference:.2f}"])
    header = ["way", "rounds", "load + first forward s (median)", "range s", "vs transformers"]
    memory_rows = [
        [labels[way], " / ".join(f"{mib:.0f}" for mib in ranks), f"{zygote:.0f}", f"{sum(ranks) + zygote:.0f}"]
        for way, (ranks, zygote) in memory.items()
    ]
    memory_header = ["way", "PSS MiB of each rank", "PSS MiB of the zygote", "together"]
    sections = [
        f"Llama of SmolLM2-135M's widths, {args.layers} layers, random init, saved as {args.format}: "
        f"{stored / 2**20:.0f} MiB of safetensors, the page cache "
        + ("dropped before every load" if args.cold else "warm")
        + f"; transformers on {args.threads} threads.",
        printed(header, rows),
        "Memory once loaded (the last round of each way; proportional set sizes: a page shared by k processes "
        "counts 1/k in each):",
        printed(memory_header, memory_rows),
    ]
    name = "load_time" + ("" if args.format == FP32 else f"_{args.format}") + ("_cold" if args.cold else "")
    write_result(name, f"Load time from a directory ({args.format})", sections, "gloo", args.note, args.output)


if __name__ == "__main__":
    main()
