"""What several scripts run on the ranks of a ``RankPool`` (``pool.run(function, ...)``): a seeded model split
there with ``ParallelEngine`` and kept, marks of each forward of a kept model, the rank's scheduling policy.

These functions travel by value, as a script's own functions do (a rank imports nothing of bench/).
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def load_split(context, spec, key: str = "bench_model", **engine) -> int:
    """Build the seeded model of ``spec``, split it over the pool's group (``engine``: more ``ParallelEngine``
    options), keep it under ``key``; its parameter count."""
    from tpcore import ParallelEngine

    model = spec.build()
    ParallelEngine(context.world_size, context.backend, process_group=context.tp_group, **engine).parallelize(model)
    context.store[key] = model
    return sum(p.numel() for p in model.parameters())


def mark_forwards(context, key: str) -> None:
    """Keep the wall time at the start and end of each forward of the model ``context.store[key]``."""
    marks = context.store["forward marks"] = []
    model = context.store[key]
    model.register_forward_pre_hook(lambda *_: marks.append(time.perf_counter()))
    model.register_forward_hook(lambda *_: marks.append(time.perf_counter()))


def forward_spans(context) -> list[tuple[float, float]]:
    """Each forward's ``(start, end)`` since the last call (:func:`mark_forwards`); taken, so the next call starts
    afresh."""
    marks = context.store["forward marks"]
    spans = list(zip(marks[0::2], marks[1::2], strict=True))
    marks.clear()
    return spans


def schedule_rank(context, policy: int) -> None:
    """``policy`` (``os.SCHED_BATCH``, ``os.SCHED_OTHER``) for each of this rank's threads."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(thread), policy, os.sched_param(0))
        except OSError:  # a thread that has just ended
            pass
