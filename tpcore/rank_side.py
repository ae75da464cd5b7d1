"""What runs on a rank of a parallelized model: receiving or reading its shard, keeping it, serving calls.

Each function is sent to every rank by the caller (:class:`~tpcore.ranks.process.RankPool` ``run`` or
``scatter``) and runs there with the rank's :class:`~tpcore.ranks.worker.RankContext`; the model a rank
keeps lives in ``context.store["model"]``.
"""

from __future__ import annotations

import logging
import resource
import time
from contextlib import nullcontext

import torch
from torch import nn

from tpcore.load.checkpoint import Checkpoint, Read
from tpcore.load.precision import cast_model
from tpcore.load.skeleton import install_tensors, named_tensors, register_output_recording
from tpcore.parallel import memfd
from tpcore.parallel.layers import bind_group
from tpcore.plan import format_bytes
from tpcore.progress import ByteCounter
from tpcore.ranks.process import RankContext
from tpcore.ranks.rng import RandomState, device_generator
from tpcore.ranks.transfer import to_cpu, to_device

__all__ = ["keep", "load_shard", "memory", "memory_detail", "read_shard", "serve"]

logger = logging.getLogger("tpcore.parallelize")


def load_shard(context: RankContext, skeleton: nn.Module, metas: list, dtype) -> int:
    """On a rank: receive this rank's tensors, give them to the (already split) meta skeleton, keep it."""
    received = context.receive_tensors([(shape, tensor_dtype) for _, shape, tensor_dtype in metas])
    tensors = {name: tensor for (name, _, _), tensor in zip(metas, received, strict=True)}
    del received
    install_tensors(skeleton, tensors)
    return keep(context, skeleton, dtype)


def read_shard(context: RankContext, skeleton: nn.Module, directory: str, reads: list[Read], dtype) -> int:
    """On a rank: read this rank's slices from the checkpoint, onto its device, into the (already split)
    meta skeleton, keep it; the caller is told the bytes read as they grow."""
    started = time.monotonic()
    counter = ByteCounter(context.report_progress)
    Checkpoint(directory).load_into(
        skeleton, reads, context.rank, context.world_size, context.device, dtype, progress=counter
    )
    counter.close()
    logger.info("read %s in %.1f s", format_bytes(counter.count), time.monotonic() - started)
    return keep(context, skeleton, dtype)


def keep(context: RankContext, skeleton: nn.Module, dtype) -> int:
    """On a rank: bind the filled skeleton to this rank, move it to the device and keep it for calls."""
    bind_group(skeleton, context.group)
    skeleton.eval().requires_grad_(False)
    if dtype is not None:
        cast_model(skeleton, dtype)
    model = skeleton.to(context.device)
    register_output_recording(model)
    context.store["model"] = model
    return sum(t.numel() * t.element_size() for t in named_tensors(model).values())


def serve(context: RankContext, method: str, args: tuple, kwargs: dict, random_state: RandomState):
    """On a rank: run ``model.<method>`` with the caller's random state; rank 0 returns the result
    (on the CPU) and its random state."""
    model = context.store["model"]
    generator = device_generator(context.device)
    random_state.apply(generator)
    # Rank 0's forward gathers its outputs (the logits) into shared memory that the caller maps: no copy.
    shared = memfd.gathered_outputs_shared() if context.rank == 0 and method == "forward" else nullcontext()
    with torch.inference_mode(), shared:
        output = getattr(model, method)(*to_device(args, context.device), **to_device(kwargs, context.device))
    return (to_cpu(output), RandomState.of(generator)) if context.rank == 0 else None


def memory(context: RankContext) -> dict[str, int]:
    """On a rank: tensor bytes, current and peak resident bytes (CUDA: the allocator's figures)."""
    model = context.store["model"]
    tensor_bytes = sum(t.numel() * t.element_size() for t in named_tensors(model).values())
    if context.device.type == "cuda":
        return {
            "allocated": torch.cuda.memory_allocated(context.device),
            "reserved": torch.cuda.memory_reserved(context.device),
            "peak": torch.cuda.max_memory_allocated(context.device),
            "tensors": tensor_bytes,
        }
    return {
        "allocated": tensor_bytes,
        "reserved": _status_bytes("VmRSS"),
        "peak": _status_bytes("VmHWM"),  # not ru_maxrss: Linux carries the parent's peak across exec
        "tensors": tensor_bytes,
    }


def memory_detail(context: RankContext) -> str:
    """On a rank: the CUDA allocator's summary, or on CPU the resident, peak resident and tensor bytes."""
    if context.device.type == "cuda":
        return "CUDA allocator summary\n" + torch.cuda.memory_summary(context.device)
    figures = memory(context)
    return (
        f"resident {figures['reserved'] / 2**20:.1f} MiB (VmRSS), peak {figures['peak'] / 2**20:.1f} MiB "
        f"(VmHWM), tensors {figures['tensors'] / 2**20:.1f} MiB"
    )


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``: resident now, ``VmHWM``: peak resident)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: best effort
