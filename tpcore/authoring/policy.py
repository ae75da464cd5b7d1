"""``Policy``: how one transformer layer class splits — the tensors to cut and the attributes to rewrite.

A policy is data. It names the layer class it applies to and lists, for one instance of it:

- :meth:`Policy.layers`: every tensor pair to cut, each a :class:`~tpcore.Layer` with its
  :class:`~tpcore.Style` (column, row, per-head, norm);
- :meth:`Policy.replace_arguments`: the attributes whose value differs per rank (head counts,
  widths), from the config of the layer's sub-model;
- :meth:`Policy.replace_modules`: module classes to give modules inside the layer.

The group methods of parallelformers (``attn_qkv``, ``attn_out``, ``mlp_in``, ``mlp_out``) are just
styles: a :class:`~tpcore.Layer` listed in ``attn_qkv`` or ``mlp_in`` is ``COLUMN``, in ``attn_out``
or ``mlp_out`` ``ROW``, unless it names a style of its own. How a style is carried out lives in
:mod:`tpcore.cut` (the slices) and :mod:`tpcore.parallel` (the modules).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

from torch import nn

from tpcore.authoring.layer import COLUMN, ROW, Layer, Style

__all__ = ["IfHeld", "Policy", "layer_class_name"]


def layer_class_name(module: nn.Module) -> str:
    """The dotted name of ``module``'s class, as a policy's ``layer_class`` names it: the plain class where a
    quantized class made from it names it as its ``plain_class``."""
    kind = type(module)
    kind = getattr(kind, "plain_class", kind)
    return f"{kind.__module__}.{kind.__qualname__}"


class IfHeld(NamedTuple):
    """A :meth:`Policy.replace_arguments` value set only in the layer instances that hold ``module``
    (a path in the layer: a module, or an attribute); the others keep theirs. For stacks whose blocks of
    one class hold different modules (hybrid stacks: an attention in some blocks, a linear attention in
    others), and for attributes that some transformers versions' layers have and others lack."""

    value: Any
    module: str


class Policy:
    """How to split one transformer layer class. Subclass, set ``layer_class`` and list the tensors.

    Every method has an empty default, so a policy lists only what its layer has: its tensors in
    :meth:`layers` (or, as parallelformers policies do, in the group methods), its per-rank
    attributes in :meth:`replace_arguments`.
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

    @classmethod
    def layer_config(cls, config: Any, layer: nn.Module) -> Any:
        """The config one layer instance is split by: ``config`` (its sub-model's) unless blocks of
        this class differ in their counts (Swin's stages: heads and widths of their own), where a
        policy returns a copy holding the instance's own (read from ``layer``). What
        :meth:`replace_arguments` and every :class:`~tpcore.Layer` count of the instance read."""
        return config

    @staticmethod
    def replace_arguments(config: Any, world_size: int) -> dict[str, Any]:
        """Attributes of one layer instance to set per rank, ``{path: value}``.

        Use :func:`~tpcore.share` for head counts and sizes (a value may then be a
        :class:`~tpcore.PerRank`, which each rank reads its own entry of), or :func:`~tpcore.divide`
        where only equal splits are right, so that a world size that does not divide them fails
        before anything is sliced. A value wrapped in :class:`IfHeld` is set only where the layer
        instance holds the module (or attribute) it names.
        """
        return {}

    @staticmethod
    def replace_modules() -> dict[str, type[nn.Module] | Callable[[nn.Module | None], type[nn.Module] | None]]:
        """Module classes to swap inside the layer instance, ``{path: new_class}``; a value may be a
        function of the module at ``path`` (``None`` where the layer has none, an optional module)
        giving its class, or ``None`` to leave it."""
        return {}

    @classmethod
    def layers(cls) -> list[Layer]:
        """Every tensor pair of the layer to cut, each with its :class:`~tpcore.Style`: by default those
        of the group methods, a :class:`~tpcore.Layer` without a style taking its group's."""
        by_group_method: list[tuple[list[Layer], Style]] = [
            (cls.attn_qkv(), COLUMN),
            (cls.mlp_in(), COLUMN),
            (cls.attn_out(), ROW),
            (cls.mlp_out(), ROW),
        ]
        return [layer.styled(style) for listed, style in by_group_method for layer in listed]

    @staticmethod
    def attn_qkv() -> list[Layer]:
        """parallelformers' group of attention q/k/v projections: a place to list ``COLUMN`` tensors."""
        return []

    @staticmethod
    def attn_out() -> list[Layer]:
        """parallelformers' group of attention output projections: a place to list ``ROW`` tensors."""
        return []

    @staticmethod
    def mlp_in() -> list[Layer]:
        """parallelformers' group of MLP input projections: a place to list ``COLUMN`` tensors."""
        return []

    @staticmethod
    def mlp_out() -> list[Layer]:
        """parallelformers' group of MLP output projections: a place to list ``ROW`` tensors."""
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
        """Whether ``module`` is an instance of exactly this policy's layer class (or of a quantized class made from
        it, which names it as its ``plain_class``: MXFP4 experts)."""
        return layer_class_name(module) == cls.layer_class_name()
