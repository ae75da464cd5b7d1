"""One rank of DeepSpeed AutoTP for decode_peers.py, started by ``torch.distributed.run`` from DeepSpeed's own venv
(it imports nothing of tpcore, and of bench/ only ``_peer_worker``): loads the model directory, splits it with
``deepspeed.init_inference`` (AutoTP: ``tensor_parallel={"tp_size": N}``, no kernel injection), and times greedy
``generate()`` as decode_peers.py times the other ways. Rank 0 prints one JSON line: the load seconds and, per batch,
the TTFT and long-run seconds of each round and the tokens.

    python -m torch.distributed.run --nproc-per-node 2 bench/_deepspeed_worker.py DIR --prompt 32 --new-tokens 33
"""

from __future__ import annotations

import os
import time

import torch
from _peer_worker import print_result, timed_batches, worker_arguments


def main() -> None:
    args = worker_arguments()
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

    def generator_for(ids: torch.Tensor):
        def generate(new_tokens: int) -> list:
            with torch.inference_mode():
                tokens = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False,
                )  # fmt: skip
            return tokens.tolist()

        return generate

    rounds = timed_batches(args, generator_for, before=torch.distributed.barrier)  # the ranks start each together
    result = {"load_s": load_s, "version_text": version, **rounds}
    if int(os.environ["RANK"]) == 0:
        print_result(result)


if __name__ == "__main__":
    main()
