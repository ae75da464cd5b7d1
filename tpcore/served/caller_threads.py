"""The caller's torch threads while the ranks compute.

In a served ``generate()`` the caller works between the ranks' steps (logits processors, the next token over
the vocabulary), a few small operations per token, each a parallel region under torch's default of one
intra-op thread per core. With CPU ranks, which take the host's cores between them (``cores // N`` threads
each), the woken threads contend with the ranks for the same cores and every rank's step waits on a core
(twice the decode time per token, measured on 2 cores). With CUDA ranks nothing contends, yet the threads,
asleep through each step, are woken for every region: on 16 cores with one H200 (``bench/generation.py
--device cuda --ranks 1``) one thread gave 17.1 ms/token at batch 8 against 18.3 with 16, and a bare decode
step's overhead 2.0 ms against 4.4. :class:`OneThreadWhileServing` gives the caller one intra-op thread for
the span of a served ``generate()`` and sets its own value back after.

A thread that hands the model's work to another thread (``tpcore serve``'s engine) gives up its own OpenMP
workers first (:func:`release_openmp_workers`): GNU OpenMP keeps a pool of workers per thread that has run a
parallel region, and once the pools hold more threads than there are cores, every pool's workers stop spinning
between regions and sleep, and each region pays their wake-up. A model stepped in a second thread of a process
whose main thread had run torch on 2 threads took 1.2-2x the main thread's time per decode step (the whole
SmolLM2-shaped model, batch 4, 2 cores); with the main thread's pool released, about the same.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["OneThreadWhileServing", "release_openmp_workers"]

#: ``omp_pause_hard`` of OpenMP 5.0's ``omp_pause_resource_all``: free the calling thread's workers
_OMP_PAUSE_HARD = 2


def release_openmp_workers() -> bool:
    """Free the OpenMP worker threads the calling thread holds (``omp_pause_resource_all``; a later parallel
    region of this thread makes them again); whether the OpenMP runtime did."""
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):  # no OpenMP runtime loaded with global symbols, or one before OpenMP 5.0
        return False
    return pause(_OMP_PAUSE_HARD) == 0


class OneThreadWhileServing:
    """A context: torch's intra-op threads set to 1 inside it (where ``enabled``), then set back.

    torch's setting is the calling thread's with some OpenMP runtimes and the process's with others, so
    each caller sets it on entry and sets its own earlier value back on exit, unless another caller has
    set it back already (the setting is no longer 1): overlapping callers leave it as they found it.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            if torch.get_num_threads() == 1:
                torch.set_num_threads(saved)
