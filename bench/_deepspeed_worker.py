"""One rank of DeepSpeed AutoTP for decode_peers.py, started by ``torch.distributed.run`` from DeepSpeed's own venv
(it imports nothing of tpcore or bench/): loads the model directory, splits it with ``deepspeed.init_inference``
(AutoTP: ``tensor_parallel={"tp_size": N}``, no kernel injection), and times greedy ``generate()`` as
decode_peers.py times the other ways. Rank 0 prints one JSON line: the load seconds and, per batch, the TTFT and
long-run seconds of each round and the tokens.

    python -m torch.distributed.run --nproc-per-node 2 bench/_deepspeed_worker.py DIR --prompt 32 --new-tokens 33
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max((os.cpu_count() or 1) // world, 1))
    started = time.perf_counter()
    import deepspeed
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.directory, dtype=torch.float32).eval()
    engine = deepspeed.init_inference(
        model, tensor_parallel={"tp_size": world}, dtype=torch.float32, replace_with_kernel_inject=False
    )
    model = engine.module
    load_s = time.perf_counter() - started
    version = f"deepspeed {deepspeed.__version__}, {torch.get_num_threads()} torch thread(s) a rank"
    result: dict = {"load_s": load_s, "version_text": version}
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(2, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def generate(new_tokens: int, inputs: dict = inputs) -> tuple[float, torch.Tensor]:
            torch.distributed.barrier()
            start = time.perf_counter()
            with torch.inference_mode():
                tokens = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            return time.perf_counter() - start, tokens

        generate(2)  # warm-up
        short, long, tokens = [], [], None
        for _ in range(args.rounds):
            short.append(generate(1)[0])
            seconds, tokens = generate(args.new_tokens)
            long.append(seconds)
        result[str(batch)] = {"short": short, "long": long, "tokens": tokens.tolist()}
    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
