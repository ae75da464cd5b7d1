"""Helpers shared by the benchmark scripts (caller side only: nothing here runs on a rank)."""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
MIB = 2**20


def command_line() -> str:
    """The command that ran this script, with the script path relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = script.relative_to(BENCH_DIR.parent).as_posix()
    except ValueError:
        shown = script.name
    args, skip = [], False
    for arg in sys.argv[1:]:  # the note is printed on its own
        if skip or arg.startswith("--note="):
            skip = False
            continue
        if arg == "--note":
            skip = True
            continue
        args.append(arg)
    return shlex.join(["python", shown, *args])


def _commit() -> str:
    """The repository's commit, ``+dirty`` if tpcore or tp-bert has uncommitted changes (a git checkout only)."""
    root = BENCH_DIR.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        status = ["git", "status", "--porcelain", "-uno", "--", "tpcore", "plugins/tp-bert"]
        dirty = subprocess.run(status, cwd=root, capture_output=True, text=True)
    except OSError:
        return "n/a"
    if head.returncode:
        return "n/a"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(backend: str) -> dict[str, str]:
    """What the figures depend on; no host names and no paths."""
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "tpcore": f"{_version('tpcore')} (commit {_commit()})",
        "tp-bert": _version("tp-bert"),
        "os": f"{platform.system()} {platform.release()}",
        "cpu cores (os.cpu_count)": str(os.cpu_count()),
        "backend": backend,
    }
    if backend == "nccl":
        info["gpus"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return info


def choose_backend(requested: str | None, world_size: int) -> str:
    """``requested``, else tpcore's default: NCCL when there is a GPU per rank, else gloo (and it says so
    when the GPUs are too few)."""
    import torch

    from tpcore.distributed import default_backend

    if requested:
        return requested
    backend = default_backend(world_size)
    if backend == "gloo" and torch.cuda.is_available():
        print(f"{torch.cuda.device_count()} GPU(s) for {world_size} ranks: using gloo on the CPU instead of NCCL")
    return backend


def load_average() -> str:
    try:
        return " / ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_busy(seconds: float = 2.0) -> float | None:
    """The fraction of all cores that were busy over the next ``seconds`` (this process sleeps
    meanwhile, so it is what the other processes use); ``None`` without ``/proc/stat``."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values), idle

    try:
        total_before, idle_before = sample()
        time.sleep(seconds)
        total_after, idle_after = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total_after - total_before
    return 1 - (idle_after - idle_before) / total if total > 0 else None


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plain_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def write_result(name: str, title: str, sections: list[str], backend: str, note: str | None, output: str | None):
    """Write ``bench/results/<name>.md`` (or ``output``) and say where, relative to the current directory."""
    env = environment(backend)
    header = [
        f"# {title}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Recorded {time.strftime('%Y-%m-%d')}; load average at the end (1/5/15 min): {load_average()}.",
        "",
    ]
    if note:
        header += [f"> Note: {note}", ""]
    body = "\n\n".join(sections)
    header.append("")
    env_table = markdown_table(["", ""], [[key, value] for key, value in env.items()])
    text = "\n".join(header) + body + "\n\n## Environment\n\n" + env_table + "\n"
    path = Path(output) if output else RESULTS_DIR / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    try:
        shown = os.path.relpath(path)
    except ValueError:
        shown = path.name
    print(f"\nwrote {shown}")
