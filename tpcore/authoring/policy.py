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

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from torch import nn

from tpcore.cut.shares import PerRank, per_rank, resolve, runs

if TYPE_CHECKING:
    from tpcore.cut.split import Split

__all__ = ["COLUMN", "ROW", "IfHeld", "Layer", "PerRank", "Policy", "ShardingError", "divide", "local_config", "share"]

#: Parallel styles: column splits a layer's output features, row its input features.
COLUMN = "column"
ROW = "row"


class ShardingError(ValueError):
    """A model cannot be split the way a policy asks (sizes, missing modules)."""


def divide(value: int, world_size: int, what: str) -> int:
    """Return ``value // world_size``; raise :class:`ShardingError` naming ``what`` if it is not exact.

    For a count that may be dealt unevenly (heads, MLP features), use :func:`share`.
    """
    if value % world_size:
        raise ShardingError(
            f"{what} = {value} cannot be split evenly over {world_size} ranks "
            "(a policy that deals it unevenly uses tpcore.share)"
        )
    return value // world_size


def share(value: int, world_size: int, what: str, *, groups: int | None = None, first: bool = False) -> int | PerRank:
    """How many of ``value`` units (heads, features) each rank holds: ``value // world_size`` when it
    divides, else :class:`PerRank` counts dealt as :func:`tpcore.shares.runs` deals them, the ones
    every :class:`Layer` with the same ``heads`` and ``groups`` is cut by (so ``share(heads, N, ...,
    groups=kv_heads)`` for query heads that stay with their key/value heads). A count of fewer
    units than ranks gives each rank one (replicated key/value heads). ``first=True`` gives the index
    of each rank's first unit instead (a rank's rows of a per-head table).

    The result is an int or a :class:`PerRank`, with arithmetic applied per rank
    (``share(heads, N, "n_head") * head_dim`` is each rank's width); :class:`ShardingError` names
    ``what`` when ``value`` is not a positive count or ``groups`` does not divide it.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ShardingError(f"{what} = {value!r} is not a positive count to split over {world_size} ranks")
    try:
        dealt = runs(value, world_size, groups)
    except ValueError:
        raise ShardingError(f"{what} = {value} cannot form {groups} equal groups") from None
    return per_rank(start if first else count for start, count in dealt)


def local_config(config: Any, world_size: int, **counts: int | PerRank) -> Any:
    """A copy of ``config`` whose attributes ``counts`` hold each rank's values (ints, or
    :class:`PerRank` from :func:`share`), for a :meth:`Policy.replace_arguments` value
    ``{"config": ...}`` where a module's forward reads a head count from ``self.config``: one copy
    when every rank's values are equal, else a :class:`PerRank` of copies."""

    def copy_for(rank: int) -> Any:
        copied = copy.copy(config)
        for name, value in counts.items():
            setattr(copied, name, resolve(value, rank))
        return copied

    if not any(isinstance(value, PerRank) for value in counts.values()):
        return copy_for(0)
    return PerRank(copy_for(rank) for rank in range(world_size))


#: a head count in a Layer: an int, a config attribute name, or a function of the config
Count = int | str | Callable[[Any], int]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    """A head count as a policy gives it: a positive int, the name of a config attribute, or a
    function of the config (a count that config flags choose)."""
    return (_is_int(value) and value >= 1) or (isinstance(value, str) and bool(value)) or callable(value)


@dataclass(frozen=True)
class Layer:
    """One parallelizable tensor pair of a layer, named by attribute paths relative to the layer.

    Args:
        weight: path of the weight, e.g. ``"attention.self.query.weight"``.
        bias: path of the bias, or ``None``.
        n_fused: how many tensors are packed along the split dimension (3 for a fused q|k|v);
            each is split separately and rank ``r`` gets the ``r``-th piece of every one. With
            ``interleaved``: how many tensors each head packs.
        reversed: alias of ``transposed``.
        replace: module class to give the module owning ``weight`` (row groups default to the
            parallel layer that matches the module's type, see :mod:`tpcore.layers`), or a function
            of that module giving its class (:func:`tpcore.layers.column_split_norm_class`).
        ignore_checker: alias of ``optional``.
        heads: how many heads each packed tensor holds, an int, the name of a config attribute or
            a function of the config (where config flags choose the count, as Falcon's do), for
            tensors that may hold fewer heads than there are ranks (grouped-query key/value
            projections): those heads are then replicated so each rank holds whole groups.
            Also makes the split check that every rank holds whole heads.
        dim: the weight's split dimension, for tensors of any rank (negative counts from the end);
            overrides the column/row default (``(E, 2I, H)`` MoE experts: 1; ``(entries, heads)``: -1).
        bias_dim: the bias's split dimension in a column group (default 0); a row bias stays whole.
        parts: head counts of unequal packed tensors, each a count as for ``heads``
            (``("num_attention_heads", "num_key_value_heads", "num_key_value_heads")`` for a
            grouped-query q|k|v); each part is cut by its own heads, rank ``r`` gets ``[Q_r | K_r | V_r]``.
        interleaved: the tensor packs whole heads one after another, each holding its ``n_fused``
            tensors (``[q0 k0 v0 | q1 k1 v1 | ...]``); needs ``heads``. With ``parts``: the tensor
            packs its head groups one after another, each holding ``part / groups`` heads of every
            part (Falcon's grouped ``[q.. k v | q.. k v | ...]``).
        groups: how many groups of consecutive heads stay together on a rank, a count as for
            ``heads`` (``"num_key_value_heads"`` on a query projection and on the output
            projection of a grouped-query attention): with ``heads``, the heads are dealt group by
            group, as the key/value projection's heads are (see :mod:`tpcore.shares`).
        transposed: the weight is stored ``(in, out)`` (HF ``Conv1D``) instead of ``(out, in)``;
            flips the weight's split dimension for this tensor only.
        optional: a missing ``weight`` is skipped instead of raising.

    Each alias pair is one attribute under two names: setting either sets both, setting both to
    different values is a :class:`ValueError` (so ``dataclasses.replace`` must change both).
    """

    weight: str | None = None
    bias: str | None = None
    n_fused: int = 1
    reversed: bool | None = None
    replace: type[nn.Module] | Callable[[nn.Module], type[nn.Module]] | None = None
    ignore_checker: bool | None = None
    heads: Count | None = None
    dim: int | None = None
    bias_dim: int | None = None
    parts: tuple[Count, ...] | None = None
    interleaved: bool = False
    transposed: bool | None = None
    optional: bool | None = None
    groups: Count | None = None

    def __post_init__(self) -> None:
        self._alias("transposed", "reversed")
        self._alias("optional", "ignore_checker")
        if isinstance(self.parts, list):
            object.__setattr__(self, "parts", tuple(self.parts))
        name = f"Layer({self.weight!r})"
        for field in ("weight", "bias"):
            if getattr(self, field) is not None and not isinstance(getattr(self, field), str):
                raise TypeError(f"{name}.{field} must be an attribute path (str), got {getattr(self, field)!r}")
        if not _is_int(self.n_fused) or self.n_fused < 1:
            raise ValueError(f"Layer.n_fused must be a positive int, got {self.n_fused!r}")
        for field in ("dim", "bias_dim"):
            if getattr(self, field) is not None and not _is_int(getattr(self, field)):
                raise TypeError(f"{name}.{field} must be an int, got {getattr(self, field)!r}")
        for field in ("heads", "groups"):
            if getattr(self, field) is not None and not _is_count(getattr(self, field)):
                raise TypeError(
                    f"{name}.{field} must be a positive int, a config attribute name or a function of the config, "
                    f"got {getattr(self, field)!r}"
                )
        if self.groups is not None and self.heads is None and self.parts is None:
            raise ValueError(f"{name}: groups= groups heads; give heads= (or parts=) too")
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"{name}.interleaved must be a bool, got {self.interleaved!r}")
        replace = self.replace
        function = callable(replace) and not isinstance(replace, type)
        if replace is not None and not (function or isinstance(replace, type) and issubclass(replace, nn.Module)):
            raise TypeError(f"{name}.replace must be an nn.Module subclass or a function giving one, got {replace!r}")
        if self.parts is not None:
            if not isinstance(self.parts, tuple) or len(self.parts) < 2 or not all(map(_is_count, self.parts)):
                raise ValueError(
                    f"{name}.parts must list the head counts (ints, config attribute names or functions) of at "
                    f"least two packed tensors, got {self.parts!r}; one tensor's heads go in heads="
                )
            if self.heads is not None:
                raise ValueError(f"{name}: parts give each packed tensor's heads; drop heads=")
            if self.n_fused not in (1, len(self.parts)):
                raise ValueError(f"{name}: n_fused={self.n_fused} disagrees with the {len(self.parts)} parts")
        if self.interleaved and self.heads is None and self.parts is None:
            raise ValueError(f"{name}: an interleaved pack needs heads= or parts= (what it interleaves)")
        if self.dim is not None and self.transposed:
            raise ValueError(f"{name}: dim= fixes the split dimension; transposed/reversed would have no effect")
        if self.bias_dim is not None and self.bias is None:
            raise ValueError(f"{name}: bias_dim= without a bias")

    def _alias(self, name: str, old: str) -> None:
        """Make ``name`` and its old spelling ``old`` one bool attribute (``False`` unless set)."""
        given = {value for value in (getattr(self, name), getattr(self, old)) if value is not None}
        if len(given) > 1:
            raise ValueError(
                f"Layer({self.weight!r}): {name}={getattr(self, name)!r} and its alias {old}="
                f"{getattr(self, old)!r} disagree"
            )
        value = given.pop() if given else False
        if not isinstance(value, bool):
            raise TypeError(f"Layer({self.weight!r}).{name} must be a bool, got {value!r}")
        object.__setattr__(self, name, value)
        object.__setattr__(self, old, value)

    @property
    def module_path(self) -> str:
        """Path of the module that owns ``weight`` (``""`` for the layer itself)."""
        return self.weight.rpartition(".")[0] if self.weight else ""

    def dims(self, style: str) -> tuple[int, int | None]:
        """Split dimensions ``(weight_dim, bias_dim)`` in a ``style`` group (``None``: the bias stays whole).

        Column parallel splits the output features, row parallel the input features; an ``(out, in)``
        weight (``nn.Linear``) has them at dims 0 and 1, a ``transposed`` ``(in, out)`` weight (``Conv1D``)
        at 1 and 0; ``dim`` overrides both. A column bias is split along ``bias_dim`` (default 0);
        a row bias is not split: it is added once, after the all-reduce.
        """
        if style not in (COLUMN, ROW):
            raise ValueError(f"unknown parallel style {style!r}")
        out_dim, in_dim = (1, 0) if self.transposed else (0, 1)
        if style == COLUMN:
            return (out_dim if self.dim is None else self.dim), (self.bias_dim or 0)
        if self.bias_dim is not None:
            raise ValueError(f"Layer({self.weight!r}): a row-parallel bias is added whole; bias_dim does not apply")
        return (in_dim if self.dim is None else self.dim), None

    def splits(self, style: str, config: Any = None) -> tuple[Split, Split | None]:
        """The :class:`~tpcore.slicer.Split` of the weight and of the bias (``None``: kept whole) in a
        ``style`` group, with ``heads`` and ``parts`` names read from ``config``, the config of the
        sub-model the layer belongs to. The bias follows the weight's layout (fused, heads, parts).
        """
        from tpcore.cut.split import Split  # the slicer imports this module

        weight_dim, bias_dim = self.dims(style)
        heads = None if self.heads is None else self._count(self.heads, config, "heads")
        parts = None if self.parts is None else tuple(self._count(part, config, "parts") for part in self.parts)
        groups = None if self.groups is None else self._count(self.groups, config, "groups")
        if groups is not None and groups == heads:
            groups = None  # one head per group: the default
        layout = {"n_fused": self.n_fused, "heads": heads, "parts": parts, "interleaved": self.interleaved}
        layout["groups"] = groups
        return Split(weight_dim, **layout), (None if bias_dim is None else Split(bias_dim, **layout))

    def _count(self, value: Count, config: Any, field: str) -> int:
        """A head count: ``value`` itself, the config attribute it names, or what it gives for ``config``."""
        if _is_int(value):
            return value
        count = value(config) if callable(value) else getattr(config, value, None)
        if not _is_int(count) or count < 1:
            found = "lacks it" if count is None else f"holds {count!r}, not a positive int"
            raise ShardingError(
                f"Layer {self.weight!r} names {field} {value!r}, but the config {type(config).__name__} {found}"
            )
        return count


class IfHeld(NamedTuple):
    """A :meth:`Policy.replace_arguments` value set only in the layer instances that hold ``module``
    (a path in the layer); the others keep theirs. For stacks whose blocks of one class hold
    different modules (hybrid stacks: an attention in some blocks, a linear attention in others)."""

    value: Any
    module: str


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

    @classmethod
    def layer_config(cls, config: Any, layer: nn.Module) -> Any:
        """The config one layer instance is split by: ``config`` (its sub-model's) unless blocks of
        this class differ in their counts (Swin's stages: heads and widths of their own), where a
        policy returns a copy holding the instance's own (read from ``layer``). What
        :meth:`replace_arguments` and every :class:`Layer` count of the instance read."""
        return config

    @staticmethod
    def replace_arguments(config: Any, world_size: int) -> dict[str, Any]:
        """Attributes of one layer instance to set per rank, ``{path: value}``.

        Use :func:`share` for head counts and sizes (a value may then be a :class:`PerRank`, which
        each rank reads its own entry of), or :func:`divide` where only equal splits are right, so
        that a world size that does not divide them fails before anything is sliced. A value wrapped
        in :class:`IfHeld` is set only where the layer instance holds the module it names.
        """
        return {}

    @staticmethod
    def replace_modules() -> dict[str, type[nn.Module] | Callable[[nn.Module | None], type[nn.Module] | None]]:
        """Module classes to swap inside the layer instance, ``{path: new_class}``; a value may be a
        function of the module at ``path`` (``None`` where the layer has none, an optional module)
        giving its class, or ``None`` to leave it."""
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
