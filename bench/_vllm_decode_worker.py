"""vLLM's offline engine for decode_peers.py, run from vLLM's own venv (it imports nothing of tpcore or bench/):
``vllm.LLM`` on the model directory at tensor_parallel_size 1, timed as decode_peers.py times the other ways:
``generate()`` of the batch's prompts (token ids) with 1 new token and with ``--new-tokens``, greedy, ``ignore_eos``.
Prints one JSON line: the load seconds and, per batch, the seconds of each round and the tokens (prompt first).

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 python bench/_vllm_decode_worker.py DIR
"""

from __future__ import annotations

import argparse
import json
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
    started = time.perf_counter()
    import vllm

    llm = vllm.LLM(model=args.directory, dtype="float32", tensor_parallel_size=1, max_model_len=512, max_num_seqs=16)
    result: dict = {"load_s": time.perf_counter() - started, "version_text": f"vllm {vllm.__version__}"}
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(2, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        prompts = [{"prompt_token_ids": row} for row in ids.tolist()]

        def generate(new_tokens: int, prompts: list = prompts) -> tuple[float, list]:
            params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            pairs = zip(prompts, outputs, strict=True)
            return seconds, [prompt["prompt_token_ids"] + list(out.outputs[0].token_ids) for prompt, out in pairs]

        generate(2)  # warm-up
        short, long, tokens = [], [], None
        for _ in range(args.rounds):
            short.append(generate(1)[0])
            seconds, tokens = generate(args.new_tokens)
            long.append(seconds)
        result[str(batch)] = {"short": short, "long": long, "tokens": tokens}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
