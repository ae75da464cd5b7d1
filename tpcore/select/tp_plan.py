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

Fused experts that the config's ``base_model_ep_plan`` dispatches (``ep_dispatch_experts``) and its tp
plan leaves out are cut the same way, as ``moe_tp_experts`` rules would cut them: transformers 5.25
dropped those rules from the tp plans, leaving the experts to expert parallelism (:func:`_ep_plan_experts`).

Any other style (``moe_identity_expert``) means the plan cannot be followed, and the model needs a
plugin. Attention projections are dealt in whole heads, so world sizes that do not divide the head
counts work too. Key/value projections narrower than the query projection carry grouped KV heads,
which keep their query heads with them and are replicated when the ranks outnumber them. Multi-head
latent attention (DeepSeek-V2/V3: no one head width; ``q_b_proj`` heads of ``nope + rope`` features,
``kv_b_proj`` of ``nope + v``, ``o_proj`` of ``v``) is dealt in whole heads of each projection's own width.
What the plan accepts is also tried on a tiny copy of the config (:mod:`tpcore.plan.trial`).
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

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tpcore.authoring import COLUMN, ROW, Policy
from tpcore.configs import config_of, module_configs, sub_models
from tpcore.select.plan_policy import Rules, TpPlanError, experts_arguments, policy_for

__all__ = ["SubModelPlan", "TpPlanError", "derive_policies", "experts_arguments", "sub_model_plans"]

#: style -> (COLUMN or ROW, packed tensors, split dim of a fused 3-D experts tensor)
_SPLIT = {
    "colwise": (COLUMN, 1, -2),
    "rowwise": (ROW, 1, -1),
    "packed_colwise": (COLUMN, 2, -2),
    "packed_rowwise": (COLUMN, 2, -1),
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
#: an ep plan's fused experts module, its tokens dispatched to the ranks holding their experts
_EP_EXPERTS = "ep_dispatch_experts"


#: model types whose forward no split of their planned tensors keeps: the plan is not followed
UNFOLLOWABLE_PLANS = {
    "codegen": "its attention cuts the output of its packed qkv_proj into 4 fixed blocks (mp_num) whatever its "
    "width, so a rank's columns are cut in the wrong places",
    "doge": "its dt_proj (row-split in the plan) mixes every key/value head's values into each head's gate, which "
    "the attention then reads per local head",
}


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
        if not plan and not getattr(config, "base_model_ep_plan", None):
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
            plan = {**_ep_plan_experts(base, config), **(plan or {})}
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
    by_class: dict[type[nn.Module], list] = {}
    for name, paths in rules.items():
        block = model.get_submodule(name)
        by_class.setdefault(type(block), []).append((name, block, _followed(paths)))
    configs = module_configs(model)
    policies: list[type[Policy]] = [policy_for(instances, configs) for instances in by_class.values()]
    policies = [policy for policy in policies if policy.layers()]
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


def _ep_plan_experts(base: nn.Module, config: Any) -> dict[str, str]:
    """Tp plan rules for the fused experts that the config's ``base_model_ep_plan`` dispatches
    (``ep_dispatch_experts``) and its tp plan leaves out: ``gate_up_proj`` (or ``up_proj``) column and
    ``down_proj`` row parallel, along the intermediate features (transformers 5.25 moved the experts'
    ``moe_tp_experts`` rules out of the tp plans; expert parallelism is how it splits them now). Experts
    of other parameters (biases, a norm after each expert) or with gate and up interleaved get no rule:
    they stay whole."""
    tp_plan = getattr(config, "base_model_tp_plan", None) or {}
    rules: dict[str, str] = {}
    for pattern, style in (getattr(config, "base_model_ep_plan", None) or {}).items():
        if style != _EP_EXPERTS or any(other == pattern or other.startswith(f"{pattern}.") for other in tp_plan):
            continue
        for parameter, split in _experts_styles(_first_held(base, pattern)).items():
            rules[f"{pattern}.{parameter}"] = split
    return rules


def _first_held(base: nn.Module, pattern: str) -> nn.Module | None:
    """The module that ``<blocks>.*.<path>`` names in the first block holding it (MoE stacks may begin with
    dense blocks)."""
    prefix, star, path = pattern.partition(".*.")
    try:
        blocks = base.get_submodule(prefix)
    except AttributeError:
        return None
    for block in blocks.children() if star and "*" not in path else ():
        try:
            return block.get_submodule(path)
        except AttributeError:
            continue
    return None


def _experts_styles(experts: nn.Module | None) -> dict[str, str]:
    """``{parameter: tp plan style}`` of a fused experts module, ``{}`` when its layout is not the two
    tensors that a cut along the intermediate features keeps: ``gate_up_proj (E, 2I, H)`` with gate and
    up concatenated, or ``up_proj (E, I, H)``, and ``down_proj (E, H, I)``; or both stored transposed
    (``is_transposed``, else read from their shapes). A quantized experts layer's ``companions`` (its scales) do not
    count: they follow its weights."""
    if experts is None:
        return {}
    names = {name for name, _ in experts.named_parameters()} - set(getattr(experts, "companions", ()))  # scales
    if names not in ({"gate_up_proj", "down_proj"}, {"up_proj", "down_proj"}):
        return {}
    down = experts.get_parameter("down_proj")
    if not getattr(experts, "is_concatenated", True) or down.dim() != 3:
        return {}
    transposed = getattr(experts, "is_transposed", None)
    if not isinstance(transposed, bool):
        size = getattr(experts, "intermediate_dim", None)
        rows, features = down.shape[1:]
        if size not in (rows, features) or rows == features:
            return {}
        transposed = size == rows
    column, row = ("rowwise", "colwise") if transposed else ("colwise", "rowwise")
    styles = {"gate_up_proj": f"packed_{column}", "up_proj": column, "down_proj": row}
    return {name: styles[name] for name in sorted(names)}


def _followed(paths: dict[str, str]) -> Rules:
    """``{path: (COLUMN or ROW, packed tensors, dim of a 3-D tensor, paired)}`` for the rules a split
    forward follows. A gathered output and a split input in one module become a column / row pair
    (``paired``: nothing is gathered between them); either alone is left whole, as its output or
    input is whole."""

    def owners(style: str) -> set[str]:
        return {path.rpartition(".")[0] for path, other in paths.items() if other == style}

    pairs = owners(_GATHERED) & owners(_SPLIT_INPUT)
    followed: Rules = {}
    for path, style in paths.items():
        if style in _SPLIT:
            followed[path] = (*_SPLIT[style], False)
        elif path.rpartition(".")[0] in pairs:
            followed[path] = (COLUMN, 1, -2, True) if style == _GATHERED else (ROW, 1, -1, True)
    return followed
