"""ParallelEngine: parallelize a model on one rank (SPMD, under torchrun or inside a worker)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from tpcore.load.checkpoint import Checkpoint, is_checkpoint_path
from tpcore.load.precision import cast_dtypes, cast_model, resolve_dtype
from tpcore.load.quantized_formats import adopt_quantized_model, checkpoint_skeleton
from tpcore.parallel import shm
from tpcore.parallel.comm import group_rank
from tpcore.parallel.cpu_layout import lay_out, linear_weight_names, transpose_linear_weights
from tpcore.parallel.quantized_linear import localize_quantized, ready_quantized
from tpcore.plan import apply_plan, log_plan, plan_for
from tpcore.progress import LoadBar
from tpcore.ranks.distributed import bind_device, check_placement, default_backend, device_for, tensor_parallel_group
from tpcore.select import choose_policies
from tpcore.select.plugins import quantized_formats

__all__ = ["ParallelEngine"]


class ParallelEngine:
    """Turns a whole model into this rank's shard of it.

    Args:
        num_gpus: tensor-parallel world size (CPU processes with gloo, GPUs with NCCL).
        backend: ``"nccl"``, ``"gloo"`` or ``None``: NCCL when this node has a CUDA device for each of its
            ranks (``LOCAL_WORLD_SIZE``, else ``num_gpus``), else gloo.
        custom_policies: a Policy class or list of them; ``None`` uses the installed plugins.
        dtype: cast the model to this dtype after slicing, as ``from_pretrained(dtype=...)`` does
            (``fp16=True`` means ``torch.float16``, except on a CPU without float16 arithmetic: bfloat16 or no
            cast, see :func:`tpcore.load.precision.resolve_dtype`; any other dtype with it is refused).
        device: ``"cuda"`` or ``"cpu"``; ``None`` is CUDA for NCCL, the CPU for gloo. The rank's
            ``LOCAL_RANK`` picks its GPU (gloo ranks on ``"cuda"`` share them: ``cuda:(r % devices)``).
        process_group: use this group instead of creating one.
        vocab_parallel: split the input and output embeddings over the vocabulary too.
        gather_logits: a vocab-parallel LM head returns the whole vocabulary's logits on every
            rank (one all-gather); ``False`` leaves each rank its ``ceil(V / N)`` columns.
    """

    def __init__(
        self,
        num_gpus: int,
        backend: str | None = None,
        custom_policies=None,
        *,
        dtype=None,
        device: str | None = None,
        process_group=None,
        vocab_parallel: bool = True,
        gather_logits: bool = True,
    ):
        if int(num_gpus) < 1:
            raise ValueError(f"num_gpus must be at least 1, got {num_gpus}")
        self.world_size = int(num_gpus)
        self.backend = backend or default_backend(self._local_world_size())
        self.custom_policies = custom_policies
        self.dtype = dtype
        self.device_type = device
        self.tp_group = process_group
        self.vocab_parallel = vocab_parallel
        self.gather_logits = gather_logits

    @property
    def num_gpus(self) -> int:
        """The world size, by parallelformers' name."""
        return self.world_size

    @property
    def mp_group(self):
        """The tensor-parallel group, by parallelformers' name."""
        return self.tp_group

    def create_process_group(self, backend: str | None = None):
        """Create (or reuse) the tensor-parallel group, bound to this rank's device; ``None`` for a world
        of one without torch.distributed. More NCCL ranks on this node than GPUs are refused first."""
        if self.tp_group is None:
            backend = backend or self.backend
            check_placement(backend, self._local_world_size(), self.device_type)
            self.tp_group = tensor_parallel_group(self.world_size, backend, self.device)
        return self.tp_group

    @property
    def device(self) -> torch.device:
        """This rank's device: picked by ``LOCAL_RANK``, else by the rank in the group (or ``RANK``)."""
        if "LOCAL_RANK" in os.environ:
            local_rank = int(os.environ["LOCAL_RANK"])
        elif dist.is_available() and dist.is_initialized():
            local_rank = group_rank(self.tp_group)
        else:
            local_rank = int(os.environ.get("RANK", 0))
        return device_for(self.backend, local_rank, self.device_type)

    def _local_world_size(self) -> int:
        """Ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``, else the tensor-parallel world."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    def parallelize(self, model: nn.Module | str | os.PathLike, fp16: bool = False, *, model_class=None) -> nn.Module:
        """Validate, bind this rank's device, join the group, slice and replace modules where the model
        is, cast it, then move it to the device.

        ``model`` is a model, or the directory of a saved one: then the model is built without weights
        and this rank reads only its own slices from the files (``model_class`` overrides the class
        ``config.json`` names), rank 0 showing a bar of its own reads (:mod:`tpcore.progress`). Rank 0 logs
        the plan's bytes per rank, and warns when much of the model stays whole (:meth:`ShardPlan.log`).
        Returns this rank's shard of the model (the same object for a model), in eval mode and without
        gradients (tensor parallelism here is for inference).
        """
        dtype = resolve_dtype(
            fp16, self.dtype, check_placement(self.backend, self._local_world_size(), self.device_type)
        )
        if is_checkpoint_path(model):
            checkpoint = Checkpoint(model)
            model = checkpoint_skeleton(checkpoint, checkpoint.config(), model_class, quantized_formats())
        else:
            adopt_quantized_model(model, quantized_formats())
            checkpoint = None
        # Fail on bad input (and, from a checkpoint, on missing weights) before joining any process group.
        policies = choose_policies(model, self.custom_policies)
        plan = plan_for(model, policies, self.world_size, vocab_parallel=self.vocab_parallel)
        if dtype is not None:  # the ranks hold their tensors cast: the plan counts them so
            plan.dtypes.update(cast_dtypes(model, dtype))
        if checkpoint is not None:
            reads = checkpoint.reads(model, plan.splits)
        device = self.device
        bind_device(device)  # before the group: NCCL and CUDA's context on this rank's GPU
        group = self.create_process_group(self.backend)
        if group is not None:
            shm.attach(group)  # gloo ranks of one host: shared-memory collectives
        rank = group_rank(group)
        if rank == 0:
            log_plan(plan)
        model.eval().requires_grad_(False)
        apply_plan(plan, model, rank, group, gather_logits=self.gather_logits)
        if checkpoint is not None:
            self._load(checkpoint, model, reads, plan, rank, device, dtype)
        localize_quantized(model, rank, self.world_size)
        if dtype is not None:
            cast_model(model, dtype)
        model = model.to(device)  # module.to also moves non-persistent buffers
        ready_quantized(model)
        transpose_linear_weights(model)  # CPU weights only
        return model

    def _load(self, checkpoint: Checkpoint, model: nn.Module, reads, plan, rank: int, device, dtype) -> None:
        """Read this rank's slices into ``model`` (already split), each linear weight laid out for the CPU as it is
        read; rank 0 shows the bar of its own reads."""
        layout = {"lay_out": lay_out, "laid_out": linear_weight_names(model)}
        if rank != 0:
            checkpoint.load_into(model, reads, rank, self.world_size, device, dtype, **layout)
            return
        total = checkpoint.bytes_to_read(reads, plan.shard_shape)
        with LoadBar(total, f"tpcore: rank 0 of {self.world_size} loading") as bar:
            checkpoint.load_into(model, reads, rank, self.world_size, device, dtype, progress=bar.add, **layout)
            bar.done(f"tpcore: rank 0 of {self.world_size} loaded")
