"""TensorReplacer: apply policies to a model instance (slice tensors, swap row-parallel modules).

Everything is validated before anything is changed: every module a policy names exists, every
tensor splits evenly over the world size, every per-rank attribute exists and divides. A model
that fails any check is left untouched and the error names the model, the tensor and the size.
Changes are instance-level only: parameter data, module sizes, ``__class__`` of the modules that
become row or vocab parallel, and attributes the policy lists. No transformers class is patched.

Besides the layers the policies cover, the model's input and output embeddings (what
``get_input_embeddings()`` / ``get_output_embeddings()`` return) are split over the vocabulary when
they are plain ``nn.Embedding`` / ``nn.Linear`` modules that nothing else shares; other kinds stay
whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tpcore.auto import AutoPolicy
from tpcore.comm import group_rank, group_size
from tpcore.configs import module_configs
from tpcore.layers import make_row_parallel, make_vocab_parallel, row_parallel_class, set_layer_size
from tpcore.policy import Layer, Policy, ShardingError
from tpcore.slicer import COLUMN, ROW, Split, TensorSlicer, check_divisible, shard, split_dims

__all__ = ["TensorReplacer"]

_MISSING = object()


def get_path(root: Any, path: str) -> Any:
    """``root.a.b.0.c`` for ``path = "a.b.0.c"``; ``_MISSING`` if any step is absent."""
    obj = root
    for name in path.split(".") if path else []:
        obj = getattr(obj, name, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def set_path(root: Any, path: str, value: Any) -> None:
    owner_path, _, name = path.rpartition(".")
    setattr(get_path(root, owner_path), name, value)


def _as_list(policies) -> list[type[Policy]]:
    """``custom_policies`` as a list: ``None``, one Policy class, or a list/tuple of them."""
    if policies is None:
        return []
    if isinstance(policies, type):
        return [policies]
    if isinstance(policies, (list, tuple)):
        return list(policies)
    raise TypeError(f"custom_policies must be a Policy subclass or a list of them, got {policies!r}")


@dataclass
class _Target:
    """One layer instance of the model, the policy that applies to it and its sub-model's config."""

    name: str
    layer: nn.Module
    policy: type[Policy]
    config: Any = None


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
        self.mp_group = mp_group
        self.fp16 = fp16
        self.num_gpus = int(num_gpus)
        self.custom_policies = _as_list(custom_policies)
        if rank is None:
            if mp_group is not None and group_size(mp_group) != self.num_gpus:
                raise ValueError(f"num_gpus={num_gpus} but the process group has {group_size(mp_group)} ranks")
            rank = group_rank(mp_group) if mp_group is not None else 0
            if mp_group is None and self.num_gpus != 1:
                raise ValueError(f"num_gpus={num_gpus} needs a process group (or an explicit rank)")
        self.slicer = TensorSlicer(rank, self.num_gpus)

    # -- the public steps, in the predecessor's names ------------------------------------------

    def auto_policy(self) -> list[type[Policy]]:
        """The policies of installed plugins that cover this model."""
        return AutoPolicy().get_policy(self.model)

    def validate(self) -> list[type[Policy]]:
        """Check, without changing anything, that the model splits over ``num_gpus`` ranks.

        Returns the policies that apply. Raises :class:`UnsupportedModelError` when no policy
        covers the model, :class:`ShardingError` naming the model, tensor and size otherwise.
        """
        policies = self._policies()
        self._validate(self._targets(policies))
        return policies

    def split_plan(self) -> dict[int, Split]:
        """``{id(tensor): Split}`` for every tensor the split cuts (validated first).

        Lets a caller cut a rank's shards out of a model without changing it.
        """
        targets = self._targets(self._policies())
        self._validate(targets)
        plan = {}
        for target in targets:
            for style, spec, weight, bias in self.preprocess(target.layer, target.policy):
                weight_dim, bias_dim = split_dims(style, spec)
                heads = self._heads(spec, target.config)
                plan[id(weight)] = Split(weight_dim, spec.n_fused, heads)
                if bias is not None and bias_dim is not None:
                    plan[id(bias)] = Split(bias_dim, spec.n_fused, heads)
        for module in self.vocab_modules():
            for tensor in (module.weight, getattr(module, "bias", None)):
                if tensor is not None and id(tensor) not in plan:
                    plan[id(tensor)] = Split(0, pad=True)
        return plan

    def replace_modules(self) -> nn.Module:
        """Validate, then split every covered layer of the model; return the model."""
        targets = self._targets(self._policies())
        arguments = self._validate(targets)
        sliced: set[int] = set()
        vocab_modules = self.vocab_modules()
        for target in targets:
            self._apply(target, sliced, arguments[target.policy, id(target.config)])
        self._split_vocab(vocab_modules, sliced)
        return self.model

    def vocab_modules(self) -> list[nn.Module]:
        """The input and output embeddings to split over the vocabulary (none if ``vocab_parallel`` is off).

        Only an exact ``nn.Embedding`` (without ``max_norm``) or ``nn.Linear`` qualifies, and only if no
        module but these two and their parents (BERT's head keeps the decoder's bias there) holds its
        weight or bias: a subclass may do more than a lookup, and a tensor that some other module reads
        must stay whole.
        """
        if not self.vocab_parallel:
            return []
        found: dict[int, nn.Module] = {}
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            try:
                module = getattr(self.model, getter)()
            except (AttributeError, NotImplementedError):
                continue
            if (type(module) is nn.Embedding and module.max_norm is None) or type(module) is nn.Linear:
                found[id(module)] = module
        names = {id(module): name for name, module in self.model.named_modules()}
        parents = {names[key].rpartition(".")[0] for key in found if key in names}
        allowed = found.keys() | {id(module) for name, module in self.model.named_modules() if name in parents}
        holders: dict[int, set[int]] = {}
        for module in self.model.modules():
            for tensor in module._parameters.values():
                if tensor is not None:
                    holders.setdefault(id(tensor), set()).add(id(module))
        return [
            module
            for module in found.values()
            if all(
                holders.get(id(tensor), set()) <= allowed
                for tensor in (module.weight, getattr(module, "bias", None))
                if tensor is not None
            )
        ]

    def replace_user_define_modules(self, model: nn.Module, policy_cls: type[Policy]) -> None:
        """Give modules inside each layer of ``policy_cls`` the classes its ``replace_modules`` names."""
        for target in self._targets([policy_cls], model):
            for path, new_class in policy_cls.replace_modules().items():
                self._swap_class(get_path(target.layer, path), new_class)

    def replace_orig_to_megatron_modules(self, model: nn.Module, policy_cls: type[Policy]) -> None:
        """Slice every layer of ``policy_cls`` in ``model`` and make its row groups all-reduce."""
        sliced: set[int] = set()
        for target in self._targets([policy_cls], model):
            self._slice_layer(target, sliced)

    def preprocess(self, layer: nn.Module, policy: type[Policy]) -> list[tuple[str, Layer, nn.Parameter, Any]]:
        """Resolve the policy's ``Layer`` paths on one layer instance: ``(style, Layer, weight, bias)``.

        Layers marked ``ignore_checker`` whose weight is missing are dropped.
        """
        resolved = []
        for style, spec in self.make_megatron_layer(policy):
            weight = get_path(layer, spec.weight) if spec.weight else _MISSING
            if weight is _MISSING:
                if spec.ignore_checker:
                    continue
                raise ShardingError(f"policy {policy.policy_name()} names {spec.weight!r}, which the layer lacks")
            bias = get_path(layer, spec.bias) if spec.bias else None
            if bias is _MISSING:
                if spec.ignore_checker:
                    bias = None
                else:
                    raise ShardingError(f"policy {policy.policy_name()} names {spec.bias!r}, which the layer lacks")
            resolved.append((style, spec, weight, bias))
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
        return (
            [(COLUMN, spec) for spec in policy.attn_qkv()]
            + [(COLUMN, spec) for spec in policy.mlp_in()]
            + [(ROW, spec) for spec in policy.attn_out()]
            + [(ROW, spec) for spec in policy.mlp_out()]
        )

    # -- internals -------------------------------------------------------------------------

    def _policies(self) -> list[type[Policy]]:
        policies = self.custom_policies or self.auto_policy()
        for policy in policies:
            if not (isinstance(policy, type) and issubclass(policy, Policy)):
                raise TypeError(f"custom_policies must be Policy subclasses, got {policy!r}")
        return policies

    @property
    def _model_name(self) -> str:
        return type(self.model).__name__

    def _targets(self, policies: list[type[Policy]], model: nn.Module | None = None) -> list[_Target]:
        model = self.model if model is None else model
        targets = []
        configs = module_configs(model)
        claimed: dict[str, type[Policy]] = {}
        for policy in policies:
            other = claimed.setdefault(policy.layer_class_name(), policy)
            if other is not policy:  # two policies would split the same tensors twice
                both = f"{other.policy_name()} and {policy.policy_name()}"
                raise ShardingError(f"policies {both} both apply to {policy.layer_class_name()}")
            found = [
                _Target(name, module, policy, configs[name])
                for name, module in model.named_modules()
                if policy.matches(module)
            ]
            if not found:
                raise ShardingError(
                    f"policy {policy.policy_name()} applies to {policy.layer_class_name()}, "
                    f"which {type(model).__name__} does not contain"
                )
            targets.extend(found)
        return targets

    def _error(self, where: str, detail: str) -> ShardingError:
        return ShardingError(f"cannot split {self._model_name} over {self.num_gpus} ranks: {where}: {detail}")

    def _validate(self, targets: list[_Target]) -> dict[tuple[type[Policy], int], dict[str, Any]]:
        """Check everything the split will touch; return the per-rank attributes of each
        ``(policy, id(sub-model config))``: a policy reads the config of its layer's sub-model."""
        arguments = {}
        for target in targets:
            policy, key = target.policy, (target.policy, id(target.config))
            if key not in arguments:
                try:
                    arguments[key] = policy.replace_arguments(target.config, self.num_gpus)
                except ShardingError as error:
                    raise self._error(f"policy {policy.policy_name()}", str(error)) from None
            where = f"{target.name} ({type(target.layer).__name__}, policy {policy.policy_name()})"
            for path in arguments[key]:
                if get_path(target.layer, path) is _MISSING:
                    raise self._error(where, f"attribute {path!r} to rewrite does not exist")
            for path in policy.replace_modules():
                if not isinstance(get_path(target.layer, path), nn.Module):
                    raise self._error(where, f"module {path!r} to replace does not exist")
            try:
                resolved = self.preprocess(target.layer, policy)
            except ShardingError as error:
                raise self._error(where, str(error)) from None
            for style, spec, weight, bias in resolved:
                weight_dim, bias_dim = split_dims(style, spec)
                for path, tensor, dim in ((spec.weight, weight, weight_dim), (spec.bias, bias, bias_dim)):
                    if tensor is None or dim is None:
                        continue
                    full_path = f"{target.name}.{path}"
                    if not isinstance(tensor, torch.Tensor) or tensor.dim() <= dim:
                        raise self._error(full_path, f"not a tensor with a dimension {dim} to split")
                    try:
                        check_divisible(
                            tensor.shape[dim], self.num_gpus, spec.n_fused, self._heads(spec, target.config)
                        )
                    except ShardingError as error:
                        raise self._error(
                            f"tensor {full_path!r} of shape {tuple(tensor.shape)}, split along dim {dim}", str(error)
                        ) from None
                if style == ROW and spec.replace is None:
                    try:
                        row_parallel_class(get_path(target.layer, spec.module_path))
                    except ShardingError as error:
                        raise self._error(f"{target.name}.{spec.module_path}", str(error)) from None
        return arguments

    def _apply(self, target: _Target, sliced: set[int], arguments: dict[str, Any]) -> None:
        self._slice_layer(target, sliced)
        for path, value in arguments.items():
            self.set_layer_size(target.layer, path, value)
        for path, new_class in target.policy.replace_modules().items():
            self._swap_class(get_path(target.layer, path), new_class)

    def _swap_class(self, module: nn.Module, new_class: type[nn.Module]) -> None:
        """Give ``module`` a policy's class; a class that declares ``tp_group`` gets the group."""
        module.__class__ = new_class
        if hasattr(new_class, "tp_group"):
            module.tp_group = self.mp_group

    def _heads(self, spec: Layer, config: Any) -> int | None:
        """The head count a ``Layer(heads=...)`` names, read from the layer's sub-model ``config``."""
        if spec.heads is None:
            return None
        heads = getattr(config, spec.heads, None)
        if not isinstance(heads, int):
            raise ShardingError(f"Layer {spec.weight!r} names heads={spec.heads!r}, which the config lacks")
        return heads

    def _split_vocab(self, modules: list[nn.Module], sliced: set[int]) -> None:
        """Give each module its rows of the vocabulary and its vocab-parallel class (ties stay tied)."""
        vocab_sizes = {id(module.weight): module.weight.shape[0] for module in modules}
        rank, world_size = self.slicer.rank, self.slicer.world_size
        for module in modules:
            vocab_size = vocab_sizes[id(module.weight)]
            with torch.no_grad():
                for tensor in (module.weight, getattr(module, "bias", None)):
                    if tensor is not None and id(tensor) not in sliced:
                        sliced.add(id(tensor))
                        tensor.data = shard(tensor.data, 0, rank, world_size, pad=True)
            rows = module.weight.shape[0]
            make_vocab_parallel(module, self.mp_group, rank * rows, vocab_size, self.gather_logits)

    def _slice_layer(self, target: _Target, sliced: set[int]) -> None:
        for style, spec, weight, bias in self.preprocess(target.layer, target.policy):
            if id(weight) in sliced:  # a tied tensor already holds its shard
                continue
            sliced.update({id(weight), id(bias)} if bias is not None else {id(weight)})
            slice_fn = self.slicer.column_slice if style == COLUMN else self.slicer.row_slice
            shards = slice_fn(spec, weight.data, None if bias is None else bias.data, self._heads(spec, target.config))
            self.set_parameters(target.layer, spec, *shards)
            owner = get_path(target.layer, spec.module_path)
            set_layer_size(owner)
            if style == ROW:
                make_row_parallel(owner, self.mp_group, spec.replace)
            elif spec.replace is not None:
                self._swap_class(owner, spec.replace)
