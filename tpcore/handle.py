"""The served model: the caller's model object, its ``forward``, ``__call__`` and ``generate`` run by the ranks.

:func:`attach` gives the caller's model instance (its class unchanged) served methods, memory queries,
``deparallelize()``, moves that end the parallelization first, and a ``repr`` that begins with the
split; :class:`ParallelHandle` (``model._tpcore_handle``) holds the ranks and the plan.

Each call carries the caller's random state (:mod:`tpcore.ranks.rng`) to every rank and takes rank
0's back, so seeded sampling draws what the unsplit model draws and the ranks never diverge. Inputs
travel through the CPU; the outputs come back on the device of the first input tensor.
"""

from __future__ import annotations

import functools
import threading

from torch import nn

from tpcore.errors import WorkerDiedError, WorkerError
from tpcore.plan import ShardPlan, bytes_summary
from tpcore.rank_side import memory, memory_detail, serve
from tpcore.ranks.failures import reraise
from tpcore.ranks.process import RankPool, ranks_text
from tpcore.ranks.rng import CallerRandomState
from tpcore.ranks.transfer import first_device, to_device
from tpcore.select import describe_policies

__all__ = ["ParallelHandle", "attach"]

_SERVED = ("forward", "generate")
#: moving the model ends the parallelization first, as in parallelformers
_MOVES = ("to", "cpu", "cuda")
_ADDED = ("deparallelize", "memory_allocated", "memory_reserved", "memory_cached", "memory_peak", "extra_repr")


def attach(
    model: nn.Module, pool: RankPool, plan: ShardPlan, timeout: float, *, has_weights: bool, verbosity: str | None
) -> nn.Module:
    """Serve ``model`` from the ranks of ``pool`` (which hold its shards by ``plan``); print each rank's
    memory first when ``verbosity`` asks. Returns ``model``."""
    handle = ParallelHandle(model, pool, timeout, plan, has_weights=has_weights)
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

    def __init__(self, model: nn.Module, pool: RankPool, timeout: float, plan: ShardPlan, has_weights: bool = True):
        self.model = model
        self.pool = pool
        self.timeout = timeout
        self.plan = plan
        #: the caller's model holds real weights (not the meta ones of a checkpoint start)
        self.has_weights = has_weights
        self.random = CallerRandomState()
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
            **{
                name: functools.partial(self.call, name)
                for name in _SERVED
                if name == "forward" or hasattr(type(model), name)
            },
            **{name: functools.partial(self.move, name) for name in _MOVES},
            "deparallelize": self.deparallelize,
            "memory_allocated": functools.partial(self._memory, "allocated"),
            "memory_reserved": memory_reserved,
            "memory_cached": memory_reserved,
            "memory_peak": functools.partial(self._memory, "peak"),
        }
        for name, value in added.items():  # instance attributes: the model's class is untouched
            setattr(model, name, value)

    def call(self, method: str, *args, **kwargs):
        """Run ``model.<method>(*args, **kwargs)`` on the ranks; raise a rank's error as its own type.

        Tensors travel through the CPU; the output comes back on the device of the first input tensor.
        """
        device = first_device((args, kwargs))
        args, kwargs = to_device((args, kwargs), "cpu")
        with self._lock:  # one call's random state at a time
            try:
                results = self.pool.run(serve, method, args, kwargs, self.random.outgoing(), timeout=self.timeout)
            except WorkerError as error:
                reraise(error)
            except WorkerDiedError as error:
                message = f"{error} (the ranks are gone: call model.deparallelize() and parallelize again)"
                raise WorkerDiedError(message) from None
            output, random_state = results[0]
            self.random.adopt(random_state)
        return output if device is None or device.type == "cpu" else to_device(output, device)

    def move(self, method: str, *args, **kwargs) -> nn.Module:
        """``model.to/cpu/cuda``: stop the ranks, then move the caller's (unsplit) model."""
        if not self.has_weights:
            raise RuntimeError(
                f"model.{method}(): this model was parallelized from a checkpoint, so this process holds no "
                "weights to move (its ranks serve on); call model.deparallelize() and load it with from_pretrained"
            )
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

    def deparallelize(self) -> nn.Module:
        """Stop the ranks and give the model its own methods back; it runs unsplit again (a model
        started from a checkpoint has no weights in the caller: load it with ``from_pretrained``)."""
        self.pool.close()
        for name in (*_SERVED, *_MOVES, *_ADDED, "_tpcore_handle"):
            self.model.__dict__.pop(name, None)
        return self.model
