"""The caller's random state, carried to the ranks with every served call and back from one of them.

Sampling must draw what the unsplit model draws, and every rank must draw the same. Two generators
matter: the CPU's, whose state travels each way only when it changed (the caller sampled since the
last call; the ranks' forward drew: a decode step of greedy search carries none), and, on CUDA ranks, the CUDA
generator of the rank's device, which follows the caller's CUDA generator (of its current device):

- When the caller's CUDA is initialised, that generator's state travels like the CPU's.
- When it is not (a CPU caller of CUDA ranks), the caller's CUDA generator is only the seed it will
  start from: the ranks' CUDA generators are re-seeded with it whenever the caller seeded since the
  last call (``torch.manual_seed``, ``torch.seed``, ``torch.cuda.manual_seed[_all]``, the same seed
  again included), and otherwise continue from the state the ranks returned after the last call. So
  ``torch.manual_seed(s)`` then two sampled ``generate()`` give two different draws, each the one
  an unsplit model on ``cuda:0`` gives after the same seeding.

torch queues CUDA seedings until CUDA is initialised (``torch.cuda._lazy_seed_tracker``); that is
where a seeding is seen. A torch without it falls back to ``torch.initial_seed()``: re-seeding
happens when that number changes, so seeding the same number again is then not seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CallerRandomState", "RandomState", "RankRandomState", "device_generator"]


@dataclass(frozen=True)
class RandomState:
    """What travels with a call: the CPU generator's state (``None``: the same as the other side's), and
    for the CUDA generator a state (``uint8`` tensor), a seed to start it from (``int``), or ``None``
    (nothing to carry)."""

    cpu: torch.Tensor | None
    cuda: torch.Tensor | int | None = None

    def apply(self, cuda_generator: torch.Generator | None) -> None:
        """On a rank: take this state (``cuda_generator``: the rank's device generator, or ``None``)."""
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        if cuda_generator is None or self.cuda is None:
            return
        if isinstance(self.cuda, int):
            cuda_generator.manual_seed(self.cuda)
        else:
            cuda_generator.set_state(self.cuda)

    @classmethod
    def of(cls, cuda_generator: torch.Generator | None, before: torch.Tensor | None = None) -> RandomState:
        """On a rank: this process's state after a call, to send back (the CPU's only if it is not ``before``)."""
        cpu = torch.get_rng_state()
        unchanged = before is not None and same_state(cpu, before)
        return cls(None if unchanged else cpu, None if cuda_generator is None else cuda_generator.get_state())


def same_state(state: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two CPU generator states (``uint8`` tensors of 5 KB) are equal: their bytes compared, which costs
    a third of ``torch.equal`` where a call runs on caches left cold."""
    return state.numpy().tobytes() == other.numpy().tobytes()


def device_generator(device: torch.device) -> torch.Generator | None:
    """The default generator that sampling on ``device`` uses; ``None`` for the CPU's (it is global)."""
    if device.type != "cuda":
        return None
    torch.cuda.init()  # fills torch.cuda.default_generators
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


class RankRandomState:
    """On a rank, for one call: the caller's state taken (:meth:`take`), whether the forward drew random numbers
    (:meth:`moved`), and the state to send back (:meth:`report`)."""

    def __init__(self, device: torch.device):
        self.generator = device_generator(device)
        self.cpu_before: torch.Tensor | None = None
        self.cuda_before: torch.Tensor | None = None

    def take(self, state: RandomState) -> None:
        """Take the caller's ``state``, and note where both generators stand before the forward."""
        state.apply(self.generator)
        self.cpu_before = torch.get_rng_state()
        self.cuda_before = None if self.generator is None else self.generator.get_state()

    def moved(self) -> bool:
        """Whether the forward since :meth:`take` drew from the CPU generator or from the rank's CUDA one."""
        if not same_state(torch.get_rng_state(), self.cpu_before):
            return True
        return self.generator is not None and not same_state(self.generator.get_state(), self.cuda_before)

    def report(self) -> RandomState:
        """The state after the forward, to send back (the CPU's only where it moved)."""
        return RandomState.of(self.generator, self.cpu_before)


class CallerRandomState:
    """The caller's side: the state to send with each call (:meth:`write`), and the ranks' state taken back
    (:meth:`read`; every rank holds the same, the reporting rank of :mod:`tpcore.served.call` sends it)."""

    _NEVER = object()

    def __init__(self):
        self._seeding = self._NEVER  # the caller's CUDA seeding the ranks last followed
        self._sent_seeding = self._NEVER
        self._cuda_state: torch.Tensor | None = None  # the ranks' CUDA state after the last call
        self._cpu_in_step: torch.Tensor | None = None  # the CPU state the ranks hold too (None: not known)
        self._cpu_sent: torch.Tensor | None = None

    def write(self) -> RandomState:
        now = torch.get_rng_state()
        in_step, self._cpu_in_step = self._cpu_in_step, None  # known again once the call succeeds
        self._cpu_sent = now
        cpu = None if in_step is not None and same_state(now, in_step) else now
        if torch.cuda.is_initialized():
            return RandomState(cpu, torch.cuda.get_rng_state())
        seeding, seed = latest_cuda_seeding()
        self._sent_seeding = seeding
        if seeding != self._seeding or self._cuda_state is None:
            return RandomState(cpu, seed)
        return RandomState(cpu, self._cuda_state)

    def read(self, state: RandomState) -> None:
        """Take the ranks' state after a call that succeeded."""
        if state.cpu is not None:
            torch.set_rng_state(state.cpu)
        self._cpu_in_step = state.cpu if state.cpu is not None else self._cpu_sent
        if state.cuda is None:
            return
        if torch.cuda.is_initialized():
            torch.cuda.set_rng_state(state.cuda)
        else:
            self._cuda_state = state.cuda
            self._seeding = self._sent_seeding


#: the seed a generator starts from (read once: a served call asks for it each time)
_DEFAULT_SEED = torch.Generator().initial_seed()


def latest_cuda_seeding() -> tuple[object, int]:
    """``(seeding, seed)``: the caller's latest CUDA seeding queued while CUDA is not initialised (an
    object that is new for every seeding), and the seed it gives the current device's generator."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    if tracker is None:
        seed = torch.initial_seed()
        return seed, seed
    calls = [call for call in getattr(tracker, "call_order", ()) if call is not None]
    if not calls:
        return None, _DEFAULT_SEED  # CUDA generators start from the default seed
    latest = calls[-1]  # (callback, traceback); the last one decides the current device's seed
    return latest, _seed_of(latest[0])


def _seed_of(callback) -> int:
    """The seed a queued seeding callback holds (``torch.initial_seed()`` if it cannot be read)."""
    code, closure = getattr(callback, "__code__", None), getattr(callback, "__closure__", None)
    if code is not None and closure and "seed" in code.co_freevars:
        seed = closure[code.co_freevars.index("seed")].cell_contents
        if isinstance(seed, int):
            return seed
    return torch.initial_seed()
