"""KV caches that live on the ranks, and the stand-in the caller holds for each.

Each rank keeps its own heads' keys and values; the caller holds a transformers ``Cache`` object that
*names* the ranks' cache. A served forward sends a :class:`CacheRef` in place of the caller's cache and
gets back a :class:`CacheState` of the ranks' cache after the step; the caller's stand-in answers length
queries (``get_seq_length``, ``batch_size``, ``is_sliding``, ...) from that state, so ``generate()``'s
bookkeeping costs no round trip, and runs every method that changes the cache (``reorder_cache`` for beam
search, ``crop`` for assisted decoding, ``batch_select_indices``, ...) on the ranks at once. Code that reads
the cache's tensors in the caller (``cache.layers[i].keys``, as Whisper's timestamps do) gets them gathered
from the ranks, every head in order, once per state of the cache.

The stand-in is of a subclass of the cache's own class (:func:`stand_in_class`), so ``isinstance`` checks
of transformers hold: a fresh ``DynamicCache`` (or ``EncoderDecoderCache`` of two) that ``generate()`` or
the user passes becomes one in place, the ranks building an empty cache of the same kind; one the ranks
made (``use_cache=True`` without a cache) is built from its :class:`CacheState`. A stand-in that is
dropped frees the ranks' cache with the next call. A cache that already holds tensors of the caller's
(filled by an unsplit model, or a static cache allocated for every head) cannot be split and is refused.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from tpcore.ranks.transfer import each_item
from tpcore.served.cache_batches import OPERATIONS

__all__ = [
    "CacheRef",
    "CacheState",
    "CallerCaches",
    "RankCaches",
    "CacheCalls",
    "batch_operation",
    "cache_keyword",
    "join_heads",
    "stand_in_class",
    "take_over",
]

#: the methods of a cache that change it: run on the ranks, then the stand-in takes the new state
MUTATIONS = (
    "reorder_cache",
    "crop",
    "batch_repeat_interleave",
    "batch_select_indices",
    "reset",
    "activate_past_recording",
)
#: the sub-caches an ``EncoderDecoderCache`` holds (each a stand-in of its own, named by its attribute)
PARTS = ("self_attention_cache", "cross_attention_cache")


class CacheRef(NamedTuple):
    """What travels in place of a cache: the ranks' cache ``id``, and for a cache the ranks do not hold yet,
    the empty caller's cache to copy (``template``)."""

    id: int
    template: Any = None


@dataclass(frozen=True)
class CacheState:
    """What the caller's stand-in knows of the ranks' cache after a step: its class and what generate asks."""

    cache_class: type
    seq_lengths: tuple[int, ...] = ()
    batch_size: int = -1
    is_sliding: tuple[bool, ...] = ()
    is_linear: tuple[bool, ...] = ()
    is_dummy: tuple[bool, ...] = ()
    is_croppable: bool = True
    is_initialized: bool = False
    parts: dict[str, CacheState] = field(default_factory=dict)

    @classmethod
    def of(cls, cache: Any) -> CacheState:
        """On a rank: the state of ``cache`` (an ``EncoderDecoderCache``: of its parts)."""
        if all(hasattr(cache, part) for part in PARTS):
            return cls(type(cache), parts={part: cls.of(getattr(cache, part)) for part in PARTS})
        layers = range(len(getattr(cache, "layers", ())))
        return cls(
            type(cache),
            seq_lengths=tuple(_seq_length(cache, layer) for layer in layers),
            batch_size=_safe(lambda: cache.batch_size, -1),
            is_sliding=_flags(cache, "is_sliding"),
            is_linear=_flags(cache, "is_linear"),
            is_dummy=_flags(cache, "is_dummy"),
            is_croppable=_safe(lambda: cache.is_croppable, False),
            is_initialized=_safe(lambda: cache.is_initialized, False),
        )


def cache_keyword(model: Any) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _safe(read: Callable[[], Any], default: Any) -> Any:
    try:
        return read()
    except (ValueError, AttributeError):
        return default


def _flags(cache: Any, name: str) -> tuple[bool, ...]:
    """The per-layer flags ``cache.<name>``; ``()`` where this transformers has none (``is_dummy`` came in 5.2x)."""
    return tuple(_safe(lambda: getattr(cache, name), ()))


def _seq_length(cache: Any, layer: int) -> int:
    try:
        return int(cache.layers[layer].get_seq_length())
    except (AttributeError, TypeError, ValueError):
        return 0  # a layer that tracks no length (linear attention)


class RankCaches:
    """On a rank: the caches it keeps, by id. Every rank makes the same calls, so ids agree."""

    def __init__(self) -> None:
        self.caches: dict[int, Any] = {}
        self._ids = itertools.count(1 << 40)  # ids the ranks give; the caller's count from 1
        self._reported: set[int] = set()  # the caches the last report found in an output

    def resolve(self, value: Any) -> Any:
        """``value`` with every :class:`CacheRef` inside replaced by the cache it names (made from its
        template when the ranks do not hold it yet)."""
        if isinstance(value, CacheRef):
            if value.id not in self.caches:
                if value.template is None:
                    raise KeyError(f"the ranks hold no cache {value.id}: it was freed, or made by other ranks")
                self.caches[value.id] = value.template
            return self.caches[value.id]
        return each_item(value, self.resolve, named_tuples=False)

    def tensors(self, cache_id: int, part: str | None) -> list[tuple[Any, Any]]:
        """This rank's ``(keys, values)`` of each layer of cache ``cache_id`` (of its ``part``): its heads."""
        cache = self.caches[cache_id]
        cache = getattr(cache, part) if part else cache
        return [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in cache.layers]

    def mutate(self, cache_id: int, part: str | None, method: str, args: tuple) -> CacheState:
        """Run ``method`` of cache ``cache_id`` (of its ``part``), or the operation of :data:`OPERATIONS` it names
        (caches among ``args`` sent as their :class:`CacheRef`); its state after."""
        cache = self.caches[cache_id]
        target = getattr(cache, part) if part else cache
        if method in OPERATIONS:
            OPERATIONS[method](target, *self.resolve(args))
        else:
            getattr(target, method)(*args)
        return CacheState.of(cache)

    def report(self, output: Any) -> Any:
        """``output`` with each cache inside (one a forward made or filled) replaced by its id (:class:`_Reported`)."""
        self._reported = set()
        return self._report(output)

    def _report(self, output: Any) -> Any:
        if _is_cache(output):
            cache_id = next((key for key, cache in self.caches.items() if cache is output), None)
            if cache_id is None:
                cache_id = next(self._ids)
                self.caches[cache_id] = output
            self._reported.add(cache_id)
            return _Reported(cache_id)
        return each_item(output, self._report, named_tuples=False, in_place=True)  # the forward's own output

    def states(self, ids: set[int]) -> dict[int, CacheState]:
        """The state of each cache of ``ids`` and of each the last :meth:`report` found, as the forward whose output
        it reported left them."""
        return {
            cache_id: CacheState.of(self.caches[cache_id])
            for cache_id in ids | self._reported
            if cache_id in self.caches
        }

    def free(self, ids: Iterable[int]) -> None:
        for cache_id in ids:
            self.caches.pop(cache_id, None)


class _Reported(NamedTuple):
    """A cache in a rank's output: its id (the caller turns it into a stand-in, of the state reported with it)."""

    id: int


def _is_cache(value: Any) -> bool:
    if isinstance(value, torch.Tensor):  # the common case, and a tensor's missing attribute is slow to look up
        return False
    from transformers.cache_utils import Cache

    return isinstance(value, Cache) or all(hasattr(value, part) for part in PARTS) and hasattr(value, "is_updated")


# -- the caller's side -------------------------------------------------------------------------------


class GatheredLayer:
    """A layer of a stand-in as code in the caller reads it: ``keys`` and ``values`` ``(batch, heads, length,
    head_dim)`` with every head, gathered from the ranks when first read."""

    def __init__(self, stand_in: StandIn, index: int):
        self._stand_in, self._index = stand_in, index

    @property
    def keys(self) -> Any:
        return self._stand_in._tpcore_gathered()[self._index][0]

    @property
    def values(self) -> Any:
        return self._stand_in._tpcore_gathered()[self._index][1]

    @property
    def is_initialized(self) -> bool:
        return self.keys is not None

    def get_seq_length(self) -> int:
        return self._stand_in.get_seq_length(self._index)


class StandIn:
    """Mixed into a subclass of a cache class: the caller's stand-in for the ranks' cache ``_tpcore_id``."""

    _tpcore_id: int
    _tpcore_part: str | None
    _tpcore_state: CacheState
    _tpcore_mutate: Callable[[int, str | None, str, tuple], CacheState]
    #: ``(cache id, part)`` -> every layer's ``(keys, values)``, every head (gathered from the ranks)
    _tpcore_fetch: Callable[[int, str | None], list[tuple[Any, Any]]]

    @property
    def layers(self) -> list[GatheredLayer]:
        """The layers as the caller reads them (their tensors gathered from the ranks on first read)."""
        return [GatheredLayer(self, index) for index in range(len(self._tpcore_state.seq_lengths))]

    @layers.setter
    def layers(self, _layers: Any) -> None:
        pass  # a stand-in's layers are the ranks'

    def _tpcore_gathered(self) -> list[tuple[Any, Any]]:
        gathered = self.__dict__.get("_tpcore_tensors")
        if gathered is None:
            gathered = self.__dict__["_tpcore_tensors"] = self._tpcore_fetch(self._tpcore_id, self._tpcore_part)
        return gathered

    def get_seq_length(self, layer_idx: int = 0) -> int:
        lengths = self._tpcore_state.seq_lengths
        return lengths[layer_idx] if layer_idx < len(lengths) else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.get_seq_length(0 if layer_idx is None else layer_idx)

    def __len__(self) -> int:
        return len(self._tpcore_state.seq_lengths)

    @property
    def batch_size(self) -> int:
        return self._tpcore_state.batch_size

    @property
    def is_sliding(self) -> list[bool]:
        return list(self._tpcore_state.is_sliding)

    @property
    def is_linear(self) -> list[bool]:
        return list(self._tpcore_state.is_linear)

    @property
    def is_dummy(self) -> list[bool]:
        return list(self._tpcore_state.is_dummy)

    @property
    def is_compileable(self) -> bool:
        return False  # its tensors are on the ranks: nothing to compile here

    @property
    def is_croppable(self) -> bool:
        return self._tpcore_state.is_croppable

    @property
    def is_initialized(self) -> bool:
        return self._tpcore_state.is_initialized

    def _tpcore_take(self, state: CacheState) -> None:
        """Take the ranks' new state (of this part, where this stand-in is one); tensors read before are stale."""
        self._tpcore_state = state.parts[self._tpcore_part] if self._tpcore_part else state
        self.__dict__.pop("_tpcore_tensors", None)


def _mutation(method: str) -> Callable[..., None]:
    def run_on_ranks(self: StandIn, *args: Any) -> None:
        args = tuple(arg.detach().cpu() if isinstance(arg, torch.Tensor) else arg for arg in args)
        self._tpcore_take(self._tpcore_mutate(self._tpcore_id, self._tpcore_part, method, args))

    run_on_ranks.__name__ = method
    run_on_ranks.__doc__ = f"``{method}`` of the ranks' cache; this stand-in takes its state after."
    return run_on_ranks


for _method in MUTATIONS:
    setattr(StandIn, _method, _mutation(_method))


def batch_operation(cache: Any, name: str, *args: Any) -> None:
    """Run the cache operation ``name`` of :data:`~tpcore.served.cache_batches.OPERATIONS` on ``cache``: in place on a
    local cache, on the ranks for a stand-in (other stand-ins among ``args`` named by their ids)."""
    if not isinstance(cache, StandIn):
        OPERATIONS[name](cache, *args)
        return
    sent = tuple(CacheRef(arg._tpcore_id) if isinstance(arg, StandIn) else arg for arg in args)
    cache._tpcore_take(cache._tpcore_mutate(cache._tpcore_id, cache._tpcore_part, name, sent))


_STAND_IN_CLASSES: dict[type, type] = {}


def stand_in_class(cache_class: type) -> type:
    """A subclass of ``cache_class`` whose instances stand for a cache on the ranks (same name), one per class."""
    if cache_class not in _STAND_IN_CLASSES:
        namespace = {"__module__": cache_class.__module__, "__qualname__": cache_class.__qualname__}
        _STAND_IN_CLASSES[cache_class] = type(cache_class.__name__, (StandIn, cache_class), namespace)
    return _STAND_IN_CLASSES[cache_class]


def take_over(cache: Any, cache_id: int, ranks: CacheCalls, state: CacheState | None = None, part: str | None = None):
    """Make the caller's ``cache`` (an instance of a transformers cache class) the stand-in of the ranks'
    cache ``cache_id``, in place; an ``EncoderDecoderCache``'s parts become stand-ins of its parts."""
    state = state or CacheState(type(cache), parts={p: CacheState(type(getattr(cache, p))) for p in _parts(cache)})
    if _parts(cache):
        for name in PARTS:
            take_over(getattr(cache, name), cache_id, ranks, state, name)
        return cache
    cache.__class__ = stand_in_class(type(cache))
    cache.__dict__.pop("layers", None)  # the ranks' layers from here on
    cache._tpcore_id, cache._tpcore_part = cache_id, part
    cache._tpcore_mutate, cache._tpcore_fetch = ranks.mutate, ranks.fetch
    cache._tpcore_take(state)
    return cache


def new_stand_in(cache_id: int, state: CacheState, ranks: CacheCalls) -> Any:
    """A stand-in built from the state of a cache the ranks made."""
    if state.parts:
        parts = [new_stand_in(cache_id, state.parts[name], ranks) for name in PARTS]
        for name, stand_in in zip(PARTS, parts, strict=True):
            stand_in._tpcore_part = name
            stand_in._tpcore_state = state.parts[name]
        return state.cache_class(*parts)
    cache: Any = object.__new__(stand_in_class(state.cache_class))
    cache._tpcore_id, cache._tpcore_part, cache._tpcore_state = cache_id, None, state
    cache._tpcore_mutate, cache._tpcore_fetch = ranks.mutate, ranks.fetch
    return cache


def _parts(cache: Any) -> tuple[str, ...]:
    return PARTS if all(hasattr(cache, part) for part in PARTS) else ()


def stand_ins(value: Any) -> Iterator[Any]:
    """The stand-ins inside ``value`` (an ``EncoderDecoderCache``'s parts)."""
    if isinstance(value, StandIn):
        yield value
    elif _parts(value):
        for part in PARTS:
            yield from stand_ins(getattr(value, part))


class CacheCalls(NamedTuple):
    """How the caller reaches the ranks' caches (each a call to the ranks): ``mutate(cache_id, part, method,
    args)`` runs a method of a cache and gives its state after; ``fetch(cache_id, part)`` gives every layer's
    ``(keys, values)`` with every head."""

    mutate: Callable[[int, str | None, str, tuple], CacheState]
    fetch: Callable[[int, str | None], list[tuple[Any, Any]]]


class CallerCaches:
    """On the caller: the ranks' caches its stand-ins name, reached through ``ranks``."""

    def __init__(self, ranks: CacheCalls):
        self.ranks = ranks
        self._ids = itertools.count(1)
        self._freed: list[int] = []

    def write(self, value: Any, sent: dict[int, Any]) -> Any:
        """``value`` with each cache inside replaced by its :class:`CacheRef` (``sent``: id -> the caller's
        object). A fresh cache becomes a stand-in in place; one holding the caller's tensors is refused."""
        if isinstance(value, _PLAIN):
            return value
        cache_id = _stand_in_id(value)
        if cache_id is not None:
            sent[cache_id] = value
            return CacheRef(cache_id)
        if _is_cache(value):
            if _holds_tensors(value):
                raise ValueError(
                    f"a {type(value).__name__} that holds tensors of this process cannot be used by the split model "
                    "(its ranks keep their own heads): pass an empty cache, or one this model returned"
                )
            cache_id = next(self._ids)
            template = copy.deepcopy(value)
            take_over(value, cache_id, self.ranks)
            self._free_when_dropped(value, cache_id)
            sent[cache_id] = value
            return CacheRef(cache_id, template)
        return each_item(value, lambda item: self.write(item, sent), named_tuples=False)

    def read(self, value: Any, sent: dict[int, Any], states: dict[int, CacheState]) -> Any:
        """The ranks' output with each cache report turned into its stand-in: the caller's own object for
        a cache it sent (taking the new state), else a new stand-in; every sent stand-in takes its state."""
        for cache_id, cache in sent.items():
            if cache_id in states:
                for stand_in in stand_ins(cache):
                    stand_in._tpcore_take(states[cache_id])
        return self._stand_ins_in(value, sent, states)

    def _stand_ins_in(self, value: Any, sent: dict[int, Any], states: dict[int, CacheState]) -> Any:
        if isinstance(value, _Reported):
            if value.id in sent:
                return sent[value.id]
            stand_in = new_stand_in(value.id, states[value.id], self.ranks)
            self._free_when_dropped(stand_in, value.id)
            return stand_in
        return each_item(value, lambda item: self._stand_ins_in(item, sent, states), named_tuples=False, in_place=True)

    def _free_when_dropped(self, cache: Any, cache_id: int) -> None:
        weakref.finalize(cache, self._freed.append, cache_id)

    def take_freed(self) -> list[int]:
        """The ids of the stand-ins dropped since the last call (the ranks free them with the next)."""
        freed, self._freed[:] = list(self._freed), []
        return freed


#: what a forward's inputs hold most, none of it a cache: passed over without a look for one
_PLAIN = (torch.Tensor, int, float, str, type(None))


def _stand_in_id(value: Any) -> int | None:
    found = list(stand_ins(value))
    return found[0]._tpcore_id if found else None


def _holds_tensors(cache: Any) -> bool:
    """Whether a cache holds any tensor already (filled, or allocated up front as a static cache is). A
    0-dim tensor is a count, not a state (transformers 5.25's linear-attention layers start at
    ``cumulative_length_linear = tensor(0)``)."""
    return any(isinstance(item, torch.Tensor) and item.dim() and item.numel() for item in _tensors(cache))


def _tensors(value: Any, depth: int = 0) -> Iterator[Any]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and hasattr(value, "__dict__"):
        for item in vars(value).values():
            if isinstance(item, (list, tuple)):
                for element in item:
                    yield from _tensors(element, depth + 1)
            else:
                yield from _tensors(item, depth + 1)


def join_heads(pieces: list[Any]) -> Any:
    """One rank's tensors ``(batch, heads, length, head_dim)`` per rank, in rank order, as one with every head:
    each rank holds a contiguous run of heads; a piece equal to the one before (a head that ranks share, or a
    part every rank holds whole) is one copy."""
    if any(piece is None for piece in pieces):
        return None
    kept = [pieces[0]]
    for piece in pieces[1:]:
        if not (piece.shape == kept[-1].shape and torch.equal(piece, kept[-1])):
            kept.append(piece)
    return torch.cat(kept, dim=1)
