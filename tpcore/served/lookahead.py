"""On the ranks: the next greedy decode step, computed while the caller runs ``generate()``'s own work.

In the caller's loop a decode step is serial: the ranks' forward, the reply, the caller's share of the step
(logits processors, stopping criteria, streamer, the next token), then the next call. After a *decode-shaped*
call (input ids, a cache the ranks hold, positions and a mask; nothing else that changes from step to step),
every rank takes the greedy guess, the argmax of the last position's logits (which every rank holds whole and
alike: they are all-gathered), and once it has replied runs the forward that the next call would ask for if
the caller picks that token: ``input_ids`` the guess, ``position_ids`` and ``cache_position`` one further,
``attention_mask`` one column of ones longer, the same cache and every other argument as before.

When the next call is exactly that one (its tensors equal, no config change, no cache freed), the stored output
answers it. When it is not (sampling drew another token, a finished row got the pad token, the caller changed
something, another cache's call), the cache gets back the very tensors it held before the guess, and the call
runs as usual: the caller sees the unsplit model's outputs either way. Any other use of the ranks' caches
(:func:`mutate_cache`, :func:`cache_tensors`) drops a pending guess first.

A guess costs one forward of the ranks' time; it is only worth it while guesses hit. After a miss (a prediction
not asked for) no guess runs until a prediction (still made, for free) matches the call that comes; this is kept
apart for the guesses after a call that started its cache (a prefill: ``generate()`` asks for its first decode
step next, a server for its running batch's step). A row given another token than its argmax
(the pad token of a row that finished in a batch) is guessed that token again at the next step. Guesses run only
where dropping one is exact: caches whose every layer is a ``DynamicLayer`` (not sliding, not linear), a model in
eval mode, a forward that drew no random numbers. A call that comes while a guess runs waits for it (one decode
step at most). No guess follows the step a ``generate()`` takes last by its ``max_new_tokens`` (the call says so:
``Call.last_step``), which is never asked for; a generation that ends earlier (end of sequence, a stop string)
leaves one guess that the next call waits for. A guess that raises (out of memory) is taken back and turns the
lookahead off on that rank. ``TPCORE_LOOKAHEAD=0`` in the environment the ranks start from turns it off.

The lookahead is a wrapper: :func:`serve`, :func:`mutate_cache` and :func:`cache_tensors` are the functions of
:mod:`tpcore.served.rank_side` that the caller sends, with the guess taken, kept or dropped around them; the
guessed step runs as the rank's idle work (:attr:`~tpcore.ranks.worker.RankContext.idle_work`), after its reply.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tpcore.ranks.process import RankContext
from tpcore.ranks.transfer import to_device
from tpcore.served import rank_side
from tpcore.served.caches import CacheRef, CacheState, RankCaches
from tpcore.served.call import Call, Forward

__all__ = [
    "ENABLED_ENV",
    "Guess",
    "Lookahead",
    "Prediction",
    "cache_tensors",
    "decode_shaped",
    "forward_names",
    "mutate_cache",
    "predicted_call",
    "serve",
]

#: ``0`` turns the lookahead off (read by each rank when it first serves a call)
ENABLED_ENV = "TPCORE_LOOKAHEAD"
#: the tensors of a decode-shaped call, each with how the next step's follows from it
_STEPPED = ("input_ids", "position_ids", "cache_position", "attention_mask")
_PLAIN = (bool, int, float, str, type(None))

logger = logging.getLogger("tpcore.served.lookahead")


def decode_shaped(call: Any, names: tuple[str, ...] = ()) -> tuple[CacheRef, dict[str, Any]] | None:
    """For a decode-shaped forward ``call``: its cache and its arguments by name (the positional ones named by
    ``names``, the forward's parameters). Decode-shaped: ``input_ids``, a cache the ranks hold, the other tensors
    of :data:`_STEPPED`, plain values. Any other call: ``None``."""
    if call.path or call.method or call.config_changes or len(call.args) > len(names):
        return None
    kwargs = {**dict(zip(names[: len(call.args)], call.args, strict=True)), **call.kwargs} if call.args else call.kwargs
    ids, cache = kwargs.get("input_ids"), None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    for key, value in kwargs.items():
        if isinstance(value, CacheRef):
            if cache is not None:
                return None
            cache = value
        elif isinstance(value, torch.Tensor):
            if key not in _STEPPED or (key == "attention_mask" and value.dim() != 2):
                return None
        elif not isinstance(value, _PLAIN):
            return None
    return (cache, kwargs) if cache is not None else None


def forward_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The names of ``model``'s forward parameters that a positional argument can fill, in order."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = inspect.signature(model.forward).parameters.values()
    return tuple(parameter.name for parameter in parameters if parameter.kind in positional)


def predicted_call(kwargs: dict[str, Any], guess: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments of the decode step after the one of ``kwargs`` if the caller takes ``guess``
    ``(batch,)``: ids ``(batch, 1)``, positions one past the last, the mask one column of ones longer."""
    following: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "input_ids":
            value = guess[:, None].to(value.dtype)
        elif key == "position_ids":
            value = value[..., -1:] + 1
        elif key == "cache_position":
            value = value[-1:] + 1
        elif key == "attention_mask":
            value = torch.cat([value, value.new_ones(value.shape[0], 1)], dim=-1)
        elif isinstance(value, CacheRef):
            value = CacheRef(value.id)  # held by the ranks from now on: no template
        following[key] = value
    return following


def _same(expected: dict[str, Any], got: dict[str, Any]) -> bool:
    if expected.keys() != got.keys():
        return False
    for key, value in expected.items():
        other = got[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(other, torch.Tensor) or value.dtype != other.dtype or value.shape != other.shape:
                return False
            if not torch.equal(value, other):
                return False
        elif type(value) is not type(other) or value != other:
            return False
    return True


def _droppable(cache: Any) -> bool:
    """Whether a guessed step can be taken back from ``cache`` exactly: every layer a filled ``DynamicLayer``."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None) or ()
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


class Prediction(NamedTuple):
    """The call expected after a served one: its keyword arguments, the id of its cache, and whether the call it
    follows started that cache."""

    kwargs: dict[str, Any]
    cache_id: int
    after_start: bool


@dataclass
class Guess:
    """A guessed step run on a rank: the call it answers, the cache it grew, each layer's ``(keys, values)``
    before it (the tensors themselves: a ``DynamicLayer`` grows into new ones), and the output."""

    call: dict[str, Any]
    cache_id: int
    cache: Any
    before: list[tuple[torch.Tensor, torch.Tensor]]
    output: Any

    def take_back(self) -> None:
        """The cache as it was before the guess."""
        for layer, (keys, values) in zip(self.cache.layers, self.before, strict=True):
            layer.keys, layer.values = keys, values


class Lookahead:
    """On a rank: the prediction made from the last served call, the guessed step run from it, and whether
    guesses have been hitting. Every rank sees the same calls and logits, so every rank decides alike."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = os.environ.get(ENABLED_ENV, "1") != "0" if enabled is None else enabled
        self.prediction: Prediction | None = None
        self.pending: Guess | None = None
        # whether the last prediction matched the call that came, apart for predictions made after a call that
        # started its cache (a prefill: generate()'s first decode step follows, a server's batch step may not)
        self.hitting = {False: True, True: True}
        self.names: tuple[str, ...] | None = None  # the served model's forward parameters, by position
        self.argmax: torch.Tensor | None = None  # (batch,) the last step's greedy tokens
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None  # rows not given their argmax, and their tokens
        self.run_count = 0
        self.used_count = 0

    def shape(self, call: Any, model: torch.nn.Module) -> tuple[CacheRef, dict[str, Any]] | None:
        """:func:`decode_shaped` of ``call`` to ``model``'s forward (``None`` while the lookahead is off)."""
        if not self.enabled:
            return None
        if self.names is None:
            self.names = forward_names(model)
        return decode_shaped(call, self.names)

    def take(self, call: Any, shaped: tuple[CacheRef, dict[str, Any]] | None) -> Any:
        """The stored output if ``call`` (its :meth:`shape`: ``shaped``) is the guessed step; else ``None``, with
        any pending guess dropped.

        Whether a step on a cache the ranks hold was the predicted one (a guess run or not) decides whether the
        next guess of that kind runs; a call that starts a cache (a new ``generate()``) or is no decode step leaves
        that as is."""
        prediction, self.prediction = self.prediction, None
        matches, self.held = False, None
        if prediction is not None and shaped is not None:
            cache_ref, kwargs = shaped
            matches = prediction.cache_id not in call.caches_freed and _same(prediction.kwargs, kwargs)
            if matches or cache_ref.template is None:
                self.hitting[prediction.after_start] = matches
            self._note_held_rows(cache_ref.id == prediction.cache_id, kwargs["input_ids"])
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if matches:
            self.used_count += 1
            return pending.output
        pending.take_back()
        return None

    def _note_held_rows(self, same_cache: bool, ids: torch.Tensor) -> None:
        """The rows whose token the caller did not take from the argmax (a finished row's pad token): the next guess
        gives them that token again."""
        argmax, self.argmax = self.argmax, None
        if same_cache and argmax is not None and ids.shape == (argmax.shape[0], 1):
            self.held = (ids[:, 0] != argmax, ids[:, 0])

    def drop(self) -> None:
        """Take back a pending guess, forget the prediction (the caches are about to be used otherwise): for the
        guesses of its kind, a miss."""
        if self.prediction is not None:
            self.hitting[self.prediction.after_start] = False
        self.prediction = self.argmax = self.held = None
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.take_back()

    def predict(
        self,
        shaped: tuple[CacheRef, dict[str, Any]] | None,
        output: Any,
        caches: RankCaches,
        model: torch.nn.Module,
        random_moved: Callable[[], bool],
    ) -> bool:
        """After a call (its :meth:`shape`: ``shaped``) gave ``output``: predict the next call; ``True`` if a guessed
        step should run now. ``random_moved``: whether that forward drew random numbers (then a guess would not be
        that step)."""
        self.argmax = None
        if shaped is None or model.training:
            return False
        cache_ref, kwargs = shaped
        logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            return False
        if not _droppable(caches.caches.get(cache_ref.id)) or random_moved():
            return False
        self.argmax = guess = logits[:, -1].argmax(-1).cpu()  # the calls' tensors arrive on the CPU
        if self.held is not None and self.held[0].shape == guess.shape:
            guess = torch.where(self.held[0], self.held[1].to(guess.dtype), guess)
        after_start = cache_ref.template is not None
        self.prediction = Prediction(predicted_call(kwargs, guess), cache_ref.id, after_start)
        return self.hitting[after_start]

    def run(self, model: torch.nn.Module, caches: RankCaches, device: torch.device, shared: Callable[[], Any]) -> None:
        """Run the predicted step on ``device`` (inside ``shared()``: rank 0's gathered outputs into shared memory)
        and keep it."""
        if self.prediction is None:
            return
        kwargs, cache_id, _ = self.prediction
        cache = caches.caches[cache_id]
        before = [(layer.keys, layer.values) for layer in cache.layers]
        guess = Guess(kwargs, cache_id, cache, before, output=None)
        try:
            with torch.inference_mode(), shared():
                guess.output = model(**caches.resolve(to_device(kwargs, device)))
        except Exception as error:  # the guess is only an optimization: take it back and stop guessing
            guess.take_back()
            self.prediction, self.enabled = None, False
            logger.warning("the lookahead is off on this rank after a guessed step failed: %r", error)
            return
        self.pending = guess
        self.run_count += 1


# -- the wrapper: what the caller sends to the ranks ---------------------------------------------------------------


def rank_lookahead(context: RankContext) -> Lookahead:
    """This rank's :class:`Lookahead` (made at its first served call)."""
    lookahead = context.store.get("lookahead")
    if lookahead is None:
        lookahead = context.store["lookahead"] = Lookahead()
    return lookahead


def serve(context: RankContext, call: Call):
    """:func:`tpcore.served.rank_side.serve`, answered from the step guessed after the last call when ``call`` is that
    step, leaving the next guess to run once the rank has replied."""
    lookahead, model = rank_lookahead(context), context.store["model"]
    shaped = lookahead.shape(call, model)
    guessed = lookahead.take(call, shaped)

    def compute(forward: Forward) -> Any:
        output = guessed if guessed is not None else forward.run()
        if not call.last_step and lookahead.predict(shaped, output, forward.caches, model, forward.random.moved):
            shared = rank_side.shared_outputs(context)
            context.idle_work = functools.partial(lookahead.run, model, forward.caches, context.device, shared)
        return output

    return rank_side.serve(context, call, compute)


def mutate_cache(context: RankContext, cache_id: int, part: str | None, method: str, args: tuple) -> CacheState | None:
    """:func:`tpcore.served.rank_side.mutate_cache`, a pending guess taken back first."""
    rank_lookahead(context).drop()
    return rank_side.mutate_cache(context, cache_id, part, method, args)


def cache_tensors(context: RankContext, cache_id: int, part: str | None) -> list[tuple[Any, Any]]:
    """:func:`tpcore.served.rank_side.cache_tensors`, a pending guess taken back first."""
    rank_lookahead(context).drop()
    return rank_side.cache_tensors(context, cache_id, part)
