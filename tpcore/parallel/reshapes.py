"""Attention forwards that reshape to the unsplit width, made to reshape to the rank's width.

Most attention forwards merge their heads back with ``reshape(*shape, -1)`` and so work on any
number of heads. Some (FSMT, LED's Longformer attention, ProphetNet, Pegasus-X's global-local
attention) merge them into the width they read from the input, ``hidden_states.size(-1)``: on a
rank holding ``w`` of the ``W`` features, ``attn.view(seq, batch, W)`` of a tensor of
``seq * batch * w`` elements fails. :func:`local_width_class` gives such a module a subclass whose
forward runs under :class:`LocalWidthReshapes`, which turns exactly those reshapes into reshapes to
``w``; every other call runs as written::

    view / reshape (..., W) of a tensor of prod(...) * w elements     ->  (..., w)
    view / reshape (..., -1, ..., W) of a tensor whose last dim is w  ->  (..., -1, ..., w)

The module's ``full_width`` (``W``) and ``local_width`` (``w``, per rank) are set by the policy's
``replace_arguments``. Other reshapes to ``W`` (of the full-width input) keep their sizes: their
element counts match.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["LocalWidthReshapes", "local_width_class"]

_RESHAPES = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.reshape})


class LocalWidthReshapes(TorchFunctionMode):
    """While active, a ``view``/``reshape`` to a last dimension of ``full`` features of a tensor
    holding ``local`` features per position reshapes to ``local`` instead (see the module docstring)."""

    def __init__(self, full: int, local: int):
        super().__init__()
        self.full, self.local = full, local

    def __torch_function__(self, func, types, args: Sequence[Any] = (), kwargs=None):
        kwargs = kwargs or {}
        if func in _RESHAPES and len(args) >= 2 and not kwargs:
            shape = _requested_shape(args[1:])
            if shape is not None:
                local = self.local_shape(args[0], shape)
                if local is not None:
                    args = (args[0], local)
        return func(*args, **kwargs)

    def local_shape(self, tensor: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape to use instead of ``shape`` for ``tensor``, or ``None`` to keep ``shape``."""
        if not shape or shape[-1] != self.full or self.full == self.local:
            return None
        local = (*shape[:-1], self.local)
        if -1 in shape:
            return local if tensor.dim() and tensor.shape[-1] == self.local else None
        if math.prod(shape) != tensor.numel() and math.prod(local) == tensor.numel():
            return local
        return None


def _requested_shape(sizes: Sequence[Any]) -> tuple[int, ...] | None:
    """The shape a ``view``/``reshape`` call asks for, from ``(*sizes)`` or ``(sizes,)``; ``None`` for
    ``view(dtype)`` and anything else that is not a shape."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    if all(isinstance(size, int) and not isinstance(size, bool) for size in sizes):
        return tuple(sizes)
    return None


def local_width_class(module: nn.Module | None) -> type[nn.Module] | None:
    """The class to give ``module`` (an attention whose forward reshapes to its input's width): a
    subclass of its own class whose forward runs under :class:`LocalWidthReshapes` with the
    instance's ``full_width`` and ``local_width``; ``None`` where the layer has no such module.
    For :meth:`tpcore.Policy.replace_modules`."""
    if module is None:
        return None
    cls: type = type(module)
    return _local_width_subclass(cls)


@functools.cache
def _local_width_subclass(cls: type) -> type[nn.Module]:
    def forward(self, *args, **kwargs):
        full, local = self.full_width, self.local_width
        if full is None or local is None:
            raise RuntimeError(
                f"{type(self).__name__} reshapes to the rank's width but its policy set no full_width and "
                "local_width (tpcore.parallel.reshapes)"
            )
        with LocalWidthReshapes(full, local):
            return cls.forward(self, *args, **kwargs)

    doc = f"``{cls.__qualname__}`` whose reshapes to the unsplit width keep the rank's width (:mod:`{__name__}`)."
    namespace = {"__doc__": doc, "__module__": __name__, "forward": forward, "full_width": None, "local_width": None}
    return type(f"LocalWidth{cls.__name__}", (cls,), namespace)
