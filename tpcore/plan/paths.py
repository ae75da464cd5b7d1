"""Attribute paths in a model (``"encoder.layer.0.attention.self.query.weight"``): reading, setting, joining."""

from __future__ import annotations

from typing import Any

__all__ = ["MISSING", "get_path", "join", "set_path"]

#: what :func:`get_path` gives for a path that leads nowhere
MISSING = object()


def get_path(root: Any, path: str) -> Any:
    """``root.a.b.0.c`` for ``path = "a.b.0.c"``; :data:`MISSING` if any step is absent."""
    obj = root
    for name in path.split(".") if path else []:
        obj = getattr(obj, name, MISSING)
        if obj is MISSING:
            return MISSING
    return obj


def set_path(root: Any, path: str, value: Any) -> None:
    """``root.a.b.c = value`` for ``path = "a.b.c"``."""
    owner_path, _, name = path.rpartition(".")
    setattr(get_path(root, owner_path), name, value)


def join(*paths: str) -> str:
    """The path of ``paths`` one inside the other, empty ones left out."""
    return ".".join(path for path in paths if path)
