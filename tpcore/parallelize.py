"""The one-line ``parallelize()``: a split model served from the caller's own process.

The caller keeps its model object and its one copy of the weights. Each rank is sent only its
own shard: the caller builds a weightless (meta) copy of the model, applies the policies to it,
and streams every rank the tensors it holds (its slices of the split tensors, the replicated
rest) as raw bytes, one tensor at a time, straight into the rank's own storage (a model on a GPU
goes through the CPU one share at a time). ``forward``, ``__call__`` and ``generate`` of the
caller's model are then served by the ranks: inputs travel through the CPU to each rank's device,
and rank 0 sends the outputs back, which the caller gets on the device of its first input tensor
(the CPU when it passed none), as the unsplit model would return them.

Started from a checkpoint directory instead of a model, the caller builds the model without
weights (parameters on the meta device) and each rank reads its own slices from the files: no
process ever holds the whole model.

Sampling stays in step: every call carries the caller's RNG state (CPU, and CUDA for CUDA ranks, see
:mod:`tpcore.rng`) to all ranks, and the caller takes rank 0's state back, so
``torch.manual_seed(s); model.generate(do_sample=True)`` draws what the unsplit model draws with
that seed, and the ranks never diverge.

While the ranks start and load, one bar counts the bytes every rank has loaded (:mod:`tpcore.progress`);
the plan's bytes per rank and, past a share of the model, what stays whole on every rank are logged
(:meth:`~tpcore.plan.ShardPlan.log`). The served model's ``repr`` begins with its split.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from torch import nn

from tpcore.parallel import memfd
from tpcore.select.auto import describe_policies
from tpcore.load.checkpoint import Checkpoint, Read, is_checkpoint_path
from tpcore.ranks.distributed import check_placement, default_backend
from tpcore.parallel.layers import bind_group
from tpcore.plan.shard_plan import ShardPlan, format_bytes
from tpcore.load.precision import cast_model, resolve_dtype
from tpcore.ranks.process import (
    CALL_TIMEOUT_S,
    START_TIMEOUT_S,
    RankContext,
    RankPool,
    WorkerDiedError,
    WorkerError,
    ranks_text,
    reraise,
)
from tpcore.progress import ByteCounter, LoadBar
from tpcore.compat import TensorReplacer
from tpcore.ranks.rng import CallerRandomState, RandomState, device_generator
from tpcore.load.skeleton import (
    drop_output_capturing_hooks,
    empty_model,
    install_tensors,
    named_tensors,
    register_output_recording,
    weightless_copy,
)
from tpcore.ranks.transfer import first_device, to_cpu, to_device

__all__ = ["ParallelHandle", "parallelize"]

_SERVED = ("forward", "generate")
#: moving the model ends the parallelization first, as in parallelformers
_MOVES = ("to", "cpu", "cuda")
_ADDED = ("deparallelize", "memory_allocated", "memory_reserved", "memory_cached", "memory_peak", "extra_repr")
_START_METHODS = (None, "spawn", "fork", "forkserver")

logger = logging.getLogger(__name__)


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
    device: str | None = None,
) -> nn.Module:
    """Split ``model`` over ``num_gpus`` local ranks and serve it from this process.

    Args:
        model: the model; it is not changed, only given served methods. Or the directory of a saved
            model (``save_pretrained``: safetensors, or pickle files read with ``weights_only``): then
            only the ranks hold weights, each its own slices read from the files, and the caller
            gets the model with its parameters on the meta device.
        num_gpus: number of ranks: GPUs with NCCL, CPU processes with gloo.
        fp16: run the ranks in ``torch.float16`` (``dtype`` for any other dtype); the model is cast as
            ``from_pretrained(dtype=...)`` casts it (modules it keeps in fp32 stay, rotary buffers too).
            CPU ranks on a CPU without float16 arithmetic run bfloat16 where the CPU has it, else keep the
            model's dtype, with a warning (:func:`tpcore.precision.resolve_dtype`); ``dtype=torch.float16``
            casts them anyway.
        backend: ``"nccl"`` or ``"gloo"``; ``None`` is NCCL when there is a CUDA device per rank, else gloo.
        custom_policies: a Policy class or a list; ``None`` uses the installed plugins.
        master_addr, master_port: rendezvous of the ranks; loopback and a free port by default.
        timeout: seconds any call may take before the ranks are presumed lost; starting the ranks
            gives up after ``min(timeout, 180)`` seconds.
        threads_per_rank: torch threads per CPU rank; the cores are split evenly by default.
        verbose: once the model is loaded, print each rank's memory: ``True`` or ``"simple"`` its
            allocated and reserved MiB (CPU: tensor bytes and resident memory), ``"detail"`` the
            CUDA allocator's summary (CPU: resident, peak resident and tensor bytes).
        init_method, daemon: parallelformers' multiprocessing start method and daemon flag, accepted
            for compatibility and ignored: ranks are always fresh interpreters that end with the
            caller, and the caller's start method is never changed.
        seed: seed the caller's torch RNG first (the ranks follow the caller's RNG on every call).
        model_class: the class to build from a checkpoint (default: the one its config names).
        vocab_parallel: split the input and output embeddings over the vocabulary too.
        device: ``"cuda"`` or ``"cpu"``; ``None`` is CUDA for NCCL, the CPU for gloo. gloo ranks on
            ``"cuda"`` share the GPUs (rank ``r`` on ``cuda:(r % devices)``); NCCL needs one per rank.

    Returns:
        ``model`` itself, whose ``forward``/``__call__``/``generate`` now run on the ranks, with
        ``deparallelize()`` and memory queries added. ``model.to()``, ``.cpu()`` and ``.cuda()``
        end the parallelization (as ``deparallelize()``), then move the caller's model, which runs
        unsplit from then on; a model started from a checkpoint has no weights here to move, so
        they raise and the ranks serve on (``half()``/``float()`` change only the caller's copy).
        Validation errors (no policy, sizes that do not cut into whole heads, an unknown ``verbose``, a
        ``master_port`` already in use, more NCCL ranks than GPUs, a checkpoint's missing, truncated or
        corrupt file) are raised before any process starts. From a checkpoint, the ranks start while this
        process builds the model, so that their imports overlap: an error found then (no policy for the
        model, parameters the files lack) stops them before it is raised.
    """
    if isinstance(num_gpus, bool):  # parallelformers' positional order is (model, fp16, num_gpus)
        raise TypeError(f"num_gpus must be an int, got {num_gpus!r}: pass fp16= and num_gpus= by keyword")
    verbosity = _verbosity(verbose)
    if init_method not in _START_METHODS:
        raise ValueError(f"init_method is a multiprocessing start method {_START_METHODS[1:]}, got {init_method!r}")
    backend = backend or default_backend(num_gpus)
    device = check_placement(backend, num_gpus, device)
    dtype = resolve_dtype(fp16, dtype, device)
    if seed is not None:
        torch.manual_seed(seed)
    if getattr(model, "_tpcore_handle", None) is not None:
        raise RuntimeError("this model is already parallelized; call model.deparallelize() first")

    def split_plan(model: nn.Module) -> ShardPlan:  # validates: raises on a model that cannot be split so
        return TensorReplacer(
            model, None, fp16, num_gpus, custom_policies, rank=0, vocab_parallel=vocab_parallel
        ).split_plan()

    from_checkpoint = is_checkpoint_path(model)
    if from_checkpoint:
        checkpoint = Checkpoint(model)
        config = checkpoint.config()  # a directory without a model in it fails here, before any rank starts
        checkpoint.verify(checkpoint.files)  # and so does a missing, truncated or corrupt weight file
        preload = _modeling_modules(config, model_class)
        # The ranks start (and import the model's code) while this process builds the model and checks the files.
        prepare = functools.partial(_from_checkpoint, checkpoint, config, model_class, split_plan, dtype)
    else:
        prepared = _from_model(model, split_plan, dtype)  # validated before any rank starts
        prepare, preload = (lambda: prepared), ()
    try:
        pool = RankPool(
            num_gpus,
            backend,
            device=device,
            master_addr=master_addr,
            master_port=master_port,
            threads_per_rank=threads_per_rank,
            start_timeout=min(timeout, START_TIMEOUT_S),
            preload=preload,
            wait=False,
        )
        try:
            prepared = prepare()
            prepared.plan.log()
            with LoadBar(prepared.total_bytes, f"tpcore: {num_gpus} ranks starting") as bar:
                pool.wait_started()
                bar.loading(f"tpcore: {num_gpus} ranks loading")
                prepared.send(pool, timeout, bar)
                bar.done(f"tpcore: {num_gpus} ranks loaded")
            handle = ParallelHandle(prepared.model, pool, timeout, prepared.plan, has_weights=not from_checkpoint)
            if verbosity is not None:
                handle.print_memory(verbosity)
        except BaseException:
            pool.close(timeout=3.0)
            raise
    except WorkerError as error:  # a rank failed to start or to load: its own exception, its traceback as cause
        reraise(error)
    handle.attach()
    return prepared.model


class _Prepared(NamedTuple):
    """The caller's model, its plan, the bytes all ranks load, and how every rank gets its shard:
    ``send(pool, timeout, bar)``, counting the bytes loaded on ``bar``."""

    model: nn.Module
    plan: ShardPlan
    total_bytes: int
    send: Callable[[RankPool, float, LoadBar], Any]


def _from_model(model: nn.Module, split_plan, dtype) -> _Prepared:
    """Validate ``model``'s split; each rank will be streamed its own tensors from the caller's."""
    plan = split_plan(model)
    skeleton_for = _skeletons(plan, weightless_copy(model))
    send = functools.partial(_send_shards, model=model, skeleton_for=skeleton_for, plan=plan, dtype=dtype)
    return _Prepared(model, plan, sum(plan.bytes_per_rank(rank) for rank in range(plan.world_size)), send)


def _from_checkpoint(checkpoint: Checkpoint, config, model_class, split_plan, dtype) -> _Prepared:
    """Build the checkpoint's model without weights, validate its split and the files; each rank will read
    its own slices."""
    model = _model_without_weights(checkpoint, config, model_class)
    plan = split_plan(model)
    reads = checkpoint.reads(model, plan.splits)  # checks the files: a missing or truncated one fails here
    total = sum(
        checkpoint.bytes_to_read(reads, functools.partial(plan.shard_shape, rank=rank))
        for rank in range(plan.world_size)
    )
    checkpoint.close()  # the caller keeps no file open while the ranks read
    skeleton = copy.deepcopy(model)  # weights on meta already; keeps the constructed buffers
    drop_output_capturing_hooks(skeleton)
    skeleton_for = _skeletons(plan, skeleton)
    directory = str(checkpoint.directory)

    def send(pool: RankPool, timeout: float, bar: LoadBar) -> None:
        def arguments(rank: int) -> tuple:
            return skeleton_for(rank), directory, reads, dtype

        pool.scatter(_read_shard, arguments, timeout=timeout, on_progress=bar.rank_loaded)

    return _Prepared(model, plan, total, send)


def _modeling_modules(config, model_class) -> tuple[str, ...]:
    """The module that defines the model a checkpoint's ``config`` builds, found without importing it."""
    if model_class is not None:
        return (model_class.__module__,)
    import transformers

    by_class = getattr(transformers, "_class_to_module", {})  # transformers' lazy import table
    names = [by_class.get(name) for name in getattr(config, "architectures", None) or ()]
    return tuple(f"transformers.{name}" for name in names if name)


def _verbosity(verbose) -> str | None:
    """``"simple"``, ``"detail"`` or ``None`` for a ``verbose`` argument (case-insensitive, as parallelformers)."""
    if verbose is None or isinstance(verbose, bool):
        return "simple" if verbose else None
    if isinstance(verbose, str) and verbose.lower() in ("simple", "detail"):
        return verbose.lower()
    raise ValueError(f"verbose must be None, False, True, 'simple' or 'detail', got {verbose!r}")


def _model_without_weights(checkpoint: Checkpoint, config, model_class) -> nn.Module:
    """The checkpoint's model with its parameters on meta, and its generation config if one was saved."""
    model = empty_model(config, model_class)
    if (checkpoint.directory / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(checkpoint.directory)
    return model


def _skeletons(plan: ShardPlan, skeleton: nn.Module):
    """``skeleton_for(rank)``: the split meta skeleton rank ``rank`` fills. One serves every rank when the
    plan is uniform (each rank binds its own group and rows); uneven shares give each rank its own."""
    if plan.uniform:
        plan.apply(skeleton, 0)
        return lambda rank: skeleton
    return lambda rank: plan.apply(copy.deepcopy(skeleton), rank)


def _send_shards(
    pool: RankPool, timeout: float, bar: LoadBar, *, model: nn.Module, skeleton_for, plan: ShardPlan, dtype
) -> None:
    """Stream every rank its parts of ``model``'s tensors, straight into the rank's storage; ``bar`` counts
    the bytes sent."""
    tensors = named_tensors(model)

    def arguments(rank: int) -> tuple:
        metas = [(name, plan.shard_shape(name, rank), tensor.dtype) for name, tensor in tensors.items()]
        return skeleton_for(rank), metas, dtype

    def shares(rank: int):
        for name, tensor in tensors.items():  # a model on a GPU: one share at a time goes through the CPU
            share = plan.share(name, tensor, rank).cpu()
            yield share
            bar.add(share.numel() * share.element_size())  # sent by now

    pool.scatter(_load_shard, arguments, shares, timeout=timeout)


def _load_shard(context: RankContext, skeleton: nn.Module, metas: list, dtype) -> int:
    """On a rank: receive this rank's tensors, give them to the (already split) meta skeleton, keep it."""
    received = context.receive_tensors([(shape, tensor_dtype) for _, shape, tensor_dtype in metas])
    tensors = {name: tensor for (name, _, _), tensor in zip(metas, received, strict=True)}
    del received
    install_tensors(skeleton, tensors)
    return _keep(context, skeleton, dtype)


def _read_shard(context: RankContext, skeleton: nn.Module, directory: str, reads: list[Read], dtype) -> int:
    """On a rank: read this rank's slices from the checkpoint, onto its device, into the (already split)
    meta skeleton, keep it; the caller is told the bytes read as they grow."""
    started = time.monotonic()
    counter = ByteCounter(context.report_progress)
    Checkpoint(directory).load_into(
        skeleton, reads, context.rank, context.world_size, context.device, dtype, progress=counter
    )
    counter.close()
    logger.info("read %s in %.1f s", format_bytes(counter.count), time.monotonic() - started)
    return _keep(context, skeleton, dtype)


def _keep(context: RankContext, skeleton: nn.Module, dtype) -> int:
    """On a rank: bind the filled skeleton to this rank, move it to the device and keep it for calls."""
    bind_group(skeleton, context.group)
    skeleton.eval().requires_grad_(False)
    if dtype is not None:
        cast_model(skeleton, dtype)
    model = skeleton.to(context.device)
    register_output_recording(model)
    context.store["model"] = model
    return sum(t.numel() * t.element_size() for t in named_tensors(model).values())


def _serve(context: RankContext, method: str, args: tuple, kwargs: dict, random_state: RandomState):
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


def _memory_detail(context: RankContext) -> str:
    """On a rank: the CUDA allocator's summary, or on CPU the resident, peak resident and tensor bytes."""
    if context.device.type == "cuda":
        return "CUDA allocator summary\n" + torch.cuda.memory_summary(context.device)
    figures = _memory(context)
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


class ParallelHandle:
    """The ranks behind a parallelized model; reached as ``model._tpcore_handle``, its split as ``.plan``."""

    def __init__(self, model: nn.Module, pool: RankPool, timeout: float, plan: ShardPlan, has_weights: bool = True):
        self.model = model
        self.pool = pool
        self.timeout = timeout
        self.plan = plan
        #: the caller's model holds real weights (not the meta ones of a checkpoint start)
        self.has_weights = has_weights
        self.random = CallerRandomState()
        self._lock = threading.Lock()
        self._policies = describe_policies(plan.policies)

    def describe(self) -> str:
        """The split at a glance: ranks, backend and devices, policies and their plugins, bytes per rank."""
        placement = ranks_text(self.pool.world_size, self.pool.backend, self.pool.devices or [self.pool.device])
        state = "" if self.pool.alive else " (stopped)"
        return f"split over {placement}{state} by {self._policies}: {self.plan.bytes_summary()}"

    def __repr__(self) -> str:
        return f"ParallelHandle({self.plan.model_name} {self.describe()}; {self.pool!r})"

    def _extra_repr(self) -> str:
        """The served model's ``extra_repr``: its split first, then the model's own (``nn.Module.__repr__``
        puts it on the model's first line)."""
        own = type(self.model).extra_repr(self.model)
        return "\n".join(line for line in (f"tpcore: {self.describe()}", own) if line)

    def attach(self) -> None:
        model = self.model
        model._tpcore_handle = self
        model.extra_repr = self._extra_repr
        for name in _SERVED:
            if name == "forward" or hasattr(type(model), name):
                setattr(model, name, functools.partial(self.call, name))
        for name in _MOVES:
            setattr(model, name, functools.partial(self.move, name))
        model.deparallelize = self.deparallelize
        model.memory_allocated = functools.partial(self._memory, "allocated")
        model.memory_reserved = functools.partial(self._memory, "reserved")
        model.memory_cached = model.memory_reserved
        model.memory_peak = functools.partial(self._memory, "peak")

    def call(self, method: str, *args, **kwargs):
        """Run ``model.<method>(*args, **kwargs)`` on the ranks; raise a rank's error as its own type.

        Tensors travel through the CPU; the output comes back on the device of the first input tensor.
        """
        device = first_device((args, kwargs))
        args, kwargs = to_device((args, kwargs), "cpu")
        with self._lock:  # one call's random state at a time
            try:
                results = self.pool.run(_serve, method, args, kwargs, self.random.outgoing(), timeout=self.timeout)
            except WorkerError as error:
                reraise(error)
            except WorkerDiedError as error:
                message = f"{error} (the ranks are gone: call model.deparallelize() and parallelize again)"
                raise WorkerDiedError(message) from None
            output, random_state = results[0]
            self.random.adopt(random_state)
        return output if device is None or device.type == "cpu" else to_device(output, device)

    def move(self, method: str, *args, **kwargs) -> nn.Module:
        """``model.to/cpu/cuda``: stop the ranks, then move the caller's (unsplit) model."""
        if not self.has_weights:
            raise RuntimeError(
                f"model.{method}(): this model was parallelized from a checkpoint, so this process holds no "
                "weights to move (its ranks serve on); call model.deparallelize() and load it with from_pretrained"
            )
        return getattr(self.deparallelize(), method)(*args, **kwargs)

    def _run_per_device(self, fn) -> dict:
        results = self.pool.run(fn, timeout=self.timeout)
        return {f"{self.pool.device}:{rank}": result for rank, result in enumerate(results)}

    def _memory(self, kind: str) -> dict[str, int]:
        return {device: figures[kind] for device, figures in self._run_per_device(_memory).items()}

    def print_memory(self, verbosity: str) -> None:
        """Print each rank's memory: one line of allocated and reserved MiB, or the detailed figures."""
        if verbosity == "simple":
            for device, figures in self._run_per_device(_memory).items():
                mib = {kind: figures[kind] / 2**20 for kind in ("allocated", "reserved")}
                print(f"tpcore {device}: allocated {mib['allocated']:.1f} MiB, reserved {mib['reserved']:.1f} MiB")
        else:
            for device, detail in self._run_per_device(_memory_detail).items():
                print(f"tpcore {device}: {detail}")

    def deparallelize(self) -> nn.Module:
        """Stop the ranks and give the model its own methods back; it runs unsplit again (a model
        started from a checkpoint has no weights in the caller: load it with ``from_pretrained``)."""
        self.pool.close()
        for name in (*_SERVED, *_MOVES, *_ADDED, "_tpcore_handle"):
            self.model.__dict__.pop(name, None)
        return self.model
