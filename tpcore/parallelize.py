"""The one-line ``parallelize()``: a split model served from the caller's own process.

The caller keeps its model object and its one copy of the weights. Each rank is sent only its
own shard: the caller builds a weightless (meta) copy of the model, applies the policies to it,
and streams every rank the tensors it holds (its slices of the split tensors, the replicated
rest) as raw bytes, one tensor at a time, straight into the rank's own storage. ``forward``,
``__call__`` and ``generate`` of the caller's model are then served by the ranks; rank 0 sends
the outputs back as CPU tensors.

Started from a checkpoint directory instead of a model, the caller builds the model without
weights (parameters on the meta device) and each rank reads its own slices from the files: no
process ever holds the whole model.

Sampling stays in step: every call carries the caller's RNG state to all ranks, and the caller
takes rank 0's state back, so ``torch.manual_seed(s); model.generate(do_sample=True)`` draws what
the unsplit model draws with that seed, and the ranks never diverge.
"""

from __future__ import annotations

import copy
import functools
import os
import resource

import torch
from torch import nn

from tpcore.checkpoint import Checkpoint, Read, is_checkpoint_path
from tpcore.distributed import default_backend
from tpcore.layers import bind_group
from tpcore.process import CALL_TIMEOUT_S, START_TIMEOUT_S, RankContext, RankPool, WorkerDiedError, WorkerError, reraise
from tpcore.replacer import TensorReplacer
from tpcore.skeleton import (
    drop_output_capturing_hooks,
    empty_model,
    install_tensors,
    named_tensors,
    register_output_recording,
    weightless_copy,
)
from tpcore.slicer import Split, shard, shard_ranges
from tpcore.transfer import to_cpu, to_device

__all__ = ["ParallelHandle", "parallelize"]

_SERVED = ("forward", "generate")
_ADDED = ("deparallelize", "memory_allocated", "memory_reserved", "memory_cached", "memory_peak")


def parallelize(
    model: nn.Module | str | os.PathLike,
    num_gpus: int,
    fp16: bool = False,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
    custom_policies=None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    *,
    timeout: float = CALL_TIMEOUT_S,
    threads_per_rank: int | None = None,
    verbose: bool | str | None = None,
    init_method: str | None = None,
    daemon: bool | None = None,
    seed: int | None = None,
    model_class: type[nn.Module] | None = None,
    vocab_parallel: bool = True,
) -> nn.Module:
    """Split ``model`` over ``num_gpus`` local ranks and serve it from this process.

    Args:
        model: the model; it is not changed, only given served methods. Or the directory of a saved
            model (``save_pretrained``: safetensors, or pickle files read with ``weights_only``): then
            only the ranks hold weights, each its own slices read from the files, and the caller
            gets the model with its parameters on the meta device.
        num_gpus: number of ranks: GPUs with NCCL, CPU processes with gloo.
        fp16: run the ranks in ``torch.float16`` (``dtype`` for any other dtype).
        backend: ``"nccl"`` or ``"gloo"``; ``None`` is NCCL when CUDA is there, else gloo.
        custom_policies: a Policy class or a list; ``None`` uses the installed plugins.
        master_addr, master_port: rendezvous of the ranks; loopback and a free port by default.
        timeout: seconds any call may take before the ranks are presumed lost; starting the ranks
            gives up after ``min(timeout, 180)`` seconds.
        threads_per_rank: torch threads per CPU rank; the cores are split evenly by default.
        verbose: print each rank's memory once the model is loaded.
        init_method, daemon: accepted for compatibility; ranks are always fresh interpreters
            that end with the caller.
        seed: seed the caller's RNG first (the ranks follow the caller's RNG on every call).
        model_class: the class to build from a checkpoint (default: the one its config names).
        vocab_parallel: split the input and output embeddings over the vocabulary too.

    Returns:
        ``model`` itself, whose ``forward``/``__call__``/``generate`` now run on the ranks, with
        ``deparallelize()`` and memory queries added. Validation errors (no policy, sizes that
        do not divide, weights missing from a checkpoint) are raised before any process starts.
    """
    if seed is not None:
        torch.manual_seed(seed)
    if fp16 and dtype not in (None, torch.float16):
        raise ValueError(f"fp16=True contradicts dtype={dtype}")
    dtype = torch.float16 if fp16 else dtype
    if getattr(model, "_tpcore_handle", None) is not None:
        raise RuntimeError("this model is already parallelized; call model.deparallelize() first")
    checkpoint = None
    if is_checkpoint_path(model):
        checkpoint = Checkpoint(model)
        model = _model_without_weights(checkpoint, model_class)
    replacer = TensorReplacer(model, None, fp16, num_gpus, custom_policies, rank=0, vocab_parallel=vocab_parallel)
    plan = replacer.split_plan()  # validates: raises before any process starts
    if checkpoint is not None:
        reads = checkpoint.reads(model, plan)  # checks the files: a missing or truncated one fails here
        checkpoint.close()  # the caller keeps no file open while the ranks read
        skeleton = copy.deepcopy(model)  # weights on meta already; keeps the constructed buffers
        drop_output_capturing_hooks(skeleton)
    else:
        skeleton = weightless_copy(model)
    policies = replacer.custom_policies or None
    TensorReplacer(skeleton, None, fp16, num_gpus, policies, rank=0, vocab_parallel=vocab_parallel).replace_modules()
    backend = backend or default_backend()
    try:
        pool = RankPool(
            num_gpus,
            backend,
            master_addr=master_addr,
            master_port=master_port,
            threads_per_rank=threads_per_rank,
            start_timeout=min(timeout, START_TIMEOUT_S),
        )
        try:
            if checkpoint is not None:
                pool.run(_read_shard, skeleton, str(checkpoint.directory), reads, dtype, timeout=timeout)
            else:
                _send_shards(pool, model, skeleton, plan, dtype, timeout)
        except BaseException:
            pool.close(timeout=3.0)
            raise
    except WorkerError as error:  # a rank failed to start or to load: its own exception, its traceback as cause
        reraise(error)
    handle = ParallelHandle(model, pool, timeout)
    handle.attach()
    if verbose:
        for device, allocated in handle.memory_allocated().items():
            print(f"tpcore: {device} holds {allocated / 2**20:.1f} MiB")
    return model


def _model_without_weights(checkpoint: Checkpoint, model_class) -> nn.Module:
    """The checkpoint's model with its parameters on meta, and its generation config if one was saved."""
    model = empty_model(checkpoint.config(), model_class)
    if (checkpoint.directory / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(checkpoint.directory)
    return model


def _send_shards(pool: RankPool, model: nn.Module, skeleton: nn.Module, plan: dict, dtype, timeout: float) -> None:
    """Stream every rank its parts of ``model``'s tensors, straight into the rank's storage."""
    world_size = pool.world_size
    tensors = named_tensors(model)
    metas = [
        (name, _shard_shape(tensor, plan.get(id(tensor)), world_size), tensor.dtype) for name, tensor in tensors.items()
    ]

    def shares(rank: int):
        for tensor in tensors.values():
            yield _share(tensor, plan.get(id(tensor)), rank, world_size)

    pool.scatter(_load_shard, lambda rank: (skeleton, metas, dtype), shares, timeout=timeout)


def _share(tensor: torch.Tensor, split: Split | None, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``tensor``: a slice if the plan cuts it, else the whole tensor.

    A slice that is one contiguous block of the tensor (rows of a column split, most vocabularies)
    is a view, sent without a copy; others are copied out, one at a time.
    """
    tensor = tensor.detach()
    if split is None:
        return tensor
    ranges, padding = shard_ranges(tensor.shape[split.dim], rank, world_size, split.n_fused, split.heads, split.pad)
    if len(ranges) == 1 and not padding:
        ((start, stop),) = ranges
        piece = tensor.narrow(split.dim, start, stop - start)
        if piece.is_contiguous():
            return piece
    return shard(tensor, split.dim, rank, world_size, split.n_fused, split.heads, split.pad)


def _shard_shape(tensor: torch.Tensor, split: Split | None, world_size: int) -> tuple[int, ...]:
    """The shape of one rank's part of ``tensor`` (every rank's part has the same shape)."""
    return tuple(_share(torch.empty_like(tensor, device="meta"), split, 0, world_size).shape)


def _load_shard(context: RankContext, skeleton: nn.Module, metas: list, dtype) -> int:
    """On a rank: receive this rank's tensors, give them to the (already split) meta skeleton, keep it."""
    received = context.receive_tensors([(shape, tensor_dtype) for _, shape, tensor_dtype in metas])
    tensors = {name: tensor for (name, _, _), tensor in zip(metas, received, strict=True)}
    del received
    install_tensors(skeleton, tensors)
    return _keep(context, skeleton, dtype)


def _read_shard(context: RankContext, skeleton: nn.Module, directory: str, reads: list[Read], dtype) -> int:
    """On a rank: read this rank's slices from the checkpoint into the (already split) meta skeleton, keep it."""
    Checkpoint(directory).load_into(skeleton, reads, context.rank, context.world_size)
    return _keep(context, skeleton, dtype)


def _keep(context: RankContext, skeleton: nn.Module, dtype) -> int:
    """On a rank: bind the filled skeleton to this rank, move it to the device and keep it for calls."""
    bind_group(skeleton, context.group)
    skeleton.eval().requires_grad_(False)
    if dtype is not None:
        skeleton.to(dtype)
    model = skeleton.to(context.device)
    register_output_recording(model)
    context.store["model"] = model
    return sum(t.numel() * t.element_size() for t in named_tensors(model).values())


def _serve(context: RankContext, method: str, args: tuple, kwargs: dict, rng_state: torch.Tensor):
    """On a rank: run ``model.<method>`` with the caller's RNG state; rank 0 returns the result."""
    model = context.store["model"]
    torch.set_rng_state(rng_state)
    if context.device.type == "cuda":
        torch.cuda.manual_seed_all(int(torch.randint(2**62, ()).item()))
        torch.set_rng_state(rng_state)
    with torch.inference_mode():
        output = getattr(model, method)(*to_device(args, context.device), **to_device(kwargs, context.device))
    return (to_cpu(output), torch.get_rng_state()) if context.rank == 0 else None


def _memory(context: RankContext) -> dict[str, int]:
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


class ParallelHandle:
    """The ranks behind a parallelized model; reached as ``model._tpcore_handle``."""

    def __init__(self, model: nn.Module, pool: RankPool, timeout: float):
        self.model = model
        self.pool = pool
        self.timeout = timeout

    def attach(self) -> None:
        model = self.model
        model._tpcore_handle = self
        for name in _SERVED:
            if name == "forward" or hasattr(type(model), name):
                setattr(model, name, functools.partial(self.call, name))
        model.deparallelize = self.deparallelize
        model.memory_allocated = functools.partial(self._memory, "allocated")
        model.memory_reserved = functools.partial(self._memory, "reserved")
        model.memory_cached = model.memory_reserved
        model.memory_peak = functools.partial(self._memory, "peak")

    def call(self, method: str, *args, **kwargs):
        """Run ``model.<method>(*args, **kwargs)`` on the ranks; raise a rank's error as its own type."""
        try:
            results = self.pool.run(_serve, method, args, kwargs, torch.get_rng_state(), timeout=self.timeout)
        except WorkerError as error:
            reraise(error)
        except WorkerDiedError as error:
            message = f"{error} (the ranks are gone: call model.deparallelize() and parallelize again)"
            raise WorkerDiedError(message) from None
        output, rng_state = results[0]
        torch.set_rng_state(rng_state)
        return output

    def _memory(self, kind: str) -> dict[str, int]:
        results = self.pool.run(_memory, timeout=self.timeout)
        device = "cuda" if self.pool.backend == "nccl" else "cpu"
        return {f"{device}:{rank}": figures[kind] for rank, figures in enumerate(results)}

    def deparallelize(self) -> nn.Module:
        """Stop the ranks and give the model its own methods back; it runs unsplit again (a model
        started from a checkpoint has no weights in the caller: load it with ``from_pretrained``)."""
        self.pool.close()
        for name in (*_SERVED, *_ADDED, "_tpcore_handle"):
            self.model.__dict__.pop(name, None)
        return self.model
