"""The load bar: one bar over the bytes every rank has loaded, drawn on a terminal only, off with transformers'
switches."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest
from output_probes import bar_states, on_terminal

from tpcore.progress import LoadBar

MIB = 2**20


def load(ranks: int = 2) -> None:
    """What ``parallelize()`` shows while ``ranks`` ranks start, then load 3 MiB between them."""
    with LoadBar(3 * MIB, f"tpcore: {ranks} ranks starting") as bar:
        bar.loading(f"tpcore: {ranks} ranks loading")
        bar.rank_loaded(0, MIB)
        bar.rank_loaded(1, MIB)
        bar.rank_loaded(0, 2 * MIB)  # running counts: rank 0's second report adds 1 MiB, not 2
        bar.done(f"tpcore: {ranks} ranks loaded")


def test_on_a_terminal_the_bar_counts_every_ranks_bytes_with_the_rank_count_and_rate():
    with on_terminal() as screen:
        load()
    text = screen.getvalue()
    assert bar_states(text, "tpcore: 2 ranks starting")[0].startswith("tpcore: 2 ranks starting:   0%|")
    assert "0.00/3.00M" in bar_states(text, "tpcore: 2 ranks loading")[0]
    final = bar_states(text, "tpcore: 2 ranks loaded")[-1]
    assert final.startswith("tpcore: 2 ranks loaded: 100%|") and "| 3.00M/3.00M [" in final and "B/s]" in final
    assert text.endswith("\n")  # the finished bar stays on its line


def test_where_stderr_is_no_terminal_the_bar_stays_out_of_the_log(monkeypatch):
    log = io.StringIO()  # a CI log: no terminal
    with on_terminal():
        monkeypatch.setattr(sys, "stderr", log)
        load()
    assert log.getvalue() == ""


def test_transformers_switch_turns_the_bar_off():
    from transformers.utils import logging as transformers_logging

    with on_terminal() as screen:
        transformers_logging.disable_progress_bar()  # on_terminal puts it back as it was
        load()
    assert screen.getvalue() == ""


@pytest.mark.slow  # a fresh interpreter: transformers reads HF_HUB_DISABLE_PROGRESS_BARS when it is imported
def test_hf_hub_disable_progress_bars_turns_the_bar_off():
    code = textwrap.dedent(
        """
        import io, sys
        class Terminal(io.StringIO):
            def isatty(self):
                return True
        sys.stderr = screen = Terminal()
        from tpcore.progress import LoadBar
        with LoadBar(100, "tpcore: 2 ranks loading") as bar:
            bar.done("tpcore: 2 ranks loaded")
        sys.__stdout__.write(repr(screen.getvalue()))
        """
    )
    shown = {}
    for value in ("1", None):
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
        if value is not None:
            env["HF_HUB_DISABLE_PROGRESS_BARS"] = value
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        shown[value] = result.stdout
    assert shown["1"] == "''" and "tpcore: 2 ranks loaded: 100%" in shown[None]


def test_the_bar_and_tpcore_s_records_leave_the_multiprocessing_start_method_unset():
    """tqdm's first bar (shown or not) or ``tqdm.write`` (how tpcore prints a record while tqdm is loaded) makes a
    process lock, and ``multiprocessing.RLock()`` fixed the global start method: ``set_start_method()`` then raised
    "context has already been set". In a fresh interpreter (nothing has set it yet), a warning printed as during
    ``parallelize()`` and a bar shown on a terminal leave it unset, and tqdm keeps a process lock of the same kind."""
    code = textwrap.dedent(
        """
        import io, multiprocessing, sys
        class Terminal(io.StringIO):
            def isatty(self):
                return True
        sys.stderr = screen = Terminal()
        import logging, tqdm
        from tpcore.progress import LoadBar
        logging.getLogger("tpcore.plan").warning("most of the model stays whole")
        with LoadBar(100, "tpcore: 2 ranks loading") as bar:
            bar.done("tpcore: 2 ranks loaded")
        from tqdm.std import TqdmDefaultWriteLock, tqdm
        unset = multiprocessing.get_start_method(allow_none=True) is None
        multiprocessing.set_start_method("spawn")
        process_lock = TqdmDefaultWriteLock.mp_lock
        in_use = process_lock in tqdm.get_lock().locks
        print(unset, "tpcore: 2 ranks loaded: 100%" in screen.getvalue(), in_use and type(process_lock).__name__)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "RLock"]
