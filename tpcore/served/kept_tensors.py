"""Kept tensors: large tensors the caller sends again unchanged travel as references to the ranks' copies.

``generate()`` of an encoder-decoder passes the encoder's output ``(batch, source length, hidden)`` to every
decoder step, and a caller may pass the same large input to many calls. Such a tensor, of at least
:data:`KEEP_BYTES`, sent a second time unchanged (the same object, its version counter the same: nothing
wrote into it) is kept by every rank, on its device; from the third call on only its id travels. When the
caller's tensor is dropped, or written into, the ranks' copies are freed with the next call. A tensor sent
once is never kept: nothing stays on the ranks for inputs used once.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from tpcore.ranks.transfer import each_item

__all__ = ["KEEP_BYTES", "CallerKeptTensors", "Kept", "RankKeptTensors"]

#: the smallest tensor worth keeping on the ranks (smaller ones cost less to send than to track)
KEEP_BYTES = 64 * 1024


class Kept(NamedTuple):
    """What travels in place of a kept tensor: its ``id``, and the ``tensor`` itself on the send that asks
    the ranks to keep it (``None`` after that)."""

    id: int
    tensor: Any = None


class RankKeptTensors:
    """On a rank: the tensors it keeps for the caller, by id. Every rank sees the same calls, so ids agree."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}

    def resolve(self, value: Any) -> Any:
        """``value`` with every :class:`Kept` inside replaced by its tensor (kept from now on if it comes with it)."""
        if isinstance(value, Kept):
            if value.tensor is not None:
                self.tensors[value.id] = value.tensor
            return self.tensors[value.id]
        return each_item(value, self.resolve, named_tuples=False)

    def free(self, ids: Iterable[int]) -> None:
        for tensor_id in ids:
            self.tensors.pop(tensor_id, None)


class _Seen(NamedTuple):
    ref: weakref.ref
    version: int
    kept_id: int | None  # the ranks' id once they keep it


class CallerKeptTensors:
    """On the caller: the large tensors sent so far (weakly), which of them the ranks keep, and the ids to free."""

    def __init__(self) -> None:
        self._seen: dict[int, _Seen] = {}
        self._ids = itertools.count(1)
        self._freed: list[int] = []

    def write(self, value: Any) -> Any:
        """``value`` with each large tensor sent before unchanged replaced by its :class:`Kept`."""
        if isinstance(value, torch.Tensor):
            return self._sent(value) if value.numel() * value.element_size() >= KEEP_BYTES else value
        return each_item(value, self.write, named_tuples=False)

    def _sent(self, tensor: torch.Tensor) -> Any:
        seen = self._seen.get(id(tensor))
        if seen is None or seen.ref() is not tensor or seen.version != tensor._version:
            self._forget(id(tensor))
            self._seen[id(tensor)] = _Seen(weakref.ref(tensor, self._dropped(id(tensor))), tensor._version, None)
            return tensor
        if seen.kept_id is None:
            kept_id = next(self._ids)
            self._seen[id(tensor)] = seen._replace(kept_id=kept_id)
            return Kept(kept_id, tensor)
        return Kept(seen.kept_id)

    def _dropped(self, key: int):
        def forget(ref: weakref.ref) -> None:
            seen = self._seen.get(key)
            if seen is not None and seen.ref is ref:
                self._forget(key)

        return forget

    def _forget(self, key: int) -> None:
        seen = self._seen.pop(key, None)
        if seen is not None and seen.kept_id is not None:
            self._freed.append(seen.kept_id)

    def reset(self) -> None:
        """After a failed call (the ranks may not have kept what it sent): every kept tensor is freed and
        the next sends start over."""
        for key in list(self._seen):
            self._forget(key)

    def take_freed(self) -> tuple[int, ...]:
        """The ids of kept tensors dropped or written into since the last call (freed with the next)."""
        freed, self._freed[:] = tuple(self._freed), []
        return freed
