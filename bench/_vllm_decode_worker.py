"""vLLM's offline engine for decode_peers.py, run from vLLM's own venv (it imports nothing of tpcore, and of bench/
only ``_peer_worker``): ``vllm.LLM`` on the model directory at tensor_parallel_size 1, timed as decode_peers.py
times the other ways: ``generate()`` of the batch's prompts (token ids) with 1 new token and with ``--new-tokens``,
greedy, ``ignore_eos``. Prints one JSON line: the load seconds and, per batch, the seconds of each round and the
tokens (prompt first).

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 python bench/_vllm_decode_worker.py DIR
"""

from __future__ import annotations

import time

import torch
from _peer_worker import print_result, timed_batches, worker_arguments


def main() -> None:
    args = worker_arguments()
    started = time.perf_counter()
    import vllm

    llm = vllm.LLM(model=args.directory, dtype="float32", tensor_parallel_size=1, max_model_len=512, max_num_seqs=16)
    load_s = time.perf_counter() - started

    def generator_for(ids: torch.Tensor):
        prompts = [{"prompt_token_ids": row} for row in ids.tolist()]

        def generate(new_tokens: int) -> list:
            params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            pairs = zip(prompts, outputs, strict=True)
            return [prompt["prompt_token_ids"] + list(out.outputs[0].token_ids) for prompt, out in pairs]

        return generate

    print_result({"load_s": load_s, "version_text": f"vllm {vllm.__version__}", **timed_batches(args, generator_for)})


if __name__ == "__main__":
    main()
