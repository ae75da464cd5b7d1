"""What every benchmark script does around its measurement (caller side only: nothing here runs on a rank): its
command line (``--quick``, ``--note``, ``--output``), where its result goes and what it records of the machine,
tables, and the short forms of a figure or an error in a table's cell."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
MIB = 2**20
#: the plugin distributions whose versions a result records
PLUGINS = ("tp-bert", "tp-gpt", "tp-t5", "tp-bart", "tp-vision")


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


def git_commit() -> str:
    """The repository's commit, ``+dirty`` if tpcore or a plugin has uncommitted changes (a git checkout only)."""
    root = BENCH_DIR.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        status = ["git", "status", "--porcelain", "-uno", "--", "tpcore", "plugins"]
        dirty = subprocess.run(status, cwd=root, capture_output=True, text=True)
    except OSError:
        return "n/a"
    if head.returncode:
        return "n/a"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def installed_version(distribution: str) -> str:
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
        "transformers": installed_version("transformers"),
        "tpcore": f"{installed_version('tpcore')} (commit {git_commit()})",
        **{plugin: installed_version(plugin) for plugin in PLUGINS},
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

    from tpcore.ranks.distributed import default_backend

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


def printed(header: list[str], rows: list[list[str]]) -> str:
    """Print a table as plain text (the console's copy); return it in Markdown (the result's)."""
    print(plain_table(header, rows))
    return markdown_table(header, rows)


def arguments(doc: str, name: str, quick: str) -> argparse.ArgumentParser:
    """A script's parser, described by the first line of its docstring ``doc``, with the arguments alike in every
    script: ``--quick`` (``quick`` says what its trial runs), ``--note`` and ``--output`` (``name``: its result's
    name)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a trial run in seconds to minutes: {quick}")
    parser.add_argument("--note", default=None, help="a remark to put in the result file")
    parser.add_argument(
        "--output", default=None, help=f"result file (*.md), or a folder for {name}.md (default bench/results/)"
    )
    return parser


def parse(parser: argparse.ArgumentParser, argv=None, quick: dict | None = None) -> argparse.Namespace:
    """The arguments, with ``quick``'s values in place of theirs under ``--quick`` (a trial's small sizes)."""
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(quick or {})
    return args


def result_path(name: str, output: str | None, suffix: str = ".md") -> Path:
    """Where ``name``'s result goes: ``--output`` if it names a ``.md`` file (other files beside it), else
    ``<output>/<name><suffix>``, by default in ``bench/results/``."""
    if output and output.endswith(".md"):
        return Path(output).with_suffix(suffix)
    return (Path(output) if output else RESULTS_DIR) / f"{name}{suffix}"


def shown(path: Path) -> str:
    """``path`` relative to the current directory if it is below it, else as it is."""
    try:
        return path.resolve().relative_to(Path.cwd()).as_posix()
    except ValueError:
        return str(path)


def write_result(name: str, title: str, sections: list[str], backend: str, note: str | None, output: str | None):
    """Write ``bench/results/<name>.md`` (or where ``output`` says) and say where."""
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
    path = result_path(name, output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {shown(path)}")


def first_line(error: BaseException, limit: int = 200) -> str:
    """The gist of an error (a rank's error without the remote traceback), for an ``n/a (...)`` cell."""
    message = getattr(error, "remote_message", None) or str(error)
    name = getattr(error, "type_name", None) or type(error).__name__
    text = f"{name}: {message.strip().splitlines()[0] if message.strip() else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
