"""ShardPlan: how a model splits over ``world_size`` ranks, resolved and validated once.

A plan is built from a model (real weights, or parameters on the meta device), the policies that
cover it and a world size. It says, for every tensor of the model, how it is cut (a
:class:`~tpcore.slicer.Split`) or that it is replicated, and for every module it touches, the
attributes to set per rank and the class to give it. Tensors are named by their first name in
:func:`~tpcore.skeleton.named_tensors` and modules by their path, so the same plan applies to any
copy of the model: the model itself (sliced in place under ``torchrun``), its meta skeleton (sent to
the ranks of ``parallelize()``), or one built empty from a checkpoint's config::

    plan = ShardPlan.build(model, policies, world_size)   # ShardingError before anything changes
    plan.splits[name]                                      # Split, or None: replicated
    plan.share(name, tensor, rank)                         # rank's part of a whole tensor
    plan.apply(model, rank, tp_group)                      # slice in place, rewrite the modules
    print(plan.report())                                   # what is cut how, bytes per rank
    plan.kept_whole[name]                                  # why a replicated tensor stays whole
    plan.log()                                             # bytes per rank (info); what stays whole (warning)

Sizes that the world size does not divide are dealt in whole units (heads, features), so ranks may
hold different shares (:mod:`tpcore.shares`): then shapes, attributes (:class:`~tpcore.shares.PerRank`
values) and bytes differ by rank, and :attr:`ShardPlan.uniform` is false.

Nothing of the model is changed by building a plan; every check runs first, and an error names
the model, the world size, the layer and the tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from tpcore.configs import module_configs, sub_models
from tpcore.parallel.layers import (
    VocabParallelEmbedding,
    make_vocab_parallel,
    row_parallel_class,
    set_layer_size,
    vocab_parallel_class,
)
from tpcore.authoring.policy import IfHeld, Layer, Policy, ShardingError
from tpcore.cut.shares import PerRank, resolve
from tpcore.load.skeleton import named_tensors
from tpcore.cut.split import COLUMN, ROW, Split

__all__ = ["REPLICATED_SHARE", "ShardPlan", "Whole", "format_bytes", "get_path", "set_path"]

_MISSING = object()

#: :meth:`ShardPlan.log` warns when the tensors every rank holds whole exceed this share of the model's bytes
REPLICATED_SHARE = 0.10
#: how many of the largest replicated modules that warning names
_NAMED_IN_WARNING = 3

logger = logging.getLogger("tpcore.plan")

#: attributes attention modules keep their per-head width in (BERT, GPT-2/Llama, T5, XLNet, ...)
_HEAD_DIM_ATTRIBUTES = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "d_head")


def get_path(root: Any, path: str) -> Any:
    """``root.a.b.0.c`` for ``path = "a.b.0.c"``; ``_MISSING`` if any step is absent."""
    obj = root
    for name in path.split(".") if path else []:
        obj = getattr(obj, name, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def module_classes(policy: type[Policy], layer: nn.Module) -> dict[str, type[nn.Module]]:
    """The classes ``policy.replace_modules()`` gives the modules of ``layer``, ``{path: class}``: a
    function value is called with the module there (``None`` where the layer has none) and may
    return ``None`` to leave it as it is."""
    classes = {}
    for path, given in policy.replace_modules().items():
        if isinstance(given, type):
            classes[path] = given
            continue
        module = get_path(layer, path)
        chosen = given(module if isinstance(module, nn.Module) else None)
        if chosen is not None:
            classes[path] = chosen
    return classes


def set_path(root: Any, path: str, value: Any) -> None:
    owner_path, _, name = path.rpartition(".")
    setattr(get_path(root, owner_path), name, value)


def join(*paths: str) -> str:
    return ".".join(path for path in paths if path)


@dataclass(frozen=True)
class Target:
    """One layer instance of the model, the policy that applies to it and the config it reads."""

    name: str
    layer: nn.Module
    policy: type[Policy]
    config: Any

    @property
    def where(self) -> str:
        return f"{self.name} ({type(self.layer).__name__}, policy {self.policy.policy_name()})"


class Whole(NamedTuple):
    """Why a tensor stays whole on every rank: the class of the module holding it, and the reason."""

    module_class: str
    reason: str


@dataclass
class ShardPlan:
    """Every tensor's cut and every module's per-rank rewrite for one model and world size.

    Attributes:
        model_name: the model's class name (for messages).
        world_size: the number of ranks.
        shapes: every tensor's whole shape, by first name.
        splits: the cut tensors, by first name (a tensor not listed is replicated).
        attributes: per-rank values of module attributes, by path from the model (``"h.0.attn.num_heads"``);
            a :class:`~tpcore.shares.PerRank` value holds one per rank.
        classes: classes to give modules, by module path (row-parallel layers, a policy's replacements).
        vocab: vocabulary-parallel modules, by path: the whole table's row count.
        resized: modules whose size attributes follow their sliced weight (``in_features``, ...).
        policies: the policies that apply.
        kept_whole: every tensor not cut (replicated on every rank), by first name: why (:class:`Whole`).
    """

    model_name: str
    world_size: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    splits: dict[str, Split] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    classes: dict[str, type[nn.Module]] = field(default_factory=dict)
    vocab: dict[str, int] = field(default_factory=dict)
    resized: list[str] = field(default_factory=list)
    policies: list[type[Policy]] = field(default_factory=list)
    kept_whole: dict[str, Whole] = field(default_factory=dict)

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        model: nn.Module,
        policies: list[type[Policy]],
        world_size: int,
        *,
        vocab_parallel: bool = True,
        rewrites: bool = True,
    ) -> ShardPlan:
        """Resolve and check how ``policies`` split ``model`` over ``world_size`` ranks.

        ``rewrites=False`` leaves out the policies' attribute rewrites and ``replace_modules`` (the
        seed API's ``replace_orig_to_megatron_modules`` slices only). Raises :class:`ShardingError`
        naming the model, the world size, the layer and the tensor; an exception a policy raises keeps
        its type and gains a note naming the model, the policy and the layer.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        plan = cls(type(model).__name__, world_size, policies=list(policies))
        tensors = named_tensors(model)
        plan.shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        plan.dtypes = {name: tensor.dtype for name, tensor in tensors.items()}
        first_name = {id(tensor): name for name, tensor in tensors.items()}
        targets = plan._targets(model)
        for target in targets:
            plan._add_layer(target, first_name, rewrites)
        vocabulary = vocabulary_choices(model)
        if vocab_parallel:
            plan._add_vocabulary(vocabulary, first_name)
        plan._check_whole_heads(model, first_name)
        plan._explain_whole(model, targets, vocabulary, first_name)
        return plan

    def error(self, where: str, detail: str) -> ShardingError:
        return ShardingError(f"cannot split {self.model_name} over {self.world_size} ranks: {where}: {detail}")

    def _targets(self, model: nn.Module) -> list[Target]:
        targets = []
        configs = module_configs(model)  # each layer reads the config of its own sub-model
        claimed: dict[str, type[Policy]] = {}
        for policy in self.policies:
            if not (isinstance(policy, type) and issubclass(policy, Policy)):
                raise TypeError(f"custom_policies must be Policy subclasses, got {policy!r}")
            other = claimed.setdefault(policy.layer_class_name(), policy)
            if other is not policy:  # two policies would split the same tensors twice
                both = f"{other.policy_name()} and {policy.policy_name()}"
                raise ShardingError(f"policies {both} both apply to {policy.layer_class_name()}")
            found = []
            for name, module in model.named_modules():
                if policy.matches(module):
                    target = Target(name, module, policy, configs[name])
                    with self._calling(target):  # the instance's own counts, where its blocks differ
                        found.append(dataclasses.replace(target, config=policy.layer_config(target.config, module)))
            if not found:
                raise ShardingError(
                    f"policy {policy.policy_name()} applies to {policy.layer_class_name()}, "
                    f"which {self.model_name} does not contain"
                )
            targets.extend(found)
        return targets

    @contextlib.contextmanager
    def _calling(self, target: Target) -> Iterator[None]:
        """Around a policy's own code: a ShardingError is restated for this model and layer; any other
        exception keeps its type and gains a note naming the model, the policy and the layer."""
        try:
            yield
        except ShardingError as error:
            raise self.error(target.where, str(error)) from None
        except Exception as error:
            add_note(error, f"while splitting {self.model_name} over {self.world_size} ranks: layer {target.where}")
            raise

    def _add_layer(self, target: Target, first_name: dict[int, str], rewrites: bool) -> None:
        policy, layer = target.policy, target.layer
        with self._calling(target):
            arguments = policy.replace_arguments(target.config, self.world_size) if rewrites else {}
            replaced = module_classes(policy, layer) if rewrites else {}
            specs = make_megatron_layer(policy)
        for path, value in arguments.items():
            if isinstance(value, IfHeld):
                if not isinstance(get_path(layer, value.module), nn.Module):
                    continue  # this instance lacks the module (a block of a hybrid stack)
                value = value.value
            owner, _, attribute = path.rpartition(".")
            declared = owner in replaced and hasattr(replaced[owner], attribute)  # by the class it is given
            if get_path(layer, path) is _MISSING and not declared:
                raise self.error(target.where, f"attribute {path!r} to rewrite does not exist")
            self.attributes[join(target.name, path)] = value
        for path, new_class in replaced.items():
            if not isinstance(get_path(layer, path), nn.Module):
                raise self.error(target.where, f"module {path!r} to replace does not exist")
            self.classes[join(target.name, path)] = new_class
        for style, spec in specs:
            self._add_tensors(target, style, spec, first_name)

    def _add_tensors(self, target: Target, style: str, spec: Layer, first_name: dict[int, str]) -> None:
        resolved = resolve_layer(target.layer, spec)
        if resolved is None:
            raise self.error(
                target.where, f"policy {target.policy.policy_name()} names {spec.weight!r} or {spec.bias!r}, "
                "which the layer lacks"
            )  # fmt: skip
        if not resolved:  # optional and absent
            return
        weight, bias = resolved
        with self._calling(target):
            weight_split, bias_split = spec.splits(style, target.config)
        for path, tensor, split in ((spec.weight, weight, weight_split), (spec.bias, bias, bias_split)):
            if tensor is None or split is None:
                continue
            full_path = join(target.name, path or "")
            if not isinstance(tensor, torch.Tensor) or not -tensor.dim() <= split.dim < tensor.dim():
                raise self.error(full_path, f"not a tensor with a dimension {split.dim} to split")
            where = f"tensor {full_path!r} of shape {tuple(tensor.shape)}, split along dim {split.dim}"
            try:
                split.check(tensor.shape[split.dim], self.world_size)
            except ShardingError as error:
                raise self.error(where, str(error)) from None
            if style == ROW and split.replicated(tensor.shape[split.dim], self.world_size):
                raise self.error(
                    where,
                    f"its {split.heads or split.parts} heads are fewer than the ranks (or than the ranks that share "
                    "a key/value head): a row-parallel sum would count a head held by two ranks twice",
                )
            split = split.resolved(tensor.dim())
            name = first_name[id(tensor)]
            earlier = self.splits.setdefault(name, split)
            if earlier != split:  # one tensor (tied) reached twice, cut two ways
                raise self.error(f"tensor {full_path!r}", f"is cut as {earlier} and as {split} by its policies")
        owner_path = join(target.name, spec.module_path)
        owner = get_path(target.layer, spec.module_path)
        if owner_path not in self.resized:
            self.resized.append(owner_path)
        replace = spec.replace if spec.replace is not None else row_parallel_class if style == ROW else None
        if replace is not None:
            try:  # a class, or a function of the module giving one (layers.column_split_norm_class)
                self.classes[owner_path] = replace if isinstance(replace, type) else replace(owner)
            except ShardingError as error:
                raise self.error(owner_path, str(error)) from None

    def _add_vocabulary(self, vocabulary: dict[str, tuple[nn.Module, str | None]], first_name: dict[int, str]) -> None:
        """Split the input and output embeddings over the vocabulary: those :func:`vocabulary_choices` finds
        splittable, unless a policy cuts them already."""
        cut_by_policies = set(self.splits)
        for path, (module, refusal) in vocabulary.items():
            if refusal is not None or first_name[id(module.weight)] in cut_by_policies:
                continue
            for tensor in (module.weight, getattr(module, "bias", None)):
                if tensor is not None:
                    self.splits.setdefault(first_name[id(tensor)], Split(0, pad=True))
            self.vocab[path] = int(module.weight.shape[0])  # type: ignore[index]

    def _explain_whole(
        self,
        model: nn.Module,
        targets: list[Target],
        vocabulary: dict[str, tuple[nn.Module, str | None]],
        first_name: dict[int, str],
    ) -> None:
        """Record why each tensor the plan does not cut stays whole: an embedding's own reason (or
        ``vocab_parallel=False``), a policy's layer that does not cut it, or no policy's layer around it."""
        by_layer = {target.name: target.policy for target in targets}
        layer_classes = ", ".join(dict.fromkeys(type(target.layer).__name__ for target in targets)) or "none"
        for path, module in model.named_modules():
            held = [*module._parameters.values(), *module._buffers.values()]
            names = [first_name[id(t)] for t in held if t is not None and id(t) in first_name]
            names = [name for name in names if name not in self.splits and name not in self.kept_whole]
            if not names:
                continue
            if path in vocabulary:
                reason = vocabulary[path][1] or "vocab_parallel=False"
            else:
                layer = next((name for name in _enclosing(path) if name in by_layer), None)
                if layer is not None:
                    reason = f"{by_layer[layer].policy_name()} does not cut it"
                else:
                    reason = f"outside the layers the policies split ({layer_classes})"
            for name in names:
                self.kept_whole[name] = Whole(type(module).__name__, reason)

    def _check_whole_heads(self, model: nn.Module, first_name: dict[int, str]) -> None:
        """Every attention whose projections are cut holds whole heads on every rank, and cuts its
        per-head parameters with them.

        An attention module is one with a per-head width attribute (``head_dim``, ...). Each cut
        linear it holds directly must give every rank a multiple of that width per packed part
        (policies that split head counts without :func:`~tpcore.policy.divide` are caught here), and
        a parameter it holds of shape ``(heads, ..., head_dim)`` (Cohere's per-head q/k norms) for one
        of its projections' head counts must be cut too: whole, it would not match the rank's heads.
        """
        for path, module in model.named_modules():
            head_dim = next((getattr(module, a) for a in _HEAD_DIM_ATTRIBUTES if _is_int(getattr(module, a, None))), 0)
            if head_dim < 1:
                continue
            head_counts: set[int] = set()
            for child_name, child in module.named_children():
                weight = getattr(child, "weight", None)
                split = self.splits.get(first_name.get(id(weight), ""))
                if weight is None or split is None or split.pad or not _is_projection(child):
                    continue
                if split.heads is not None and weight.shape[split.dim] == split.heads * split.n_fused:
                    continue  # one feature per head (a per-head gate), dealt in whole heads by its split
                for size in piece_sizes(split, weight.shape[split.dim], self.world_size):
                    if size % head_dim:
                        raise self.error(
                            join(path, child_name),
                            f"each rank would hold {size / head_dim:g} heads of width {head_dim} "
                            f"({size} of {weight.shape[split.dim]} features): heads must stay whole; "
                            "the policy's head counts do not divide by the world size",
                        )
                head_counts.update(size // head_dim for size in piece_sizes(split, weight.shape[split.dim], 1))
            for name, tensor in module.named_parameters():
                full_name = first_name.get(id(tensor), "")
                whole = full_name not in self.splits
                if whole and tensor.dim() >= 2 and tensor.shape[0] in head_counts and tensor.shape[-1] == head_dim:
                    raise self.error(
                        join(path, name),
                        f"a per-head parameter of shape {tuple(tensor.shape)} (one row per head) is left whole "
                        "while the heads are cut: the policy must cut it with them (Layer(dim=0, heads=...))",
                    )

    # -- reading the plan --------------------------------------------------------------------

    @property
    def uniform(self) -> bool:
        """Whether every rank holds the same shapes and attribute values (every cut even)."""
        return not any(isinstance(value, PerRank) for value in self.attributes.values()) and all(
            split.even(self.shapes[name][split.dim], self.world_size) for name, split in self.splits.items()
        )

    def shard_shape(self, name: str, rank: int = 0) -> tuple[int, ...]:
        """The shape of rank ``rank``'s part of tensor ``name``."""
        shape = list(self.shapes[name])
        split = self.splits.get(name)
        if split is not None:
            dim = split.dim % len(shape)
            shape[dim] = split.shard_size(shape[dim], self.world_size, rank)
        return tuple(shape)

    def share(self, name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of the whole tensor ``name``: its slice, or the tensor itself when
        replicated. A slice that is one contiguous block of the tensor is a view (sent without a copy)."""
        tensor = tensor.detach()
        split = self.splits.get(name)
        if split is None:
            return tensor
        dim = split.dim % tensor.dim()
        ranges, padding = split.ranges(tensor.shape[dim], rank, self.world_size)
        if len(ranges) == 1 and not padding:
            ((start, stop),) = ranges
            piece = tensor.narrow(dim, start, stop - start)
            if piece.is_contiguous():
                return piece
        return split.shard(tensor, rank, self.world_size)

    def bytes_per_rank(self, rank: int = 0) -> int:
        """The bytes of tensors rank ``rank`` holds."""
        return sum(math.prod(self.shard_shape(n, rank)) * self.dtypes[n].itemsize for n in self.shapes)

    def tensor_bytes(self, name: str) -> int:
        """The bytes of the whole tensor ``name``."""
        return math.prod(self.shapes[name]) * self.dtypes[name].itemsize

    @property
    def whole_bytes(self) -> int:
        """The bytes of the unsplit model's tensors."""
        return sum(self.tensor_bytes(name) for name in self.shapes)

    @property
    def replicated_bytes(self) -> int:
        """The bytes every rank holds whole (each rank holds all of them)."""
        return sum(self.tensor_bytes(name) for name in self.shapes if name not in self.splits)

    def bytes_summary(self) -> str:
        """Each rank's bytes against the whole model's, and the replicated bytes:
        ``"per rank 273.5 MiB | 239.8 MiB of 513.1 MiB (53% | 47%; 137.5 KiB replicated on every rank)"``."""
        per_rank = [self.bytes_per_rank(rank) for rank in range(self.world_size)]
        whole = self.whole_bytes
        sizes = _per_rank_text([format_bytes(size) for size in per_rank])
        shares = _per_rank_text([f"{size / whole:.0%}" if whole else "-" for size in per_rank])
        replicated = format_bytes(self.replicated_bytes)
        return f"per rank {sizes} of {format_bytes(whole)} ({shares}; {replicated} replicated on every rank)"

    def replicated_warning(self, share: float = REPLICATED_SHARE) -> str | None:
        """Past ``share`` of the model's bytes held whole on every rank (over more than one rank), what says so:
        the share, then the largest replicated modules (layers folded as ``*``), each with its class, its bytes
        and why it stays whole; ``None`` below it."""
        whole, replicated = self.whole_bytes, self.replicated_bytes
        if self.world_size < 2 or not whole or replicated <= share * whole:
            return None
        sizes: dict[tuple[str, str, str], int] = {}
        modules: dict[tuple[str, str, str], set[str]] = {}
        for name, (module_class, reason) in self.kept_whole.items():
            path = name.rpartition(".")[0]
            key = (re.sub(r"\.\d+(?=\.|$)", ".*", path), module_class, reason)
            sizes[key] = sizes.get(key, 0) + self.tensor_bytes(name)
            modules.setdefault(key, set()).add(path)
        largest = sorted(sizes, key=lambda key: -sizes[key])[:_NAMED_IN_WARNING]
        lines = [
            f"{self.model_name} over {self.world_size} ranks: {format_bytes(replicated)} of its "
            f"{format_bytes(whole)} ({replicated / whole:.0%}) stays whole on every rank; the largest:"
        ]
        for key in largest:
            module, module_class, reason = key
            count = f" x{len(modules[key])}" if len(modules[key]) > 1 else ""
            size = format_bytes(sizes[key])
            lines.append(f"    {module or '(model)'} ({module_class}{count}, {size}) is replicated: {reason}")
        return "\n".join(lines)

    def log(self) -> None:
        """Log each rank's bytes (info) and, past :data:`REPLICATED_SHARE` replicated, what stays whole (a warning)."""
        logger.info("%s over %d ranks: %s", self.model_name, self.world_size, self.bytes_summary())
        warning = self.replicated_warning()
        if warning is not None:
            logger.warning("%s", warning)

    # -- applying ------------------------------------------------------------------------------

    def apply(self, model: nn.Module, rank: int, tp_group=None, *, gather_logits: bool = True) -> nn.Module:
        """Make ``model`` (a copy of the one the plan was built from) rank ``rank``'s shard, in place.

        Tensors are sliced (a meta tensor only changes shape; ties stay ties), module attributes set,
        classes given (a class declaring ``tp_group`` gets ``tp_group``), vocabulary-parallel modules
        told their rows. Returns ``model``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        tensors = named_tensors(model)
        for name, split in self.splits.items():
            tensor = tensors.get(name)
            if tensor is None or tuple(tensor.shape) != self.shapes[name]:
                found = "missing" if tensor is None else f"of shape {tuple(tensor.shape)}"
                raise ValueError(
                    f"this plan of {self.model_name} cuts {name!r} of shape {self.shapes[name]}, "
                    f"which the model it is applied to has {found}"
                )
            with torch.no_grad():
                tensor.data = split.shard(tensor.data, rank, self.world_size)
        for path in self.resized:
            set_layer_size(model.get_submodule(path))
        for path, value in self.attributes.items():
            set_path(model, path, resolve(value, rank))
        for path, new_class in self.classes.items():
            module = model.get_submodule(path)
            module.__class__ = new_class
            if hasattr(new_class, "tp_group"):
                module.tp_group = tp_group
        for path, vocab_size in self.vocab.items():
            module = model.get_submodule(path)
            rows = int(module.weight.shape[0])  # type: ignore[index]
            make_vocab_parallel(module, tp_group, rank * rows, vocab_size, gather_logits)
        return model

    # -- showing -------------------------------------------------------------------------------

    def report(self) -> str:
        """What is cut how, what stays replicated, each rank's shares where they differ, and the bytes each
        rank holds (layers folded as ``*``)."""
        rows: dict[tuple[str, str, tuple, str], int] = {}
        ranks = range(self.world_size)
        for name, shape in self.shapes.items():
            pieces = _per_rank_text([_shape(self.shard_shape(name, rank)) for rank in ranks])
            key = (re.sub(r"\.\d+\.", ".*.", name), describe(self.splits.get(name)), shape, pieces)
            rows[key] = rows.get(key, 0) + 1
        width = max((len(k[0]) for k in rows), default=0)
        lines = [f"{self.model_name} over {self.world_size} ranks" + ("" if self.uniform else ", shares by rank") + ":"]
        for (name, how, shape, piece), count in rows.items():
            times = f" x{count}" if count > 1 else ""
            lines.append(f"    {name:<{width}}  {how:<28} {_shape(shape)} -> {piece}{times}")
        attributes: dict[tuple[str, str], int] = {}
        for path, value in self.attributes.items():
            if isinstance(value, PerRank):
                folded = (re.sub(r"\.\d+\.", ".*.", path), _per_rank_text([_value_text(v) for v in value]))
                attributes[folded] = attributes.get(folded, 0) + 1
        for (path, values), count in attributes.items():
            lines.append(f"    {path:<{width}}  {'set per rank':<28} {values}" + (f" x{count}" if count > 1 else ""))
        lines.append(self.bytes_summary())
        return "\n".join(lines)


def _value_text(value: Any) -> str:
    """A per-rank attribute value in a few characters: a number, or the type of an object (a config copy)."""
    return str(value) if isinstance(value, (int, float)) else f"a {type(value).__name__}"


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (Python 3.11+); on 3.10 the note joins the message, the type unchanged."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} ({note})", *error.args[1:])


def describe(split: Split | None) -> str:
    """How ``split`` cuts a tensor, in a few words (``"cut dim 0, 3 packed"``)."""
    if split is None:
        return "replicated"
    if split.pad:
        return "vocabulary rows"
    words = [f"dim {split.dim}"]
    if split.n_fused > 1:
        words.append(f"{split.n_fused} packed")
    if split.heads is not None:
        words.append(f"{split.heads} heads" + (" interleaved" if split.interleaved else ""))
    if split.parts:
        by_group = " by group" if split.interleaved else ""
        words.append("parts of " + "/".join(map(str, split.parts)) + " heads" + by_group)
    if split.groups is not None:
        words.append(f"{split.groups} groups")
    return "cut " + ", ".join(words)


def _per_rank_text(values: list[str]) -> str:
    """One value if every rank has it, else each rank's (``"(6, 8) | (3, 8)"``)."""
    return values[0] if len(set(values)) == 1 else " | ".join(values)


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def format_bytes(size: int) -> str:
    """``size`` bytes in GiB, MiB or KiB, one decimal."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 2**10:.1f} KiB"


def _enclosing(path: str) -> list[str]:
    """``path`` and the paths of the modules around it, innermost first (``"a.b.c"``, ``"a.b"``, ``"a"``, ``""``)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:end]) for end in range(len(parts), -1, -1)]


def _vocabulary_refusal(module: nn.Module) -> str | None:
    """Why ``module``'s type cannot be split over the vocabulary (:func:`~tpcore.layers.vocab_parallel_class`);
    ``None`` when it can."""
    if vocab_parallel_class(module) is not None:
        return None
    name = type(module).__name__
    if isinstance(module, VocabParallelEmbedding):
        return f"{name} is split over the vocabulary already"
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        return f"{name} renormalizes the rows it looks up (max_norm)"
    if isinstance(module, nn.Embedding):
        return f"the forward of {name} is not a lookup times one scale, which is what splits over the vocabulary"
    if isinstance(module, nn.Linear):
        return f"{name} has a forward of its own; only an exact nn.Linear head splits over the vocabulary"
    return f"{name} is neither an nn.Embedding nor an nn.Linear"


def piece_sizes(split: Split, size: int, world_size: int) -> set[int]:
    """The sizes of the contiguous pieces that ranks hold of a dimension of ``size`` (one per packed part)."""
    return {stop - start for rank in range(world_size) for start, stop in split.ranges(size, rank, world_size)[0]}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_projection(module: nn.Module) -> bool:
    """A linear map whose cut feature dimension packs heads (``nn.Linear``, HF ``Conv1D``)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def make_megatron_layer(policy: type[Policy]) -> list[tuple[str, Layer]]:
    """The policy's tensors with their parallel style: column for q/k/v and MLP in, row for the outputs."""
    return (
        [(COLUMN, spec) for spec in policy.attn_qkv()]
        + [(COLUMN, spec) for spec in policy.mlp_in()]
        + [(ROW, spec) for spec in policy.attn_out()]
        + [(ROW, spec) for spec in policy.mlp_out()]
    )


def resolve_layer(layer: nn.Module, spec: Layer) -> tuple[Any, Any] | tuple[()] | None:
    """``(weight, bias)`` that ``spec`` names on ``layer`` (bias ``None`` when it names none); ``()``
    when an optional weight is absent; ``None`` when a required tensor is absent."""
    weight = get_path(layer, spec.weight) if spec.weight else _MISSING
    if weight is _MISSING:
        return () if spec.ignore_checker else None
    bias = get_path(layer, spec.bias) if spec.bias else None
    if bias is _MISSING:
        if not spec.ignore_checker:
            return None
        bias = None
    return weight, bias


def vocabulary_modules(model: nn.Module) -> list[nn.Module]:
    """The input and output embeddings to split over the vocabulary (see :func:`vocabulary_choices`)."""
    return [module for module, refusal in vocabulary_choices(model).values() if refusal is None]


def vocabulary_choices(model: nn.Module) -> dict[str, tuple[nn.Module, str | None]]:
    """The input and output embeddings of the model and its sub-models, by path, each with ``None`` where it
    splits over the vocabulary, else why it stays whole.

    A module splits when its type has a vocabulary-parallel class (:func:`~tpcore.layers.vocab_parallel_class`)
    and no module but it, its parents (BERT's head keeps the decoder's bias there) and the other
    vocabulary-parallel modules holding the same weight (BART's ``shared``, ``encoder.embed_tokens``,
    ``decoder.embed_tokens`` and ``lm_head``: one tied table) holds its weight or bias: a tensor that
    some other module reads must stay whole. Tied modules are split together or not at all.
    """
    holders: dict[int, dict[int, nn.Module]] = {}
    for module in model.modules():
        for tensor in module._parameters.values():
            if tensor is not None:
                holders.setdefault(id(tensor), {})[id(module)] = module
    asked: dict[int, nn.Module] = {}
    for owner in sub_models(model).values():  # a composite model's towers name their own (CLIP's text tower)
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            try:
                module = getattr(owner, getter)()
            except (AttributeError, NotImplementedError):
                continue
            if isinstance(module, nn.Module):
                asked[id(module)] = module
    refusals = {key: _vocabulary_refusal(module) for key, module in asked.items()}
    found = {key: module for key, module in asked.items() if refusals[key] is None}
    for module in list(found.values()):  # the modules a tied table is shared with
        for key, holder in holders.get(id(module.weight), {}).items():
            if holder.weight is module.weight and vocab_parallel_class(holder) is not None:
                found[key] = asked[key] = holder
                refusals[key] = None
    names = {id(module): name for name, module in model.named_modules()}
    parents = {names[key].rpartition(".")[0] for key in found if key in names}
    allowed = found.keys() | {id(module) for name, module in model.named_modules() if name in parents}
    for key, module in found.items():
        for table in (module.weight, getattr(module, "bias", None)):
            readers = [holder for other, holder in holders.get(id(table), {}).items() if other not in allowed]
            if table is not None and readers:
                reader = readers[0]
                refusals[key] = f"{names.get(id(reader), 'a module')} ({type(reader).__name__}) reads its tensors too"
                break
    return {names[key]: (module, refusals[key]) for key, module in asked.items() if key in names}
