"""Policies derived from a transformers ``base_model_tp_plan``, for models no plugin covers.

Many transformers configs declare how their base model splits: ``{"layers.*.self_attn.q_proj":
"colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``. Each ``<prefix>.*.<path>`` rule names a
linear layer inside the repeated blocks at ``<prefix>``; this module turns those rules into one
:class:`Policy` per block class. Styles it understands:

=========================================  ====================================================
``colwise`` / ``rowwise``                  column / row parallel (q/k/v and MLP in / outputs); a
                                           ``colwise`` 1-D parameter (attention sinks, one per
                                           head) is cut by the heads
``packed_colwise`` / ``packed_rowwise``    column parallel of two packed halves (gate|up), packed
                                           along the out (``(E, 2I, H)``) or the last dim
                                           (``(E, H, 2I)``)
``colwise_gather_output`` +                split without the gather: the pair becomes column /
``rowwise_split_input`` in one module      row parallel; a packed output (Phi-3's ``qkv_proj``
                                           ``[Q | K | V]``, ``gate_up_proj``) is cut by its parts,
                                           and an RMSNorm over the whole gathered width (OLMo 2's
                                           q/k norms) becomes a column-split norm
``colwise_gather_output`` or               left whole (its output is whole, as the gather makes
``rowwise_split_input`` alone              it, or its input is)
``moe_tp_experts``, ``all_reduce``         the module's output is all-reduced: what the ``rowwise``
                                           rules inside it already make it; fused experts
                                           ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``
                                           (or stored ``(E, H, 2I)``, ``(E, I, H)``) are cut along
                                           ``I``, the dim the style names; ``intermediate_dim``
                                           rewritten
``replicated_with_grad_allreduce``,        left whole on every rank (norms, embeddings, the MLA
``replicate``, ``embedding_*``,            ``kv_a_proj``: these styles only fix gradients or keep
``mla_kv_a_proj``, ``local_params``        a module on local tensors)
=========================================  ====================================================

Any other style (``moe_identity_expert``) means the plan cannot be followed, and the model needs a
plugin. Attention projections are dealt in whole heads, so world sizes that do not divide the head
counts work too. Key/value projections narrower than the query projection carry grouped KV heads,
which keep their query heads with them and are replicated when the ranks outnumber them.
Per-head parameters the plan leaves out but that must follow the heads (Cohere's
``q_norm``/``k_norm`` weights of shape ``(heads, head_dim)``) are cut with them. An attention whose
forward reads its head counts from ``self.config`` (Phi-3) gets a per-rank copy of its config.

Composite models (LLaVA, CLIP, encoder-decoders with their own sub-configs) carry one plan per
sub-model (:func:`tpcore.configs.sub_models`): each sub-model's config plan is read relative to
that sub-model's base model, as transformers applies it. A sub-model whose config has no plan,
or a plan that cannot be followed, stays whole. Policies are per block class; their
``replace_arguments`` reads the head counts of the config it is handed (the block's sub-model's),
so one block class shared by towers of different widths (CLIP's) gets each tower's own counts.
"""

from __future__ import annotations

import collections
import copy
import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tpcore.authoring import IfHeld, Layer, Policy, local_config, share
from tpcore.configs import config_of, module_configs, sub_models
from tpcore.cut.shares import PerRank, runs
from tpcore.errors import ShardingError
from tpcore.parallel.layers import column_split_norm_class

__all__ = ["SubModelPlan", "TpPlanError", "derive_policies", "experts_arguments", "sub_model_plans"]

#: style -> (column or row, packed tensors, split dim of a fused 3-D experts tensor)
_SPLIT = {
    "colwise": ("column", 1, -2),
    "rowwise": ("row", 1, -1),
    "packed_colwise": ("column", 2, -2),
    "packed_rowwise": ("column", 2, -1),
}
#: a gathered column output and a row layer that splits its whole input: followed as a pair in one module
_GATHERED, _SPLIT_INPUT = "colwise_gather_output", "rowwise_split_input"
_KEPT_WHOLE = {
    "replicated_with_grad_allreduce",
    "replicate",
    "embedding_rowwise",
    "embedding_colwise",
    "mla_kv_a_proj",
    "local_params",
}
#: a module whose output is all-reduced: what the ``rowwise`` rules inside it already make it
_REDUCED_OUTPUT = {"moe_tp_experts", "all_reduce"}
_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_key_value_groups")
_CONFIG_HEADS = ("num_attention_heads", "num_key_value_heads")


#: model types whose forward no split of their planned tensors keeps: the plan is not followed
UNFOLLOWABLE_PLANS = {
    "codegen": "its attention cuts the output of its packed qkv_proj into 4 fixed blocks (mp_num) whatever its "
    "width, so a rank's columns are cut in the wrong places",
    "doge": "its dt_proj (row-split in the plan) mixes every key/value head's values into each head's gate, which "
    "the attention then reads per local head",
}


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
        if getattr(config, "model_type", None) in UNFOLLOWABLE_PLANS:
            reason = UNFOLLOWABLE_PLANS[config.model_type]
            plans.append(
                SubModelPlan(
                    name, config, whole=f"{_describe(module, config)}: tpcore does not follow its tp plan: {reason}"
                )
            )
            continue
        base = getattr(module, "base_model", module)
        if base is module:  # its base_model_prefix names no child (Llama 4's causal LM): the child of its config
            base = next(
                (child for child in module.children() if _is_pretrained(child) and child.config is config), module
            )
        base_name = next(n for n, m in module.named_modules() if m is base)
        prefix = ".".join(part for part in (name, base_name) if part)
        try:
            rules = _block_rules(base, plan)
        except TpPlanError as error:
            plans.append(SubModelPlan(name, config, whole=f"{_describe(module, config)}: {error}"))
            continue
        if not rules:
            plans.append(
                SubModelPlan(
                    name,
                    config,
                    whole=f"{_describe(module, config)}: its tp plan splits no block (only {', '.join(plan)})",
                )
            )
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
    policies = [_policy_for(instances, configs) for instances in by_class.values()]
    policies = [policy for policy in policies if policy.attn_qkv() or policy.attn_out()]
    if not policies:
        named = ", ".join(sorted({path for paths in rules.values() for path in paths}))
        raise TpPlanError(
            f"the rules of its tp plan that a split forward follows name no tensor of its blocks ({named})"
        )
    return policies


def _is_pretrained(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers model (not a submodule that merely keeps the config, as rotary
    embeddings do)."""
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def _describe(module: nn.Module, config: Any) -> str:
    model_type = getattr(config, "model_type", None)
    return f"{type(module).__name__}'s config" + (f" ({model_type})" if model_type else "")


def _block_rules(base: nn.Module, plan: dict[str, str]) -> dict[str, dict[str, str]]:
    """``{blocks path in base: {linear path: style}}`` from a plan's split rules (checked)."""
    rules: dict[str, dict[str, str]] = {}
    for pattern, style in plan.items():
        if style in _KEPT_WHOLE or style in _REDUCED_OUTPUT:
            continue
        if style not in _SPLIT and style not in (_GATHERED, _SPLIT_INPUT):
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


def _followed(paths: dict[str, str]) -> dict[str, tuple[str, int, int, bool]]:
    """``{path: (column or row, packed tensors, dim of a 3-D tensor, paired)}`` for the rules a split
    forward follows. A gathered output and a split input in one module become a column / row pair
    (``paired``: nothing is gathered between them); either alone is left whole, as its output or
    input is whole."""

    def owners(style: str) -> set[str]:
        return {path.rpartition(".")[0] for path, other in paths.items() if other == style}

    pairs = owners(_GATHERED) & owners(_SPLIT_INPUT)
    followed = {}
    for path, style in paths.items():
        if style in _SPLIT:
            followed[path] = (*_SPLIT[style], False)
        elif path.rpartition(".")[0] in pairs:
            followed[path] = ("column", 1, -2, True) if style == _GATHERED else ("row", 1, -1, True)
    return followed


def _policy_for(instances: list[tuple[str, nn.Module, dict[str, str]]], configs: dict[str, Any]) -> type[Policy]:
    """A Policy for the class of the blocks ``(name, block, rules)``, from the rules that exist in them.

    Sub-models whose plans name the same block class must agree on its rules.
    """
    name, block, paths = instances[0]
    for other_name, _, other in instances[1:]:
        if other != paths:
            raise TpPlanError(f"the tp plans of {name!r} and {other_name!r} split {type(block).__name__} differently")
    block_configs = list({id(configs[n]): configs[n] for n, _, _ in instances}.values())
    config = block_configs[0]
    grouped_kv = any(_kv_heads(config) != _heads(config) for config in block_configs if _heads(config))
    followed = _followed(paths)
    row_inputs = {  # a paired row layer's input width, which its column partner's packed halves fill twice
        path.rpartition(".")[0]: linear.in_features
        for path, (kind, _, _, paired) in followed.items()
        if kind == "row" and paired and isinstance(linear := _module(block, path), nn.Linear)
    }
    columns, rows, attention_paths, full_width, intermediates = [], [], set(), set(), {}
    held_by_some: dict[str, str] = {}  # attention owner -> a split linear that some blocks lack
    for path, (kind, n_fused, tensor_dim, paired) in followed.items():
        owner_path = path.rpartition(".")[0]
        holders = [b for _, b, _ in instances if _module(b, path) is not None or _parameter(b, path) is not None]
        if not holders:
            continue  # blocks of this class lack it
        holder, optional = holders[0], len(holders) < len(instances)  # some blocks lack it (hybrid stacks)
        linear = _module(holder, path)
        if linear is None:
            parameter = _parameter(holder, path)
            assert parameter is not None
            if parameter.dim() == 1:  # one value per head (attention sinks)
                columns.append(Layer(weight=path, dim=0, optional=optional, **_query_heads(grouped_kv)))
                continue
            # a fused experts tensor, cut along the dim the style names (``(E, 2I, H)``: -2, ``(E, H, I)``: -1,
            # the other storage ``(E, H, 2I)``, ``(E, I, H)`` alike); its down projection makes the output partial
            kind = "row" if path.rpartition(".")[2].startswith("down") else "column"
            if path.endswith("gate_up_proj"):
                n_fused = 2  # gate|up halves, whatever the style (Inkling's plan says plain ``colwise``)
            spec = Layer(weight=path, dim=tensor_dim, n_fused=n_fused, optional=optional)
            (columns if kind == "column" else rows).append(spec)
            size = getattr(holder.get_submodule(owner_path), "intermediate_dim", None)
            if isinstance(size, int) and not optional:  # hybrid stacks: left as built (their forward reads no size)
                intermediates[f"{owner_path}.intermediate_dim"] = size
            continue
        if not isinstance(linear, nn.Linear):
            raise TpPlanError(f"its tp plan splits {path!r}, a {type(linear).__name__}, not a Linear")
        in_attention = "attn" in path or "attention" in path
        if kind == "column" and paired and not in_attention and linear.out_features == 2 * row_inputs[owner_path]:
            n_fused = 2  # gate|up packed in one projection
        layout = _head_layout(holder, path, linear, kind, n_fused, grouped_kv, config) if in_attention else {}
        spec = Layer(weight=f"{path}.weight", bias=f"{path}.bias", n_fused=n_fused, optional=optional, **layout)
        (columns if kind == "column" else rows).append(spec)
        if in_attention:
            attention_paths.add(owner_path)
            if optional:
                held_by_some.setdefault(owner_path, path)
            if paired:
                full_width.add(owner_path)
    # the first block that holds every attention the rules name (hybrid stacks mix attention kinds)
    block = next((b for _, b, _ in instances if all(_module(b, owner) for owner in attention_paths)), block)
    _check_config_head_counts(instances, attention_paths, config)
    columns.extend(_per_head_parameters(block, attention_paths, config, grouped_kv))
    norms = _full_width_norms(block, full_width, config, grouped_kv)
    # q/k norms over the whole width after projections the plan leaves split (transformers' own plan would
    # feed them a rank's columns): computed column-split alike, or refused if they are not RMSNorms (ESM C)
    norms += _full_width_norms(block, attention_paths - full_width, config, grouped_kv, qk_only=True)
    columns.extend(norms)
    attributes = {
        (f"{owner}.{name}" if owner else name, owner): name
        for owner in attention_paths
        for name in _HEAD_ATTRIBUTES
        if isinstance(getattr(block.get_submodule(owner) if owner else block, name, None), int)
    }
    config_readers = [owner for owner in sorted(attention_paths) if _reads_config_heads(_module(block, owner))]
    block_name = type(block).__name__

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
        if norms:
            _check_norms_see_equal_copies(block_name, heads, kv_heads, world_size)
        local = share(heads, world_size, "num_attention_heads", groups=kv_heads)
        local_kv = share(kv_heads, world_size, "num_key_value_heads")  # one, replicated, when fewer than ranks
        values = {
            "num_heads": local,
            "num_attention_heads": local,
            "num_key_value_heads": local_kv,
            "num_key_value_groups": local // local_kv,
        }
        configs = {
            f"{owner}.config" if owner else "config": held(
                owner, local_config(config, world_size, num_attention_heads=local, num_key_value_heads=local_kv)
            )
            for owner in config_readers
        }
        return {
            **{path: held(owner, values[name]) for (path, owner), name in attributes.items()},
            **configs,
            **local_sizes,
        }

    def held(owner: str, value: Any) -> Any:
        """``value``, set only in the blocks holding the split attention where some blocks lack it."""
        return IfHeld(value, held_by_some[owner]) if owner in held_by_some else value

    kind = type(block)
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
    block: nn.Module, path: str, linear: nn.Linear, kind: str, n_fused: int, grouped_kv: bool, config: Any
) -> dict[str, Any]:
    """The head words (:class:`Layer` ``heads``, ``groups``, ``parts``) of an attention linear, so that
    uneven world sizes deal it in whole heads: key/value projections by their heads, query and output
    projections by the query heads in key/value groups, a packed ``[Q | K | V]`` by its three parts;
    ``{}`` when its split features are not whole heads."""
    owner_path = path.rpartition(".")[0]
    owner = block.get_submodule(owner_path) if owner_path else block
    heads, kv_heads = _heads(config), _kv_heads(config)
    head_dim = getattr(owner, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int) or n_fused != 1:
        return {}
    kv_heads = kv_heads or heads
    features = linear.out_features if kind == "column" else linear.in_features
    if kind == "column" and features == (heads + 2 * kv_heads) * head_dim:
        kv = "num_key_value_heads" if grouped_kv else "num_attention_heads"
        return {"parts": ("num_attention_heads", kv, kv), **({"groups": kv} if grouped_kv else {})}
    if kind == "column" and path.rsplit(".", 1)[-1] in ("k_proj", "v_proj") and grouped_kv:
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
            found.append(Layer(weight=f"{path}.weight", bias=bias, dim=0, heads=count, groups=groups))
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
            found.append(Layer(weight=f"{path}.weight", replace=column_split_norm_class, **words))
    return found


_QK_NORM = re.compile(r"(q|k|query|key)_?(layer)?_?norm")


def _check_config_head_counts(
    instances: list[tuple[str, nn.Module, dict[str, str]]], attention_paths: set[str], config: Any
) -> None:
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
