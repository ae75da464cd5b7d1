"""What decode_peers.py's peer workers share (``_deepspeed_worker.py``, ``_vllm_decode_worker.py``): their command
line, the seeded prompts of each batch, and the timed rounds. It runs in a peer's own venv: torch only, nothing of
tpcore or of the rest of bench/."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch


def worker_arguments() -> argparse.Namespace:
    """The model directory, ``--prompt`` tokens, ``--new-tokens``, ``--rounds``, ``--batches``, ``--vocab``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--vocab", type=int, default=49152)
    return parser.parse_args()


def timed_batches(
    args: argparse.Namespace,
    generator_for: Callable[[torch.Tensor], Callable[[int], list]],
    before: Callable[[], None] = lambda: None,
) -> dict:
    """For each batch of ``args.batches``: ``generate = generator_for(ids)`` on the seeded prompt ids
    ``[batch, prompt]`` (decode_peers.py's), a warm-up, then ``args.rounds`` rounds of ``generate(1)`` and
    ``generate(new_tokens)``, each timed after ``before()`` (a barrier of the ranks, say):
    ``{batch: {"short": s, "long": s, "tokens": the last round's}}``."""
    result = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(2, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        generate = generator_for(ids)
        generate(2)
        short, long, tokens = [], [], None
        for _ in range(args.rounds):
            short.append(_timed(generate, 1, before)[0])
            seconds, tokens = _timed(generate, args.new_tokens, before)
            long.append(seconds)
        result[str(batch)] = {"short": short, "long": long, "tokens": tokens}
    return result


def print_result(result: dict) -> None:
    """The one line decode_peers.py reads."""
    print("RESULT " + json.dumps(result), flush=True)


def _timed(generate: Callable[[int], list], new_tokens: int, before: Callable[[], None]) -> tuple[float, list]:
    before()
    start = time.perf_counter()
    tokens = generate(new_tokens)
    return time.perf_counter() - start, tokens
