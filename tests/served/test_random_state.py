"""The random state a served call carries: the CUDA generator of CUDA ranks follows the caller's.

No CUDA here: CPU generators stand in for the ranks' CUDA generators (the same ``torch.Generator``
calls), and the caller's own CUDA generator, where it is initialised, is a CPU generator patched
in. The caller's seedings are real ``torch.manual_seed`` calls, queued by torch as on any machine
whose CUDA is not initialised yet.
"""

from __future__ import annotations

import pytest
import torch

from tpcore.served.random_state import CallerRandomState, RandomState, device_generator


class CudaRanks:
    """``world_size`` ranks as :func:`tpcore.parallelize._serve` treats them, each drawing ``draws``
    numbers from its device generator (a CPU generator here) as sampling would."""

    def __init__(self, world_size: int = 2):
        self.generators = [torch.Generator().manual_seed(100 + rank) for rank in range(world_size)]  # any state
        self.caller = CallerRandomState()

    def sample(self, draws: int = 8, fail: bool = False) -> torch.Tensor:
        state = self.caller.write()
        replies = []
        for generator in self.generators:
            state.apply(generator)
            replies.append((torch.randint(10**6, (draws,), generator=generator), RandomState.of(generator)))
        for drawn, _ in replies[1:]:
            assert torch.equal(drawn, replies[0][0])  # the ranks never diverge
        if fail:  # the call raised: nothing comes back, and one rank has drawn more than the others
            torch.rand(3, generator=self.generators[1])
            raise RuntimeError("a rank failed")
        self.caller.read(replies[0][1])
        return replies[0][0]


def unsplit(generator: torch.Generator, draws: int = 8) -> torch.Tensor:
    return torch.randint(10**6, (draws,), generator=generator)


@pytest.fixture
def cuda_not_initialised(monkeypatch):
    """A caller whose CUDA is not initialised and that has not seeded yet (earlier tests' seedings forgotten)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_lazy_seed_tracker", type(torch.cuda._lazy_seed_tracker)())


def test_a_cpu_caller_of_cuda_ranks_gets_the_unsplit_draws_after_every_seeding(cuda_not_initialised):
    ranks, reference = CudaRanks(), torch.Generator()  # reference: the unsplit model's cuda:0 generator
    first, second = ranks.sample(), ranks.sample()  # never seeded: CUDA's default seed
    assert torch.equal(first, unsplit(reference)) and torch.equal(second, unsplit(reference))

    torch.manual_seed(1234)
    reference.manual_seed(1234)
    first, second = ranks.sample(), ranks.sample()
    assert not torch.equal(first, second)  # the second draw continues from the first
    assert torch.equal(first, unsplit(reference)) and torch.equal(second, unsplit(reference))

    torch.manual_seed(1234)  # the same seed again starts over
    reference.manual_seed(1234)
    assert torch.equal(ranks.sample(), unsplit(reference))

    torch.cuda.manual_seed(99)  # seeding CUDA alone is seen too
    reference.manual_seed(99)
    assert torch.equal(ranks.sample(), unsplit(reference))
    assert torch.initial_seed() == 1234  # the CPU generator kept its own seed


def test_a_failed_call_leaves_the_ranks_in_step_with_the_last_good_state(cuda_not_initialised):
    ranks, reference = CudaRanks(), torch.Generator()
    torch.manual_seed(7)
    reference.manual_seed(7)
    assert torch.equal(ranks.sample(), unsplit(reference))
    after_first = reference.get_state()
    with pytest.raises(RuntimeError, match="a rank failed"):
        ranks.sample(fail=True)
    reference.set_state(after_first)  # the ranks start again from rank 0's state after the last good call
    assert torch.equal(ranks.sample(), unsplit(reference))


def test_a_caller_with_cuda_initialised_sends_its_cuda_state_and_takes_rank_0s_back(monkeypatch):
    caller_cuda = torch.Generator().manual_seed(5)  # the caller's own (initialised) CUDA generator
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: caller_cuda.get_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: caller_cuda.set_state(state))
    ranks, reference = CudaRanks(3), torch.Generator().manual_seed(5)
    assert torch.equal(ranks.sample(), unsplit(reference))
    assert torch.equal(caller_cuda.get_state(), reference.get_state())  # the caller continues where rank 0 left
    caller_cuda.manual_seed(11)  # whatever the caller does with its generator, the ranks follow
    reference.manual_seed(11)
    assert torch.equal(ranks.sample(), unsplit(reference))
    assert torch.equal(unsplit(caller_cuda), unsplit(reference))


def test_cpu_ranks_carry_the_cpu_state_only():
    cpu = torch.get_rng_state()
    state = RandomState(cpu, 123)
    state.apply(None)  # a CPU rank has no device generator: the seed is not used
    assert torch.equal(torch.get_rng_state(), cpu)
    assert RandomState.of(None).cuda is None
    assert device_generator(torch.device("cpu")) is None


def test_the_cpu_state_travels_only_when_it_changed():
    """A decode step of greedy search draws nothing: its call carries no CPU state, and none comes back;
    after the caller draws (sampling), or a call fails, the state travels again."""
    caller = CallerRandomState()
    first = caller.write()
    assert first.cpu is not None  # the ranks' state is not known yet
    before = torch.get_rng_state()
    caller.read(RandomState.of(None, before))  # a forward that drew nothing
    assert caller.write().cpu is None
    caller.read(RandomState(None))
    torch.rand(3)  # the caller samples
    drawn = caller.write()
    assert drawn.cpu is not None and torch.equal(drawn.cpu, torch.get_rng_state())
    # the ranks drew (dropout in training mode): their state comes back and the caller takes it
    torch.rand(5)
    after = torch.get_rng_state()
    torch.set_rng_state(drawn.cpu)
    caller.read(RandomState(after))
    assert torch.equal(torch.get_rng_state(), after) and caller.write().cpu is None
    caller.write()  # a call that fails is never adopted: the next one sends the state again
    assert caller.write().cpu is not None
