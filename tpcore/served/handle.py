"""The served model: the caller's model object, its ``forward``, ``__call__`` and ``generate`` run by the ranks.

:func:`attach` gives the caller's model instance (its class unchanged) served methods, memory queries,
``deparallelize()``, moves that end the parallelization first, and a ``repr`` that begins with the
split; :class:`ParallelHandle` (``model._tpcore_handle``) holds the ranks and the plan.

Each call carries the caller's per-call state (:mod:`tpcore.served.call`: caches, kept tensors, config changes,
random state) to every rank and takes theirs back, so seeded sampling draws what the unsplit model draws and the
ranks never diverge. Inputs travel through the CPU; the outputs come back on the device of the first input
tensor. What the ranks run is :mod:`tpcore.served.lookahead`'s wrapper of :mod:`tpcore.served.rank_side`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import torch
from torch import nn

from tpcore.errors import WorkerDiedError, WorkerError
from tpcore.load.saving import save_gathered, stored_keys
from tpcore.load.skeleton import install_tensors
from tpcore.parallel.quantized_linear import localize_quantized, ready_quantized
from tpcore.plan import ShardPlan, bytes_summary
from tpcore.ranks.failures import reraise
from tpcore.ranks.process import RankPool, ranks_text
from tpcore.ranks.transfer import first_device, to_device
from tpcore.select import describe_policies
from tpcore.served import lookahead
from tpcore.served.caches import CacheCalls, CacheState, join_heads
from tpcore.served.call import Call, CallerState, reporting_rank
from tpcore.served.caller_threads import OneThreadWhileServing
from tpcore.served.rank_side import memory, memory_detail, shard_tensors

__all__ = ["ParallelHandle", "attach"]

_SERVED = ("forward",)  # generate() is the model's own, run here: its forward steps are served
#: moving the model ends the parallelization first, as in parallelformers
_MOVES = ("to", "cpu", "cuda")
#: the most bytes of whole tensors gathered in the caller at once (``save_pretrained``, ``deparallelize``)
GATHER_BYTES = 1 << 30
_ADDED = (
    "save_pretrained",
    "deparallelize",
    "memory_allocated",
    "memory_reserved",
    "memory_cached",
    "memory_peak",
    "extra_repr",
)


def attach(
    model: nn.Module,
    pool: RankPool,
    plan: ShardPlan,
    timeout: float,
    *,
    has_weights: bool,
    verbosity: str | None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Serve ``model`` from the ranks of ``pool`` (which hold its shards by ``plan``, in ``dtype`` where they
    were cast); print each rank's memory first when ``verbosity`` asks. Returns ``model``."""
    handle = ParallelHandle(model, pool, timeout, plan, has_weights=has_weights, dtype=dtype)
    if verbosity is not None:
        try:
            handle.print_memory(verbosity)
        except BaseException:
            pool.close(timeout=3.0)
            raise
    handle.attach()
    return model


class ParallelHandle:
    """The ranks behind a parallelized model; reached as ``model._tpcore_handle``, its split as ``.plan``."""

    def __init__(
        self,
        model: nn.Module,
        pool: RankPool,
        timeout: float,
        plan: ShardPlan,
        has_weights: bool = True,
        dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.pool = pool
        self.timeout = timeout
        self.plan = plan
        #: the caller's model holds real weights (not the meta ones of a checkpoint start)
        self.has_weights = has_weights
        #: what the ranks compute on and in, which the served model reports as its ``device`` and ``dtype``
        self.device = torch.device(pool.devices[0] if pool.devices else pool.device)
        self.dtype = dtype or next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)
        self.model_class = type(model)
        #: the caller's half of the per-call state (tpcore.served.call)
        self.state = CallerState(getattr(model, "config", None), CacheCalls(self.mutate_cache, self.cache_tensors))
        #: the caller's generate() works in one thread between the ranks' steps (tpcore.served.caller_threads)
        self.one_thread = OneThreadWhileServing(True)
        #: inside a served generate(): the forward steps it may still take, where its arguments bound them
        self._steps_left: int | None = None
        self._lock = threading.Lock()
        self._policies = describe_policies(plan.policies)

    def describe(self) -> str:
        """The split at a glance: ranks, backend and devices, policies and their plugins, bytes per rank."""
        placement = ranks_text(self.pool.world_size, self.pool.backend, self.pool.devices or [self.pool.device])
        state = "" if self.pool.alive else " (stopped)"
        return f"split over {placement}{state} by {self._policies}: {bytes_summary(self.plan)}"

    def __repr__(self) -> str:
        return f"ParallelHandle({self.plan.model_name} {self.describe()}; {self.pool!r})"

    def _extra_repr(self) -> str:
        """The served model's ``extra_repr``: its split first, then the model's own (``nn.Module.__repr__``
        puts it on the model's first line)."""
        own = type(self.model).extra_repr(self.model)
        return "\n".join(line for line in (f"tpcore: {self.describe()}", own) if line)

    def attach(self) -> None:
        model = self.model
        memory_reserved = functools.partial(self._memory, "reserved")
        added = {
            "_tpcore_handle": self,
            "extra_repr": self._extra_repr,
            "forward": functools.wraps(type(model).forward)(functools.partial(self.call, "")),
            **{name: functools.partial(self.move, name) for name in _MOVES},
            "deparallelize": self.deparallelize,
            "save_pretrained": self.save_pretrained,
            "memory_allocated": functools.partial(self._memory, "allocated"),
            "memory_reserved": memory_reserved,
            "memory_cached": memory_reserved,
            "memory_peak": functools.partial(self._memory, "peak"),
        }
        for name, value in added.items():
            setattr(model, name, value)
        model.__class__ = served_class(type(model))
        for path, module in self._served_submodules():
            module.forward = functools.wraps(type(module).forward)(functools.partial(self.call, path))
        for path, module, name in self._served_feature_methods():
            served = functools.partial(self.call, path, _method=name)
            setattr(module, name, functools.wraps(getattr(type(module), name))(served))

    def _served_feature_methods(self) -> list[tuple[str, nn.Module, str]]:
        """The multimodal encoders ``generate()`` calls itself (``base_model.get_image_features``), by path."""
        base = getattr(self.model, "base_model", None)
        if not isinstance(base, nn.Module):
            return []
        path = next((name for name, module in self.model.named_modules() if module is base), None)
        names = ("get_image_features", "get_video_features")
        return [(path, base, name) for name in names if path is not None and callable(getattr(type(base), name, None))]

    def _served_submodules(self) -> list[tuple[str, nn.Module]]:
        """The submodules that ``generate()`` calls itself (an encoder-decoder's encoder), by path."""
        get_encoder = getattr(self.model, "get_encoder", None)
        encoder = (
            get_encoder() if callable(get_encoder) and getattr(self.model.config, "is_encoder_decoder", False) else None
        )
        if not isinstance(encoder, nn.Module) or encoder is self.model:
            return []
        return [(name, module) for name, module in self.model.named_modules() if module is encoder][:1]

    @torch.compiler.disable  # nothing here to compile: under torch.compile the call runs as it is
    def call(self, path: str, *args, _method: str = "", **kwargs):
        """Run the forward of the model (of its submodule at ``path``) on the ranks, with the caller's
        random state and config; raise a rank's error as its own type.

        Tensors travel through the CPU; the output comes back on the device of the first input tensor.
        A cache passed in names the ranks' cache (:mod:`tpcore.served.caches`); a cache in the output is the
        caller's stand-in for the ranks' one.
        """
        device = first_device((args, kwargs))
        with self._lock:  # one call's state at a time
            request, sent = self.state.write(path, _method, args, kwargs, self._last_step(path, _method))
            try:
                output, random_state, states = self._serve(request)
            except BaseException:
                self.state.failed()
                raise
            output = self.state.read(output, random_state, states, sent)
        return output if device is None or device.type == "cpu" else to_device(output, device)

    @contextlib.contextmanager
    def generating(self, steps: int | None) -> Iterator[None]:
        """Inside a served ``generate()`` that takes at most ``steps`` forward steps (``None``: unknown), whose last
        call then says so (``Call.last_step``: the ranks guess no step after it)."""
        saved, self._steps_left = self._steps_left, steps
        try:
            yield
        finally:
            self._steps_left = saved

    def _last_step(self, path: str, method: str) -> bool:
        """Whether this call of the model's forward is the last step of the ``generate()`` it serves."""
        if path or method or self._steps_left is None:
            return False
        self._steps_left -= 1
        return self._steps_left == 0

    def mutate_cache(self, cache_id: int, part: str | None, method: str, args: tuple) -> CacheState:
        """Run a method of the ranks' cache ``cache_id`` that changes it; its state after."""
        with self._lock:
            return self._run(lookahead.mutate_cache, cache_id, part, method, args)

    def cache_tensors(self, cache_id: int, part: str | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's ``(keys, values)`` of the ranks' cache ``cache_id``, every head in order."""
        with self._lock:
            per_rank = self._run_on_all(lookahead.cache_tensors, cache_id, part)
        layers = zip(*per_rank, strict=True)  # per layer: each rank's (keys, values)
        return [tuple(join_heads(list(pieces)) for pieces in zip(*each, strict=True)) for each in layers]

    def _serve(self, request: Call) -> tuple:
        """``(output, random state, cache states)`` of a served call: rank 0's output and the reporting rank's
        states (:func:`tpcore.served.lookahead.serve`)."""
        reporter = reporting_rank(self.pool.world_size)
        with self._rank_errors_raised():
            replies = self.pool.run_some(lookahead.serve, request, ranks=sorted({0, reporter}), timeout=self.timeout)
        return replies[0] if reporter == 0 else (replies[0], *replies[1])

    def _run(self, function, *args):
        """``function`` on every rank; rank 0's result as soon as it is here (the others' replies are read with
        the next call: :meth:`RankPool.run_first`), a rank's error raised as its own type."""
        with self._rank_errors_raised():
            return self.pool.run_first(function, *args, timeout=self.timeout)

    def _run_on_all(self, function, *args) -> list:
        """``function`` on every rank; every rank's result, a rank's error raised as its own type."""
        with self._rank_errors_raised():
            return self.pool.run(function, *args, timeout=self.timeout)

    @contextlib.contextmanager
    def _rank_errors_raised(self) -> Iterator[None]:
        try:
            yield
        except WorkerError as error:
            reraise(error)
        except WorkerDiedError as error:
            message = f"{error} (the ranks are gone: call model.deparallelize() and parallelize again)"
            raise WorkerDiedError(message) from None

    def move(self, method: str, *args, **kwargs) -> nn.Module:
        """``model.to/cpu/cuda``: stop the ranks, then move the caller's (unsplit) model."""
        if not self.has_weights:
            raise RuntimeError(_no_weights_to_move(f"model.{method}()"))
        return getattr(self.deparallelize(), method)(*args, **kwargs)

    def _run_per_device(self, fn) -> dict:
        results = self.pool.run(fn, timeout=self.timeout)
        return {f"{self.pool.device}:{rank}": result for rank, result in enumerate(results)}

    def _memory(self, kind: str) -> dict[str, int]:
        return {device: figures[kind] for device, figures in self._run_per_device(memory).items()}

    def print_memory(self, verbosity: str) -> None:
        """Print each rank's memory: one line of allocated and reserved MiB, or the detailed figures."""
        if verbosity == "simple":
            for device, figures in self._run_per_device(memory).items():
                mib = {kind: figures[kind] / 2**20 for kind in ("allocated", "reserved")}
                print(f"tpcore {device}: allocated {mib['allocated']:.1f} MiB, reserved {mib['reserved']:.1f} MiB")
        else:
            for device, detail in self._run_per_device(memory_detail).items():
                print(f"tpcore {device}: {detail}")

    def gathered(self, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        """The whole tensors ``names``, a group of about :data:`GATHER_BYTES` at a time, assembled from every
        rank's parts: no process holds more than a group beside its own share."""
        group: list[str] = []
        for name in [*names, None]:
            if name is not None:
                group.append(name)
            size = sum(self.plan.tensor_bytes(each) for each in group)
            if group and (name is None or size >= GATHER_BYTES):
                with self._lock:
                    parts = self.pool.run(shard_tensors, group, timeout=self.timeout)
                yield {each: self.plan.assemble(each, [part[each] for part in parts]) for each in group}
                group = []

    def save_pretrained(self, directory: str | os.PathLike, **options) -> None:
        """``model.save_pretrained``: the caller's own where it holds the weights; else the ranks' shards
        gathered and written a file at a time (:func:`tpcore.load.saving.save_gathered`)."""
        if self.has_weights:
            getattr(self.model_class, "save_pretrained")(self.model, directory, **options)  # noqa: B009  (a transformers model)
            return
        keys = stored_keys(self.model)  # a quantized layer's tensors under the names its format's files use
        groups = (
            {keys.get(name, name): tensor for name, tensor in group.items()}
            for group in self.gathered(self._saved_names())
        )
        save_gathered(self.model, groups, directory)

    def _saved_names(self) -> list[str]:
        """The tensors a checkpoint holds: the plan's (first names) that the state dict has (no buffer its
        constructor computes)."""
        saved = set(self.model.state_dict(keep_vars=True))
        return [name for name in self.plan.shapes if name in saved]

    def deparallelize(self) -> nn.Module:
        """Stop the ranks and give the model its own methods back; it runs unsplit again. A model started
        from a checkpoint first takes its weights, gathered from the ranks' shards."""
        if not self.has_weights:
            for tensors in self.gathered(self._saved_names()):
                install_tensors(self.model, tensors)
            localize_quantized(self.model, 0, 1)  # its quantized layers (as stored) compute whole from here on
            ready_quantized(self.model)
            self.has_weights = True
        return self.detach()

    def detach(self) -> nn.Module:
        """Stop the ranks and give the model its own methods back, as they are: a model started from a
        checkpoint keeps its parameters on meta (:meth:`deparallelize` gathers them first)."""
        self.pool.close()
        self.model.__class__ = self.model_class
        for name in (*_SERVED, *_MOVES, *_ADDED, "_tpcore_handle"):
            self.model.__dict__.pop(name, None)
        for _, module in self._served_submodules():
            module.__dict__.pop("forward", None)
        for _, module, name in self._served_feature_methods():
            module.__dict__.pop(name, None)
        return self.model


def _no_weights_to_move(what: str) -> str:
    return (
        f"{what}: this model was parallelized from a checkpoint, so this process holds no weights to move "
        "(its ranks serve on); call model.deparallelize() and load it with from_pretrained"
    )


def _served_apply(model: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` of a served model, which a wrapper's move reaches past ``model.to`` (a
    ``SentenceTransformer`` moved to its device): where this process holds no weights (a checkpoint start),
    a move to the device and dtype the ranks already compute on and in is nothing to do; any other is refused.
    """
    handle: ParallelHandle = model.__dict__["_tpcore_handle"]
    if handle.has_weights:
        return handle.model_class._apply(model, fn, recurse)
    probe = torch.empty(0, dtype=handle.dtype, device=handle.device)
    moved = fn(probe)
    if moved.device == probe.device and moved.dtype == probe.dtype:
        return model
    raise RuntimeError(_no_weights_to_move(f"moving to {moved.device}, {moved.dtype}"))


def _served_generate(model_class: type):
    """The model's own ``generate``, run with the caller in one intra-op thread (:mod:`.caller_threads`)."""
    own = getattr(model_class, "generate")  # noqa: B009  (a transformers model class)

    @functools.wraps(own)
    def generate(self, *args, **kwargs):
        handle = self.__dict__["_tpcore_handle"]
        with handle.one_thread(), handle.generating(_generate_steps(self, kwargs)):
            return own(self, *args, **kwargs)

    return generate


#: generate() arguments under which a new token may take other than one forward step (candidates checked at once)
_NOT_ONE_STEP_A_TOKEN = ("assistant_model", "prompt_lookup_num_tokens", "custom_generate", "assistant_early_exit")


def _generate_steps(model: nn.Module, kwargs: dict) -> int | None:
    """The forward steps a ``generate(**kwargs)`` takes at most: its ``max_new_tokens`` (of the call, else of its
    generation config), one step a token; ``None`` where that is not known. An estimate off by one costs a
    guessed step or saves none, never an output."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if any(kwargs.get(key, getattr(config, key, None)) is not None for key in _NOT_ONE_STEP_A_TOKEN):
        return None
    steps = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


_SERVED_CLASSES: dict[type, type] = {}


def served_class(model_class: type) -> type:
    """A subclass of ``model_class`` (its name, module and everything else its own) whose ``device`` and
    ``dtype`` are those the ranks compute on and in: a model loaded from a checkpoint holds no weights here,
    yet ``pipeline()``, ``inputs.to(model.device)`` and ``generate()`` need a device."""
    if model_class not in _SERVED_CLASSES:
        namespace = {
            "__module__": model_class.__module__,
            "__qualname__": model_class.__qualname__,
            "__doc__": model_class.__doc__,
            "device": property(lambda self: self._tpcore_handle.device),
            "dtype": property(lambda self: self._tpcore_handle.dtype),
            "_apply": _served_apply,
        }
        if callable(getattr(model_class, "generate", None)):
            namespace["generate"] = _served_generate(model_class)
        _SERVED_CLASSES[model_class] = type(model_class.__name__, (model_class,), namespace)
    return _SERVED_CLASSES[model_class]
