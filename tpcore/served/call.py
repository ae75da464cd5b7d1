"""One served call and the per-call state it carries, each state a codec: written in the caller, resolved on a rank.

A served forward travels as a :class:`Call`: the module and method to run, the inputs, and one field per piece
of state that the caller and the ranks keep in step. Each piece is a pair of classes in a module of its own,
the caller's half writing what the call carries and the rank's half resolving it:

==================  ===========================  ==============================  ============================
state               module                       written by (caller)             resolved by (rank)
==================  ===========================  ==============================  ============================
KV caches           :mod:`.caches`               ``CallerCaches.write``          ``RankCaches.resolve``
kept tensors        :mod:`.kept_tensors`         ``CallerKeptTensors.write``     ``RankKeptTensors.resolve``
config changes      :mod:`.config_changes`       ``CallerConfig.write``          ``apply_config_changes``
random state        :mod:`.random_state`         ``CallerRandomState.write``     ``RankRandomState.take``
==================  ===========================  ==============================  ============================

:class:`CallerState` and :class:`RankState` hold the two halves of every piece: the one place a new piece of
state is added on each side. The reply comes back the other way: the :func:`reporting_rank` reports the random
state and the caches' states, which the caller's halves read (``CallerRandomState.read``, ``CallerCaches.read``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tpcore.ranks.transfer import to_device
from tpcore.served.caches import CacheCalls, CacheRef, CacheState, CallerCaches, RankCaches
from tpcore.served.config_changes import CallerConfig, apply_config_changes
from tpcore.served.kept_tensors import CallerKeptTensors, RankKeptTensors
from tpcore.served.random_state import CallerRandomState, RandomState, RankRandomState

__all__ = ["Call", "CallerState", "Forward", "RankState", "reporting_rank"]


@dataclass(frozen=True)
class Call:
    """One served call: the forward of the model (or of its submodule at ``path``; or its ``method``, a multimodal
    encoder's ``get_image_features``) on ``args`` and ``kwargs`` (caches as :class:`~.caches.CacheRef`, kept
    tensors as :class:`~.kept_tensors.Kept`), with the caller's random state, the attributes of its config changed
    since the last call (``{sub-config path: {name: value}}``), and the ids of the caches and of the kept tensors
    the caller dropped. ``last_step``: the caller's ``generate()`` asks no step after this one (its
    ``max_new_tokens``-th), so the ranks guess none (:mod:`.lookahead`)."""

    path: str
    args: tuple
    kwargs: dict
    random_state: RandomState
    config_changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    caches_freed: tuple[int, ...] = ()
    method: str = ""
    kept_freed: tuple[int, ...] = ()
    last_step: bool = False


def reporting_rank(world_size: int) -> int:
    """The rank that tells the caller the state of the caches and the random state after a served call: the last,
    which does that while rank 0 sends the output (one rank alone: rank 0, which does both)."""
    return world_size - 1


class CallerState:
    """The caller's half of every per-call state: :meth:`write` makes a call, :meth:`read` takes its reply."""

    def __init__(self, config: Any, ranks: CacheCalls):
        self.random = CallerRandomState()
        self.caches = CallerCaches(ranks)
        self.kept = CallerKeptTensors()
        self.config = CallerConfig(config)

    def write(
        self, path: str, method: str, args: tuple, kwargs: dict, last_step: bool = False
    ) -> tuple[Call, dict[int, Any]]:
        """The :class:`Call` of ``path``'s forward (or ``method``) on ``args`` and ``kwargs``, its inputs on the CPU,
        and the caches it sends (id -> the caller's object, which :meth:`read` gives the ranks' state after)."""
        args, kwargs = to_device(self.kept.write((args, kwargs)), "cpu")
        sent: dict[int, Any] = {}
        args, kwargs = self.caches.write((args, kwargs), sent)
        call = Call(
            path,
            args,
            kwargs,
            self.random.write(),
            self.config.write(),
            tuple(self.caches.take_freed()),
            method,
            self.kept.take_freed(),
            last_step,
        )
        return call, sent

    def read(self, output: Any, random_state: RandomState, states: dict[int, CacheState], sent: dict[int, Any]) -> Any:
        """The caller's output of a call that succeeded: the ranks' random state taken, each cache a stand-in."""
        self.random.read(random_state)
        return self.caches.read(output, sent, states)

    def failed(self) -> None:
        """After a call that failed: the ranks may not have kept what it sent."""
        self.kept.reset()


@dataclass
class Forward:
    """A call resolved on a rank, ready to run: :meth:`run` is the forward on the rank's own objects."""

    target: Any
    args: tuple
    kwargs: dict
    model: nn.Module
    caches: RankCaches
    random: RankRandomState

    def run(self) -> Any:
        return self.target(*self.args, **self.kwargs)


class RankState:
    """A rank's half of every per-call state: what it keeps for the caller between calls (caches, kept tensors),
    :meth:`resolve` to make a call runnable, :meth:`report` for what the reporting rank sends back."""

    def __init__(self) -> None:
        self.caches = RankCaches()
        self.kept = RankKeptTensors()

    def resolve(self, call: Call, model: nn.Module, device: torch.device) -> Forward:
        """``call`` on ``model`` (on ``device``): the dropped caches and kept tensors freed, the config changes and
        the random state taken, the inputs on the device with every cache and kept tensor the rank's own."""
        self.caches.free(call.caches_freed)
        self.kept.free(call.kept_freed)
        apply_config_changes(model, call.config_changes)
        random = RankRandomState(device)
        random.take(call.random_state)
        inputs = (call.args, call.kwargs)  # on the CPU, as they arrived
        if device.type != "cpu":
            inputs = to_device(inputs, device)
        args, kwargs = self.caches.resolve(self.kept.resolve(inputs))
        target = model.get_submodule(call.path) if call.path else model
        if call.method:
            target = getattr(target, call.method)
        return Forward(target, args, kwargs, model, self.caches, random)

    def report(self, call: Call, forward: Forward) -> tuple[RandomState, dict[int, CacheState]]:
        """After ``call`` ran as ``forward``: the random state, and the state of each cache it sent or output."""
        sent = {ref.id for ref in _refs((call.args, call.kwargs))}
        return forward.random.report(), self.caches.states(sent)


def _refs(value: Any):
    if isinstance(value, CacheRef):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _refs(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _refs(item)
