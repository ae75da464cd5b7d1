"""TensorReplacer: the seed API (parallelformers' names), a thin layer over :class:`~tpcore.plan.ShardPlan`.

Everything is validated before anything is changed (see :mod:`tpcore.plan`): a model that fails a check
is left untouched and the error names the model, the tensor and the size. Changes are instance-level
only: parameter data, module sizes, ``__class__`` of the modules that become row or vocab parallel,
and attributes the policy lists. No transformers class is patched.

Besides the layers the policies cover, the model's input and output embeddings (what
``get_input_embeddings()`` / ``get_output_embeddings()`` return) are split over the vocabulary when
their type has a vocabulary-parallel layer and nothing else shares their tensors; others stay whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpcore.select.auto import AutoPolicy
from tpcore.parallel.comm import group_rank, group_size
from tpcore.plan.shard_plan import (
    ShardPlan,
    get_path,
    make_megatron_layer,
    module_classes,
    resolve_layer,
    set_path,
    vocabulary_modules,
)
from tpcore.authoring.policy import Layer, Policy, ShardingError

__all__ = ["TensorReplacer"]


def _as_list(policies) -> list[type[Policy]]:
    """``custom_policies`` as a list: ``None``, one Policy class, or a list/tuple of them."""
    if policies is None:
        return []
    if isinstance(policies, type):
        return [policies]
    if isinstance(policies, (list, tuple)):
        return list(policies)
    raise TypeError(f"custom_policies must be a Policy subclass or a list of them, got {policies!r}")


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
        self.custom_policies = _as_list(custom_policies)
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
        return ShardPlan.build(self.model, self._policies(), self.world_size, vocab_parallel=self.vocab_parallel)

    def validate(self) -> list[type[Policy]]:
        """Check, without changing anything, that the model splits over ``num_gpus`` ranks; return the
        policies that apply."""
        return self.split_plan().policies

    def replace_modules(self) -> nn.Module:
        """Validate, then split every covered layer of the model; return the model."""
        return self.split_plan().apply(self.model, self.rank, self.tp_group, gather_logits=self.gather_logits)

    def vocab_modules(self) -> list[nn.Module]:
        """The input and output embeddings to split over the vocabulary (none if ``vocab_parallel`` is off)."""
        return vocabulary_modules(self.model) if self.vocab_parallel else []

    def replace_user_define_modules(self, model: nn.Module, policy_cls: type[Policy]) -> None:
        """Give modules inside each layer of ``policy_cls`` the classes its ``replace_modules`` names."""
        for _, layer in model.named_modules():
            if policy_cls.matches(layer):
                for path, new_class in module_classes(policy_cls, layer).items():
                    module = get_path(layer, path)
                    module.__class__ = new_class
                    if hasattr(new_class, "tp_group"):
                        module.tp_group = self.tp_group

    def replace_orig_to_megatron_modules(self, model: nn.Module, policy_cls: type[Policy]) -> None:
        """Slice every layer of ``policy_cls`` in ``model`` and make its row groups all-reduce."""
        plan = ShardPlan.build(model, [policy_cls], self.world_size, vocab_parallel=False, rewrites=False)
        plan.apply(model, self.rank, self.tp_group)

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
        return self.custom_policies or self.auto_policy()
