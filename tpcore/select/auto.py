"""AutoPolicy: find the policies for a model among all registered plugins, and its tp plans.

The rule, per layer class: a registered plugin policy for the class if there is one; otherwise the
policy derived from the tp plan of the class's sub-model (:mod:`tpcore.select.tp_plan`), unless its
blocks contain, or lie inside, a layer a plugin policy covers (both would split the same tensors).
A model with neither (no plugin policy, and no tp plan in any of its configs) gets the policies its
structure gives (:mod:`tpcore.select.structural`),
which :func:`~tpcore.plan.plan_for` uses only once a tiny random copy split by them computes the
unsplit outputs (:mod:`tpcore.plan.proof`).
LLaVA with tp-gpt installed: tp-gpt's Llama policy splits the language model; its CLIP vision
tower, which neither a plugin nor a tp plan covers, stays whole on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from tpcore.authoring import Policy
from tpcore.authoring.policy import layer_class_name
from tpcore.configs import owning_sub_model, sub_models
from tpcore.errors import UnsupportedModelError
from tpcore.select.plan_policy import PlanPolicy
from tpcore.select.plugins import (
    DISABLE_AUTOLOAD_ENV,
    PolicyEntry,
    autoload_disabled,
    plugin_infos,
    registered_policies,
)
from tpcore.select.structural import STRUCTURAL_ORIGIN, StructuralError, StructuralPolicy, structural_policies
from tpcore.select.tp_plan import TpPlanError, derive_policies, sub_model_plans

__all__ = [
    "AutoPolicy",
    "as_policy_list",
    "choose_policies",
    "SubModelCoverage",
    "UnsupportedModelError",
    "describe_policies",
    "policy_origin",
    "sub_model_coverage",
]

#: where :func:`policy_origin` says a policy derived from a config's ``base_model_tp_plan`` comes from
TP_PLAN_ORIGIN = "config tp plan"

logger = logging.getLogger("tpcore.auto")


class AutoPolicy:
    """Maps a model to the registered policies whose layer class it contains."""

    def entries_for(self, model: nn.Module) -> list[PolicyEntry]:
        """Registered policies matching a layer class of ``model``, in registration order."""
        layer_classes = {layer_class_name(module) for module in model.modules()}
        return [entry for entry in registered_policies() if entry.policy.layer_class_name() in layer_classes]

    def get_policy(self, model: nn.Module) -> list[type[Policy]]:
        """The policies for ``model``: the plugins' for the layer classes they cover, then those
        derived from the sub-models' ``base_model_tp_plan`` for blocks no plugin policy reaches
        (see the module docstring); raise :class:`UnsupportedModelError` if there are none."""
        plugin_policies = [entry.policy for entry in self.entries_for(model)]
        try:
            derived = derive_policies(model)
        except TpPlanError as error:
            note = f"No policy could be derived: {error}."
            if plugin_policies:
                derived = []
            elif any(getattr(plan.config, "base_model_tp_plan", None) for plan in sub_model_plans(model)):
                raise UnsupportedModelError(unsupported_message(model, note)) from None  # a plan, not followed
            else:
                return _structural_or_refused(model, note)
        chosen = plugin_policies + _not_overlapping(model, derived, plugin_policies)
        if logger.isEnabledFor(logging.INFO):
            logger.info("AutoPolicy chose for %s: %s", type(model).__name__, describe_policies(chosen))
        return chosen

    def available(self) -> list[PolicyEntry]:
        """Every registered policy."""
        return registered_policies()


def _structural_or_refused(model: nn.Module, plan_note: str) -> list[type[Policy]]:
    """The structural policies of ``model`` (proven where they are planned), or
    :class:`UnsupportedModelError` saying why neither a plugin, a tp plan nor its structure splits it."""
    try:
        chosen = structural_policies(model)
    except StructuralError as error:
        raise UnsupportedModelError(unsupported_message(model, f"{plan_note}\n{_sentence(error)}.")) from None
    logger.info(
        "no plugin or tp plan covers %s: its structure gives %s, to be proven on a tiny copy when planned",
        type(model).__name__,
        describe_policies(chosen),
    )
    return chosen


def _sentence(error: Exception) -> str:
    text = str(error)
    return text[:1].upper() + text[1:]


def as_policy_list(policies: Any) -> list[type[Policy]]:
    """``custom_policies`` as a list: ``None`` (empty), one Policy class, or a list or tuple of them."""
    if policies is None:
        return []
    if isinstance(policies, type):
        return [policies]
    if isinstance(policies, (list, tuple)):
        return list(policies)
    raise TypeError(f"custom_policies must be a Policy subclass or a list of them, got {policies!r}")


def choose_policies(model: nn.Module, custom_policies: Any = None) -> list[type[Policy]]:
    """The policies that split ``model``: ``custom_policies`` when given (a class or a list), else what
    :class:`AutoPolicy` finds (raises :class:`~tpcore.UnsupportedModelError` when nothing covers it)."""
    return as_policy_list(custom_policies) or AutoPolicy().get_policy(model)


def policy_origin(policy: type[Policy]) -> str:
    """Where ``policy`` comes from: its plugin's distribution and version (``"tp-gpt 0.1.0"``), the config's tp
    plan (:data:`TP_PLAN_ORIGIN`), or ``"custom_policies"`` (a class no plugin registers)."""
    entry = next((entry for entry in registered_policies() if entry.policy is policy), None)
    if entry is not None:
        return f"{entry.distribution} {entry.version}"
    if issubclass(policy, StructuralPolicy):
        return STRUCTURAL_ORIGIN
    if issubclass(policy, PlanPolicy):
        return TP_PLAN_ORIGIN
    return "custom_policies"


def describe_policies(policies: list[type[Policy]]) -> str:
    """Each policy with where it comes from: ``"GPT2Policy (tp-gpt 0.1.0)"``, joined by commas."""
    return ", ".join(f"{policy.policy_name()} ({policy_origin(policy)})" for policy in policies) or "none"


@dataclass(frozen=True)
class SubModelCoverage:
    """Which of ``policies`` split layers of one sub-model (``name``: its module path), or why none does."""

    name: str
    module_class: str
    policies: tuple[type[Policy], ...]
    whole: str | None = None


def sub_model_coverage(model: nn.Module, policies: list[type[Policy]]) -> list[SubModelCoverage]:
    """For every sub-model of ``model`` (:func:`tpcore.configs.sub_models`), the policies that split
    layers of it (those inside a nested sub-model count for the nested one); a sub-model that none
    splits stays whole on every rank, and ``whole`` says why."""
    models = sub_models(model)
    covering: dict[str, dict[type[Policy], None]] = {name: {} for name in models}
    for name, module in model.named_modules():
        for policy in policies:
            if policy.matches(module):
                covering[owning_sub_model(models, name)][policy] = None
    reasons = {plan.name: plan.whole for plan in sub_model_plans(model)}
    result = []
    for name, module in models.items():
        found = tuple(covering[name])
        whole = None if found else f"no plugin policy covers its layers and {reasons[name] or 'its tp plan is unused'}"
        result.append(SubModelCoverage(name, type(module).__name__, found, whole))
    return result


def _not_overlapping(model: nn.Module, derived: list[type[Policy]], chosen: list[type[Policy]]) -> list[type[Policy]]:
    """The ``derived`` policies none of whose layers is, contains or lies inside a layer of ``chosen``."""
    names = {policy: [n for n, m in model.named_modules() if policy.matches(m)] for policy in derived + chosen}
    taken = [name for policy in chosen for name in names[policy]]

    def nested(a: str, b: str) -> bool:
        return not a or not b or a == b or a.startswith(b + ".") or b.startswith(a + ".")

    return [p for p in derived if not any(nested(name, other) for name in names[p] for other in taken)]


def unsupported_message(model: nn.Module, plan_note: str | None = None) -> str:
    infos = plugin_infos()
    loaded = [f"{i.distribution} {i.version}" for i in infos if i.error is None]
    failed = [f"{i.distribution} {i.version} (failed: {i.error})" for i in infos if i.error is not None]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    lines = [
        f"No installed tpcore policy covers {type(model).__name__}"
        + (f" (model_type {model_type!r})." if model_type else "."),
        "Installed plugins: " + (", ".join(loaded) if loaded else "none") + ".",
    ]
    if failed:
        lines.append("Plugins that failed to load: " + ", ".join(failed) + ".")
    if plan_note:
        lines.append(plan_note)
    if autoload_disabled():
        lines.append(f"Plugin autoload is disabled ({DISABLE_AUTOLOAD_ENV} is set).")
    lines.append(
        "Install the tpcore plugin for its model family (pip install tp-<family>), "
        "or pass custom_policies=[YourPolicy]; `tpcore plugins` lists what is installed."
    )
    return "\n".join(lines)
