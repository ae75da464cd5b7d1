"""ParallelEngine: parallelize a model on one rank (SPMD, under torchrun or inside a worker)."""

from __future__ import annotations

import os

import torch
from torch import nn

from tpcore.comm import group_rank
from tpcore.distributed import default_backend, device_for, tensor_parallel_group
from tpcore.replacer import TensorReplacer

__all__ = ["ParallelEngine"]


class ParallelEngine:
    """Turns a whole model into this rank's shard of it.

    Args:
        num_gpus: tensor-parallel world size (CPU processes with gloo, GPUs with NCCL).
        backend: ``"nccl"``, ``"gloo"`` or ``None`` for NCCL when CUDA is there, else gloo.
        custom_policies: a Policy class or list of them; ``None`` uses the installed plugins.
        dtype: convert the model to this dtype after slicing (``fp16=True`` means ``torch.float16``).
        process_group: use this group instead of creating one.
    """

    def __init__(
        self, num_gpus: int, backend: str | None = None, custom_policies=None, *, dtype=None, process_group=None
    ):
        if int(num_gpus) < 1:
            raise ValueError(f"num_gpus must be at least 1, got {num_gpus}")
        self.num_gpus = int(num_gpus)
        self.backend = backend or default_backend()
        self.custom_policies = custom_policies
        self.dtype = dtype
        self.mp_group = process_group

    def create_process_group(self, backend: str | None = None):
        """Create (or reuse) the tensor-parallel group; ``None`` for a world of one without torch.distributed."""
        if self.mp_group is None:
            self.mp_group = tensor_parallel_group(self.num_gpus, backend or self.backend)
        return self.mp_group

    @property
    def device(self) -> torch.device:
        local_rank = int(os.environ.get("LOCAL_RANK", group_rank(self.mp_group)))
        return device_for(self.backend, local_rank)

    def parallelize(self, model: nn.Module, fp16: bool = False) -> nn.Module:
        """Validate, slice and replace modules where the model is, then move it to this rank's device.

        Returns the same model object, now holding only this rank's shard, in eval mode and
        without gradients (tensor parallelism here is for inference).
        """
        # Fail on bad input before joining any process group.
        TensorReplacer(model, None, fp16, self.num_gpus, self.custom_policies, rank=0).validate()
        group = self.create_process_group(self.backend)
        model.eval().requires_grad_(False)
        TensorReplacer(model, group, fp16, self.num_gpus, self.custom_policies).replace_modules()
        dtype = torch.float16 if fp16 else self.dtype
        if dtype is not None:
            model.to(dtype)
        device = self.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return model.to(device)  # module.to also moves non-persistent buffers
