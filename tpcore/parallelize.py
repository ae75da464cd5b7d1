"""The one-line ``parallelize()``: a split model served from the caller's own process.

The caller keeps its model object and its one copy of the weights. Each rank is sent only its
own shard: the caller builds a weightless (meta) copy of the model, applies the policies to it,
and streams every rank the tensors it holds (its slices of the split tensors, the replicated
rest) as raw bytes, one tensor at a time, straight into the rank's own storage. ``forward``,
``__call__`` and ``generate`` of the caller's model are then served by the ranks; rank 0 sends
the outputs back as CPU tensors.

Sampling stays in step: every call carries the caller's RNG state to all ranks, and the caller
takes rank 0's state back, so ``torch.manual_seed(s); model.generate(do_sample=True)`` draws what
the unsplit model draws with that seed, and the ranks never diverge.
"""

from __future__ import annotations

import copy
import functools
import resource
from typing import Any

import torch
from torch import nn

from tpcore.distributed import default_backend
from tpcore.process import CALL_TIMEOUT_S, RankContext, RankPool, WorkerDiedError, WorkerError
from tpcore.replacer import TensorReplacer
from tpcore.slicer import shard
from tpcore.transfer import to_cpu, to_device

__all__ = ["ParallelHandle", "parallelize"]

_SERVED = ("forward", "generate")
_ADDED = ("deparallelize", "memory_allocated", "memory_reserved", "memory_cached", "memory_peak")


def parallelize(
    model: nn.Module,
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
) -> nn.Module:
    """Split ``model`` over ``num_gpus`` local ranks and serve it from this process.

    Args:
        model: the model; it is not changed, only given served methods.
        num_gpus: number of ranks: GPUs with NCCL, CPU processes with gloo.
        fp16: run the ranks in ``torch.float16`` (``dtype`` for any other dtype).
        backend: ``"nccl"`` or ``"gloo"``; ``None`` is NCCL when CUDA is there, else gloo.
        custom_policies: a Policy class or a list; ``None`` uses the installed plugins.
        master_addr, master_port: rendezvous of the ranks; loopback and a free port by default.
        timeout: seconds any call may take before the ranks are presumed lost.
        threads_per_rank: torch threads per CPU rank; the cores are split evenly by default.
        verbose: print each rank's memory once the model is loaded.
        init_method, daemon: accepted for compatibility; ranks are always fresh interpreters
            that end with the caller.
        seed: seed the caller's RNG first (the ranks follow the caller's RNG on every call).

    Returns:
        ``model`` itself, whose ``forward``/``__call__``/``generate`` now run on the ranks, with
        ``deparallelize()`` and memory queries added. Validation errors (no policy, sizes that
        do not divide) are raised before any process starts.
    """
    if seed is not None:
        torch.manual_seed(seed)
    if fp16 and dtype not in (None, torch.float16):
        raise ValueError(f"fp16=True contradicts dtype={dtype}")
    dtype = torch.float16 if fp16 else dtype
    if getattr(model, "_tpcore_handle", None) is not None:
        raise RuntimeError("this model is already parallelized; call model.deparallelize() first")
    replacer = TensorReplacer(model, None, fp16, num_gpus, custom_policies, rank=0)
    plan = replacer.split_plan()  # validates: raises before any process starts
    skeleton = _weightless_copy(model)
    TensorReplacer(skeleton, None, fp16, num_gpus, replacer.custom_policies or None, rank=0).replace_modules()
    backend = backend or default_backend()
    pool = RankPool(
        num_gpus, backend, master_addr=master_addr, master_port=master_port, threads_per_rank=threads_per_rank
    )
    try:
        tensors = _named_tensors(model)
        shapes = {name: _shard_shape(tensor, plan.get(id(tensor)), num_gpus) for name, tensor in tensors.items()}
        metas = [(name, shape, tensors[name].dtype) for name, shape in shapes.items()]

        def shares(rank: int):
            for tensor in tensors.values():
                yield _share(tensor, plan.get(id(tensor)), rank, num_gpus)

        pool.scatter(_load_shard, lambda rank: (skeleton, metas, dtype), shares, timeout=timeout)
    except BaseException:
        pool.close(timeout=3.0)
        raise
    handle = ParallelHandle(model, pool, timeout)
    handle.attach()
    if verbose:
        for device, allocated in handle.memory_allocated().items():
            print(f"tpcore: {device} holds {allocated / 2**20:.1f} MiB")
    return model


def _weightless_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers live on the meta device (no data).

    Ties survive: one meta tensor stands for each distinct original tensor.
    """
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    skeleton = copy.deepcopy(model, memo)
    _drop_output_capturing_hooks(skeleton)
    return skeleton


def _drop_output_capturing_hooks(model: nn.Module) -> None:
    """Remove the forward hooks transformers installs to record hidden states and attentions.

    They are bound to this process (a ContextVar) and cannot travel; the rank installs its own.
    """
    for module in model.modules():
        module.__dict__.pop("_output_capturing_hooks_installed", None)
        for key, hook in list(module._forward_hooks.items()):
            if "output_capturing" in getattr(hook, "__qualname__", ""):
                del module._forward_hooks[key]


def _register_output_recording(model: nn.Module) -> None:
    """Let transformers record hidden states and attentions of a model that was unpickled rather
    than constructed (its constructor registers what each model class can record)."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # transformers versions without output capturing need nothing
        return
    for module in model.modules():
        if hasattr(module, "_can_record_outputs") and hasattr(module, "config"):
            _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every distinct parameter and buffer (non-persistent ones too) by its first name."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    return named


def _share(tensor: torch.Tensor, split: tuple | None, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``tensor``: a slice if the plan cuts it, else the whole tensor."""
    if split is None:
        return tensor.detach()
    dim, n_fused, heads = split
    return shard(tensor.detach(), dim, rank, world_size, n_fused, heads)


def _shard_shape(tensor: torch.Tensor, split: tuple | None, world_size: int) -> tuple[int, ...]:
    """The shape of one rank's part of ``tensor`` (every rank's part has the same shape)."""
    return tuple(_share(torch.empty_like(tensor, device="meta"), split, 0, world_size).shape)


def _load_shard(context: RankContext, skeleton: nn.Module, metas: list, dtype) -> int:
    """On a rank: receive this rank's tensors, give them to the (already split) meta skeleton, keep it."""
    received = context.receive_tensors([(shape, tensor_dtype) for _, shape, tensor_dtype in metas])
    state = {name: tensor for (name, _, _), tensor in zip(metas, received, strict=True)}
    del received
    slots: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    first_name: dict[int, str] = {}
    for module_name, module in skeleton.named_modules(remove_duplicate=False):
        for kind, table in (("p", module._parameters), ("b", module._buffers)):
            for leaf, tensor in table.items():
                if tensor is None:
                    continue
                slots.setdefault(id(tensor), []).append((module, leaf, kind == "p"))
                first_name.setdefault(id(tensor), f"{module_name}.{leaf}" if module_name else leaf)
    for key, places in slots.items():
        value = state[first_name[key]]
        for module, leaf, is_parameter in places:
            if is_parameter:
                module._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, False)
                value = module._parameters[leaf]  # one Parameter object for every tied place
            else:
                module._buffers[leaf] = value
    for module in skeleton.modules():
        if hasattr(module, "tp_group"):
            module.tp_group = context.group
    skeleton.eval().requires_grad_(False)
    if dtype is not None:
        skeleton.to(dtype)
    model = skeleton.to(context.device)
    _register_output_recording(model)
    context.store["model"] = model
    return sum(t.numel() * t.element_size() for t in _named_tensors(model).values())


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
    tensor_bytes = sum(t.numel() * t.element_size() for t in _named_tensors(model).values())
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
            if error.exception is not None:
                raise error.exception from error
            raise
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
        """Stop the ranks and give the model its own methods back; it runs unsplit again."""
        self.pool.close()
        for name in (*_SERVED, *_ADDED, "_tpcore_handle"):
            self.model.__dict__.pop(name, None)
        return self.model
