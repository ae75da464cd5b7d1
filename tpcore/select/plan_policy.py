"""Policies derived from tp plan rules: :class:`PlanPolicy`, one subclass per block class, as data.

:func:`policy_for` resolves the rules that reach one block class (``{linear path: style}``, see
:mod:`tpcore.select.tp_plan`) into the :class:`~tpcore.Layer` s to cut, each with its
:class:`~tpcore.Style`: column and row projections (attention projections dealt in whole heads, a packed
``[Q | K | V]`` by its parts), fused experts tensors, per-head parameters that follow the heads
(``PER_HEAD``), and RMSNorms over a whole gathered width (``NORM``). Its ``replace_arguments`` gives each
rank its head counts from the config of the block's sub-model, so one block class shared by towers of
different widths (CLIP's) gets each tower's own counts.
"""

from __future__ import annotations

import collections
import copy
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from tpcore.authoring import COLUMN, NORM, PER_HEAD, ROW, IfHeld, Layer, PerRank, Policy, Style, local_config, share
from tpcore.cut.shares import runs
from tpcore.errors import ShardingError
from tpcore.parallel.layers import GROUPED_MM_FEATURES

__all__ = ["Instance", "PlanPolicy", "Rule", "Rules", "TpPlanError", "experts_arguments", "policy_for"]

_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_key_value_groups")
_CONFIG_HEADS = ("num_attention_heads", "num_key_value_heads")

#: how a split follows one rule: ``(COLUMN or ROW, packed tensors, dim of a 3-D tensor, paired)``; ``paired``: one of
#: a gathered output and a split input in one module, followed as a column / row pair (nothing gathered between)
Rule = tuple[Style, int, int, bool]
#: a block's rules, by linear (or parameter) path in the block
Rules = dict[str, Rule]
#: a block instance: its name, the module, and its rules
Instance = tuple[str, nn.Module, Rules]


class TpPlanError(LookupError):
    """The model's tp plan is missing or uses a style tpcore cannot follow."""


class PlanPolicy(Policy):
    """A policy derived from a tp plan (:func:`policy_for`): its tensors and the attributes that follow the
    heads, as data."""

    #: every tensor to cut, with its style
    tensors: ClassVar[tuple[Layer, ...]] = ()
    #: ``(path, owner, attribute)``: the head-count attributes of the split attentions
    head_attributes: ClassVar[tuple[tuple[str, str, str], ...]] = ()
    #: attentions whose forward reads its head counts from ``self.config``: they get a per-rank copy
    config_readers: ClassVar[tuple[str, ...]] = ()
    #: ``(experts module, intermediate size, held by some blocks only)`` of fused experts cut along it
    intermediates: ClassVar[tuple[tuple[str, int, bool], ...]] = ()
    #: attention -> a split linear that some blocks of the class lack (hybrid stacks): set only where held
    held_by_some: ClassVar[dict[str, str]] = {}
    #: some norm sums its square over the ranks (a ``NORM`` tensor)
    has_norms: ClassVar[bool] = False
    #: the forward is transformers' own, read by no policy author: ``plan_for`` tries the split on a tiny copy
    verify_by_trial: ClassVar[bool] = True

    @classmethod
    def layers(cls) -> list[Layer]:
        return list(cls.tensors)

    @classmethod
    def replace_arguments(cls, config: Any, world_size: int) -> dict[str, Any]:
        """Per-rank head counts and experts sizes, read from the config of the block's sub-model."""
        heads = _heads(config)
        arguments = {
            f"{owner}.{name}": IfHeld(value, owner) if optional else value
            for owner, size, optional in cls.intermediates
            for name, value in experts_arguments(config, size, world_size).items()
        }
        if heads is None:
            return arguments
        kv_heads = _kv_heads(config) or heads
        if cls.has_norms:
            _check_norms_see_equal_copies(cls.__name__, heads, kv_heads, world_size)
        local = share(heads, world_size, "num_attention_heads", groups=kv_heads)
        local_kv = share(kv_heads, world_size, "num_key_value_heads")  # one, replicated, when fewer than ranks
        values = {
            "num_heads": local,
            "num_attention_heads": local,
            "num_key_value_heads": local_kv,
            "num_key_value_groups": local // local_kv,
        }
        for path, owner, name in cls.head_attributes:
            arguments[path] = cls._held(owner, values[name])
        for owner in cls.config_readers:
            copies = local_config(config, world_size, num_attention_heads=local, num_key_value_heads=local_kv)
            arguments[f"{owner}.config" if owner else "config"] = cls._held(owner, copies)
        return arguments

    @classmethod
    def _held(cls, owner: str, value: Any) -> Any:
        """``value``, set only in the blocks holding the split attention where some blocks lack it."""
        return IfHeld(value, cls.held_by_some[owner]) if owner in cls.held_by_some else value


@dataclass
class _Resolved:
    """What the rules of one block class resolve to (:func:`_resolve`)."""

    layers: list[Layer] = field(default_factory=list)
    attention_paths: set[str] = field(default_factory=set)
    full_width: set[str] = field(default_factory=set)
    intermediates: dict[str, tuple[int, bool]] = field(default_factory=dict)
    held_by_some: dict[str, str] = field(default_factory=dict)


def policy_for(instances: list[Instance], configs: dict[str, Any]) -> type[PlanPolicy]:
    """The :class:`PlanPolicy` of the class of the blocks ``instances``, from the rules that exist in them.

    Sub-models whose plans name the same block class must agree on its rules.
    """
    name, block, rules = instances[0]
    for other_name, _, other in instances[1:]:
        if other != rules:
            raise TpPlanError(f"the tp plans of {name!r} and {other_name!r} split {type(block).__name__} differently")
    block_configs = list({id(configs[n]): configs[n] for n, _, _ in instances}.values())
    config = block_configs[0]
    grouped_kv = any(_kv_heads(config) != _heads(config) for config in block_configs if _heads(config))
    found = _resolve(instances, config, grouped_kv)
    # the first block that holds every attention the rules name (hybrid stacks mix attention kinds)
    attentions = found.attention_paths
    block = next((b for _, b, _ in instances if all(_module(b, owner) for owner in attentions)), block)
    _check_config_head_counts(instances, attentions, config)
    found.layers += _per_head_parameters(block, attentions, config, grouped_kv)
    norms = _full_width_norms(block, found.full_width, config, grouped_kv)
    # q/k norms over the whole width after projections the plan leaves split (transformers' own plan would
    # feed them a rank's columns): computed column-split alike, or refused if they are not RMSNorms (ESM C)
    norms += _full_width_norms(block, attentions - found.full_width, config, grouped_kv, qk_only=True)
    kind = type(block)
    data = {
        "__doc__": f"Derived from {type(config).__name__}.base_model_tp_plan.",
        "__module__": __name__,
        "layer_class": f"{kind.__module__}.{kind.__qualname__}",
        "name": f"{kind.__name__} (tp plan of {getattr(config, 'model_type', None)})",
        "tensors": (*found.layers, *norms),
        "head_attributes": _head_attributes(block, attentions),
        "config_readers": tuple(owner for owner in sorted(attentions) if _reads_config_heads(_module(block, owner))),
        "intermediates": tuple((owner, *size) for owner, size in found.intermediates.items()),
        "held_by_some": found.held_by_some,
        "has_norms": bool(norms),
    }
    return type(f"{kind.__name__}PlanPolicy", (PlanPolicy,), data)


def _resolve(instances: list[Instance], config: Any, grouped_kv: bool) -> _Resolved:
    """The tensors each rule names (in the first block that holds it; optional where some blocks lack it)."""
    block, rules = instances[0][1], instances[0][2]
    row_inputs = {  # a paired row layer's input width, which its column partner's packed halves fill twice
        path.rpartition(".")[0]: linear.in_features
        for path, (style, _, _, paired) in rules.items()
        if style is ROW and paired and isinstance(linear := _module(block, path), nn.Linear)
    }
    found = _Resolved()
    for path, rule in rules.items():
        holders = [b for _, b, _ in instances if _module(b, path) is not None or _parameter(b, path) is not None]
        if holders:  # else blocks of this class lack it
            optional = len(holders) < len(instances)  # some blocks lack it (hybrid stacks)
            if _module(holders[0], path) is None:
                _add_parameter(found, holders[0], path, rule, optional, grouped_kv)
            else:
                _add_linear(found, holders[0], path, rule, optional, grouped_kv, config, row_inputs)
    return found


def _add_parameter(found: _Resolved, holder: nn.Module, path: str, rule: Rule, optional: bool, grouped_kv: bool):
    """A rule naming a parameter: one value per head (attention sinks), or a fused experts tensor, cut along
    the dim the style names (``(E, 2I, H)``: -2, ``(E, H, I)``: -1, the other storage ``(E, H, 2I)``,
    ``(E, I, H)`` alike); its down projection makes the experts' output partial."""
    _, n_fused, tensor_dim, _ = rule
    parameter = _parameter(holder, path)
    assert parameter is not None
    if parameter.dim() == 1:
        found.layers.append(Layer(weight=path, style=PER_HEAD, optional=optional, **_query_heads(grouped_kv)))
        return
    style = ROW if path.rpartition(".")[2].startswith("down") else COLUMN
    if path.endswith("gate_up_proj"):
        n_fused = 2  # gate|up halves, whatever the style (Inkling's plan says plain ``colwise``)
    found.layers.append(Layer(weight=path, style=style, dim=tensor_dim, n_fused=n_fused, optional=optional))
    owner_path = path.rpartition(".")[0]
    size = getattr(holder.get_submodule(owner_path), "intermediate_dim", None)
    if isinstance(size, int):  # set where held (MoE stacks with dense first blocks: DeepSeek's)
        found.intermediates[owner_path] = (size, optional)


def _add_linear(
    found: _Resolved,
    holder: nn.Module,
    path: str,
    rule: Rule,
    optional: bool,
    grouped_kv: bool,
    config: Any,
    row_inputs: dict[str, int],
) -> None:
    """A rule naming a Linear: column or row, attention projections in whole heads, gate|up packed in one."""
    style, n_fused, _, paired = rule
    linear = _module(holder, path)
    if not isinstance(linear, nn.Linear):
        raise TpPlanError(f"its tp plan splits {path!r}, a {type(linear).__name__}, not a Linear")
    owner_path = path.rpartition(".")[0]
    in_attention = "attn" in path or "attention" in path
    if style is COLUMN and paired and not in_attention and linear.out_features == 2 * row_inputs[owner_path]:
        n_fused = 2  # gate|up packed in one projection
    layout = _head_layout(holder, path, linear, style, n_fused, grouped_kv, config) if in_attention else {}
    found.layers.append(
        Layer(weight=f"{path}.weight", bias=f"{path}.bias", style=style, n_fused=n_fused, optional=optional, **layout)
    )
    if in_attention:
        found.attention_paths.add(owner_path)
        if optional:
            found.held_by_some.setdefault(owner_path, path)
        if paired:
            found.full_width.add(owner_path)


def _head_attributes(block: nn.Module, attention_paths: set[str]) -> tuple[tuple[str, str, str], ...]:
    """``(path, owner, attribute)`` of the int head-count attributes the split attentions hold."""
    return tuple(
        (f"{owner}.{name}" if owner else name, owner, name)
        for owner in sorted(attention_paths)
        for name in _HEAD_ATTRIBUTES
        if isinstance(getattr(block.get_submodule(owner) if owner else block, name, None), int)
    )


def experts_arguments(config: Any, size: int, world_size: int) -> dict[str, Any]:
    """A fused experts module's per-rank attributes: ``intermediate_dim``, each rank's share of the
    ``size`` intermediate features; and where a share breaks the 16-byte rows that transformers'
    grouped-mm experts kernels need (uneven splits), a ``config`` copy that runs its eager experts
    implementation instead (the same sums, expert by expert)."""
    local = share(size, world_size, "intermediate_dim")
    arguments: dict[str, Any] = {"intermediate_dim": local}
    shares = tuple(local) if isinstance(local, PerRank) else (local,)
    if world_size > 1 and any(count % GROUPED_MM_FEATURES for count in shares):
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            eager = copy.copy(config)
            eager._experts_implementation = "eager"
            arguments["config"] = eager
    return arguments


def _module(block: nn.Module, path: str) -> nn.Module | None:
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def _query_heads(grouped_kv: bool) -> dict[str, Any]:
    """The :class:`Layer` head words of a tensor cut by query heads (in their key/value groups)."""
    return {"heads": "num_attention_heads", **({"groups": "num_key_value_heads"} if grouped_kv else {})}


def _reads_config_heads(module: nn.Module | None) -> bool:
    """Whether ``module``'s forward reads a head count from ``self.config`` (Phi-3 slices its packed
    q|k|v by ``self.config.num_attention_heads``)."""
    try:
        source = inspect.getsource(type(module).forward) if module is not None else ""
    except (OSError, TypeError):
        return False
    return any(f"self.config.{name}" in source for name in _CONFIG_HEADS)


def _parameter(block: nn.Module, path: str) -> nn.Parameter | None:
    """The parameter at ``path`` in ``block`` that a plan rule names (a fused 3-D experts tensor, or
    a 1-D one with a value per head), if there is one."""
    owner_path, _, name = path.rpartition(".")
    try:
        owner = block.get_submodule(owner_path)
    except AttributeError:
        return None
    parameter = owner._parameters.get(name)
    return parameter if parameter is not None and parameter.dim() in (1, 3) else None


def _head_layout(
    block: nn.Module, path: str, linear: nn.Linear, style: Style, n_fused: int, grouped_kv: bool, config: Any
) -> dict[str, Any]:
    """The head words (:class:`Layer` ``heads``, ``groups``, ``parts``) of an attention linear, so that
    uneven world sizes deal it in whole heads: key/value projections by their heads, query and output
    projections by the query heads in key/value groups, a packed ``[Q | K | V]`` by its three parts;
    ``{}`` when its split features are not whole heads."""
    owner_path = path.rpartition(".")[0]
    owner = block.get_submodule(owner_path) if owner_path else block
    heads, kv_heads = _heads(config), _kv_heads(config)
    head_dim = getattr(owner, "head_dim", None)
    features = linear.out_features if style is COLUMN else linear.in_features
    if isinstance(heads, int) and head_dim is None and n_fused == 1 and not grouped_kv and features % heads == 0:
        # multi-head latent attention (DeepSeek-V2/V3): no one head width, each split projection is
        # heads x its own width (q: nope + rope, kv_b: nope + v, o: v), viewed per head by its forward
        return _query_heads(grouped_kv)
    if not isinstance(heads, int) or not isinstance(head_dim, int) or n_fused != 1:
        return {}
    kv_heads = kv_heads or heads
    if style is COLUMN and features == (heads + 2 * kv_heads) * head_dim:
        kv = "num_key_value_heads" if grouped_kv else "num_attention_heads"
        return {"parts": ("num_attention_heads", kv, kv), **({"groups": kv} if grouped_kv else {})}
    if style is COLUMN and path.rsplit(".", 1)[-1] in ("k_proj", "v_proj") and grouped_kv:
        return {"heads": "num_key_value_heads"} if features == kv_heads * head_dim else {}
    if features not in (heads * head_dim, heads):  # ``heads``: one feature per head (Laguna's output gate)
        return {}
    return _query_heads(grouped_kv)


def _per_head_parameters(block: nn.Module, attention_paths: set[str], config: Any, grouped_kv: bool) -> list[Layer]:
    """Per-head parameters the plan leaves out that must follow the heads: norm weights of shape
    ``(heads, head_dim)`` inside a split attention (Cohere's q/k norms), cut along their heads (query
    heads in their key/value groups)."""
    heads, kv_heads = _heads(config), _kv_heads(config)
    found = []
    for owner_path in sorted(attention_paths):
        owner = block.get_submodule(owner_path) if owner_path else block
        head_dim = getattr(owner, "head_dim", None)
        for child_name, child in owner.named_children():
            weight = getattr(child, "weight", None)
            if isinstance(child, nn.Linear) or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
                continue
            if weight.shape[1] != head_dim or weight.shape[0] not in (heads, kv_heads):
                continue
            queries = weight.shape[0] == heads
            count = "num_attention_heads" if queries else "num_key_value_heads"
            groups = "num_key_value_heads" if queries and grouped_kv else None
            path = f"{owner_path}.{child_name}" if owner_path else child_name
            bias = f"{path}.bias" if isinstance(getattr(child, "bias", None), nn.Parameter) else None
            found.append(Layer(weight=f"{path}.weight", bias=bias, style=PER_HEAD, heads=count, groups=groups))
    return found


def _full_width_norms(
    block: nn.Module, owners: set[str], config: Any, grouped_kv: bool, qk_only: bool = False
) -> list[Layer]:
    """RMSNorms over the whole width of a projection whose output the plan gathers (OLMo 2's q/k norms
    of ``heads * head_dim`` features): cut with the heads, and computed as column-split norms (one
    all-reduce of two numbers per row instead of the gather). ``qk_only``: only the children named as
    query/key norms (``q_norm``, ``k_layernorm``, ...)."""
    heads, kv_heads = _heads(config), _kv_heads(config)
    found = []
    for owner_path in sorted(owners):
        owner = block.get_submodule(owner_path) if owner_path else block
        head_dim = getattr(owner, "head_dim", None)
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            continue
        for child_name, child in owner.named_children():
            weight = getattr(child, "weight", None)
            if isinstance(child, nn.Linear) or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
                continue
            if qk_only and (not _QK_NORM.fullmatch(child_name) or weight.shape[0] == head_dim):
                continue  # a norm of one head's width normalizes each head on its own
            path = f"{owner_path}.{child_name}" if owner_path else child_name
            if weight.shape[0] == heads * head_dim:
                words = _query_heads(grouped_kv)
            elif weight.shape[0] == (kv_heads or heads) * head_dim:
                words = {"heads": "num_key_value_heads"}
            else:
                continue
            found.append(Layer(weight=f"{path}.weight", style=NORM, **words))
    return found


_QK_NORM = re.compile(r"(q|k|query|key)_?(layer)?_?norm")


def _check_config_head_counts(instances: list[Instance], attention_paths: set[str], config: Any) -> None:
    """The head counts a derived policy rewrites come from the config: refuse attentions whose own
    grouping differs from it (MiMo-V2-Flash doubles the key/value heads of its sliding-window layers)."""
    heads, kv_heads = _heads(config), _kv_heads(config)
    if not heads or not kv_heads:
        return
    for name, block, _ in instances:
        for owner_path in attention_paths:
            owner = _module(block, owner_path) if owner_path else block
            groups = getattr(owner, "num_key_value_groups", None)
            if isinstance(groups, int) and groups != heads // kv_heads:
                raise TpPlanError(
                    f"{name}.{owner_path} groups {groups} query heads per key/value head, its config "
                    f"{heads // kv_heads}: head counts that differ by layer are not read from the config"
                )


def _check_norms_see_equal_copies(block_name: str, heads: int, kv_heads: int, world_size: int) -> None:
    """A column-split norm sums its ranks' squares, so heads held by several ranks must be held by
    equally many (:class:`ShardingError` otherwise: key/value heads fewer than the ranks, not dividing them)."""
    for count, groups in ((heads, kv_heads), (kv_heads, None)):
        held = collections.Counter(
            unit for first, size in runs(count, world_size, groups) for unit in range(first, first + size)
        )
        if len(set(held.values())) > 1:
            raise ShardingError(
                f"{block_name} normalizes its whole q/k width: over {world_size} ranks its {kv_heads} key/value "
                f"heads would be held by unequally many ranks; use a world size that {kv_heads} divides or "
                "that divides it"
            )


def _heads(config: Any) -> int | None:
    heads = getattr(config, "num_attention_heads", None)
    return heads if isinstance(heads, int) else None


def _kv_heads(config: Any) -> int | None:
    return getattr(config, "num_key_value_heads", None) or _heads(config)
