"""A ``tpcore serve`` left running: 16 clients for ``--minutes`` (30 by default), resident memory, shared-memory
segments and open files of the server and its ranks sampled as it goes; they should stay flat.

The server is the real command (``tpcore serve <dir> --num-gpus 2`` in a process of its own) on a random-init Llama of
SmolLM2-135M's widths (``--layers`` of its 30, default 4: rows join and leave the running batch often). Each
client sends, one after another, a mix of what a server meets: completions of 1 to 40 prompt tokens and 1 to 48
new tokens, streamed ones (a fifth of them dropped by the client after 3 chunks), chats, and bad requests (400).
Each sample: the sum of VmRSS over the server and its ranks, the files in ``/dev/shm`` (count and bytes), the
server's open file descriptors, and requests answered. The first ``--warm-up`` minutes are left out of the growth
figures (allocators and caches fill first). At the end SIGTERM stops the server; no rank may be left. Writes
``bench/results/soak.md``.

    python bench/soak.py                 # 30 minutes plus a minute of start
    python bench/soak.py --quick         # 2 minutes
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from _common import MIB, arguments, parse, printed, write_result
from _models import smollm2_checkpoint

from tpcore.serve import free_port

CLIENTS = 16


def descendants(pid: int) -> list[int]:
    """``pid``'s children, their children, ... (Linux ``/proc``)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except FileNotFoundError:
                continue
            for child in map(int, children):
                found.append(child)
                queue.append(child)
    return found


def resident_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def shared_memory() -> tuple[int, float]:
    """Files in ``/dev/shm``: how many, and their MiB."""
    entries = [entry for entry in os.scandir("/dev/shm") if entry.is_file(follow_symlinks=False)]
    return len(entries), sum(entry.stat().st_blocks * 512 for entry in entries) / MIB


def sample(server: subprocess.Popen, answered: int, started: float) -> dict:
    ranks = descendants(server.pid)
    segments, segment_mib = shared_memory()
    return {
        "minute": (time.monotonic() - started) / 60,
        "server MiB": resident_mib(server.pid),
        "ranks MiB": sum(resident_mib(pid) for pid in ranks),
        "processes": 1 + len(ranks),
        "shm files": segments,
        "shm MiB": segment_mib,
        "fds": len(os.listdir(f"/proc/{server.pid}/fd")),
        "answered": answered,
    }


class Clients:
    """``CLIENTS`` threads sending a mix of requests until :meth:`stop`; what they got, counted."""

    def __init__(self, url: str, seed: int = 0):
        self.url, self.seed = url, seed
        self.counts = {"completion": 0, "stream": 0, "dropped": 0, "chat": 0, "bad": 0, "unexpected": 0}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(index,)) for index in range(CLIENTS)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()

    @property
    def answered(self) -> int:
        with self.lock:
            return sum(count for kind, count in self.counts.items() if kind != "unexpected")

    def _count(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1

    def _client(self, index: int) -> None:
        draw = random.Random(self.seed * 1000 + index)
        with httpx.Client(base_url=self.url, timeout=300) as http:
            while not self.stopping.is_set():
                prompt = " ".join(f"w{draw.randrange(2, 49152)}" for _ in range(draw.randint(1, 40)))
                body = {"model": "soak", "prompt": prompt, "max_tokens": draw.randint(1, 48), "temperature": 0}
                roll = draw.random()
                try:
                    if roll < 0.55:
                        kind = "completion" if http.post("/v1/completions", json=body).status_code == 200 else "x"
                    elif roll < 0.8:
                        kind = self._stream(http, body, drop=draw.random() < 0.2)
                    elif roll < 0.95:
                        chat = {"model": "soak", "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": body["max_tokens"], "temperature": 0.8, "seed": index}  # fmt: skip
                        kind = "chat" if http.post("/v1/chat/completions", json=chat).status_code == 200 else "x"
                    else:
                        bad = {**body, "temperature": 5}
                        kind = "bad" if http.post("/v1/completions", json=bad).status_code == 400 else "x"
                except httpx.HTTPError:
                    kind = "x"
                self._count("unexpected" if kind == "x" else kind)

    def _stream(self, http: httpx.Client, body: dict, drop: bool) -> str:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                return "x"
            for chunks, _ in enumerate(response.iter_lines()):
                if drop and chunks == 3:
                    return "dropped"  # the connection closes with the unread rest
        return "stream"


def with_chat_template(directory: str) -> None:
    """Give the checkpoint's word-level tokenizer a chat template (the messages' contents, space-separated)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(directory)


def start_server(directory: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "tpcore", "serve", directory, "--num-gpus", "2", "--port", str(port),
               "--name", "soak", "--max-batch", "16", "--max-queue", "256"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"tpcore serve exited with {server.returncode} before it served")
        time.sleep(1)
    server.kill()
    raise RuntimeError("tpcore serve did not answer /health in 5 minutes")


def growth(samples: list[dict], warm_up: float, key: str) -> tuple[float, float]:
    """``key``'s change from the first sample after ``warm_up`` minutes to the last, and per hour."""
    steady = [each for each in samples if each["minute"] >= warm_up] or samples[-1:]
    first, last = steady[0], steady[-1]
    hours = max((last["minute"] - first["minute"]) / 60, 1e-9)
    return last[key] - first[key], (last[key] - first[key]) / hours


def main() -> None:
    parser = arguments(__doc__, "soak", "2 minutes, 1 of warm-up")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warm-up", type=float, default=5.0, help="minutes left out of the growth figures")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--layers", type=int, default=4, help="layers of the SmolLM2-shaped model (30: its own)")
    args = parse(parser, quick={"minutes": 2.0, "warm_up": 1.0, "every": 10.0})
    with tempfile.TemporaryDirectory() as directory:
        smollm2_checkpoint(Path(directory), args.layers)
        with_chat_template(directory)
        port = free_port()
        server = start_server(directory, port)
        clients = Clients(f"http://127.0.0.1:{port}")
        started, samples = time.monotonic(), []
        try:
            samples.append(sample(server, 0, started))
            clients.start()
            while time.monotonic() - started < args.minutes * 60:
                time.sleep(args.every)
                samples.append(sample(server, clients.answered, started))
                print("  " + ", ".join(f"{key} {value:.1f}" for key, value in samples[-1].items()), flush=True)
        finally:
            clients.stop()
            ranks = descendants(server.pid)
            server.send_signal(signal.SIGTERM)
            exit_code = server.wait(120)
    time.sleep(1)
    left = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    header = list(samples[0])
    rows = [[f"{each[key]:.1f}" if isinstance(each[key], float) else str(each[key]) for key in header]
            for each in samples]  # fmt: skip
    figures = []
    for key in ("server MiB", "ranks MiB", "shm files", "shm MiB", "fds"):
        change, per_hour = growth(samples, args.warm_up, key)
        figures.append([key, f"{change:+.1f}", f"{per_hour:+.1f}"])
    summary = printed(["after the warm-up", "change", "per hour"], figures)
    counts = ", ".join(f"{kind} {count}" for kind, count in clients.counts.items())
    sections = [
        f"{CLIENTS} clients for {args.minutes:g} minutes on a {args.layers}-layer SmolLM2-shaped Llama split over 2 "
        f"ranks; growth counted after the first {args.warm_up:g} minutes.",
        f"Requests: {counts}. SIGTERM: exit code {exit_code}, ranks left {len(left)} of {len(ranks)}.",
        f"## Growth\n\n{summary}",
        f"## Samples\n\n{printed(header, rows)}",
    ]
    write_result("soak", "tpcore serve left running: memory, shared memory and files over time", sections, "gloo",
                 args.note, args.output)  # fmt: skip


if __name__ == "__main__":
    main()
