"""parallelformers' names: :class:`TensorReplacer` (with ``auto_policy``, ``replace_modules``,
``replace_user_define_modules``, ``replace_orig_to_megatron_modules``, ``preprocess``, ``set_parameters``,
``set_layer_size``, ``make_megatron_layer``), :class:`TensorSlicer` (``column_slice``, ``row_slice``),
``split_dims``, ``check_divisible``, ``shard``, ``shard_ranges``: each a thin layer over the shard plan
(:mod:`tpcore.plan`) and :class:`~tpcore.cut.split.Split`.

Everything is validated before anything is changed: a model that fails a check is left untouched and
the error names the model, the tensor and the size. Changes are instance-level only: parameter data,
module sizes, ``__class__`` of the modules that become row or vocab parallel, and attributes the
policy lists. No transformers class is patched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tpcore.authoring import COLUMN, ROW, Layer, Policy
from tpcore.cut.split import Split
from tpcore.errors import ShardingError
from tpcore.parallel.comm import group_rank, group_size
from tpcore.plan import ShardPlan, apply_plan, class_for, plan_for
from tpcore.plan.build import resolve_layer
from tpcore.plan.paths import get_path, set_path
from tpcore.plan.vocabulary import vocabulary_modules
from tpcore.select.auto import AutoPolicy, as_policy_list, choose_policies

__all__ = [
    "COLUMN",
    "ROW",
    "TensorReplacer",
    "TensorSlicer",
    "check_divisible",
    "make_megatron_layer",
    "shard",
    "shard_ranges",
    "split_dims",
]


def make_megatron_layer(policy: type[Policy]) -> list[tuple[str, Layer]]:
    """The policy's tensors with their style, ``[(style, Layer)]`` (:meth:`tpcore.Policy.layers`)."""
    return [(str(spec.style), spec) for spec in policy.layers()]


def check_divisible(size: int, world_size: int, n_fused: int = 1, heads: int | None = None) -> None:
    """Raise :class:`ShardingError` unless ``size`` splits into ``n_fused * world_size`` equal pieces
    (or, for a tensor of ``heads`` heads, into ``n_fused * heads`` and the heads evenly over the ranks)."""
    split = Split(0, n_fused, heads)
    split.check(size, world_size)
    if not split.even(size, world_size):
        units = f"{heads} heads" if heads else f"{size // n_fused} features"
        raise ShardingError(f"size {size}: {units} cannot be split evenly over {world_size} ranks")


def shard_ranges(
    size: int, rank: int, world_size: int, n_fused: int = 1, heads: int | None = None, pad: bool = False
) -> tuple[list[tuple[int, int]], int]:
    """:meth:`Split.ranges` of ``Split(0, n_fused, heads, pad)``."""
    return Split(0, n_fused, heads, pad).ranges(size, rank, world_size)


def shard(
    tensor: torch.Tensor,
    dim: int,
    rank: int,
    world_size: int,
    n_fused: int = 1,
    heads: int | None = None,
    pad: bool = False,
) -> torch.Tensor:
    """:meth:`Split.shard` of ``Split(dim, n_fused, heads, pad)``."""
    return Split(dim, n_fused, heads, pad).shard(tensor, rank, world_size)


def split_dims(style: str, layer: Layer) -> tuple[int, int | None]:
    """Split dimensions ``(weight_dim, bias_dim)`` of ``layer`` in a ``style`` group: :meth:`Layer.dims`."""
    return dataclasses.replace(layer, style=style).dims()


class TensorSlicer:
    """Slices the tensors of a :class:`Layer` for one rank of a ``world_size`` group."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size

    def column_slice(
        self, layer: Layer, weight: torch.Tensor, bias: torch.Tensor | None, heads: int | None = None, config=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shard ``weight`` and ``bias`` along the output features (``heads`` overrides ``layer.heads``;
        ``config`` resolves the head counts ``layer`` names)."""
        return self._slice(COLUMN, layer, weight, bias, heads, config)

    def row_slice(
        self, layer: Layer, weight: torch.Tensor, bias: torch.Tensor | None, heads: int | None = None, config=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shard ``weight`` along the input features; ``bias`` stays whole (added once after the reduce)."""
        return self._slice(ROW, layer, weight, bias, heads, config)

    def _slice(self, style, layer, weight, bias, heads, config):
        layer = dataclasses.replace(layer, style=style, **({} if heads is None else {"heads": heads}))
        weight_split, bias_split = layer.splits(config)
        weight = weight_split.shard(weight, self.rank, self.world_size)
        if bias is not None and bias_split is not None:
            bias = bias_split.shard(bias, self.rank, self.world_size)
        return weight, bias


class TensorReplacer:
    """Splits the layers of ``model`` that ``custom_policies`` (or the installed plugins) cover.

    Args:
        model: the model, changed in place.
        mp_group: the tensor-parallel process group (``None``: not distributed, world of one,
            unless ``rank`` is given).
        fp16: kept for the predecessor's signature; dtype is the engine's business.
        num_gpus: the world size; must equal the size of ``mp_group``.
        custom_policies: a Policy class or a list of them; ``None`` asks :class:`AutoPolicy`.
        rank: this rank in the group, for slicing without a process group (tests, tooling).
        vocab_parallel: split the input and output embeddings over the vocabulary.
        gather_logits: a vocab-parallel LM head returns the whole vocabulary's logits (else this
            rank's ``ceil(V / N)`` columns).
    """

    def __init__(
        self,
        model,
        mp_group=None,
        fp16=False,
        num_gpus=1,
        custom_policies=None,
        rank=None,
        *,
        vocab_parallel: bool = True,
        gather_logits: bool = True,
    ):
        self.model = model
        self.vocab_parallel = vocab_parallel
        self.gather_logits = gather_logits
        self.tp_group = self.mp_group = mp_group  # mp_group: parallelformers' name
        self.fp16 = fp16
        self.world_size = self.num_gpus = int(num_gpus)
        self.custom_policies = as_policy_list(custom_policies)
        if rank is None:
            if mp_group is not None and group_size(mp_group) != self.world_size:
                raise ValueError(f"num_gpus={num_gpus} but the process group has {group_size(mp_group)} ranks")
            rank = group_rank(mp_group) if mp_group is not None else 0
            if mp_group is None and self.world_size != 1:
                raise ValueError(f"num_gpus={num_gpus} needs a process group (or an explicit rank)")
        if not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        self.rank = rank

    # -- the public steps, in the predecessor's names ------------------------------------------

    def auto_policy(self) -> list[type[Policy]]:
        """The policies of installed plugins that cover this model."""
        return AutoPolicy().get_policy(self.model)

    def split_plan(self) -> ShardPlan:
        """The validated :class:`~tpcore.plan.ShardPlan` of this model over ``num_gpus`` ranks; the model
        is not changed. Raises :class:`UnsupportedModelError` when no policy covers the model,
        :class:`ShardingError` naming the model, tensor and size otherwise."""
        return plan_for(self.model, self._policies(), self.world_size, vocab_parallel=self.vocab_parallel)

    def validate(self) -> list[type[Policy]]:
        """Check, without changing anything, that the model splits over ``num_gpus`` ranks; return the
        policies that apply."""
        return self.split_plan().policies

    def replace_modules(self) -> nn.Module:
        """Validate, then split every covered layer of the model; return the model."""
        plan = self.split_plan()
        return apply_plan(plan, self.model, self.rank, self.tp_group, gather_logits=self.gather_logits)

    def vocab_modules(self) -> list[nn.Module]:
        """The input and output embeddings to split over the vocabulary (none if ``vocab_parallel`` is off)."""
        return vocabulary_modules(self.model) if self.vocab_parallel else []

    def replace_user_define_modules(self, model: nn.Module, policy_cls: type[Policy]) -> None:
        """Give modules inside each layer of ``policy_cls`` the classes its ``replace_modules`` names."""
        for _, layer in model.named_modules():
            if policy_cls.matches(layer):
                for path, rule in policy_cls.replace_modules().items():
                    module = get_path(layer, path)
                    new_class = class_for(module if isinstance(module, nn.Module) else None, rule)
                    if new_class is not None:
                        module.__class__ = new_class
                        if hasattr(new_class, "tp_group"):
                            module.tp_group = self.tp_group

    def replace_orig_to_megatron_modules(self, model: nn.Module, policy_cls: type[Policy]) -> None:
        """Slice every layer of ``policy_cls`` in ``model`` and make its row groups all-reduce."""
        plan = plan_for(model, [policy_cls], self.world_size, vocab_parallel=False, rewrites=False)
        apply_plan(plan, model, self.rank, self.tp_group)

    def preprocess(self, layer: nn.Module, policy: type[Policy]) -> list[tuple[str, Layer, nn.Parameter, Any]]:
        """Resolve the policy's ``Layer`` paths on one layer instance: ``(style, Layer, weight, bias)``.

        Layers marked ``optional`` (``ignore_checker``) whose weight is missing are dropped.
        """
        resolved = []
        for style, spec in make_megatron_layer(policy):
            tensors = resolve_layer(layer, spec)
            if tensors is None:
                raise ShardingError(
                    f"policy {policy.policy_name()} names {spec.weight!r} or {spec.bias!r}, which the layer lacks"
                )
            if tensors:
                resolved.append((style, spec, *tensors))
        return resolved

    def set_parameters(self, layer: nn.Module, spec: Layer, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Put the shards into the layer's existing parameters (identity and ties are kept)."""
        with torch.no_grad():
            get_path(layer, spec.weight).data = weight
            if bias is not None and spec.bias:
                get_path(layer, spec.bias).data = bias

    def set_layer_size(self, policy: nn.Module, name: str, size: Any) -> None:
        """Set attribute ``name`` (a path inside the layer instance ``policy``) to its per-rank ``size``."""
        set_path(policy, name, size)

    @staticmethod
    def make_megatron_layer(policy: type[Policy]) -> list[tuple[str, Layer]]:
        """The policy's tensors with their parallel style: column for q/k/v and MLP in, row for the outputs."""
        return make_megatron_layer(policy)

    def _policies(self) -> list[type[Policy]]:
        return choose_policies(self.model, self.custom_policies)
