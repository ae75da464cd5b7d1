"""What the caller changes on a served model's config between calls, so that the ranks compute with it.

``model.config.output_hidden_states = True``, ``model.set_attn_implementation("eager")`` and the like change
the caller's config; :class:`ConfigWatch` finds the attributes that differ from what the ranks have (of the
config and of every sub-config, by path) and each call carries them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigWatch"]


class ConfigWatch:
    """The caller's ``config``, as last sent to the ranks: :meth:`changes` gives what differs since."""

    def __init__(self, config: Any):
        self.config = config
        self.sent = _snapshot(config)

    def changes(self) -> dict[str, dict[str, Any]]:
        """``{sub-config path: {attribute: value}}`` changed since the last call (``""``: the config itself)."""
        now = _snapshot(self.config)
        changed: dict[str, dict[str, Any]] = {}
        for path, attributes in now.items():
            before = self.sent.get(path, {})
            diff = {name: value for name, value in attributes.items() if name not in before or before[name] != value}
            if diff:
                changed[path] = diff
        self.sent = now
        return changed


def _snapshot(config: Any, path: str = "") -> dict[str, dict[str, Any]]:
    """Each (sub-)config's plain attributes by path; sub-configs are walked, not compared."""
    from transformers import PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        return {}
    found: dict[str, dict[str, Any]] = {path: {}}
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            found.update(_snapshot(value, f"{path}.{name}" if path else name))
        else:
            found[path][name] = _copied(value)
    return found


def _copied(value: Any) -> Any:
    """A copy of containers, so that a later change in place is seen as a change."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value) if not hasattr(value, "_fields") else value
    return value
