"""Plugin manager: lazy, per-entry-point loading of the ``tpcore`` entry-point group.

Environment switches (read on first use of the registry):

``TPCORE_DISABLE_PLUGIN_AUTOLOAD=1``
    load no entry points at all (policies then come only from ``custom_policies``).
``TPCORE_PLUGINS=tp-bert,tp-gpt``
    load only these plugins, by distribution or entry-point name; empty loads none.

A plugin that fails to import or register (with any exception, ``SystemExit`` too; only
``KeyboardInterrupt`` goes through), or that claims a policy name, a layer class or a quantized
format's ``quant_method`` that another loaded plugin (or tpcore itself) already has, is reported
with its distribution name and version (a :class:`PluginLoadWarning`, and in :func:`plugin_infos`)
and the others still load.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import threading
import traceback
import warnings
from dataclasses import dataclass, field

import pluggy

from tpcore.authoring import Policy, QuantizedFormat, hookspecs
from tpcore.errors import PluginConflictError, PluginLoadWarning
from tpcore.load.quantized_formats import BUILT_IN_FORMATS

__all__ = [
    "PluginConflictError",
    "PluginInfo",
    "PluginLoadWarning",
    "PolicyEntry",
    "get_plugin_manager",
    "plugin_infos",
    "quantized_formats",
    "registered_policies",
    "reset_plugins",
]

DISABLE_AUTOLOAD_ENV = "TPCORE_DISABLE_PLUGIN_AUTOLOAD"
ONLY_PLUGINS_ENV = "TPCORE_PLUGINS"


@dataclass
class PluginInfo:
    """An entry point of the ``tpcore`` group and what came of loading it."""

    name: str
    distribution: str
    version: str
    policies: list[str] = field(default_factory=list)
    #: the ``quant_method`` of each quantized format it registers
    formats: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class PolicyEntry:
    """A registered policy and the plugin it came from."""

    policy: type[Policy]
    plugin: str
    distribution: str
    version: str


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_infos: list[PluginInfo] = []


def _selected(entry_point, dist_name: str) -> bool:
    if autoload_disabled():
        return False
    only = os.environ.get(ONLY_PLUGINS_ENV)
    if only is None:
        return True
    wanted = {_canonical(name) for name in only.split(",") if name.strip()}
    return _canonical(entry_point.name) in wanted or _canonical(dist_name) in wanted


def autoload_disabled() -> bool:
    return os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip() not in ("", "0")


def _canonical(name: str) -> str:
    """Distribution names compare as packaging does: case, ``_`` and ``.`` do not matter."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _check_conflicts(policies: list[type[Policy]], info: PluginInfo, owners: dict) -> None:
    """Raise :class:`PluginConflictError` naming both plugins if a policy name or layer class is taken."""
    for policy in policies:
        for key in (("name", policy.policy_name()), ("layer class", policy.layer_class_name())):
            owner = owners.get(key)
            if owner is not None and owner is not info:
                raise PluginConflictError(
                    f"policy {key[0]} {key[1]!r} is registered by both {owner.distribution} {owner.version} "
                    f"and {info.distribution} {info.version}; uninstall one, or choose with {ONLY_PLUGINS_ENV}"
                )
    for policy in policies:
        owners[("name", policy.policy_name())] = info
        owners[("layer class", policy.layer_class_name())] = info


def _load_entry_points(manager: pluggy.PluginManager) -> list[PluginInfo]:
    infos = []
    owners: dict = {}
    for entry_point in importlib.metadata.entry_points(group=hookspecs.PROJECT):
        dist = entry_point.dist
        dist_name = dist.metadata["Name"] if dist is not None else entry_point.name
        version = dist.version if dist is not None else "?"
        if not _selected(entry_point, dist_name) or manager.get_plugin(entry_point.name):
            continue
        info = PluginInfo(entry_point.name, dist_name, version)
        try:
            plugin = entry_point.load()
            manager.register(plugin, name=entry_point.name)
            manager.check_pending()  # a misspelt hook fails this plugin only
            policies = _policies_of(manager, plugin)
            _check_conflicts(policies, info, owners)
            formats = _formats_of(manager, plugin)
            _check_format_conflicts(formats, info, owners)
            info.policies = [policy.policy_name() for policy in policies]
            info.formats = [form.quant_method for form in formats]
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # a broken plugin, sys.exit() in it too, must not take the others down
            if manager.get_plugin(entry_point.name) is not None:
                manager.unregister(name=entry_point.name)
            info.error = "".join(traceback.format_exception_only(type(error), error)).strip()
            warnings.warn(
                f"tpcore plugin {entry_point.name!r} from {dist_name} {version} failed to load: {info.error}",
                PluginLoadWarning,
                stacklevel=3,
            )
        infos.append(info)
    return infos


def _policies_of(manager: pluggy.PluginManager, plugin) -> list[type[Policy]]:
    """The policies one registered plugin returns, validated."""
    impls = [impl for impl in manager.hook.tpcore_register_policies.get_hookimpls() if impl.plugin is plugin]
    policies = []
    for impl in impls:
        for policy in impl.function() or []:
            if not (isinstance(policy, type) and issubclass(policy, Policy)):
                raise TypeError(f"tpcore_register_policies returned {policy!r}, not a Policy subclass")
            policies.append(policy)
    return policies


def _formats_of(manager: pluggy.PluginManager, plugin) -> list[QuantizedFormat]:
    """The quantized formats one registered plugin returns, validated."""
    hook = manager.hook.tpcore_register_quantized_formats
    formats = []
    for impl in [impl for impl in hook.get_hookimpls() if impl.plugin is plugin]:
        for form in impl.function() or []:
            if not isinstance(form, QuantizedFormat) or not form.quant_method:
                raise TypeError(
                    f"tpcore_register_quantized_formats returned {form!r}, not a QuantizedFormat with a quant_method"
                )
            formats.append(form)
    return formats


def _check_format_conflicts(formats: list[QuantizedFormat], info: PluginInfo, owners: dict) -> None:
    """Raise :class:`PluginConflictError` if a format's ``quant_method`` is tpcore's own or another plugin's."""
    built_in = {form.quant_method for form in BUILT_IN_FORMATS}
    seen: set[str] = set()
    for form in formats:
        owner = info if form.quant_method in seen else owners.get(("format", form.quant_method))
        if form.quant_method in built_in or owner is not None:
            by = "tpcore itself" if owner is None else f"{owner.distribution} {owner.version}"
            raise PluginConflictError(
                f"quantized format {form.quant_method!r} is registered by both {by} and {info.distribution} "
                f"{info.version}; uninstall one, or choose with {ONLY_PLUGINS_ENV}"
            )
        seen.add(form.quant_method)
    for form in formats:
        owners[("format", form.quant_method)] = info


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading entry points on first call."""
    global _manager, _infos
    with _lock:
        if _manager is None:
            manager = pluggy.PluginManager(hookspecs.PROJECT)
            manager.add_hookspecs(hookspecs)
            _infos = _load_entry_points(manager)
            _manager = manager
        return _manager


def plugin_infos() -> list[PluginInfo]:
    """Every entry point considered on load, loaded or failed."""
    get_plugin_manager()
    return list(_infos)


def registered_policies() -> list[PolicyEntry]:
    """All policies of all loaded plugins, with the plugin each came from."""
    manager = get_plugin_manager()
    entries: list[PolicyEntry] = []
    for name, plugin in manager.list_name_plugin():
        info = next((i for i in _infos if i.name == name), None)
        dist, version = (info.distribution, info.version) if info else (name, "?")
        entries.extend(PolicyEntry(policy, name, dist, version) for policy in _policies_of(manager, plugin))
    return entries


def quantized_formats() -> tuple[QuantizedFormat, ...]:
    """The quantized checkpoint formats tpcore splits: its own, then each loaded plugin's."""
    manager = get_plugin_manager()
    return BUILT_IN_FORMATS + tuple(
        form for _, plugin in manager.list_name_plugin() for form in _formats_of(manager, plugin)
    )


def reset_plugins() -> None:
    """Forget loaded plugins so the next use reloads them (for tests and env changes)."""
    global _manager, _infos
    with _lock:
        _manager, _infos = None, []
