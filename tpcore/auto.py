"""AutoPolicy: find the policies for a model among all registered plugins."""

from __future__ import annotations

from torch import nn

from tpcore.plugins import DISABLE_AUTOLOAD_ENV, PolicyEntry, autoload_disabled, plugin_infos, registered_policies
from tpcore.policy import Policy
from tpcore.tp_plan import TpPlanError, derive_policies

__all__ = ["AutoPolicy", "UnsupportedModelError"]


class UnsupportedModelError(LookupError):
    """No installed policy covers any layer of a model."""


class AutoPolicy:
    """Maps a model to the registered policies whose layer class it contains."""

    def entries_for(self, model: nn.Module) -> list[PolicyEntry]:
        """Registered policies matching a layer class of ``model``, in registration order."""
        layer_classes = {f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}
        return [entry for entry in registered_policies() if entry.policy.layer_class_name() in layer_classes]

    def get_policy(self, model: nn.Module) -> list[type[Policy]]:
        """The policies for ``model``: the plugins' when any covers it, else policies derived
        from the config's ``base_model_tp_plan``; raise :class:`UnsupportedModelError` if neither."""
        entries = self.entries_for(model)
        if entries:
            return [entry.policy for entry in entries]
        try:
            return derive_policies(model)
        except TpPlanError as error:
            raise UnsupportedModelError(unsupported_message(model, f"No policy could be derived: {error}.")) from None

    def available(self) -> list[PolicyEntry]:
        """Every registered policy."""
        return registered_policies()


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
