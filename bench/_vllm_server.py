"""vLLM's OpenAI server as a subprocess of serve_vllm.py, from vLLM's own venv: the versions there, the command line
and environment it runs with at a tensor_parallel_size, and the server started, awaited until ``/health`` answers,
and stopped with every process it started."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tpcore.serve import free_port

#: what CPU vLLM's documentation asks to set: KV cache GiB per rank, the cores each rank's OpenMP threads bind
KV_CACHE_GIB = "1"


def vllm_environment(tp: int) -> dict[str, str]:
    """The environment variables ``vllm serve`` runs with at tensor_parallel_size ``tp``."""
    cores = os.cpu_count() or 1
    if tp == 1:
        bind = f"0-{cores - 1}"
    else:  # each rank its own share of the cores, as tpcore's ranks get
        share = max(cores // tp, 1)
        bind = "|".join(f"{r * share}-{r * share + share - 1}" if share > 1 else str(r) for r in range(tp))
    return {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "VLLM_CPU_OMP_THREADS_BIND": bind}


def vllm_command(
    python: str, directory: str, tp: int, port: int, max_model_len: int, eager: bool, extra: tuple[str, ...] = ()
) -> list[str]:
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", directory, "--served-model-name"]
    command += ["bench", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--tensor-parallel-size", str(tp), "--dtype", "float32", "--max-model-len", str(max_model_len)]
    command += ["--max-num-seqs", "16"]  # tpcore's Limits(max_batch=16)
    if tp > 1:
        command += ["--distributed-executor-backend", "mp"]
    if eager:
        command.append("--enforce-eager")
    return command + list(extra)


def vllm_versions(python: str) -> dict[str, str] | None:
    """Versions in vLLM's own venv, None where ``import vllm`` fails there."""
    code = "import vllm\n"
    code += "from importlib import metadata as m\nfor d in ('vllm-cpu', 'torch', 'transformers'):\n"
    code += "    try: print(d, m.version(d))\n    except m.PackageNotFoundError: print(d, 'not installed')"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode:
        print(done.stderr[-2000:])
        return None
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def stop(process: subprocess.Popen) -> None:
    """End the server and every process it started (its own process group), no orphans."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    try:  # workers left behind in the group
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def last_error(text: str) -> str:
    """The log's last line that names an error (its Python exception), stripped."""
    named = re.compile(r"\w+Error\b|Value error")
    lines = [line.strip() for line in text.splitlines() if named.search(line) and "https://" not in line]
    return lines[-1].split(" [type=")[0] if lines else "no error line in its log"


class VllmServer:
    """vLLM's server on the model of ``directory`` at tensor_parallel_size ``tp`` while inside: started (its log
    beside ``directory``), ``url`` once ``/health`` answers (``startup``: seconds to then; ``shown``: its command
    line with its environment), stopped on the way out. A server that exits or is not healthy within
    ``start_timeout`` seconds raises ``RuntimeError`` with the reason."""

    def __init__(self, python: str, directory: str, tp: int, args, extra: tuple[str, ...] = ()):
        self.tp, self.start_timeout = tp, args.start_timeout
        port = free_port()
        self.command = vllm_command(python, directory, tp, port, args.max_model_len, args.enforce_eager, extra)
        self.environment = vllm_environment(tp)
        self.shown = " ".join(f"{k}={v}" for k, v in self.environment.items()) + " " + shlex.join(self.command)
        self.log = Path(directory).parent / f"vllm_tp{tp}.log"
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> VllmServer:
        print(f"  {self.shown}", flush=True)
        started = time.perf_counter()
        with open(self.log, "w") as output:
            self.process = subprocess.Popen(
                self.command, env={**os.environ, **self.environment}, stdout=output, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        try:
            self._wait_healthy(started)
        except BaseException:
            stop(self.process)
            raise
        self.startup = time.perf_counter() - started
        print(f"  vLLM tp={self.tp} healthy after {self.startup:.0f} s", flush=True)
        return self

    def _wait_healthy(self, started: float) -> None:
        while True:
            if self.process.poll() is not None:
                print(self.log.read_text()[-4000:])
                raise RuntimeError(f"exited {self.process.returncode}: {last_error(self.log.read_text())}")
            if time.perf_counter() - started > self.start_timeout:
                print(self.log.read_text()[-4000:])
                raise RuntimeError(f"not healthy after {self.start_timeout:.0f} s")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)

    def __exit__(self, *exc) -> None:
        stop(self.process)
