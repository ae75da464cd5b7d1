"""KV caches that live on the ranks, and the stand-in the caller holds for each.

Each rank keeps its own heads' keys and values; the caller holds a transformers ``Cache`` object that
*names* the ranks' cache. A served forward sends a :class:`CacheRef` in place of the caller's cache and
gets back a :class:`CacheState` of the ranks' cache after the step; the caller's stand-in answers length
queries (``get_seq_length``, ``batch_size``, ``is_sliding``, ...) from that state, so ``generate()``'s
bookkeeping costs no round trip, and runs every method that changes the cache (``reorder_cache`` for beam
search, ``crop`` for assisted decoding, ``batch_select_indices``, ...) on the ranks at once.

The stand-in is of a subclass of the cache's own class (:func:`stand_in_class`), so ``isinstance`` checks
of transformers hold: a fresh ``DynamicCache`` (or ``EncoderDecoderCache`` of two) that ``generate()`` or
the user passes becomes one in place, the ranks building an empty cache of the same kind; one the ranks
made (``use_cache=True`` without a cache) is built from its :class:`CacheState`. A stand-in that is
dropped frees the ranks' cache with the next call. A cache that already holds tensors of the caller's
(filled by an unsplit model, or a static cache allocated for every head) cannot be split and is refused.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from tpcore.cache_batches import OPERATIONS

__all__ = ["CacheRef", "CacheState", "CallerCaches", "RankCaches", "batch_operation", "stand_in_class", "take_over"]

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
            is_sliding=tuple(cache.is_sliding),
            is_linear=tuple(cache.is_linear),
            is_dummy=tuple(cache.is_dummy),
            is_croppable=_safe(lambda: cache.is_croppable, False),
            is_initialized=_safe(lambda: cache.is_initialized, False),
        )


def _safe(read: Callable[[], Any], default: Any) -> Any:
    try:
        return read()
    except (ValueError, AttributeError):
        return default


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

    def resolve(self, value: Any) -> Any:
        """``value`` with every :class:`CacheRef` inside replaced by the cache it names (made from its
        template when the ranks do not hold it yet)."""
        if isinstance(value, CacheRef):
            if value.id not in self.caches:
                if value.template is None:
                    raise KeyError(f"the ranks hold no cache {value.id}: it was freed, or made by other ranks")
                self.caches[value.id] = value.template
            return self.caches[value.id]
        if isinstance(value, dict):
            return type(value)({key: self.resolve(item) for key, item in value.items()})
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self.resolve(item) for item in value)
        return value

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
        """``output`` with each cache inside (one a forward made or filled) replaced by ``(id, state)``."""
        if _is_cache(output):
            cache_id = next((key for key, cache in self.caches.items() if cache is output), None)
            if cache_id is None:
                cache_id = next(self._ids)
                self.caches[cache_id] = output
            return _Reported(cache_id, CacheState.of(output))
        if isinstance(output, dict):
            return type(output)(**{key: self.report(item) for key, item in output.items()})
        if isinstance(output, (list, tuple)) and not hasattr(output, "_fields"):
            return type(output)(self.report(item) for item in output)
        return output

    def states(self, ids: set[int]) -> dict[int, CacheState]:
        return {cache_id: CacheState.of(self.caches[cache_id]) for cache_id in ids if cache_id in self.caches}

    def free(self, ids: list[int]) -> None:
        for cache_id in ids:
            self.caches.pop(cache_id, None)


class _Reported(NamedTuple):
    """A cache in a rank's output: its id and state (the caller turns it into a stand-in)."""

    id: int
    state: CacheState


def _is_cache(value: Any) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(value, Cache) or all(hasattr(value, part) for part in PARTS) and hasattr(value, "is_updated")


# -- the caller's side -------------------------------------------------------------------------------


class StandIn:
    """Mixed into a subclass of a cache class: the caller's stand-in for the ranks' cache ``_tpcore_id``."""

    _tpcore_id: int
    _tpcore_part: str | None
    _tpcore_state: CacheState
    _tpcore_mutate: Callable[[int, str | None, str, tuple], CacheState]

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
        """Take the ranks' new state (of this part, where this stand-in is one)."""
        self._tpcore_state = state.parts[self._tpcore_part] if self._tpcore_part else state


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
    """Run the cache operation ``name`` of :data:`~tpcore.cache_batches.OPERATIONS` on ``cache``: in place on a
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


def take_over(cache: Any, cache_id: int, mutate: Callable, state: CacheState | None = None, part: str | None = None):
    """Make the caller's ``cache`` (an instance of a transformers cache class) the stand-in of the ranks'
    cache ``cache_id``, in place; an ``EncoderDecoderCache``'s parts become stand-ins of its parts."""
    state = state or CacheState(type(cache), parts={p: CacheState(type(getattr(cache, p))) for p in _parts(cache)})
    if _parts(cache):
        for name in PARTS:
            take_over(getattr(cache, name), cache_id, mutate, state, name)
        return cache
    cache.__class__ = stand_in_class(type(cache))
    cache._tpcore_id, cache._tpcore_part, cache._tpcore_mutate = cache_id, part, mutate
    cache._tpcore_take(state)
    return cache


def new_stand_in(cache_id: int, state: CacheState, mutate: Callable) -> Any:
    """A stand-in built from the state of a cache the ranks made."""
    if state.parts:
        parts = [new_stand_in(cache_id, state.parts[name], mutate) for name in PARTS]
        for name, stand_in in zip(PARTS, parts, strict=True):
            stand_in._tpcore_part = name
            stand_in._tpcore_state = state.parts[name]
        return state.cache_class(*parts)
    cache: Any = object.__new__(stand_in_class(state.cache_class))
    cache.layers = []
    cache._tpcore_id, cache._tpcore_part, cache._tpcore_mutate, cache._tpcore_state = cache_id, None, mutate, state
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


class CallerCaches:
    """On the caller: the ranks' caches its stand-ins name. ``mutate(cache_id, part, method, args)`` runs a
    method of the ranks' cache and gives its state after (a call to the ranks)."""

    def __init__(self, mutate: Callable[[int, str | None, str, tuple], CacheState]):
        self.mutate = mutate
        self._ids = itertools.count(1)
        self._freed: list[int] = []

    def outgoing(self, value: Any, sent: dict[int, Any]) -> Any:
        """``value`` with each cache inside replaced by its :class:`CacheRef` (``sent``: id -> the caller's
        object). A fresh cache becomes a stand-in in place; one holding the caller's tensors is refused."""
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
            take_over(value, cache_id, self.mutate)
            self._free_when_dropped(value, cache_id)
            sent[cache_id] = value
            return CacheRef(cache_id, template)
        if isinstance(value, dict):
            return type(value)({key: self.outgoing(item, sent) for key, item in value.items()})
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self.outgoing(item, sent) for item in value)
        return value

    def incoming(self, value: Any, sent: dict[int, Any], states: dict[int, CacheState]) -> Any:
        """The ranks' output with each cache report turned into its stand-in: the caller's own object for
        a cache it sent (taking the new state), else a new stand-in; every sent stand-in takes its state."""
        for cache_id, cache in sent.items():
            if cache_id in states:
                for stand_in in stand_ins(cache):
                    stand_in._tpcore_take(states[cache_id])
        return self._stand_ins_in(value, sent)

    def _stand_ins_in(self, value: Any, sent: dict[int, Any]) -> Any:
        if isinstance(value, _Reported):
            if value.id in sent:
                return sent[value.id]
            stand_in = new_stand_in(value.id, value.state, self.mutate)
            self._free_when_dropped(stand_in, value.id)
            return stand_in
        if isinstance(value, dict):
            return type(value)(**{key: self._stand_ins_in(item, sent) for key, item in value.items()})
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._stand_ins_in(item, sent) for item in value)
        return value

    def _free_when_dropped(self, cache: Any, cache_id: int) -> None:
        weakref.finalize(cache, self._freed.append, cache_id)

    def take_freed(self) -> list[int]:
        """The ids of the stand-ins dropped since the last call (the ranks free them with the next)."""
        freed, self._freed[:] = list(self._freed), []
        return freed


def _stand_in_id(value: Any) -> int | None:
    found = list(stand_ins(value))
    return found[0]._tpcore_id if found else None


def _holds_tensors(cache: Any) -> bool:
    """Whether a cache holds any tensor already (filled, or allocated up front as a static cache is)."""
    return any(isinstance(item, torch.Tensor) and item.numel() for item in _tensors(cache))


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
