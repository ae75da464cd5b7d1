"""Functions that tests send to RankPool workers (importable by the spawned ranks via pytest's pythonpath)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist


def whoami(context):
    return context.rank, context.world_size, os.getpid()


def all_reduce_sum(context, value):
    tensor = torch.tensor([float(value + context.rank)])
    dist.all_reduce(tensor, group=context.group)
    return tensor.item()


def raise_on(context, rank, message):
    if context.rank == rank:
        raise KeyError(message)
    return context.rank


def kill_on(context, rank):
    if context.rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def sleep(context, seconds):
    time.sleep(seconds)
    return context.rank


def raise_or_reduce(context, rank):
    """``rank`` raises; the others wait for it in an all-reduce that never completes."""
    if context.rank == rank:
        raise ValueError("bad input on one rank")
    all_reduce_sum(context, 0)


def environment_variable(context, name):
    """The value of ``name`` in this rank's environment (``None`` if unset)."""
    return os.environ.get(name)


def parameter_shapes(context):
    """``{name: shape}`` of the model a ``parallelize()`` rank serves."""
    return {name: tuple(p.shape) for name, p in context.store["model"].named_parameters()}
