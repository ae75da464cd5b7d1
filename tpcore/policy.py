"""The declarative "what to split": a ``Policy`` per layer class, a ``Layer`` per tensor pair.

A policy names the transformer layer class it applies to and lists, per group, the tensors of one
layer instance to split. Paths are attribute paths relative to that layer instance
(``"attention.self.query.weight"``). Groups fix the split semantics:

=============  ==========================  ===================================================
group          parallel style              split of ``y = x @ W.T + b`` (``W``: ``(out, in)``)
=============  ==========================  ===================================================
``attn_qkv``   column                      ``W`` and ``b`` along ``out``; outputs stay local
``attn_out``   row (+ all-reduce)          ``W`` along ``in``; ``b`` whole, added once after
``mlp_in``     column                      as ``attn_qkv``
``mlp_out``    row (+ all-reduce)          as ``attn_out``
=============  ==========================  ===================================================

How the split is done lives in :mod:`tpcore.slicer` and :mod:`tpcore.layers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

__all__ = ["Layer", "Policy", "ShardingError", "divide"]


class ShardingError(ValueError):
    """A model cannot be split the way a policy asks (sizes, missing modules)."""


def divide(value: int, world_size: int, what: str) -> int:
    """Return ``value // world_size``; raise :class:`ShardingError` naming ``what`` if it is not exact."""
    if value % world_size:
        raise ShardingError(f"{what} = {value} cannot be split evenly over {world_size} ranks")
    return value // world_size


@dataclass(frozen=True)
class Layer:
    """One parallelizable tensor pair of a layer, named by attribute paths relative to the layer.

    Args:
        weight: path of the weight, e.g. ``"attention.self.query.weight"``.
        bias: path of the bias, or ``None``.
        n_fused: how many tensors are packed along the split dimension (3 for a fused q|k|v);
            each is split separately and rank ``r`` gets the ``r``-th piece of every one.
        reversed: the weight is stored ``(in, out)`` (HF ``Conv1D``) instead of ``(out, in)``;
            flips the weight's split dimension for this tensor only.
        replace: module class to give the module owning ``weight`` (row groups default to the
            parallel layer that matches the module's type, see :mod:`tpcore.layers`).
        ignore_checker: a missing ``weight`` is skipped instead of raising.
        heads: name of the config attribute holding how many heads the tensor packs, for
            tensors that may hold fewer heads than there are ranks (grouped-query key/value
            projections): those heads are then replicated so each rank holds whole groups.
    """

    weight: str | None = None
    bias: str | None = None
    n_fused: int = 1
    reversed: bool = False
    replace: type[nn.Module] | None = None
    ignore_checker: bool = False
    heads: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n_fused, int) or self.n_fused < 1:
            raise ValueError(f"Layer.n_fused must be a positive int, got {self.n_fused!r}")

    @property
    def module_path(self) -> str:
        """Path of the module that owns ``weight`` (``""`` for the layer itself)."""
        return self.weight.rpartition(".")[0] if self.weight else ""


class Policy:
    """How to split one transformer layer class. Subclass and override the static methods.

    The layer class is required: set ``layer_class`` or override ``original_layer_class``. Every
    other method has an empty default, so a policy lists only what its layer has.
    """

    #: The layer class this policy applies to: a class, or its qualified name
    #: (``"transformers.models.bert.modeling_bert.BertLayer"``), which avoids importing it.
    layer_class: ClassVar[type[nn.Module] | str | None] = None

    #: Optional name shown by ``tpcore plugins``; defaults to the class name.
    name: ClassVar[str | None] = None

    @classmethod
    def original_layer_class(cls) -> type[nn.Module] | str:
        """The layer class this policy applies to (``layer_class`` unless overridden)."""
        if cls.layer_class is None:
            raise TypeError(f"policy {cls.__name__} names no layer class: set layer_class")
        return cls.layer_class

    @staticmethod
    def replace_arguments(config: Any, world_size: int) -> dict[str, Any]:
        """Attributes of one layer instance to set per rank, ``{path: value}``.

        Use :func:`divide` for head counts and sizes so that a world size that does not divide
        them fails before anything is sliced.
        """
        return {}

    @staticmethod
    def replace_modules() -> dict[str, type[nn.Module]]:
        """Module classes to swap inside the layer instance, ``{path: new_class}``."""
        return {}

    @staticmethod
    def attn_qkv() -> list[Layer]:
        """Attention query, key and value projections (column parallel)."""
        return []

    @staticmethod
    def attn_out() -> list[Layer]:
        """Attention output projection (row parallel, all-reduced)."""
        return []

    @staticmethod
    def mlp_in() -> list[Layer]:
        """MLP input projections (column parallel)."""
        return []

    @staticmethod
    def mlp_out() -> list[Layer]:
        """MLP output projection (row parallel, all-reduced)."""
        return []

    @classmethod
    def policy_name(cls) -> str:
        return cls.name or cls.__name__

    @classmethod
    def layer_class_name(cls) -> str:
        """Qualified name of the layer class, whichever way ``original_layer_class`` gives it."""
        target = cls.original_layer_class()
        return target if isinstance(target, str) else f"{target.__module__}.{target.__qualname__}"

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        """Whether ``module`` is an instance of exactly this policy's layer class."""
        kind = type(module)
        return f"{kind.__module__}.{kind.__qualname__}" == cls.layer_class_name()


# -- interim (the layout-words branch replaces this) --
def _splits(self, style, config):
    from tpcore.slicer import Split, split_dims

    weight_dim, bias_dim = split_dims(style, self)
    heads = None
    if self.heads is not None:
        heads = getattr(config, self.heads, None)
        if not isinstance(heads, int):
            raise ShardingError(f"Layer {self.weight!r} names heads={self.heads!r}, which the config lacks")
    return Split(weight_dim, self.n_fused, heads), None if bias_dim is None else Split(bias_dim, self.n_fused, heads)


Layer.splits = _splits
