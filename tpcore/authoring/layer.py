"""``Layer``: one tensor pair of a layer to split, named by paths, with its ``Style`` and layout words.

A style says what a rank's part of the tensor is and what its module then computes, for
``y = x @ W.T + b`` with ``W`` stored ``(out, in)`` (``transposed``: ``(in, out)``, HF ``Conv1D``):

===============  ==========================================  ========================================
style            the tensor is cut along                     the module on a rank
===============  ==========================================  ========================================
``COLUMN``       ``out`` (weight dim 0, bias dim 0)          computes its slice of the output
                                                             features; nothing is exchanged
``ROW``          ``in`` (weight dim 1); the bias stays whole computes a partial sum, all-reduced,
                 (rank 0 alone holds it where the module     the bias added once after (or inside,
                 adds it inside its forward)                 by rank 0 alone)
``PER_HEAD``     its heads (dim 0 unless ``dim=``): a table  unchanged: it reads its heads' rows
                 or parameter with one slice per head        (relative position biases, per-head
                                                             norms and biases)
``NORM``         as ``COLUMN``: the weight of a norm over    sums its statistic over every rank
                 a column-split activation                   (:class:`~tpcore.ColumnSplitRMSNorm`)
===============  ==========================================  ========================================

``dim=`` names the weight's cut dimension outright, for tensors of any rank (MoE experts
``(E, 2I, H)``: ``COLUMN`` with ``dim=1``). The layout words (``n_fused``, ``heads``, ``groups``,
``parts``, ``interleaved``) say what the cut dimension packs; :meth:`Layer.splits` turns them into
the :class:`~tpcore.cut.split.Split` every path cuts by.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Callable
from dataclasses import InitVar, dataclass
from typing import Any

from torch import nn

from tpcore.cut.split import Split
from tpcore.errors import ShardingError

__all__ = ["COLUMN", "NORM", "PER_HEAD", "ROW", "Count", "Layer", "Style"]


class Style(str, enum.Enum):
    """How a tensor is cut and what its module computes on a rank (module docstring)."""

    COLUMN = "column"
    ROW = "row"
    PER_HEAD = "per_head"
    NORM = "norm"

    def __str__(self) -> str:
        return self.value


COLUMN, ROW, PER_HEAD, NORM = Style.COLUMN, Style.ROW, Style.PER_HEAD, Style.NORM

#: a head count in a Layer: an int, a config attribute name, or a function of the config
Count = int | str | Callable[[Any], int]

#: the order parallelformers' positional ``Layer(...)`` arguments took, accepted with a warning
_POSITIONAL = ("weight", "bias", "n_fused", "reversed", "replace", "ignore_checker", "heads")
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One :class:`DeprecationWarning` per ``key`` and process, pointing at the caller's caller."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, DeprecationWarning, stacklevel=4)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    """A head count as a policy gives it: a positive int, the name of a config attribute, or a
    function of the config (a count that config flags choose)."""
    return (_is_int(value) and value >= 1) or (isinstance(value, str) and bool(value)) or callable(value)


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One parallelizable tensor pair of a layer, named by attribute paths relative to the layer.

    Args:
        weight: path of the weight, e.g. ``"attention.self.query.weight"``.
        bias: path of the bias, or ``None``.
        style: a :class:`Style`; ``None`` takes the style of the group method that lists it
            (:meth:`tpcore.Policy.layers`).
        n_fused: how many tensors are packed along the cut dimension (3 for a fused q|k|v);
            each is split separately and rank ``r`` gets the ``r``-th piece of every one. With
            ``interleaved``: how many tensors each head packs.
        transposed: the weight is stored ``(in, out)`` (HF ``Conv1D``) instead of ``(out, in)``;
            flips the weight's cut dimension for this tensor only.
        optional: a missing ``weight`` is skipped instead of raising.
        replace: module class to give the module owning ``weight`` instead of the one its style
            gives (``ROW``: the parallel layer matching the module's type; ``NORM``: the column-split
            norm), or a function of that module giving its class.
        heads: how many heads each packed tensor holds, an int, the name of a config attribute or
            a function of the config (where config flags choose the count, as Falcon's do). Heads
            are dealt whole; fewer heads than ranks are replicated so each rank holds whole groups.
        groups: how many groups of consecutive heads stay together on a rank, a count as for
            ``heads`` (``"num_key_value_heads"`` on the query and output projections of a
            grouped-query attention): the heads are dealt group by group.
        parts: head counts of unequal packed tensors, each a count as for ``heads``
            (``("num_attention_heads", "num_key_value_heads", "num_key_value_heads")`` for a
            grouped-query q|k|v); each part is cut by its own heads, rank ``r`` gets ``[Q_r | K_r | V_r]``.
        interleaved: the tensor packs whole heads one after another, each holding its ``n_fused``
            tensors (``[q0 k0 v0 | q1 k1 v1 | ...]``); needs ``heads``. With ``parts``: the tensor
            packs its head groups one after another, each holding ``part / groups`` heads of every
            part (Falcon's grouped ``[q.. k v | q.. k v | ...]``).
        dim: the weight's cut dimension, for tensors of any rank (negative counts from the end);
            overrides the style's default.
        bias_dim: the bias's cut dimension (default 0); a ``ROW`` bias stays whole.
        widths: with ``parts``, each part's unit width (counts as for ``heads``) where the parts are
            measured in different units: Mamba2's ``in_proj`` ``[z | x | B | C | dt]`` is
            ``parts=(heads, heads, groups, groups, heads)`` of ``widths=(head_dim, head_dim, state, state, 1)``.
            Default: one width, ``size / sum(parts)``.

    ``reversed`` and ``ignore_checker``, the predecessor's names of ``transposed`` and ``optional``,
    are accepted with a :class:`DeprecationWarning`, as is the predecessor's positional order
    (weight, bias, n_fused, reversed, replace, ignore_checker, heads); reading them gives the new fields.
    """

    weight: str | None = None
    bias: str | None = None
    style: Style | None = None
    n_fused: int = 1
    transposed: bool = False
    optional: bool = False
    replace: type[nn.Module] | Callable[[nn.Module], type[nn.Module]] | None = None
    heads: Count | None = None
    groups: Count | None = None
    parts: tuple[Count, ...] | None = None
    interleaved: bool = False
    dim: int | None = None
    bias_dim: int | None = None
    widths: tuple[Count, ...] | None = None
    reversed: InitVar[bool | None] = None
    ignore_checker: InitVar[bool | None] = None

    def __post_init__(self, reversed: bool | None, ignore_checker: bool | None) -> None:  # noqa: A002
        self._alias("transposed", "reversed", reversed)
        self._alias("optional", "ignore_checker", ignore_checker)
        for field in ("parts", "widths"):
            if isinstance(getattr(self, field), list):
                object.__setattr__(self, field, tuple(getattr(self, field)))
        if self.style is not None:
            try:
                object.__setattr__(self, "style", Style(self.style))
            except ValueError:
                styles = ", ".join(style.value for style in Style)
                raise ValueError(f"{self._name}: unknown parallel style {self.style!r} (one of {styles})") from None
        self._check_fields()
        self._check_layout()

    @property
    def _name(self) -> str:
        return f"Layer({self.weight!r})"

    def _alias(self, name: str, old: str, old_value: bool | None) -> None:
        """Take the predecessor's spelling ``old`` of the bool field ``name``, with a warning."""
        if old_value is None:
            value = getattr(self, name)
        else:
            warn_once(old, f"Layer({old}=...) is deprecated; use Layer({name}=...)")
            if getattr(self, name) not in (False, old_value):
                raise ValueError(
                    f"{self._name}: {name}={getattr(self, name)!r} and its alias {old}={old_value!r} disagree"
                )
            value = old_value
        if not isinstance(value, bool):
            raise TypeError(f"{self._name}.{name} must be a bool, got {value!r}")
        object.__setattr__(self, name, value)

    def _check_fields(self) -> None:
        for field in ("weight", "bias"):
            if getattr(self, field) is not None and not isinstance(getattr(self, field), str):
                raise TypeError(f"{self._name}.{field} must be an attribute path (str), got {getattr(self, field)!r}")
        if not _is_int(self.n_fused) or self.n_fused < 1:
            raise ValueError(f"Layer.n_fused must be a positive int, got {self.n_fused!r}")
        for field in ("dim", "bias_dim"):
            if getattr(self, field) is not None and not _is_int(getattr(self, field)):
                raise TypeError(f"{self._name}.{field} must be an int, got {getattr(self, field)!r}")
        for field in ("heads", "groups"):
            if getattr(self, field) is not None and not _is_count(getattr(self, field)):
                raise TypeError(
                    f"{self._name}.{field} must be a positive int, a config attribute name or a function of the "
                    f"config, got {getattr(self, field)!r}"
                )
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"{self._name}.interleaved must be a bool, got {self.interleaved!r}")
        replace = self.replace
        function = callable(replace) and not isinstance(replace, type)
        if replace is not None and not (function or isinstance(replace, type) and issubclass(replace, nn.Module)):
            raise TypeError(
                f"{self._name}.replace must be an nn.Module subclass or a function giving one, got {replace!r}"
            )

    def _check_layout(self) -> None:
        name = self._name
        if self.groups is not None and self.heads is None and self.parts is None:
            raise ValueError(f"{name}: groups= groups heads; give heads= (or parts=) too")
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
        self._check_widths()
        if self.dim is not None and self.transposed:
            raise ValueError(f"{name}: dim= fixes the split dimension; transposed would have no effect")
        if self.bias_dim is not None and self.bias is None:
            raise ValueError(f"{name}: bias_dim= without a bias")
        if self.style is PER_HEAD and self.heads is None and self.parts is None:
            raise ValueError(f"{name}: a PER_HEAD tensor is cut by its heads; give heads= (or parts=)")
        if self.style is ROW and self.bias_dim is not None:
            raise ValueError(f"{name}: a row-parallel bias is added whole; bias_dim does not apply")

    def _check_widths(self) -> None:
        name = self._name
        if self.widths is None:
            return
        if self.parts is None or self.interleaved:
            raise ValueError(f"{name}: widths= give the unit width of each of parts=, packed one after another")
        if not isinstance(self.widths, tuple) or len(self.widths) != len(self.parts):
            raise ValueError(f"{name}.widths must give one width per part ({len(self.parts)}), got {self.widths!r}")
        if not all(map(_is_count, self.widths)):
            raise TypeError(f"{name}.widths must be counts (ints, config attribute names or functions)")

    @property
    def module_path(self) -> str:
        """Path of the module that owns ``weight`` (``""`` for the layer itself)."""
        return self.weight.rpartition(".")[0] if self.weight else ""

    def styled(self, style: Style) -> Layer:
        """This layer with ``style`` where it names none (the style of the group that lists it)."""
        return self if self.style is not None else dataclasses.replace(self, style=style)

    def dims(self) -> tuple[int, int | None]:
        """The cut dimensions ``(weight_dim, bias_dim)`` its style gives (``None``: the bias stays whole):
        ``COLUMN`` and ``NORM`` the output features (dim 0 of ``(out, in)``, 1 if ``transposed``),
        ``ROW`` the input features, ``PER_HEAD`` dim 0; ``dim`` overrides the weight's, ``bias_dim``
        (default 0) the bias's."""
        if self.style is None:
            raise ValueError(f"{self._name} has no style: give style= or list it in a policy's group method")
        out_dim, in_dim = (1, 0) if self.transposed else (0, 1)
        if self.style is ROW:
            return (in_dim if self.dim is None else self.dim), None
        default = 0 if self.style is PER_HEAD else out_dim
        return (default if self.dim is None else self.dim), (self.bias_dim or 0)

    def splits(self, config: Any = None) -> tuple[Split, Split | None]:
        """The :class:`~tpcore.cut.split.Split` of the weight and of the bias (``None``: kept whole), with
        ``heads``, ``groups`` and ``parts`` read from ``config``, the config of the sub-model the layer
        belongs to. The bias follows the weight's layout (fused, heads, parts)."""
        weight_dim, bias_dim = self.dims()
        heads = None if self.heads is None else self._count(self.heads, config, "heads")
        parts = None if self.parts is None else tuple(self._count(part, config, "parts") for part in self.parts)
        groups = None if self.groups is None else self._count(self.groups, config, "groups")
        if groups is not None and groups == heads:
            groups = None  # one head per group: the default
        widths = None if self.widths is None else tuple(self._count(w, config, "widths") for w in self.widths)
        layout = {"n_fused": self.n_fused, "heads": heads, "parts": parts, "interleaved": self.interleaved}
        layout |= {"groups": groups, "widths": widths}
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


_dataclass_init = Layer.__init__


def _init(self: Layer, *args: Any, **fields: Any) -> None:
    """``Layer(**fields)``; the predecessor's positional order is taken with a warning."""
    if args:
        if len(args) > len(_POSITIONAL):
            raise TypeError(f"Layer() takes at most {len(_POSITIONAL)} positional arguments ({len(args)} given)")
        warn_once("positional", "positional Layer(...) arguments are deprecated; name the fields")
        for name, value in zip(_POSITIONAL, args, strict=False):
            if name in fields:
                raise TypeError(f"Layer() got multiple values for {name!r}")
            fields[name] = value
    _dataclass_init(self, **fields)


Layer.__init__ = _init  # type: ignore[method-assign]
# the predecessor's names read the new fields (the dataclass took them as init-only aliases)
setattr(Layer, "reversed", property(lambda self: self.transposed, doc="``transposed``, by its old name."))  # noqa: B010
setattr(Layer, "ignore_checker", property(lambda self: self.optional, doc="``optional``, by its old name."))  # noqa: B010
