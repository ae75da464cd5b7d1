"""Shared-memory collectives of the gloo ranks of one host (:mod:`tpcore.parallel.shm`): the same results
as gloo's, nothing left in /dev/shm, a missing rank ends in a timeout instead of a hang."""

from __future__ import annotations

import pytest
import rank_helpers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpcore.parallel import shm
from tpcore.ranks.process import RankPool

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


def tensor_of(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=generator)


@settings(max_examples=10, deadline=None)
@given(
    world_size=st.integers(2, 4),
    shapes=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_shared_memory_collectives_give_what_the_backend_gives(rank_pools, world_size, shapes, dtype, transpose, seed):
    tensors = [tensor_of(shape, dtype, seed + i) for i, shape in enumerate(shapes)]
    if transpose:  # non-contiguous inputs
        tensors = [t.T if t.dim() == 2 else t for t in tensors]
    for attached, results in rank_pools.get(world_size).run(rank_helpers.shm_against_backend, tensors):
        assert attached
        for reduced, expected, gathered, gathered_expected in results:
            tolerance = {"rtol": 0, "atol": 0} if dtype == torch.int64 else {"rtol": 1e-2, "atol": 1e-2}
            torch.testing.assert_close(reduced, expected.view_as(reduced), **tolerance)
            assert torch.equal(gathered, gathered_expected)


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensors_larger_than_a_slot_go_through_in_chunks(rank_pools, world_size):
    slot_floats = shm.SLOT_BYTES // 4
    # 3 chunks of a flat tensor; a strided one; rows gathered in 3 steps along the last dim
    tensors = [torch.randn(2 * slot_floats + 3), torch.randn(3, slot_floats // 2 + 1).T, torch.randn(3000, 1000)]
    for attached, results in rank_pools.get(world_size).run(rank_helpers.shm_against_backend, tensors):
        assert attached
        for reduced, expected, gathered, gathered_expected in results:
            torch.testing.assert_close(reduced, expected.view_as(reduced), rtol=1e-6, atol=1e-6)
            assert torch.equal(gathered, gathered_expected)


def test_a_rank_that_never_arrives_is_a_timeout_not_a_hang(tmp_path):
    path = tmp_path / "segment"
    path.write_bytes(bytes(shm.segment_bytes(2, 64)))
    alone = shm.ShmCollectives(path, rank=0, world_size=2, slot_bytes=64, timeout_s=0.3)
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not reach shared-memory step 1 within 0.3 s"):
        alone.all_reduce(torch.ones(4))


@pytest.mark.slow
def test_tpcore_shm_0_keeps_gloo_and_no_segment_is_left_behind(monkeypatch):
    before = set(shm.SHM_DIR.iterdir())
    with RankPool(2, "gloo") as pool:
        assert pool.run(rank_helpers.shm_against_backend, [])[0][0]  # attached by default
    monkeypatch.setenv("TPCORE_SHM", "0")
    with RankPool(2, "gloo") as pool:
        attached, _ = pool.run(rank_helpers.shm_against_backend, [torch.ones(3)])[0]
    assert not attached
    assert set(shm.SHM_DIR.iterdir()) == before


def test_no_room_in_dev_shm_means_no_segment_and_no_file(monkeypatch):
    before = set(shm.SHM_DIR.iterdir())

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    assert shm._create_segment(shm.segment_bytes(2, shm.SLOT_BYTES)) is None
    assert set(shm.SHM_DIR.iterdir()) == before
