"""The caller's torch threads while CPU ranks of this host compute.

The ranks of a CPU pool take the host's cores between them (``cores // N`` intra-op threads each). The
caller's process keeps torch's default of one intra-op thread per core, and in ``generate()`` it works
between the ranks' steps (logits processors, the next token over the vocabulary): a parallel region there
wakes threads that then contend with the ranks for the same cores, so every rank's step waits on a core
(twice the decode time per token, measured on 2 cores). :class:`OneThreadWhileServing` gives the caller one
intra-op thread for the span of a served ``generate()`` and sets its own value back after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["OneThreadWhileServing"]


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
