"""Building a plan: every policy resolved on every layer instance and checked, before anything changes.

:func:`plan_for` finds each policy's layer instances (each with the config of its own sub-model),
resolves every tensor its :class:`~tpcore.Layer` s name, checks every cut (sizes that cut into whole
units, row cuts that would count a replicated head twice, one tensor cut two ways, a bias that a
row-parallel module would add on every rank), evaluates the
per-rank attributes, adds the vocabulary cuts, checks that every attention keeps whole heads, and
records why each tensor it does not cut stays whole. An error names the model, the world size, the
layer and the tensor; an exception a policy's own code raises keeps its type and gains a note.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tpcore.authoring import NORM, ROW, IfHeld, Layer, Policy
from tpcore.configs import module_configs
from tpcore.cut.split import Split
from tpcore.errors import ShardingError
from tpcore.load.skeleton import named_tensors
from tpcore.parallel.layers import sums_inside
from tpcore.parallel.quantized_linear import QuantizedLayer
from tpcore.plan.apply import class_for
from tpcore.plan.paths import MISSING, get_path, join
from tpcore.plan.proof import check_by_proof, needs_proof
from tpcore.plan.shard_plan import Replacement, ShardPlan, Whole
from tpcore.plan.trial import check_by_trial
from tpcore.plan.vocabulary import vocabulary_choices

__all__ = ["add_note", "plan_for", "resolve_layer"]

#: attributes attention modules keep their per-head width in (BERT, GPT-2/Llama, T5, XLNet, ...)
_HEAD_DIM_ATTRIBUTES = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "d_head")


def plan_for(
    model: nn.Module,
    policies: list[type[Policy]],
    world_size: int,
    *,
    vocab_parallel: bool = True,
    rewrites: bool = True,
    trial: bool = True,
) -> ShardPlan:
    """Resolve and check how ``policies`` split ``model`` (real weights or meta) over ``world_size`` ranks.

    ``vocab_parallel`` also splits the input and output embeddings over the vocabulary;
    ``rewrites=False`` leaves out the policies' attribute rewrites and ``replace_modules`` (what the
    predecessor's ``replace_orig_to_megatron_modules`` did). ``trial``: where a policy asks for it, run the
    split on a tiny copy of the config (:func:`~tpcore.plan.trial.check_by_trial`). Raises
    :class:`~tpcore.ShardingError` naming the model, the world size, the layer and the tensor (or the rank
    whose trial failed).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    builder = _Builder(model, ShardPlan(type(model).__name__, world_size, policies=list(policies)))
    targets = builder.targets()
    for target in targets:
        builder.add_layer(target, rewrites)
    builder.check_row_biases()
    vocabulary = vocabulary_choices(model)
    if vocab_parallel:
        builder.add_vocabulary(vocabulary)
    builder.check_whole_heads()
    builder.explain_whole(targets, vocabulary)
    if trial and rewrites:

        def plan_tiny(tiny: nn.Module) -> ShardPlan:
            return plan_for(tiny, policies, world_size, vocab_parallel=vocab_parallel, trial=False)

        if needs_proof(policies):  # a structural policy: equal outputs on a tiny copy, or no split
            check_by_proof(model, policies, world_size, plan_tiny, key=vocab_parallel)
        else:
            check_by_trial(model, policies, world_size, plan_tiny, key=vocab_parallel)
    return builder.plan


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


class _Builder:
    """Fills one :class:`ShardPlan` from one model, step by step (:func:`plan_for`)."""

    def __init__(self, model: nn.Module, plan: ShardPlan):
        self.model, self.plan = model, plan
        tensors = named_tensors(model)
        plan.shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        plan.dtypes = {name: tensor.dtype for name, tensor in tensors.items()}
        self.first_name = {id(tensor): name for name, tensor in tensors.items()}
        #: values that packed layers store an element (int4: 8 a word): plain cuts deal features in runs of as many
        packings = [size for module in model.modules() if isinstance(module, QuantizedLayer) for size in module.packing]
        self.packed_run = math.lcm(*packings) if packings else 1

    def targets(self) -> list[Target]:
        """Every layer instance each policy applies to, with its config (its sub-model's, or its own)."""
        plan, targets = self.plan, []
        configs = module_configs(self.model)
        claimed: dict[str, type[Policy]] = {}
        for policy in plan.policies:
            if not (isinstance(policy, type) and issubclass(policy, Policy)):
                raise TypeError(f"custom_policies must be Policy subclasses, got {policy!r}")
            other = claimed.setdefault(policy.layer_class_name(), policy)
            if other is not policy:  # two policies would split the same tensors twice
                both = f"{other.policy_name()} and {policy.policy_name()}"
                raise ShardingError(f"policies {both} both apply to {policy.layer_class_name()}")
            found = []
            for name, module in self.model.named_modules():
                if policy.matches(module):
                    target = Target(name, module, policy, configs[name])
                    with self.calling(target):  # the instance's own counts, where its blocks differ
                        found.append(dataclasses.replace(target, config=policy.layer_config(target.config, module)))
            if not found:
                raise ShardingError(
                    f"policy {policy.policy_name()} applies to {policy.layer_class_name()}, "
                    f"which {plan.model_name} does not contain"
                )
            targets.extend(found)
        return targets

    @contextlib.contextmanager
    def calling(self, target: Target) -> Iterator[None]:
        """Around a policy's own code: a ShardingError is restated for this model and layer; any other
        exception keeps its type and gains a note naming the model, the policy and the layer."""
        try:
            yield
        except ShardingError as error:
            raise self.plan.error(target.where, str(error)) from None
        except Exception as error:
            add_note(
                error, f"while splitting {self.plan.model_name} over {self.plan.world_size} ranks: layer {target.where}"
            )
            raise

    def add_layer(self, target: Target, rewrites: bool) -> None:
        """A layer instance's module replacements, per-rank attributes and cut tensors."""
        policy = target.policy
        with self.calling(target):
            arguments = policy.replace_arguments(target.config, self.plan.world_size) if rewrites else {}
            rules = policy.replace_modules() if rewrites else {}
            layers = policy.layers()
        replaced = self.add_replacements(target, rules)
        self.add_attributes(target, arguments, replaced)
        for spec in layers:
            self.add_tensors(target, spec)

    def add_replacements(self, target: Target, rules: dict[str, Any]) -> dict[str, type[nn.Module]]:
        """Record a policy's ``replace_modules`` rules; the classes they give this instance, by path."""
        classes = {}
        for path, rule in rules.items():
            module = get_path(target.layer, path)
            module = module if isinstance(module, nn.Module) else None
            if isinstance(rule, type) and module is None:
                raise self.plan.error(target.where, f"module {path!r} to replace does not exist")
            with self.calling(target):
                chosen = class_for(module, rule) if module is not None or not isinstance(rule, type) else None
            if chosen is not None:
                classes[path] = chosen
                self.plan.replacements[join(target.name, path)] = rule
        return classes

    def add_attributes(self, target: Target, arguments: dict[str, Any], replaced: dict[str, type[nn.Module]]) -> None:
        """Record the per-rank attribute values (an :class:`~tpcore.IfHeld` one where its module or
        attribute is)."""
        for path, value in arguments.items():
            if isinstance(value, IfHeld):
                held = get_path(target.layer, value.module)
                if held is MISSING or held is None:
                    continue  # this instance lacks it (a block of a hybrid stack, a layer of another version)
                value = value.value
            owner, _, attribute = path.rpartition(".")
            declared = owner in replaced and hasattr(replaced[owner], attribute)  # by the class it is given
            if get_path(target.layer, path) is MISSING and not declared:
                raise self.plan.error(target.where, f"attribute {path!r} to rewrite does not exist")
            self.plan.attributes[join(target.name, path)] = value

    def add_tensors(self, target: Target, spec: Layer) -> None:
        """Record the cuts of one :class:`~tpcore.Layer`'s weight and bias, checked, and what its module becomes."""
        resolved = resolve_layer(target.layer, spec)
        if resolved is None:
            raise self.plan.error(
                target.where, f"policy {target.policy.policy_name()} names {spec.weight!r} or {spec.bias!r}, "
                "which the layer lacks"
            )  # fmt: skip
        if not resolved:  # optional and absent
            return
        with self.calling(target):
            weight_split, bias_split = spec.splits(target.config)
        owner_path = join(target.name, spec.module_path)
        owner = get_path(target.layer, spec.module_path)
        if spec.style is ROW and spec.replace is None and resolved[1] is not None and self.sums_inside(owner):
            bias_split = Split(0, summand=True)  # added before the all-reduce: rank 0 alone holds it
        quantized = isinstance(owner, QuantizedLayer)
        weight_name = (spec.weight or "").rpartition(".")[2]
        if quantized and weight_split is not None:  # a cut of the tensor it stores in the plain weight's place
            weight_split = owner.stored_split(weight_split, weight_name)
            weight_split = self.in_packed_runs(weight_split, resolved[0], owner.packing[weight_split.dim], True)
        elif weight_split is not None:
            weight_split = self.in_packed_runs(weight_split, resolved[0], 1)
        if bias_split is not None and resolved[1] is not None:
            bias_split = self.in_packed_runs(bias_split, resolved[1], 1, quantized)
        for path, tensor, split in ((spec.weight, resolved[0], weight_split), (spec.bias, resolved[1], bias_split)):
            if tensor is not None and split is not None:
                self.add_cut(join(target.name, path or ""), tensor, split, spec)
        if quantized and weight_split is not None:  # its scales cut as its weight
            for name, split in owner.follower_cuts(weight_split.resolved(resolved[0].dim()), weight_name).items():
                self.add_cut(join(owner_path, name), getattr(owner, name), split, spec)
        if owner_path not in self.plan.resized:
            self.plan.resized.append(owner_path)
        self.add_module_class(owner, owner_path, spec)

    def add_module_class(self, owner: Any, owner_path: str, spec: Layer) -> None:
        """Record the class a :class:`~tpcore.Layer`'s module becomes (its ``replace=``, or its style's), checked."""
        rule: Replacement | None = spec.replace if spec.replace is not None else None
        if rule is None and spec.style in (ROW, NORM):
            rule = spec.style
        if rule is not None:
            try:  # validated here, chosen again where the plan is applied
                class_for(owner, rule)
            except ShardingError as error:
                raise self.plan.error(owner_path, str(error)) from None
            self.plan.replacements[owner_path] = rule

    def sums_inside(self, module: Any) -> bool:
        """Whether ``module``'s row-parallel class all-reduces what its own forward returns, biases included."""
        try:
            return isinstance(module, nn.Module) and sums_inside(class_for(module, ROW))  # type: ignore[arg-type]
        except ShardingError:
            return False  # refused where the replacement is recorded

    def check_row_biases(self) -> None:
        """A module whose row-parallel forward all-reduces its own output adds each bias it holds on every rank:
        each is cut with its features or held by rank 0 alone (the row ``Layer``'s ``bias=``), else refused."""
        for path, rule in self.plan.replacements.items():
            module = self.model.get_submodule(path)
            if rule is not ROW or not self.sums_inside(module):
                continue
            for name, tensor in module.named_parameters():
                if "bias" in name.rpartition(".")[2] and self.first_name.get(id(tensor)) not in self.plan.splits:
                    raise self.plan.error(
                        join(path, name),
                        f"a {type(module).__qualname__} adds it inside its row-parallel forward, so every rank would "
                        "add it to the all-reduced output: name it as the row Layer's bias= (rank 0 alone then "
                        "holds it), or give the Layer a replace= class",
                    )

    def in_packed_runs(self, split: Split, tensor: Any, packing: int, quantized: bool = False) -> Split:
        """``split``, dealing a plain dimension in runs of :attr:`packed_run` values where the model holds packed
        layers: a packed layer's words and the features it meets in another layer (an MLP's up and down
        projections) are then cut at the same places. ``packing``: values one element of ``tensor`` holds.
        ``quantized``: ``tensor`` is a quantized layer's, whose heads of one feature each (fused experts'
        intermediate features, dealt in whole gate/up pairs) are dealt in those runs too."""
        if self.packed_run == 1 or split.parts is not None or split.pad or split.summand:
            return split
        if not isinstance(tensor, torch.Tensor) or not -tensor.dim() <= split.dim < tensor.dim():
            return split  # refused by add_cut
        values = tensor.shape[split.dim] * packing // split.n_fused
        if split.heads is not None and not (quantized and split.heads == values):
            return split
        return split._replace(heads=values // self.packed_run) if values % self.packed_run == 0 else split

    def add_cut(self, full_path: str, tensor: Any, split: Split, spec: Layer) -> None:
        """Check and record one tensor's cut."""
        plan = self.plan
        if not isinstance(tensor, torch.Tensor) or not -tensor.dim() <= split.dim < tensor.dim():
            raise plan.error(full_path, f"not a tensor with a dimension {split.dim} to split")
        where = f"tensor {full_path!r} of shape {tuple(tensor.shape)}, split along dim {split.dim}"
        try:
            split.check(tensor.shape[split.dim], plan.world_size)
        except ShardingError as error:
            raise plan.error(where, str(error)) from None
        if spec.style is ROW and split.replicated(tensor.shape[split.dim], plan.world_size):
            raise plan.error(
                where,
                f"its {split.heads or split.parts} heads are fewer than the ranks (or than the ranks that share "
                "a key/value head): a row-parallel sum would count a head held by two ranks twice",
            )
        split = split.resolved(tensor.dim())
        name = self.first_name[id(tensor)]
        earlier = plan.splits.setdefault(name, split)
        if earlier != split:  # one tensor (tied) reached twice, cut two ways
            raise plan.error(f"tensor {full_path!r}", f"is cut as {earlier} and as {split} by its policies")

    def add_vocabulary(self, vocabulary: dict[str, tuple[nn.Module, str | None]]) -> None:
        """Split the input and output embeddings over the vocabulary: those :func:`vocabulary_choices` finds
        splittable, unless a policy cuts them already."""
        cut_by_policies = set(self.plan.splits)
        for path, (module, refusal) in vocabulary.items():
            if refusal is not None or self.first_name[id(module.weight)] in cut_by_policies:
                continue
            for tensor in (module.weight, getattr(module, "bias", None)):
                if tensor is not None:
                    self.plan.splits.setdefault(self.first_name[id(tensor)], Split(0, pad=True))
            self.plan.vocab[path] = int(module.weight.shape[0])  # type: ignore[index]

    def explain_whole(self, targets: list[Target], vocabulary: dict[str, tuple[nn.Module, str | None]]) -> None:
        """Record why each tensor the plan does not cut stays whole: an embedding's own reason (or
        ``vocab_parallel=False``), a policy's layer that does not cut it, or no policy's layer around it."""
        plan = self.plan
        by_layer = {target.name: target.policy for target in targets}
        layer_classes = ", ".join(dict.fromkeys(type(target.layer).__name__ for target in targets)) or "none"
        for path, module in self.model.named_modules():
            held = [*module._parameters.values(), *module._buffers.values()]
            names = [self.first_name[id(t)] for t in held if t is not None and id(t) in self.first_name]
            names = [name for name in names if name not in plan.splits and name not in plan.kept_whole]
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
                plan.kept_whole[name] = Whole(type(module).__name__, reason)

    def check_whole_heads(self) -> None:
        """Every attention whose projections are cut holds whole heads on every rank, and cuts its
        per-head parameters with them.

        An attention module is one with a per-head width attribute (``head_dim``, ...). Each cut
        linear it holds directly must give every rank a multiple of that width per packed part
        (policies that split head counts without :func:`~tpcore.divide` are caught here), and a
        parameter it holds of shape ``(heads, ..., head_dim)`` (Cohere's per-head q/k norms) for one
        of its projections' head counts must be cut too: whole, it would not match the rank's heads.
        """
        for path, module in self.model.named_modules():
            head_dim = next((getattr(module, a) for a in _HEAD_DIM_ATTRIBUTES if _is_int(getattr(module, a, None))), 0)
            if head_dim >= 1:
                head_counts = self._check_projection_heads(path, module, head_dim)
                self._check_per_head_parameters(path, module, head_dim, head_counts)

    def _check_projection_heads(self, path: str, module: nn.Module, head_dim: int) -> set[int]:
        """Each cut projection of the attention ``module`` gives every rank whole heads; its head counts."""
        plan, head_counts = self.plan, set[int]()
        for child_name, child in module.named_children():
            weight = getattr(child, "weight", None)
            split = plan.splits.get(self.first_name.get(id(weight), ""))
            if weight is None or split is None or split.pad or not _is_projection(child):
                continue
            packing = getattr(child, "packing", (1,) * weight.dim())[split.dim]  # values a stored element
            features = weight.shape[split.dim] * packing
            if split.heads is not None and features == split.heads * split.n_fused:
                continue  # one feature per head (a per-head gate), dealt in whole heads by its split
            if split.widths is not None:
                continue  # parts of their own unit widths (Mamba2's [z | x | B | C | dt]): whole units by the split
            for size in (piece * packing for piece in piece_sizes(split, weight.shape[split.dim], plan.world_size)):
                if size % head_dim:
                    raise plan.error(
                        join(path, child_name),
                        f"each rank would hold {size / head_dim:g} heads of width {head_dim} "
                        f"({size} of {features} features): heads must stay whole; "
                        "the policy's head counts do not divide by the world size",
                    )
            head_counts.update(size * packing // head_dim for size in piece_sizes(split, weight.shape[split.dim], 1))
        return head_counts

    def _check_per_head_parameters(self, path: str, module: nn.Module, head_dim: int, head_counts: set[int]) -> None:
        """A parameter of shape ``(heads, ..., head_dim)`` beside cut heads is cut with them. A linear map's weight
        is no such table, whatever its shape (WavLM's ``gru_rel_pos_linear`` maps each head's ``head_dim`` to 8
        features, every head alike: ``(8, head_dim)`` with 8 heads is a coincidence)."""
        linear_weights = {id(child.weight) for child in module.modules() if isinstance(child, nn.Linear)}
        for name, tensor in module.named_parameters():
            if id(tensor) in linear_weights:
                continue
            whole = self.first_name.get(id(tensor), "") not in self.plan.splits
            if whole and tensor.dim() >= 2 and tensor.shape[0] in head_counts and tensor.shape[-1] == head_dim:
                raise self.plan.error(
                    join(path, name),
                    f"a per-head parameter of shape {tuple(tensor.shape)} (one row per head) is left whole "
                    "while the heads are cut: the policy must cut it with them (Layer(style=PER_HEAD, heads=...))",
                )


def resolve_layer(layer: nn.Module, spec: Layer) -> tuple[Any, Any] | tuple[()] | None:
    """``(weight, bias)`` that ``spec`` names on ``layer`` (bias ``None`` when it names none); ``()``
    when an optional weight is absent; ``None`` when a required tensor is absent."""
    weight = get_path(layer, spec.weight) if spec.weight else MISSING
    if weight is MISSING:
        return () if spec.optional else None
    bias = get_path(layer, spec.bias) if spec.bias else None
    if bias is MISSING:
        if not spec.optional:
            return None
        bias = None
    return weight, bias


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (Python 3.11+); on 3.10 the note joins the message, the type unchanged."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} ({note})", *error.args[1:])


def piece_sizes(split: Split, size: int, world_size: int) -> set[int]:
    """The sizes of the contiguous pieces that ranks hold of a dimension of ``size`` (one per packed part)."""
    return {stop - start for rank in range(world_size) for start, stop in split.ranges(size, rank, world_size)[0]}


def _enclosing(path: str) -> list[str]:
    """``path`` and the paths of the modules around it, innermost first (``"a.b.c"``, ``"a.b"``, ``"a"``, ``""``)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:end]) for end in range(len(parts), -1, -1)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_projection(module: nn.Module) -> bool:
    """A linear map whose cut feature dimension packs heads (``nn.Linear``, HF ``Conv1D``)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
