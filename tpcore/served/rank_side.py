"""What runs on a rank of a parallelized model: receiving or reading its shard, keeping it, serving calls.

Each function is sent to every rank by the caller (:class:`~tpcore.ranks.process.RankPool` ``run`` or
``scatter``) and runs there with the rank's :class:`~tpcore.ranks.worker.RankContext`; the model a rank
keeps lives in ``context.store["model"]``, its half of the per-call state in ``context.store["state"]``
(:class:`~tpcore.served.call.RankState`). The lookahead (:mod:`tpcore.served.lookahead`) wraps :func:`serve` and
the functions that use the caches.
"""

from __future__ import annotations

import ctypes
import logging
import resource
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tpcore.load.checkpoint import Checkpoint, Read
from tpcore.load.precision import cast_model
from tpcore.load.skeleton import install_tensors, named_tensors, register_output_recording
from tpcore.parallel import memfd
from tpcore.parallel.cpu_layout import lay_out, linear_weight_names, transpose_linear_weights
from tpcore.parallel.layers import bind_group
from tpcore.parallel.quantized_linear import QuantizedLayer, localize_quantized, ready_quantized
from tpcore.plan import ShardPlan, apply_plan, format_bytes
from tpcore.progress import ByteCounter
from tpcore.ranks.process import RankContext
from tpcore.ranks.transfer import to_cpu, to_device
from tpcore.served.caches import CacheState
from tpcore.served.call import Call, Forward, RankState, reporting_rank

__all__ = [
    "cache_tensors",
    "keep",
    "load_shard",
    "memory",
    "memory_detail",
    "mutate_cache",
    "rank_state",
    "read_shard",
    "serve",
    "shard_tensors",
    "shared_outputs",
]

logger = logging.getLogger("tpcore.parallelize")


def own_skeleton(context: RankContext, skeleton: nn.Module, plan: ShardPlan | None) -> nn.Module:
    """On a rank: the meta ``skeleton`` split for this rank: as sent where ``plan`` is ``None`` (split by the caller),
    else split here by ``plan``."""
    return skeleton if plan is None else apply_plan(plan, skeleton, context.rank)


def load_shard(context: RankContext, skeleton: nn.Module, plan: ShardPlan | None, metas: list, dtype) -> int:
    """On a rank: receive this rank's tensors, give them to its split meta skeleton (:func:`own_skeleton`), keep
    it."""
    skeleton = own_skeleton(context, skeleton, plan)
    received = context.receive_tensors([(shape, tensor_dtype) for _, shape, tensor_dtype in metas])
    tensors = {name: tensor for (name, _, _), tensor in zip(metas, received, strict=True)}
    del received
    install_tensors(skeleton, tensors)
    return keep(context, skeleton, dtype)


def read_shard(
    context: RankContext, skeleton: nn.Module, plan: ShardPlan | None, directory: str, reads: list[Read], dtype
) -> int:
    """On a rank: read this rank's slices from the checkpoint, onto its device, into its split meta skeleton
    (:func:`own_skeleton`), keep it; the caller is told the bytes read as they grow."""
    started = time.monotonic()
    skeleton = own_skeleton(context, skeleton, plan)
    counter = ByteCounter(context.report_progress)
    Checkpoint(directory).load_into(
        skeleton, reads, context.rank, context.world_size, context.device, dtype, progress=counter,
        lay_out=lay_out, laid_out=linear_weight_names(skeleton),
    )  # fmt: skip
    counter.close()
    logger.info("read %s in %.1f s", format_bytes(counter.count), time.monotonic() - started)
    return keep(context, skeleton, dtype)


def keep(context: RankContext, skeleton: nn.Module, dtype) -> int:
    """On a rank: bind the filled skeleton to this rank, move it to the device and keep it for calls."""
    bind_group(skeleton, context.tp_group)
    localize_quantized(skeleton, context.rank, context.world_size)
    skeleton.eval().requires_grad_(False)
    if dtype is not None:
        cast_model(skeleton, dtype)
    model = skeleton.to(context.device)
    ready_quantized(model)
    transpose_linear_weights(model)  # CPU weights only
    _return_free_heap()
    register_output_recording(model)
    context.store["model"] = model
    return sum(t.numel() * t.element_size() for t in named_tensors(model).values())


def _return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing): the buffers a
    load read through, cast or laid out and freed stay resident otherwise, as holes between the tensors kept (a
    SmolLM2-shaped rank held 465-595 MiB from one load to the next, 420-455 with them returned)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return
    trim(0)


def rank_state(context: RankContext) -> RankState:
    """This rank's half of the per-call state (made at its first served call)."""
    state = context.store.get("state")
    if state is None:
        state = context.store["state"] = RankState()
    return state


def shared_outputs(context: RankContext) -> Callable[[], AbstractContextManager]:
    """Where this rank's outputs go: rank 0 gathers its outputs (the logits) into shared memory, which the caller
    reads (a CUDA rank copies them there): no copy through the socket, no new segment per call."""
    return memfd.gathered_outputs_shared if context.rank == 0 else nullcontext


def serve(context: RankContext, call: Call, compute: Callable[[Forward], Any] | None = None):
    """On a rank: run the call with the caller's random state and its config (``compute``: how the resolved
    forward gives its output; by default it runs). Rank 0 returns the output (on the CPU, each cache as its id); the
    :func:`~tpcore.served.call.reporting_rank` returns its random state and the state of each cache sent or output
    (``(output, random state, states)`` from a rank that is both)."""
    state = rank_state(context)
    forward = state.resolve(call, context.store["model"], context.device)
    with torch.inference_mode(), shared_outputs(context)():
        output = forward.run() if compute is None else compute(forward)
        output = state.caches.report(output)
        output = gather_attentions(output, context.tp_group)
        output = to_cpu(output) if context.rank == 0 else None
    if context.rank != reporting_rank(context.world_size):
        return output
    report = state.report(call, forward)
    return (output, *report) if context.rank == 0 else report


def gather_attentions(output: Any, group: Any) -> Any:
    """``output`` with every attention map (``attentions``, ``cross_attentions``, ... ``(batch, heads, q, k)``)
    holding every head, in order: each rank's heads (a contiguous run, in rank order) gathered; a map every
    rank holds whole (of a part left unsplit) is kept as it is. Only when the caller asked for attentions."""
    if not isinstance(output, dict):
        return output
    keys = [key for key in output if key.endswith("attentions") and isinstance(output[key], tuple)]
    if not keys or group is None or dist.get_world_size(group) == 1:
        return output
    for key in keys:
        output[key] = tuple(_every_head(attention, group) for attention in output[key])
    return output


def _every_head(attention: Any, group: Any) -> Any:
    if not isinstance(attention, torch.Tensor) or attention.dim() < 2:
        return attention
    pieces: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, attention.cpu(), group=group)
    if all(piece.shape == attention.shape and torch.equal(piece, pieces[0]) for piece in pieces):
        return attention  # every rank holds every head of it
    return torch.cat(pieces, dim=1).to(attention.device)


def shard_tensors(context: RankContext, names: list[str]) -> dict[str, torch.Tensor]:
    """On a rank: its parts of the tensors ``names`` (first names) as the files store them, on the CPU."""
    model = context.store["model"]
    tensors = named_tensors(model)
    return {name: _as_stored(model, name, tensors[name]).detach().cpu() for name in names}


def _as_stored(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``name`` of ``model``) as stored: a quantized layer gives back what a kernel laid out otherwise."""
    path, _, attribute = name.rpartition(".")
    owner = model.get_submodule(path)
    return owner.as_stored(attribute) if isinstance(owner, QuantizedLayer) else tensor


def mutate_cache(context: RankContext, cache_id: int, part: str | None, method: str, args: tuple) -> CacheState | None:
    """On a rank: run ``method`` of the cache ``cache_id`` (its ``part``); rank 0 returns its state after."""
    with torch.inference_mode():
        state = rank_state(context).caches.mutate(cache_id, part, method, to_device(args, context.device))
    return state if context.rank == 0 else None


def cache_tensors(context: RankContext, cache_id: int, part: str | None) -> list[tuple[Any, Any]]:
    """On a rank: its heads of each layer's ``(keys, values)`` of the cache ``cache_id`` (its ``part``), on the CPU."""
    return to_cpu(rank_state(context).caches.tensors(cache_id, part))


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
