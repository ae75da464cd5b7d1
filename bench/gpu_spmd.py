"""SPMD shard-on-load under torchrun: ``ParallelEngine(N).parallelize(path)`` against the unsplit model
(step 4 of ``bench/gpu.sh``).

    python3 bench/gpu_spmd.py save DIR                       # a tiny seeded Llama checkpoint (safetensors)
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_spmd.py run DIR OUT.json [--cpu]

Each rank reads its own slices of the checkpoint onto ``cuda:<local rank>`` (NCCL; ``--cpu``, or no CUDA:
the CPU and gloo), runs a forward pass and greedy ``generate()`` on inputs moved to its device, and
compares them with ``from_pretrained`` of the same folder on the same device. Rank 0 writes the record
(``OUT.json``; other ranks ``OUT.rank<r>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from gpu_env import scrub_paths
from gpu_probe import GENERATE, llama_spec, logits_diff, prompts, unsplit

import tpcore
from tpcore import destroy_process_group


def save(directory: Path) -> None:
    llama_spec(seed=7).build().save_pretrained(directory)


def run(directory: Path, cpu: bool) -> dict:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and not cpu
    backend = "nccl" if cuda else "gloo"
    record: dict = {"backend": backend, "checks": {}}
    engine = tpcore.ParallelEngine(num_gpus=int(os.environ.get("WORLD_SIZE", 1)), backend=backend)
    model = engine.parallelize(str(directory))
    device = next(model.parameters()).device
    record.update(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(), device=str(device))
    expected_device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    record["checks"]["on_this_ranks_device"] = device == expected_device and all(
        t.device == device for t in [*model.parameters(), *model.buffers()]
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval().to(device)
    spec = llama_spec(seed=7)
    inputs = prompts(spec)
    record["forward"] = logits_diff(
        unsplit(reference, "forward", inputs, device).logits, unsplit(model, "forward", inputs, device).logits
    )
    record["checks"]["forward_within_tolerance"] = record["forward"]["within"]
    greedy = [unsplit(m, "generate", inputs, device, do_sample=False, **GENERATE).cpu() for m in (reference, model)]
    record["checks"]["greedy_identical"] = torch.equal(*greedy)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("save").add_argument("directory", type=Path)
    runner = commands.add_parser("run")
    runner.add_argument("directory", type=Path)
    runner.add_argument("output", type=Path)
    runner.add_argument("--cpu", action="store_true", help="gloo on the CPU even if CUDA is there")
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.directory)
        return 0
    started = time.perf_counter()
    try:
        record = run(args.directory, args.cpu)
        failed = [check for check, passed in record["checks"].items() if not passed]
        record["status"] = "fail" if failed else "pass"
        if failed:
            record["failed"] = failed
        forward = record["forward"]
        record["summary"] = f"{record['device']}: forward diff {forward.get('max_abs_diff', 'n/a')}"
    except Exception as error:
        record = {"status": "error", "error": scrub_paths(f"{type(error).__name__}: {error}")[:3000]}
        record["traceback"] = scrub_paths(traceback.format_exc())[-6000:]
    record["seconds"] = round(time.perf_counter() - started, 2)
    rank = int(os.environ.get("RANK", 0))
    output = args.output if rank == 0 else args.output.with_suffix(f".rank{rank}.json")
    output.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps({k: record[k] for k in ("status", "seconds")} | {"summary": record.get("summary")}))
    destroy_process_group()
    return 0 if record["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
