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
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tpcore.load.checkpoint import Checkpoint, Read
from tpcore.load.precision import cast_model
from tpcore.load.skeleton import install_tensors, named_tensors, register_output_recording
from tpcore.lookahead import Lookahead
from tpcore.parallel import memfd
from tpcore.parallel.layers import bind_group
from tpcore.plan import format_bytes
from tpcore.progress import ByteCounter
from tpcore.rank_cache import CacheRef, CacheState, RankCaches
from tpcore.ranks.process import RankContext
from tpcore.ranks.rng import RandomState, device_generator, same_state
from tpcore.ranks.transfer import to_cpu, to_device
from tpcore.resent import RankTensors

__all__ = [
    "Call",
    "cache_tensors",
    "keep",
    "load_shard",
    "memory",
    "memory_detail",
    "mutate_cache",
    "read_shard",
    "reporting_rank",
    "serve",
    "shard_tensors",
]

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


@dataclass(frozen=True)
class Call:
    """One served call: the forward of the model (or of its submodule at ``path``) on ``args`` and
    ``kwargs`` (caches as :class:`~tpcore.rank_cache.CacheRef`), with the caller's random state, the
    attributes of its config changed since the last call (``{sub-config path: {name: value}}``), the
    caches the caller dropped, and the kept tensors it dropped (:mod:`tpcore.resent`)."""

    path: str
    args: tuple
    kwargs: dict
    random_state: RandomState
    config_changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    freed: tuple[int, ...] = ()
    method: str = ""  # a method of that module instead of its forward (a multimodal encoder's get_image_features)
    tensors_freed: tuple[int, ...] = ()


def reporting_rank(world_size: int) -> int:
    """The rank that tells the caller the state of the caches and the random state after a served call: the last,
    which does that while rank 0 sends the output (one rank alone: rank 0, which does both)."""
    return world_size - 1


def serve(context: RankContext, call: Call):
    """On a rank: run the call with the caller's random state and its config. Rank 0 returns the output (on the CPU,
    each cache as its id); the :func:`reporting_rank` returns its random state and the state of each cache sent
    or output (``(output, random state, states)`` from a rank that is both). A decode step is answered from the
    step guessed after the last call when it is that one, and leaves the next guess to run (:mod:`tpcore.lookahead`)."""
    model = context.store["model"]
    caches = context.store.setdefault("caches", RankCaches())
    lookahead = _lookahead(context)
    shaped = lookahead.shape(call, model)
    guessed = lookahead.take(call, shaped)
    caches.free(call.freed)
    kept = context.store.setdefault("kept", RankTensors())
    kept.free(call.tensors_freed)
    apply_config_changes(model, call.config_changes)
    generator = device_generator(context.device)
    call.random_state.apply(generator)
    # the reporting rank tells the caller whether the CPU generator moved; a guess needs both generators still
    cpu_before, cuda_before = torch.get_rng_state(), None if generator is None else generator.get_state()
    inputs = (call.args, call.kwargs)  # on the CPU, as they arrived
    if context.device.type != "cpu":
        inputs = to_device(inputs, context.device)
    args, kwargs = caches.resolve(kept.resolve(inputs))
    target = model.get_submodule(call.path) if call.path else model
    if call.method:
        target = getattr(target, call.method)
    # Rank 0 gathers its outputs (the logits) into shared memory, which the caller reads (a CUDA rank copies them
    # there): no copy through the socket, no new segment per call.
    shared = memfd.gathered_outputs_shared if context.rank == 0 else nullcontext
    with torch.inference_mode(), shared():
        output = guessed if guessed is not None else target(*args, **kwargs)
        if lookahead.predict(shaped, output, caches, model, partial(_random_moved, cpu_before, generator, cuda_before)):
            context.idle_work = partial(lookahead.run, model, caches, context.device, shared)
        output = caches.report(output)
        output = gather_attentions(output, context.group)
        output = to_cpu(output) if context.rank == 0 else None
    if context.rank != reporting_rank(context.world_size):
        return output
    sent = {ref.id for ref in _refs((call.args, call.kwargs))}
    report = RandomState.of(generator, cpu_before), caches.states(sent)
    return (output, *report) if context.rank == 0 else report


def _lookahead(context: RankContext) -> Lookahead:
    """This rank's :class:`~tpcore.lookahead.Lookahead` (made at its first served call)."""
    lookahead = context.store.get("lookahead")
    if lookahead is None:
        lookahead = context.store["lookahead"] = Lookahead()
    return lookahead


def _random_moved(cpu_before: torch.Tensor, generator: torch.Generator | None, cuda_before: Any) -> bool:
    """Whether the forward just run drew from the CPU generator or from the rank's CUDA ``generator``."""
    if not same_state(torch.get_rng_state(), cpu_before):
        return True
    return generator is not None and not same_state(generator.get_state(), cuda_before)


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
    """On a rank: its parts of the tensors ``names`` (first names), on the CPU."""
    tensors = named_tensors(context.store["model"])
    return {name: tensors[name].detach().cpu() for name in names}


def mutate_cache(context: RankContext, cache_id: int, part: str | None, method: str, args: tuple) -> CacheState | None:
    """On a rank: run ``method`` of the cache ``cache_id`` (its ``part``); rank 0 returns its state after."""
    caches = context.store.setdefault("caches", RankCaches())
    _lookahead(context).drop()
    with torch.inference_mode():
        state = caches.mutate(cache_id, part, method, to_device(args, context.device))
    return state if context.rank == 0 else None


def cache_tensors(context: RankContext, cache_id: int, part: str | None) -> list[tuple[Any, Any]]:
    """On a rank: its heads of each layer's ``(keys, values)`` of the cache ``cache_id`` (its ``part``), on the CPU."""
    _lookahead(context).drop()
    return to_cpu(context.store.setdefault("caches", RankCaches()).tensors(cache_id, part))


def apply_config_changes(model: nn.Module, changes: dict[str, dict[str, Any]]) -> None:
    """Set the caller's changed config attributes on this rank's model config (and its sub-configs, by path)."""
    for path, attributes in changes.items():
        config = model.config
        for name in path.split(".") if path else []:
            config = getattr(config, name)
        for name, value in attributes.items():
            setattr(config, name, value)


def _refs(value: Any):
    if isinstance(value, CacheRef):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _refs(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _refs(item)


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
