"""What the caller changes on a served model's config between calls, so that the ranks compute with it.

``model.config.output_hidden_states = True``, ``model.set_attn_implementation("eager")`` and the like change
the caller's config; :class:`CallerConfig` finds the attributes that differ from what the ranks have (of the
config and of every sub-config, by path), each call carries them, and :func:`apply_config_changes` sets them on
the rank's model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CallerConfig", "apply_config_changes"]


class CallerConfig:
    """The caller's ``config``, as last sent to the ranks: :meth:`write` gives what differs since."""

    def __init__(self, config: Any):
        self.config = config
        self.sent: dict[str, dict[str, Any]] = {}
        self.write()

    def write(self) -> dict[str, dict[str, Any]]:
        """``{sub-config path: {attribute: value}}`` changed since the last call (``""``: the config itself).

        Each attribute is compared with a copy of what was sent (so that a container changed in place is seen),
        and copied again only when it changed. A served call runs this every time, so a config that did not
        change is told by one comparison of its attributes with what was sent (sub-configs are kept there by
        reference: each is compared on its own path)."""
        from transformers import PretrainedConfig

        changed: dict[str, dict[str, Any]] = {}
        for path, config in _configs(self.config, PretrainedConfig):
            values, sent = vars(config), self.sent.setdefault(path, {})
            if values == sent:
                continue
            for name, value in values.items():
                if isinstance(value, PretrainedConfig):
                    sent[name] = value
                elif name not in sent or (sent[name] is not value and sent[name] != value):
                    changed.setdefault(path, {})[name] = value
                    sent[name] = _copied(value)
            for name in sent.keys() - values.keys():  # deleted since: the ranks keep theirs
                del sent[name]
        return changed


def apply_config_changes(model: Any, changes: dict[str, dict[str, Any]]) -> None:
    """On a rank: set the caller's changed config attributes on ``model``'s config (and its sub-configs, by path)."""
    for path, attributes in changes.items():
        config = model.config
        for name in path.split(".") if path else []:
            config = getattr(config, name)
        for name, value in attributes.items():
            setattr(config, name, value)


def _configs(config: Any, config_class: type, path: str = ""):
    """``(path, config)`` of the config and each sub-config inside it, walked through their attributes."""
    if not isinstance(config, config_class):
        return
    yield path, config
    for name, value in vars(config).items():
        if isinstance(value, config_class):
            yield from _configs(value, config_class, f"{path}.{name}" if path else name)


def _copied(value: Any) -> Any:
    """A copy of containers, so that a later change in place is seen as a change."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value) if not hasattr(value, "_fields") else value
    return value
