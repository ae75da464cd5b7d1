"""Structural policies: for a model that neither a plugin nor a tp plan covers, the split read off its modules.

Like DeepSpeed's AutoTP, this finds, in every repeated block (the elements of a ``ModuleList`` of one
class), the ``nn.Linear`` pairs a Megatron split cuts column -> row:

- an **attention**: in a module whose path names an attention (``attn``, ``attention``), three sibling
  projections named as queries, keys and values (``q_proj``/``k_proj``/``v_proj``, ``query``/``key``/
  ``value``, ``q``/``k``/``v``, ...) from the hidden width (``hidden_size``, ``d_model``, ``n_embd``) to
  ``num_attention_heads x head_dim`` (keys and values ``num_key_value_heads x head_dim``), and an output
  projection (``o_proj``, ``out_proj``, ``dense``, ...) from the queries' width back to the hidden width,
  the nearest such to them: q/k/v column parallel, the output row parallel, dealt in whole heads;
- an **MLP**: a projection to the hidden width from an intermediate width (its ``down``) and the
  projections from the hidden width to that width (its ``up`` and ``gate``; one of twice the width packs
  ``[gate | up]``) near it: column parallel, the down row parallel.

The rules go through the policy a tp plan of the same rules would give (:func:`~tpcore.select.plan_policy.policy_for`:
head counts, per-head parameters and per-rank configs follow the heads), and the attentions' width
attributes (``all_head_size``, ``inner_dim``, ``embed_dim`` equal to the queries' width) take the rank's
width. Nothing here knows what the forward computes between those layers (a norm over the intermediate
features, an activation mixing them), so every structural policy asks for a proof
(``prove_by_trial``): :func:`~tpcore.plan.plan_for` runs the split of a tiny random copy of the config on
threads acting as ranks and compares every output with the unsplit model's
(:mod:`tpcore.plan.proof`) before the user's model is touched; the policy is used only when that passes.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from torch import nn

from tpcore.authoring import COLUMN, ROW, Policy, share
from tpcore.configs import config_of, module_configs
from tpcore.select.plan_policy import Instance, PlanPolicy, Rules, TpPlanError, policy_for

__all__ = [
    "STRUCTURAL_ENV",
    "STRUCTURAL_ORIGIN",
    "StructuralError",
    "StructuralPolicy",
    "structural_enabled",
    "structural_policies",
]

#: set to ``0`` to refuse a model that neither a plugin nor a tp plan covers instead of reading its structure
STRUCTURAL_ENV = "TPCORE_STRUCTURAL"

#: where :func:`~tpcore.select.auto.policy_origin` says a structural policy comes from
STRUCTURAL_ORIGIN = "structure (proven on a tiny copy)"

_QKV_NAMES = (
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("q", "k", "v"),
    ("q_lin", "k_lin", "v_lin"),
    ("wq", "wk", "wv"),
    ("Wq", "Wk", "Wv"),
    ("query_proj", "key_proj", "value_proj"),
    ("to_q", "to_k", "to_v"),
)
_OUTPUT_NAMES = {"o_proj", "out_proj", "o", "dense", "out_lin", "proj", "wo", "out", "c_proj", "output", "to_out"}
_HIDDEN = ("hidden_size", "d_model", "n_embd", "dim")
_WIDTH_ATTRIBUTES = ("all_head_size", "inner_dim", "embed_dim")
_COLUMN, _PACKED, _ROW = (COLUMN, 1, -2, False), (COLUMN, 2, -2, False), (ROW, 1, -1, False)


class StructuralError(LookupError):
    """No repeated block of the model holds a split this module can read off."""


class StructuralPolicy(PlanPolicy):
    """A policy read off a block's modules (see the module docstring); used only once proven on a tiny copy."""

    prove_by_trial: ClassVar[bool] = True
    #: ``(path, owner)``: width attributes of the split attentions (``heads x head_dim`` features)
    width_attributes: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def replace_arguments(cls, config: Any, world_size: int) -> dict[str, Any]:
        """The plan policy's head counts, and each width attribute the rank's heads x head_dim."""
        arguments = super().replace_arguments(config, world_size)
        if not cls.width_attributes:
            return arguments
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        local = share(heads, world_size, "num_attention_heads", groups=kv_heads)
        head_dim = getattr(config, "head_dim", None)
        if not isinstance(head_dim, int):  # read from this config: the tiny copy of a proof has heads of its own
            head_dim = _hidden(config) // heads
        for path, owner in cls.width_attributes:
            arguments[path] = cls._held(owner, local * head_dim)
        return arguments


def structural_enabled() -> bool:
    """Whether models no plugin or tp plan covers get structural policies (``TPCORE_STRUCTURAL`` not ``0``)."""
    return os.environ.get(STRUCTURAL_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def structural_policies(model: nn.Module, skip: tuple[type[nn.Module], ...] = ()) -> list[type[Policy]]:
    """One :class:`StructuralPolicy` per class of the outermost repeated blocks of ``model`` that hold an
    attention or an MLP to split (blocks of the classes in ``skip`` left out); raises
    :class:`StructuralError` saying why where there is none."""
    if not structural_enabled():
        raise StructuralError(f"structural policies are off ({STRUCTURAL_ENV}=0)")
    configs = module_configs(model)
    by_class: dict[type[nn.Module], list[Instance]] = {}
    taken: list[str] = []
    for name, module in model.named_modules():
        if not _repeated_blocks(module) or any(name.startswith(prefix + ".") for prefix in taken):
            continue
        config = config_of(model, name)
        found = [(f"{name}.{i}", block, block_rules(block, config)) for i, block in module.named_children()]
        found = [item for item in found if item[2] and not isinstance(item[1], skip)]
        if found:
            taken.append(name)
            for item in found:
                by_class.setdefault(type(item[1]), []).append(item)
    policies: list[type[Policy]] = []
    reasons = []
    for kind, instances in by_class.items():
        try:
            derived = policy_for(instances, configs)
        except TpPlanError as error:
            reasons.append(f"{kind.__name__}: {error}")
            continue
        if derived.layers():
            policies.append(_structural(derived, instances[0][1], instances[0][2], configs[instances[0][0]]))
    if not policies:
        why = "; ".join(reasons) or "no repeated block holds q/k/v and output projections or an MLP of Linears"
        raise StructuralError(f"no structural split of {type(model).__name__}: {why}")
    return policies


def block_rules(block: nn.Module, config: Any) -> Rules:
    """``{linear path: rule}`` of one block: its attentions' and MLPs' column and row projections."""
    hidden = _hidden(config)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int):
        return {}
    linears = {path: m for path, m in block.named_modules() if type(m) is nn.Linear}
    rules: Rules = {}
    if isinstance(heads, int) and heads > 0:
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        rules |= _attention_rules(linears, hidden, heads, kv_heads)
    rules |= _mlp_rules({p: m for p, m in linears.items() if p not in rules}, hidden)
    return rules


def _attention_rules(linears: dict[str, nn.Linear], hidden: int, heads: int, kv_heads: int) -> Rules:
    rules: Rules = {}
    for names in _QKV_NAMES:
        for q_path, q in linears.items():
            owner, _, leaf = q_path.rpartition(".")
            if leaf != names[0] or not any(word in owner.lower() for word in ("attn", "attention")):
                continue
            paths = [_join(owner, name) for name in names]
            if not all(path in linears for path in paths) or q.out_features % heads:
                continue
            k, v = linears[paths[1]], linears[paths[2]]
            head_dim = q.out_features // heads
            if {q.in_features, k.in_features, v.in_features} != {hidden}:
                continue
            if k.out_features != v.out_features or k.out_features not in (kv_heads * head_dim, q.out_features):
                continue
            output = _output_of(linears, owner, q.out_features, hidden, set(paths))
            if output is not None:
                rules |= dict.fromkeys(paths, _COLUMN) | {output: _ROW}
    return rules


def _output_of(linears: dict[str, nn.Linear], owner: str, width: int, hidden: int, used: set[str]) -> str | None:
    """The attention's output projection: ``width -> hidden``, output-named, the nearest to ``owner``."""
    candidates = [
        path
        for path, linear in linears.items()
        if path not in used
        and path.rpartition(".")[2] in _OUTPUT_NAMES
        and (linear.in_features, linear.out_features) == (width, hidden)
    ]
    return max(candidates, key=lambda path: len(os.path.commonprefix([path, owner])), default=None)


def _mlp_rules(linears: dict[str, nn.Linear], hidden: int) -> Rules:
    """Each ``down`` (intermediate -> hidden) with the ``up``/``gate`` projections (hidden -> intermediate, or
    ``[gate | up]`` of twice it) that share its parent or its parent's parent."""
    rules: Rules = {}
    for down_path, down in linears.items():
        width = down.in_features
        if down.out_features != hidden or width == hidden or down_path in rules:
            continue
        near = _ancestor(down_path, 2)
        ups = {
            path: _PACKED if linear.out_features == 2 * width else _COLUMN
            for path, linear in linears.items()
            if path not in rules
            and path != down_path
            and linear.in_features == hidden
            and linear.out_features in (width, 2 * width)
            and (not near or path.startswith(near + "."))
        }
        if ups:
            rules |= ups | {down_path: _ROW}
    return rules


def _structural(derived: type[PlanPolicy], block: nn.Module, rules: Rules, config: Any) -> type[StructuralPolicy]:
    """``derived`` (the plan policy of ``rules``) as a :class:`StructuralPolicy`, with the attentions' widths."""
    heads = config.num_attention_heads if isinstance(getattr(config, "num_attention_heads", None), int) else 0
    widths = []
    for path, rule in rules.items():
        owner, _, leaf = path.rpartition(".")
        if rule is not _COLUMN or leaf not in {names[0] for names in _QKV_NAMES} or not heads:
            continue
        linear = block.get_submodule(path)
        assert isinstance(linear, nn.Linear)
        width = linear.out_features
        module = block.get_submodule(owner) if owner else block
        for name in _WIDTH_ATTRIBUTES:
            if getattr(module, name, None) == width:
                widths.append((_join(owner, name), owner))
    kind = type(block)
    data = {
        "__doc__": f"Read off the Linears of {kind.__name__} (tpcore.select.structural).",
        "__module__": __name__,
        "name": f"{kind.__name__} (structural)",
        "width_attributes": tuple(widths),
    }
    return type(f"{kind.__name__}StructuralPolicy", (StructuralPolicy, derived), data)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _hidden(config: Any) -> Any:
    """The hidden width (``hidden_size``, ``d_model``, ...), or ``None``."""
    return next((v for v in (getattr(config, n, None) for n in _HIDDEN) if isinstance(v, int)), None)


def _repeated_blocks(module: nn.Module) -> bool:
    """A ``ModuleList`` of blocks of one class (not of containers: a policy would match every container)."""
    kinds = {type(m) for m in module.children()} if isinstance(module, nn.ModuleList) else set()
    return len(kinds) == 1 and not issubclass(next(iter(kinds)), _CONTAINERS)


def _ancestor(path: str, levels: int) -> str:
    parts = path.split(".")
    return ".".join(parts[: max(len(parts) - levels, 0)])


def _join(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name
