"""A process's memory, in the caller and on the ranks (Linux: ``/proc``): its RSS and peak RSS, the peak reset,
RSS sampled from a thread while something runs, freed heap handed back; a model's tensor bytes and the CUDA
allocator's figures in their place on a GPU; what a process leaves behind (``/dev/shm`` entries, children).

Its functions also run on the ranks, sent by value once :func:`send_by_value` has run.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import threading
import time

from _common import MIB


def send_by_value() -> None:
    """Let this module's functions travel to the ranks by value, as a script's own do: a rank then imports nothing
    of bench/, and its memory is what it was with them in the script. (Not on import: cloudpickle's own modules
    would weigh on the RSS memory.py reads at its start.)"""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def proc_status(context=None) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process in bytes (``context``: also run on a rank as it is)."""
    figures = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                figures[key] = int(value.split()[0]) * 1024
    return figures


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def settle() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), so that RSS shows what is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RssSampler:
    """Samples this process's ``VmRSS`` every ``interval`` seconds in a daemon thread; keeps the max."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status()["VmRSS"])
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_status()["VmRSS"])


class PeakAbove:
    """This process's peak RSS while inside, above its RSS on entry: ``sampled`` (:class:`RssSampler`) and
    ``by_hwm`` (``VmHWM``, reset on entry where ``hwm_reset``), with the ``seconds`` inside."""

    def __enter__(self) -> PeakAbove:
        self.before = proc_status()["VmRSS"]
        self.hwm_reset = reset_peak()
        self.started = time.perf_counter()
        self.sampler = RssSampler().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.__exit__(*exc)
        self.seconds = time.perf_counter() - self.started
        hwm = proc_status()["VmHWM"]
        self.sampled = self.sampler.peak - self.before
        self.by_hwm = hwm - self.before


def tensor_bytes(model) -> int:
    """Bytes of the parameters and buffers this process holds (a DTensor counts its local shard)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            total += local.numel() * local.element_size()
    return total


def reset_peaks(device) -> int:
    """Start measuring a peak here; returns the floor: the CUDA allocator's bytes on a GPU, else this process's RSS."""
    import torch

    settle()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    reset_peak()
    return proc_status()["VmRSS"]


def peak(device) -> int:
    """The peak since :func:`reset_peaks`: the CUDA allocator's on a GPU, else ``VmHWM``."""
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else proc_status()["VmHWM"]


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def child_pids() -> list[int]:
    """Live (not zombie) child processes of this process, from /proc."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            children.append(int(entry))
    return children


def mib(value: float) -> str:
    return f"{value / MIB:.1f}"


def of_model(value: float, model_bytes: int, digits: int = 2) -> str:
    """``MiB (x model)``: ``12.3 (0.25x)``."""
    return f"{mib(value)} ({value / model_bytes:.{digits}f}x)"
