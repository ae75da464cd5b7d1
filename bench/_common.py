"""Helpers shared by the benchmark scripts (caller side only: nothing here runs on a rank): arguments and
where results go, the environment, timing figures of the ways a script compares, tables."""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
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


def _commit() -> str:
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
        **{plugin: _version(plugin) for plugin in PLUGINS},
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


def common_arguments(parser, name: str, quick: str) -> None:
    """``--quick``, ``--note`` and ``--output``, alike in every script (``name``: its result's name)."""
    parser.add_argument("--quick", action="store_true", help=f"a trial run in seconds to minutes: {quick}")
    parser.add_argument("--note", default=None, help="a remark to put in the result file")
    parser.add_argument(
        "--output", default=None, help=f"result file (*.md), or a folder for {name}.md (default bench/results/)"
    )


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


# -- the figures of the ways a script compares ----------------------------------------------------------


def first_line(error: BaseException, limit: int = 200) -> str:
    """The gist of an error (a rank's error without the remote traceback), for an ``n/a (...)`` cell."""
    message = getattr(error, "remote_message", None) or str(error)
    name = getattr(error, "type_name", None) or type(error).__name__
    text = f"{name}: {message.strip().splitlines()[0] if message.strip() else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def spread_ms(seconds: list[float]) -> str:
    """``p25 - p75`` in ms, interpolated within the samples (so also right for a handful of them)."""
    if len(seconds) < 2:
        return f"{seconds[0] * 1e3:.1f}" if seconds else "n/a"
    q1, _, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
    return f"{q1 * 1e3:.1f} - {q3 * 1e3:.1f}"


@dataclass
class Entry:
    """What one way measured on one model: loading, each timed call's seconds, memory, outputs to compare."""

    way: str
    na: str | None = None  # why the way could not run it
    ready_s: float | None = None  # checkpoint to a model ready to run
    start_s: float | None = None  # starting its ranks, before the clock of ready_s
    floor: int | None = None  # a rank's memory after its imports, before loading
    load_peak: int | None = None
    run_peak: int | None = None
    rank_bytes: int | None = None  # parameter and buffer bytes of the largest rank
    dtype: str | None = None  # of the model as loaded
    attn: str | None = None
    times: dict[str, list[float]] = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)  # rank 0's outputs of the first timed round
    collectives: dict | None = None
    notes: list[str] = field(default_factory=list)

    def add_times(self, times: dict[str, list[float]]) -> None:
        for name, values in times.items():
            self.times.setdefault(name, []).extend(values)

    def ms(self, call: str) -> float | None:
        """Median ms of a call."""
        return None if self.na or not self.times.get(call) else median_ms(self.times[call])

    def per_token_ms(self, one: str, many: str, tokens: int) -> float | None:
        """``(t(1 + K) - t(1)) / K`` from the medians of two ``generate()`` calls of 1 and 1 + K new tokens."""
        first, last = self.ms(one), self.ms(many)
        return None if first is None or last is None else (last - first) / tokens

    def peak_above_floor(self) -> int | None:
        return None if self.run_peak is None or self.floor is None else self.run_peak - self.floor


#: a figure of an Entry: (key, label, the function that reads it)
Figure = tuple[str, str, Callable[[Entry], float | None]]


def ratio_tables(entries: list[Entry], figures: list[Figure]) -> list[tuple[list[str], list[list[str]]]]:
    """Per figure: the row way's figure / the column way's (below 1: the row way is faster or smaller)."""
    live = [e for e in entries if not e.na]
    tables = []
    for _, label, read in figures:
        rows = []
        for row in live:
            cells = [row.way]
            for column in live:
                a, b = read(row), read(column)
                cells.append("-" if row is column else ("n/a" if a is None or not b else f"{a / b:.2f}"))
            rows.append(cells)
        tables.append(([f"{label}: row / column", *(e.way for e in live)], rows))
    return tables


# -- ways side by side ----------------------------------------------------------------------------------
# A way has ``name`` and ``load(task, entry)``, ``round(task, plan) -> {"times", "outputs"}``, ``memory()``,
# ``collectives(task)`` and ``unload()``; a task has ``name``, ``calls``, ``repeat`` (timed calls per round
# where not 1), ``keep`` (``{call: (output attribute or None for tokens, label)}``) and ``figures``.


def run_part(task, ways: list, rounds: int, measure_ranks: bool) -> list[Entry]:
    """Load ``task`` every way (then one untimed round), time ``rounds`` interleaved rounds (who goes first
    rotates, so drifting load hits all alike), read each way's memory and collectives (``measure_ranks``),
    unload. A way that fails is ``n/a`` with the reason, and the others go on."""
    entries = {way.name: Entry(way.name) for way in ways}
    plan = {"warmup": False, "repeat": task.repeat, "keep": {}}
    for way in ways:
        try:
            way.load(task, entries[way.name])
            way.round(task, {**plan, "warmup": True})
            print(f"  {task.name} / {way.name}: ready in {entries[way.name].ready_s:.1f} s", flush=True)
        except Exception as error:
            _fail(way, entries[way.name], error)
    keep = {call: attribute for call, (attribute, _) in task.keep.items()}
    for number in range(rounds):
        live = [way for way in ways if not entries[way.name].na]
        first = number % max(1, len(live))
        for way in live[first:] + live[:first]:
            try:
                result = way.round(task, {**plan, "keep": keep if number == 0 else {}})
            except Exception as error:
                _fail(way, entries[way.name], error, f"round {number + 1}: ")
                continue
            entries[way.name].add_times(result["times"])
            entries[way.name].outputs = entries[way.name].outputs or result["outputs"]
        figures = [
            f"{e.way} " + " / ".join(fmt(read(e), ".0f") for _, _, read in task.figures) for e in entries.values()
        ]
        print(f"  {task.name} round {number + 1}/{rounds} (ms): " + ", ".join(figures), flush=True)
    for way in ways:
        entry = entries[way.name]
        if entry.na:
            continue
        if measure_ranks:
            try:
                entry.collectives = way.collectives(task)
                figures = way.memory()
                entry.rank_bytes, entry.run_peak = figures["rank_bytes"], figures["peak"]
            except Exception as error:
                entry.notes.append(f"collectives / rank memory not measured: {first_line(error)}")
        way.unload()
    return list(entries.values())


def _fail(way, entry: Entry, error: Exception, when: str = "") -> None:
    entry.na = when + first_line(error)
    print(f"  {way.name}: n/a ({entry.na})", flush=True)
    traceback.print_exc()  # the whole story on stderr; the result keeps the gist
    try:
        way.unload()
    except Exception as unloading:
        print(f"  {way.name}: unloading failed too: {first_line(unloading)}")


def max_abs_diff(mine, theirs) -> str:
    """The largest absolute difference of two outputs (token ids: ``same`` or ``differ (k tokens)``)."""
    if mine is None or theirs is None:
        return "n/a"
    if mine.is_floating_point():
        return f"{(mine.double() - theirs.double()).abs().max().item():.1e}"
    if mine.shape != theirs.shape:
        return f"differ (shape {tuple(mine.shape)})"
    return "same" if mine.equal(theirs) else f"differ ({int((mine != theirs).sum())} tokens)"


def way_table(task, entries: list[Entry], model_bytes: int, with_memory: bool) -> str:
    """A part's table, one row per way: ready time, the task's figures, the largest rank's parameter bytes
    (``with_memory``: its peak, above its floor, and the collectives), and each kept output against the
    first unsplit way's."""
    reference = next((e for e in entries if e.way.startswith("unsplit") and not e.na), None)
    header = ["way", "ready s", *(label for _, label, _ in task.figures), "rank params MiB (x model)"]
    if with_memory:
        header += ["rank peak MiB", "peak - floor MiB: loaded / all calls", "collectives / layer", "/ forward"]
    header += [label for _, label in task.keep.values()]
    rows = []
    for entry in entries:
        if entry.na:
            rows.append([entry.way, f"n/a ({entry.na})", *[""] * (len(header) - 2)])
            continue
        row = [entry.way, fmt(entry.ready_s, ".1f"), *(fmt(read(entry), ".1f") for _, _, read in task.figures)]
        share = entry.rank_bytes
        row.append(f"{share / MIB:.1f} ({share / model_bytes:.3f}x)" if share else "n/a")
        if with_memory:
            comm = entry.collectives or {}
            row += [
                fmt(entry.run_peak and entry.run_peak / MIB, ".0f"),
                f"{_above(entry.load_peak, entry.floor)} / {_above(entry.run_peak, entry.floor)}",
                str(comm.get("layer0", "n/a")),
                str(comm.get("total", "n/a")),
            ]
        for call in task.keep:
            theirs = reference.outputs.get(call) if reference else None
            row.append("reference" if entry is reference else max_abs_diff(entry.outputs.get(call), theirs))
        rows.append(row)
    return markdown_table(header, rows)


def _above(peak: int | None, floor: int | None) -> str:
    return "n/a" if peak is None or floor is None else f"{(peak - floor) / MIB:.0f}"


def bar_chart(entries: list[Entry], panels: list, path: Path, title: str) -> str | None:
    """One bar panel per ``(title, [(label, read, scale)])`` over the ways; the reason if there is no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"no chart: {error}"
    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 4.8))
    for ax, (panel, series) in zip(axes, panels, strict=True):
        width = 0.8 / len(series)
        for i, (label, read, scale) in enumerate(series):
            values = [(read(e) or 0.0) * scale if not e.na else 0.0 for e in entries]
            offset = (i - (len(series) - 1) / 2) * width
            bars = ax.bar([x + offset for x in range(len(entries))], values, width, label=label)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v else "n/a" for v in values], fontsize=7)
        ax.set_title(panel, fontsize=10)
        ax.set_xticks(list(range(len(entries))), [e.way for e in entries], rotation=20, ha="right", fontsize=8)
        if len(series) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
