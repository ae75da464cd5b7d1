"""Ways side by side: several ways of running the same model (load it, time a round of calls, report memory and
collectives, unload) driven in interleaved rounds, what each measured (an :class:`Entry`), and the tables and
chart that set them side by side; a result made of parts, rewritten after each.

A way has ``name`` and ``load(task, entry)``, ``round(task, plan) -> {"times", "outputs"}``, ``memory()``,
``collectives(task)`` and ``unload()``; a task has ``name``, ``calls``, ``repeat`` (timed calls per round where
not 1), ``keep`` (``{call: (output attribute or None for tokens, label)}``) and ``figures``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _common import MIB, first_line, fmt, markdown_table, write_result
from _memory import of_model
from _timing import median_ms, rotated, spread_ms


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
        for way in rotated([way for way in ways if not entries[way.name].na], number):
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


def ratio(read, entry: Entry, base: Entry | None) -> str:
    """A figure of ``entry`` against the same figure of ``base`` (``1.3``), ``n/a`` where either is missing."""
    mine, theirs = read(entry), None if base is None or base.na else read(base)
    return "n/a" if mine is None or not theirs else f"{mine / theirs:.1f}"


def output_of(entry: Entry | None, call: str):
    """The output ``entry`` kept of ``call``; None where there is none."""
    return None if entry is None or entry.na else entry.outputs.get(call)


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
        row.append(of_model(entry.rank_bytes, model_bytes, 3) if entry.rank_bytes else "n/a")
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


def ratios_section(entries: list[Entry], figures: list[Figure]) -> str:
    """The ratio tables under their heading."""
    tables = "\n\n".join(markdown_table(header, rows) for header, rows in ratio_tables(entries, figures))
    return (
        "### Ratios\n\nEach table: the row way's figure divided by the column way's (below 1: the row way is "
        "faster or smaller).\n\n" + tables
    )


def spread_table(entries: list[Entry], calls) -> str:
    """p25 - p75 of each call's timed calls, and how many there were, per way."""
    header = ["way", *(f"{name} ms" for name in calls), "timed calls"]
    rows = [[e.way, *(spread_ms(e.times.get(name, [])) for name in calls),
             " / ".join(str(len(e.times.get(name, []))) for name in calls)] for e in entries if not e.na]  # fmt: skip
    return markdown_table(header, rows)


def collectives_table(entries: list[Entry]) -> str:
    """The collectives of one forward per way: by op, in the first layer, and the ``torch.distributed`` calls."""
    header = ["way", "counted by", "per forward, by op", "in layer 0, by op", "torch.distributed.* calls"]
    rows = [
        [
            e.way,
            f"`{e.collectives['counted_by']}`",
            ", ".join(f"{op} x{k}" for op, k in e.collectives["by_op"].items()) or "none",
            ", ".join(f"{op} x{k}" for op, k in e.collectives["layer0_by_op"].items()) or "none",
            str(e.collectives["dist_calls"]),
        ]
        for e in entries
        if not e.na and e.collectives
    ]
    return markdown_table(header, rows)


def loading_table(entries: list[Entry], loaded_by: dict[str, str]) -> str:
    """How each way loaded: by what (``loaded_by[way]``), the attention, its ranks' start, ready time, peak and
    floor."""
    header = ["way", "loaded by", "attention", "ranks started s", "ready s", "peak while loading MiB", "floor MiB"]
    rows = [
        [
            e.way,
            loaded_by[e.way],
            e.attn or "n/a",
            fmt(e.start_s, ".1f") if e.start_s is not None else ("in ready s" if e.way.endswith("()") else "-"),
            fmt(e.ready_s, ".1f"),
            fmt(e.load_peak and e.load_peak / MIB, ".0f"),
            fmt(e.floor and e.floor / MIB, ".0f"),
        ]
        for e in entries
        if not e.na
    ]
    return markdown_table(header, rows)


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


# -- a result made of parts ------------------------------------------------------------------------------


@dataclass
class PartedResult:
    """A result whose parts each add a section: written in the order of ``order`` with the notes last, rewritten
    after each part (a run cut short keeps what it had). ``chart()``: a section after the header, or None."""

    name: str
    title: str
    order: tuple[str, ...]
    backend: str
    note: str | None
    output: str | None
    chart: Callable[[PartedResult], str | None] = lambda result: None
    header: str = ""
    sections: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    entries: dict[str, list[Entry]] = field(default_factory=dict)  # what each part's ways measured
    figures: dict[str, dict] = field(default_factory=dict)  # what a part keeps for another part's section

    def add(self, name: str, text: str) -> None:
        self.sections[name] = text
        print("\n" + text.replace("**", ""), flush=True)
        self.write()

    def write(self) -> None:
        chart = self.chart(self)
        sections = [self.header, *([chart] if chart is not None else [])]
        sections += [self.sections[name] for name in self.order if name in self.sections]
        if self.notes:
            sections.append("## Notes\n\n" + "\n".join(f"- {note}" for note in self.notes))
        write_result(self.name, self.title, sections, self.backend, self.note, self.output)

    def run_parts(self, parts: list[str], run: Callable[[str], None], budget: float | None, started: float):
        """``run(part)`` for each part in turn; a part not started within ``budget`` seconds of ``started`` is
        skipped (a note says so), one that raises is a failure (returned) and the others go on."""
        failures = []
        for part in parts:
            elapsed = time.perf_counter() - started
            if budget is not None and elapsed > budget:
                self.notes.append(f"part `{part}` skipped: {elapsed:.0f} s spent of the --budget of {budget:.0f} s")
                continue
            print(f"\n== {part} ({elapsed:.0f} s in)", flush=True)
            try:
                run(part)
            except Exception as error:
                failures.append(f"part `{part}` failed: {first_line(error)}")
                traceback.print_exc()
        return failures
