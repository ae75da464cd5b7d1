"""Moving model inputs and outputs between devices (and so between processes).

Containers are rebuilt with their own types, so a ``ModelOutput`` stays a ``ModelOutput`` and a named
tuple the same named tuple.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tpcore.parallel import memfd

__all__ = ["each_item", "first_device", "to_cpu", "to_device"]


def each_item(value: Any, function: Callable[[Any], Any], named_tuples: bool = True, in_place: bool = False) -> Any:
    """``value`` with ``function`` applied to each item, when it is a dict, list or tuple (a named tuple
    only with ``named_tuples``), else ``value`` as it is; a dict's item that ``function`` turns into ``None`` is
    left out.

    A container whose items all come back as they were is returned itself, not built again: a served call
    walks its inputs and outputs several times, and building a ``ModelOutput`` (a dataclass) again costs
    tens of microseconds each time. ``in_place``: a dict whose items change (none to ``None``) is changed
    itself, for a container the walker owns (a forward's fresh output)."""
    if isinstance(value, dict):
        changed = {}
        for key, item in value.items():
            new = function(item)
            if new is not item:
                changed[key] = new
        if not changed:
            return value
        if in_place and all(new is not None for new in changed.values()):  # `is`: no array compared with None
            for key, new in changed.items():
                value[key] = new  # a ModelOutput sets its attribute too
            return value
        items = {key: changed.get(key, item) for key, item in value.items()}
        items = {key: item for key, item in items.items() if item is not None}
        return type(value)(**items) if dataclasses.is_dataclass(value) else type(value)(items)  # ModelOutput: both
    if isinstance(value, (list, tuple)) and (named_tuples or not hasattr(value, "_fields")):
        listed, same = [], True
        for item in value:
            new = function(item)
            same = same and new is item
            listed.append(new)
        return value if same else _rebuilt(value, listed)
    return value


def to_device(value: Any, device) -> Any:
    """Every tensor inside ``value`` moved to ``device`` (to ``"cpu"``, a CPU tensor is itself: no call into torch)."""
    if isinstance(value, torch.Tensor):
        return value if device == "cpu" and value.is_cpu else value.to(device)
    return each_item(value, lambda item: to_device(item, device))


def to_cpu(value: Any) -> Any:
    """Every tensor inside ``value`` detached on the CPU (one from another device copied by
    :func:`tpcore.parallel.memfd.cpu_copy`); a KV cache (it holds a rank's own heads only) is dropped
    rather than sent back."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return value.detach() if value.requires_grad else value
        return memfd.cpu_copy(value.detach())
    if _is_cache(value):
        return None
    return each_item(value, to_cpu)


def first_device(value: Any) -> torch.device | None:
    """The device of the first tensor inside ``value`` (dicts in their order), ``None`` if it holds none."""
    if isinstance(value, torch.Tensor):
        return value.device
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        device = first_device(item)
        if device is not None:
            return device
    return None


def _rebuilt(value: list | tuple, items: list) -> list | tuple:
    """``value``'s type holding ``items``: a named tuple takes them as its fields."""
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def _is_cache(value: Any) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(value, Cache)
