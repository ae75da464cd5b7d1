"""Timing, in the caller and on the ranks: timed calls, the order of interleaved rounds, and the figures made of
the seconds (medians, quartiles, ranges, ms per new token).

Its functions also run on the ranks: they travel by value, as a script's own functions do (a rank imports nothing
of bench/).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def timed_calls(call: Callable, warmup: int, repeats: int, device=None) -> tuple[list[float], object]:
    """``call()`` ``warmup + repeats`` times back to back: the seconds of each of the last ``repeats``, and the
    last output. On a CUDA ``device`` the queued kernels are waited for before and after each call."""
    import torch

    cuda = device is not None and device.type == "cuda"
    times, output = [], None
    for i in range(warmup + repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        output = call()
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, output


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Each call's seconds from every rank's list of them: a call takes as long as its slowest rank."""
    return [max(ranks) for ranks in zip(*per_rank, strict=True)]


def rotated(ways: Sequence, number: int) -> list:
    """The order of round ``number``: who goes first rotates, so that load drifting over the rounds hits all alike."""
    first = number % max(1, len(ways))
    return [*ways[first:], *ways[:first]]


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def spread_ms(seconds: list[float], digits: int = 1, method: str = "inclusive") -> str:
    """``p25 - p75`` in ms (``inclusive``: interpolated within the samples, so also right for a handful of them)."""
    if len(seconds) < 2:
        return f"{seconds[0] * 1e3:.{digits}f}" if seconds else "n/a"
    q1, _, q3 = statistics.quantiles(seconds, n=4, method=method)
    return f"{q1 * 1e3:.{digits}f} - {q3 * 1e3:.{digits}f}"


def median_range(values: list[float]) -> str:
    """``median (min-max)``, of ratios: ``1.095 (1.014-1.386)``."""
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def per_token_ms(long: list[float], short: list[float], new_tokens: int) -> float:
    """ms per new token from the seconds of ``generate()`` with ``new_tokens`` and with 1 new token: the difference
    of their medians over ``new_tokens - 1`` (the prefill cancels out)."""
    return (statistics.median(long) - statistics.median(short)) / (new_tokens - 1) * 1e3
