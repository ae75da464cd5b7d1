"""Moving model inputs and outputs between devices (and so between processes).

Containers are rebuilt with their own types, so a ``ModelOutput`` stays a ``ModelOutput`` and a named
tuple the same named tuple.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["first_device", "to_cpu", "to_device"]


def to_device(value: Any, device) -> Any:
    """Every tensor inside ``value`` moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)({k: to_device(v, device) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [to_device(v, device) for v in value])
    return value


def to_cpu(value: Any) -> Any:
    """Every tensor inside ``value`` detached on the CPU; a KV cache (it holds a rank's own heads
    only) is dropped rather than sent back."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if _is_cache(value):
        return None
    if isinstance(value, dict):  # ModelOutput is a dict (and a dataclass)
        return type(value)(**{k: v for k, v in ((k, to_cpu(v)) for k, v in value.items()) if v is not None})
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [to_cpu(v) for v in value])
    return value


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
