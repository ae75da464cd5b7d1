"""Starting a model's ranks and giving each its shard, from the caller's model or from a checkpoint.

A :class:`Launch` turns a plan into ranks that hold their shards. What each rank gets comes from its
source:

- :class:`ModelSource`: the caller's model. The caller builds a weightless (meta) copy, applies the
  plan to it (one per rank when the shares differ), and streams each rank its slices of the split
  tensors and the replicated rest as raw bytes, straight into the rank's storage (a model on a GPU
  goes through the CPU one share at a time). The caller keeps its one copy of the weights.
- :class:`CheckpointSource`: a saved model directory. Its config and files are checked first (a
  missing, truncated or corrupt file fails before any rank starts); the ranks start at once,
  importing the model's code while the caller builds the model without weights and its plan; each
  rank then reads only its own slices from the files. No process holds the whole model.

One bar counts the bytes every rank has loaded (:mod:`tpcore.progress`), and the plan's bytes per rank
(and what stays whole, past a share of the model) is logged (:func:`~tpcore.plan.log_plan`).
"""

from __future__ import annotations

import copy
import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tpcore.errors import WorkerError
from tpcore.load.checkpoint import Checkpoint
from tpcore.load.precision import cast_dtypes, resolve_dtype
from tpcore.load.quantized_formats import check_quantization, checkpoint_skeleton
from tpcore.load.skeleton import drop_output_capturing_hooks, named_tensors, portable, weightless_copy
from tpcore.plan import ShardPlan, apply_plan, log_plan
from tpcore.progress import LoadBar
from tpcore.ranks.distributed import check_placement, default_backend
from tpcore.ranks.failures import reraise
from tpcore.ranks.process import CALL_TIMEOUT_S, START_TIMEOUT_S, RankPool
from tpcore.select.plugins import quantized_formats
from tpcore.served.rank_side import load_shard, read_shard

__all__ = ["CheckpointSource", "Launch", "LaunchOptions", "ModelSource"]


@dataclass(frozen=True)
class LaunchOptions:
    """How to start the ranks and in what dtype they compute (:meth:`checked` resolves and checks them)."""

    world_size: int
    backend: str
    device: str
    dtype: torch.dtype | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    threads_per_rank: int | None = None
    timeout: float = CALL_TIMEOUT_S

    @classmethod
    def checked(cls, world_size: int, backend: str | None, device: str | None, fp16: bool, dtype, **rest: Any):
        """The options for ``world_size`` ranks, the backend and device chosen as ``parallelize`` documents
        (a placement that cannot run is refused here, before any rank starts) and the dtype resolved."""
        backend = backend or default_backend(world_size)
        device = check_placement(backend, world_size, device)
        return cls(world_size, backend, device, resolve_dtype(fp16, dtype, device), **rest)

    def start(self, preload: tuple[str, ...] = ()) -> RankPool:
        """Start the ranks in the background (:meth:`RankPool.wait_started` finishes the start)."""
        return RankPool(
            self.world_size,
            self.backend,
            device=self.device,
            master_addr=self.master_addr,
            master_port=self.master_port,
            threads_per_rank=self.threads_per_rank,
            start_timeout=min(self.timeout, START_TIMEOUT_S),
            preload=preload,
            wait=False,
        )


class ModelSource:
    """The caller's model: each rank is streamed its own tensors from the caller's."""

    has_weights = True
    preload: tuple[str, ...] = ()  # the caller's model is validated before any rank starts

    def __init__(self, model: nn.Module):
        self.model = model

    def shards(self, plan: ShardPlan, dtype: torch.dtype | None) -> Shards:
        tensors = named_tensors(self.model)
        skeleton_for = _skeletons(plan, weightless_copy(self.model))

        def send(pool: RankPool, timeout: float, bar: LoadBar) -> None:
            def arguments(rank: int) -> tuple:
                metas = [(name, plan.shard_shape(name, rank), tensor.dtype) for name, tensor in tensors.items()]
                return *skeleton_for(rank), metas, dtype

            def shares(rank: int) -> Iterator[torch.Tensor]:
                for name, tensor in tensors.items():  # a model on a GPU: one share at a time goes through the CPU
                    share = plan.shard(name, tensor, rank).cpu()
                    yield share
                    bar.add(share.numel() * share.element_size())  # sent by now

            pool.scatter(load_shard, arguments, shares, timeout=timeout)

        sent = sum(math.prod(plan.shard_shape(name, rank)) * tensor.element_size()
                   for rank in range(plan.world_size) for name, tensor in tensors.items())  # fmt: skip
        return Shards(sent, send)


class CheckpointSource:
    """A saved model directory: its config and weight files checked now, the model built without weights on
    first use (:attr:`model`); each rank reads its own slices."""

    has_weights = False

    def __init__(self, directory: str | os.PathLike, model_class: type[nn.Module] | None = None):
        self.checkpoint = Checkpoint(directory)
        self.config = self.checkpoint.config()  # a directory without a model in it fails here
        self.formats = quantized_formats()
        quantized = check_quantization(
            self.config, f"the checkpoint in {self.checkpoint.directory.name!r}", self.formats
        )
        self.checkpoint.verify(self.checkpoint.files)  # and so does a missing, truncated or corrupt weight file
        self.model_class = model_class
        if quantized is not None:  # built now: its format refuses a tensor it cannot split before any rank starts
            _ = self.model
        #: the module that defines the model and those its format computes with, which the ranks import while the
        #: caller builds it
        self.preload = _modeling_modules(self.config, model_class) + (quantized.rank_modules if quantized else ())

    @functools.cached_property
    def model(self) -> nn.Module:
        """The checkpoint's model with its parameters on meta, and its generation config if one was saved."""
        return checkpoint_skeleton(self.checkpoint, self.config, self.model_class, self.formats)

    def shards(self, plan: ShardPlan, dtype: torch.dtype | None) -> Shards:
        checkpoint = self.checkpoint
        reads = checkpoint.reads(self.model, plan.splits)  # checks the files: a missing or truncated one fails here
        total = sum(
            checkpoint.bytes_to_read(reads, functools.partial(plan.shard_shape, rank=rank))
            for rank in range(plan.world_size)
        )
        checkpoint.close()  # the caller keeps no file open while the ranks read
        skeleton = copy.deepcopy(self.model)  # weights on meta already; keeps the constructed buffers
        drop_output_capturing_hooks(skeleton)
        skeleton_for = _skeletons(plan, skeleton)
        directory = str(checkpoint.directory)

        def send(pool: RankPool, timeout: float, bar: LoadBar) -> None:
            def arguments(rank: int) -> tuple:
                return *skeleton_for(rank), directory, reads, dtype

            pool.scatter(read_shard, arguments, timeout=timeout, on_progress=bar.rank_loaded)

        return Shards(total, send)


@dataclass(frozen=True)
class Shards:
    """What every rank loads: the bytes of all of it, and ``send(pool, timeout, bar)``, which gives each rank
    its shard and counts the bytes loaded on ``bar``."""

    total_bytes: int
    send: Callable[[RankPool, float, LoadBar], None]


class Launch:
    """``with Launch(source, options) as launch: pool = launch.load(plan)``: the ranks of ``source``'s
    model, each holding its shard by ``plan``. A source that names modules to preload (a checkpoint) starts
    its ranks on entry, so that their imports overlap the caller's work; an error inside the block stops the
    ranks, and a rank's exception is raised as its own type."""

    def __init__(self, source: ModelSource | CheckpointSource, options: LaunchOptions):
        self.source, self.options = source, options
        self.pool: RankPool | None = None

    def __enter__(self) -> Launch:
        if self.source.preload:
            self.pool = self.options.start(self.source.preload)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        if error is not None and self.pool is not None:
            self.pool.close(timeout=3.0)
        if isinstance(error, WorkerError):  # a rank failed to start or to load: its own exception, its traceback
            reraise(error)

    def load(self, plan: ShardPlan) -> RankPool:
        """Start the ranks (if not yet) and give each its shard; returns their pool."""
        options = self.options
        shards = self.source.shards(plan, options.dtype)  # every check in this process first
        if options.dtype is not None:  # the ranks hold their tensors cast: the plan counts them so
            plan.dtypes.update(cast_dtypes(self.source.model, options.dtype))
        log_plan(plan)
        self.pool = self.pool or options.start()
        ranks = options.world_size
        with LoadBar(shards.total_bytes, f"tpcore: {ranks} ranks starting") as bar:
            self.pool.wait_started()
            bar.loading(f"tpcore: {ranks} ranks loading")
            shards.send(self.pool, options.timeout, bar)
            bar.done(f"tpcore: {ranks} ranks loaded")
        return self.pool


def _skeletons(plan: ShardPlan, skeleton: nn.Module) -> Callable[[int], tuple[nn.Module, ShardPlan | None]]:
    """``skeleton_for(rank)``: the meta skeleton rank ``rank`` fills and the plan it still applies to it
    (:func:`~tpcore.served.rank_side.own_skeleton`). Split here once where the plan is uniform (each rank binds
    its own group and rows); with uneven shares every rank gets the unsplit skeleton and the plan, and splits its
    own copy, all at once, where copying and splitting one per rank here would hold each rank for the ones
    before it."""
    portable(skeleton)
    if plan.uniform:
        apply_plan(plan, skeleton, 0)
        return lambda rank: (skeleton, None)
    return lambda rank: (skeleton, plan)


def _modeling_modules(config: Any, model_class: type[nn.Module] | None) -> tuple[str, ...]:
    """The module that defines the model a checkpoint's ``config`` builds, found without importing it."""
    if model_class is not None:
        return (model_class.__module__,)
    import transformers

    by_class = getattr(transformers, "_class_to_module", {})  # transformers' lazy import table
    names = [by_class.get(name) for name in getattr(config, "architectures", None) or ()]
    return tuple(f"transformers.{name}" for name in names if name)
