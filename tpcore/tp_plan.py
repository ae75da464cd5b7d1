"""Policies derived from a transformers ``base_model_tp_plan``, for models no plugin covers.

Many transformers configs declare how their base model splits: ``{"layers.*.self_attn.q_proj":
"colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``. Each ``<prefix>.*.<path>`` rule names a
linear layer inside the repeated blocks at ``<prefix>``; this module turns those rules into one
:class:`Policy` per block class. Styles it understands:

==========================================  ===================================================
``colwise`` / ``rowwise``                   column / row parallel (q/k/v and MLP in / outputs)
``packed_colwise``                          column parallel of two packed halves (gate|up)
``replicated_with_grad_allreduce``,         left whole on every rank (norms, embeddings)
``replicate``, ``embedding_*``
``moe_tp_experts``                          the experts module's output is all-reduced: its
                                            fused ``gate_up_proj (E, 2I, H)`` (``packed_colwise``)
                                            and ``down_proj (E, H, I)`` (``rowwise``) are cut along
                                            ``I``, ``intermediate_dim`` rewritten per rank
==========================================  ===================================================

Any other style (gathered outputs, MLA) means the plan cannot be followed, and the model needs a
plugin. Attention projections are dealt in whole heads, so world sizes that do not divide the head
counts work too. Key/value projections narrower than the query projection carry grouped KV heads,
which keep their query heads with them and are replicated when the ranks outnumber them.
Per-head parameters the plan leaves out but that must follow the heads (Cohere's
``q_norm``/``k_norm`` weights of shape ``(heads, head_dim)``) are cut with them.

Composite models (LLaVA, CLIP, encoder-decoders with their own sub-configs) carry one plan per
sub-model (:func:`tpcore.configs.sub_models`): each sub-model's config plan is read relative to
that sub-model's base model, as transformers applies it. A sub-model whose config has no plan,
or a plan that cannot be followed, stays whole. Policies are per block class; their
``replace_arguments`` reads the head counts of the config it is handed (the block's sub-model's),
so one block class shared by towers of different widths (CLIP's) gets each tower's own counts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tpcore.configs import config_of, module_configs, sub_models
from tpcore.policy import Layer, PerRank, Policy, share

__all__ = ["SubModelPlan", "TpPlanError", "derive_policies", "experts_arguments", "sub_model_plans"]

_SPLIT = {"colwise": ("column", 1), "rowwise": ("row", 1), "packed_colwise": ("column", 2)}
_KEPT_WHOLE = {"replicated_with_grad_allreduce", "replicate", "embedding_rowwise", "embedding_colwise"}
#: a fused experts module whose output is all-reduced: what its ``rowwise`` ``down_proj`` already makes it
_REDUCED_OUTPUT = {"moe_tp_experts"}
_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_key_value_groups")


class TpPlanError(LookupError):
    """The model's tp plan is missing or uses a style tpcore cannot follow."""


@dataclass(frozen=True)
class SubModelPlan:
    """What one sub-model's tp plan gives: its blocks' rules, or why it stays whole.

    ``rules`` maps a block path (relative to the model) to ``{linear path in the block: style}``.
    """

    name: str
    config: Any
    rules: dict[str, dict[str, str]] = field(default_factory=dict)
    whole: str | None = None


def sub_model_plans(model: nn.Module) -> list[SubModelPlan]:
    """The tp plan of every sub-model of ``model`` (:func:`tpcore.configs.sub_models`), outermost first."""
    plans = []
    for name, module in sub_models(model).items():
        config = config_of(model, name)
        plan = getattr(config, "base_model_tp_plan", None)
        if not plan:
            plans.append(SubModelPlan(name, config, whole=f"{_describe(module, config)} has no base_model_tp_plan"))
            continue
        base = getattr(module, "base_model", module)
        base_name = next(n for n, m in module.named_modules() if m is base)
        prefix = ".".join(part for part in (name, base_name) if part)
        try:
            rules = _block_rules(base, plan)
        except TpPlanError as error:
            plans.append(SubModelPlan(name, config, whole=f"{_describe(module, config)}: {error}"))
            continue
        rules = {".".join(p for p in (prefix, blocks) if p): paths for blocks, paths in rules.items()}
        plans.append(SubModelPlan(name, config, rules))
    return plans


def derive_policies(model: nn.Module) -> list[type[Policy]]:
    """One policy per block class that the sub-models' ``base_model_tp_plan`` describe.

    Raises :class:`TpPlanError` when no sub-model's plan gives any (saying why for each).
    """
    plans = sub_model_plans(model)
    rules: dict[str, dict[str, str]] = {}  # block name -> {linear path: style}, merged over the plans
    for plan in plans:
        for blocks_name, paths in plan.rules.items():
            for index, _ in model.get_submodule(blocks_name).named_children():
                block_rules = rules.setdefault(f"{blocks_name}.{index}", {})
                for path, style in paths.items():
                    other = block_rules.setdefault(path, style)
                    if other != style:
                        where = f"{blocks_name}.{index}.{path}"
                        raise TpPlanError(f"tp plans of its sub-models split {where!r} as {other!r} and {style!r}")
    if not rules:
        raise TpPlanError("; ".join(plan.whole for plan in plans if plan.whole))
    by_class: dict[type[nn.Module], list[tuple[str, nn.Module, dict[str, str]]]] = {}
    for name, paths in rules.items():
        block = model.get_submodule(name)
        by_class.setdefault(type(block), []).append((name, block, paths))
    configs = module_configs(model)
    return [_policy_for(instances, configs) for instances in by_class.values()]


def _describe(module: nn.Module, config: Any) -> str:
    model_type = getattr(config, "model_type", None)
    return f"{type(module).__name__}'s config" + (f" ({model_type})" if model_type else "")


def _block_rules(base: nn.Module, plan: dict[str, str]) -> dict[str, dict[str, str]]:
    """``{blocks path in base: {linear path: style}}`` from a plan's split rules (checked)."""
    rules: dict[str, dict[str, str]] = {}
    for pattern, style in plan.items():
        if style in _KEPT_WHOLE or style in _REDUCED_OUTPUT:
            continue
        if style not in _SPLIT:
            raise TpPlanError(f"its tp plan splits {pattern!r} as {style!r}, which tpcore does not follow")
        prefix, star, path = pattern.partition(".*.")
        if not star or "*" in path:
            raise TpPlanError(f"its tp plan rule {pattern!r} is not of the form '<blocks>.*.<linear>'")
        try:
            base.get_submodule(prefix)
        except AttributeError:
            raise TpPlanError(f"its tp plan names blocks {prefix!r}, which the model lacks") from None
        rules.setdefault(prefix, {})[path] = style
    return rules


def _policy_for(instances: list[tuple[str, nn.Module, dict[str, str]]], configs: dict[str, Any]) -> type[Policy]:
    """A Policy for the class of the blocks ``(name, block, rules)``, from the rules that exist in them.

    Sub-models whose plans name the same block class must agree on its rules.
    """
    name, block, paths = instances[0]
    for other_name, _, other in instances[1:]:
        if other != paths:
            raise TpPlanError(f"the tp plans of {name!r} and {other_name!r} split {type(block).__name__} differently")
    block_configs = list({id(configs[n]): configs[n] for n, _, _ in instances}.values())
    grouped_kv = any(_kv_heads(config) != _heads(config) for config in block_configs if _heads(config))
    columns, rows, attention_paths, intermediates = [], [], set(), {}
    for path, style in paths.items():
        kind, n_fused = _SPLIT[style]
        try:
            linear = block.get_submodule(path)
        except AttributeError:
            parameter = _parameter(block, path)
            if parameter is None:
                continue  # blocks of this class lack it (hybrid stacks)
            # a fused experts tensor: (E, 2I, H) cut along its out features, (E, H, I) along its in features
            spec = Layer(weight=path, dim=-2 if kind == "column" else -1, n_fused=n_fused)
            (columns if kind == "column" else rows).append(spec)
            owner_path = path.rpartition(".")[0]
            size = getattr(block.get_submodule(owner_path), "intermediate_dim", None)
            if isinstance(size, int):
                intermediates[f"{owner_path}.intermediate_dim"] = size
            continue
        if not isinstance(linear, nn.Linear):
            raise TpPlanError(f"its tp plan splits {path!r}, a {type(linear).__name__}, not a Linear")
        in_attention = "attn" in path or "attention" in path
        layout = _head_layout(block, path, linear, kind, n_fused, grouped_kv, block_configs[0]) if in_attention else {}
        spec = Layer(weight=f"{path}.weight", bias=f"{path}.bias", n_fused=n_fused, **layout)
        (columns if kind == "column" else rows).append(spec)
        if in_attention:
            attention_paths.add(path.rpartition(".")[0])
    columns.extend(_per_head_parameters(block, attention_paths, block_configs[0], grouped_kv))
    attributes = {
        f"{owner}.{name}" if owner else name: name
        for owner in attention_paths
        for name in _HEAD_ATTRIBUTES
        if isinstance(getattr(block.get_submodule(owner) if owner else block, name, None), int)
    }

    def replace_arguments(config, world_size):
        """Per-rank head counts, read from the config of the block's sub-model."""
        heads, kv_heads = _heads(config), _kv_heads(config)
        local_sizes = {
            f"{owner}.{name}": value
            for path, size in intermediates.items()
            for owner in [path.rpartition(".")[0]]
            for name, value in experts_arguments(config, size, world_size).items()
        }
        if heads is None:
            return local_sizes
        local = share(heads, world_size, "num_attention_heads", groups=kv_heads)
        local_kv = share(kv_heads, world_size, "num_key_value_heads")  # one, replicated, when fewer than ranks
        values = {
            "num_heads": local,
            "num_attention_heads": local,
            "num_key_value_heads": local_kv,
            "num_key_value_groups": local // local_kv,
        }
        return {**{path: values[name] for path, name in attributes.items()}, **local_sizes}

    kind, config = type(block), block_configs[0]
    return type(
        f"{kind.__name__}PlanPolicy",
        (Policy,),
        {
            "__doc__": f"Derived from {type(config).__name__}.base_model_tp_plan.",
            "__module__": __name__,
            "layer_class": f"{kind.__module__}.{kind.__qualname__}",
            "name": f"{kind.__name__} (tp plan of {getattr(config, 'model_type', None)})",
            "replace_arguments": staticmethod(replace_arguments),
            "attn_qkv": staticmethod(lambda: list(columns)),
            "attn_out": staticmethod(lambda: list(rows)),
        },
    )


#: transformers' grouped-mm experts kernels need rows of a multiple of 16 bytes: 8 half-precision features
_GROUPED_MM_FEATURES = 8


def experts_arguments(config: Any, size: int, world_size: int) -> dict[str, Any]:
    """A fused experts module's per-rank attributes: ``intermediate_dim``, each rank's share of the
    ``size`` intermediate features; and where a share breaks the 16-byte rows that transformers'
    grouped-mm experts kernels need (uneven splits), a ``config`` copy that runs its eager experts
    implementation instead (the same sums, expert by expert)."""
    local = share(size, world_size, "intermediate_dim")
    arguments: dict[str, Any] = {"intermediate_dim": local}
    shares = tuple(local) if isinstance(local, PerRank) else (local,)
    if world_size > 1 and any(count % _GROUPED_MM_FEATURES for count in shares):
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            eager = copy.copy(config)
            eager._experts_implementation = "eager"
            arguments["config"] = eager
    return arguments


def _parameter(block: nn.Module, path: str) -> nn.Parameter | None:
    """The parameter at ``path`` in ``block`` (a plan rule on a fused experts tensor), if there is one."""
    owner_path, _, name = path.rpartition(".")
    try:
        owner = block.get_submodule(owner_path)
    except AttributeError:
        return None
    parameter = owner._parameters.get(name)
    return parameter if parameter is not None and parameter.dim() == 3 else None


def _head_layout(
    block: nn.Module, path: str, linear: nn.Linear, kind: str, n_fused: int, grouped_kv: bool, config: Any
) -> dict[str, Any]:
    """The head words (:class:`Layer` ``heads``, ``groups``) of an attention linear, so that uneven world
    sizes deal it in whole heads: key/value projections by their heads, query and output projections by
    the query heads in key/value groups; ``{}`` when its split features are not ``heads * head_dim``."""
    owner_path = path.rpartition(".")[0]
    owner = block.get_submodule(owner_path) if owner_path else block
    heads, kv_heads = _heads(config), _kv_heads(config)
    head_dim = getattr(owner, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int) or n_fused != 1:
        return {}
    features = linear.out_features if kind == "column" else linear.in_features
    if kind == "column" and path.rsplit(".", 1)[-1] in ("k_proj", "v_proj") and grouped_kv:
        return {"heads": "num_key_value_heads"} if features == (kv_heads or heads) * head_dim else {}
    if features != heads * head_dim:
        return {}
    return {"heads": "num_attention_heads", **({"groups": "num_key_value_heads"} if grouped_kv else {})}


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
            found.append(Layer(weight=f"{path}.weight", bias=bias, dim=0, heads=count, groups=groups))
    return found


def _heads(config: Any) -> int | None:
    heads = getattr(config, "num_attention_heads", None)
    return heads if isinstance(heads, int) else None


def _kv_heads(config: Any) -> int | None:
    return getattr(config, "num_key_value_heads", None) or _heads(config)
