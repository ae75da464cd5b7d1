"""Functions that tests/parallel/test_layers.py sends to RankPool workers (importable there via pytest's pythonpath)."""

from __future__ import annotations

import torch


def bound_forward(context, modules, inputs):
    """This rank's ``modules[rank]`` (split on the caller, so its class travelled by value), bound to the
    pool's group with :func:`tpcore.parallel.layers.bind_group`, run on ``inputs[rank]``: the output, tpcore's
    collectives during the forward, and the module's ``vocab_start`` (``None`` if it has none)."""
    from tpcore.parallel.comm import count_collectives
    from tpcore.parallel.layers import bind_group

    module = modules[context.rank]
    bind_group(module, context.tp_group)
    with count_collectives() as counts, torch.inference_mode():
        out = module(*inputs[context.rank])
    return out, dict(counts), getattr(module, "vocab_start", None)
