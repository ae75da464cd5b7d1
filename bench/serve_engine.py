"""The serve engine without HTTP: where its time goes, and transformers' own continuous batching beside it.

``--requests`` generation requests (32-token prompts of random ids, ``--new-tokens`` greedy tokens each, end of
sequence ignored) are all queued at once, and each way runs them to the end, ``--max-batch`` rows at a time:

- **tpcore engine, whole**: ``tpcore.serve``'s engine (``Scheduler``: grouped prefill, one left-padded running
  batch) on the model in this process, on all cores;
- **tpcore engine, N=2**: the same engine on ``tpcore.parallelize(directory, num_gpus=2)`` (gloo ranks);
- **tpcore engine, N=2 compiled**: the same with the ranks' decode step compiled, as ``tpcore serve --compile``
  loads it (its compile time is printed, not counted);
- **transformers CB**: ``model.generate_batch`` (transformers' continuous batching: paged KV cache, its own
  scheduler, in a thread of its own) on the model whole in this process, this thread's OpenMP workers released
  first as tpcore's engine releases them (``release_openmp_workers``); a first run of the same requests
  makes its manager (kept: ``persistent_manager``) and is not counted;
- **generate(), static batches**: ``model.generate`` on batches of ``--max-batch`` prompts, one after another.

For tpcore's engine: seconds in prefill forwards, in decode steps, in choosing tokens (``_accept``: sampling,
text, events) and in the rest. Every way's tokens are compared with each prompt's solo greedy ``generate()``.

    python bench/serve_engine.py           # about 15 minutes on 2 CPU cores -> bench/results/serve_engine.md
    python bench/serve_engine.py --quick   # a smoke run
"""

from __future__ import annotations

import asyncio
import collections
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers
from _common import arguments, parse, printed, write_result
from _decode import VOCAB
from _models import smollm2_checkpoint

from tpcore.serve.requests import Failed, Finished, Request
from tpcore.serve.sampling import SamplingParams
from tpcore.serve.scheduler import Generation, Scheduler
from tpcore.serve.server import load_model
from tpcore.served.caller_threads import release_openmp_workers

PROMPT = 32


class Timed:
    """Seconds spent in the named methods of objects, and the tokens each engine row chose."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.tokens: dict[str, list[int]] = collections.defaultdict(list)

    def wrap(self, owner, name: str, label: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started

        setattr(owner, name, timed)

    def record_tokens(self, scheduler: Scheduler) -> None:
        accept = scheduler._accept

        def recorded(row, logits):
            token = accept(row, logits)
            self.tokens[row.request.id].append(token)
            return token

        scheduler._accept = recorded  # type: ignore[method-assign]


def engine_run(model, tokenizer, prompts: list[list[int]], new_tokens: int, max_batch: int):
    """All ``prompts`` through a new engine on ``model``: (seconds, each prompt's tokens, seconds by stage)."""
    scheduler = Scheduler(model, tokenizer, eos_ids=set(), max_batch=max_batch, max_queue=len(prompts))
    timed = Timed()
    timed.wrap(scheduler.batch, "prefill", "prefill")
    timed.wrap(scheduler.batch, "step", "decode steps")
    timed.record_tokens(scheduler)
    timed.wrap(scheduler, "_accept", "choosing tokens")
    loop, ended = asyncio.new_event_loop(), threading.Semaphore(0)
    requests = []
    for prompt in prompts:
        request = Request(Generation(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0)), loop)
        request.push = lambda event: ended.release() if isinstance(event, (Finished, Failed)) else None
        requests.append(request)
    started = time.perf_counter()
    for request in requests:
        scheduler.submit(request)
    scheduler.start()
    for _ in requests:
        ended.acquire()
    seconds = time.perf_counter() - started
    scheduler.stop()
    stages = dict(timed.seconds)
    stages["rest"] = seconds - sum(stages.values())
    return seconds, [timed.tokens[request.id] for request in requests], stages


def continuous_batching_run(model, prompts: list[list[int]], new_tokens: int, max_batch: int):
    """transformers' ``generate_batch`` on all ``prompts``: (seconds, each prompt's tokens)."""
    config = transformers.GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0, max_batch_size=max_batch
    )
    run = dict(inputs=prompts, generation_config=config, progress_bar=False, persistent_manager=True)
    release_openmp_workers()  # its generation thread gets the cores as tpcore's engine thread does
    model.generate_batch(**run)  # its warm-up, and a manager (paged cache, scheduler) kept for the timed run
    started = time.perf_counter()
    outputs = model.generate_batch(**run)
    seconds = time.perf_counter() - started
    by_prompt = {tuple(output.prompt_ids): list(output.generated_tokens) for output in outputs.values()}
    return seconds, [by_prompt[tuple(prompt)] for prompt in prompts]


def static_batches_run(model, prompts: list[list[int]], new_tokens: int, max_batch: int):
    """``generate()`` on batches of ``max_batch`` prompts: (seconds, each prompt's tokens)."""
    tokens, started = [], time.perf_counter()
    for first in range(0, len(prompts), max_batch):
        ids = torch.tensor(prompts[first : first + max_batch])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        tokens.extend(out[:, PROMPT:].tolist())
    return time.perf_counter() - started, tokens


def solo(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens alone (end of sequence ignored)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        out.append(generated[0, PROMPT:].tolist())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "serve_engine", "2 layers, 8 requests of 8 tokens, no compile")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled way (minutes of compiling)")
    args = parse(parser, argv, quick={"layers": 2, "requests": 8, "new_tokens": 8, "no_compile": True})
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, VOCAB, (PROMPT,), generator=generator).tolist() for _ in range(args.requests)]
    results: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory() as directory, torch.inference_mode():
        smollm2_checkpoint(Path(directory), args.layers)
        whole, tokenizer = load_model(directory, 0)
        expected = solo(whole, prompts, args.new_tokens)
        shape = (prompts, args.new_tokens, args.max_batch)
        results["tpcore engine, whole"] = engine_run(whole, tokenizer, *shape)
        print("whole", results["tpcore engine, whole"][0], flush=True)
        for way, compile_ in (("tpcore engine, N=2", False), ("tpcore engine, N=2 compiled", True)):
            if compile_ and args.no_compile:
                continue
            started = time.perf_counter()
            split, _ = load_model(directory, 2, compile=compile_)
            print(f"{way}: loaded in {time.perf_counter() - started:.0f} s", flush=True)
            try:
                results[way] = engine_run(split, tokenizer, *shape)
            finally:
                split.deparallelize()
            print(way, results[way][0], flush=True)
        results["transformers CB, whole"] = (*continuous_batching_run(whole, *shape), None)
        results["generate(), static batches, whole"] = (*static_batches_run(whole, *shape), None)
    total_tokens = args.requests * args.new_tokens
    rows, stage_rows = [], []
    for way, (seconds, tokens, stages) in results.items():
        same = sum(mine == theirs for mine, theirs in zip(tokens, expected, strict=True))
        rows.append([way, f"{seconds:.2f}", f"{total_tokens / seconds:.1f}", f"{same}/{len(prompts)}"])
        if stages:
            stage_rows.append([way] + [f"{stages[name]:.2f} ({stages[name] / seconds:.0%})" for name in STAGES])
    sections = [
        f"Llama of SmolLM2-135M's widths (random init), {args.layers} layers, fp32; {args.requests} requests of "
        f"{PROMPT}-token prompts queued at once, {args.new_tokens} greedy tokens each (end of sequence ignored), "
        f"up to {args.max_batch} rows decoded together. Whole ways: this process, {torch.get_num_threads()} "
        "threads; N=2: gloo ranks, the cores split between them.\n\n"
        + printed(["way", "seconds", "tokens/s", "tokens equal to solo"], rows),
        "Where the engine's time goes (seconds, share):\n\n" + printed(["way", *STAGES], stage_rows),
    ]
    write_result("serve_engine", "The serve engine without HTTP", sections, "gloo", args.note, args.output)


STAGES = ("prefill", "decode steps", "choosing tokens", "rest")


if __name__ == "__main__":
    main()
