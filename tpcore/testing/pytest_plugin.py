"""pytest plugin of tpcore (entry point ``pytest11``): fixtures for equivalence tests of policies."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def rank_pools():
    """A :class:`tpcore.testing.PoolCache`: gloo worlds by size, spawned once per test session."""
    from tpcore.testing import PoolCache

    pools = PoolCache()
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def nccl_rank_pools():
    """Like ``rank_pools``, with NCCL worlds on the visible CUDA devices (one device per rank)."""
    from tpcore.testing import PoolCache

    pools = PoolCache(backend="nccl")
    yield pools
    pools.close()


@pytest.fixture
def tp_check(rank_pools):
    """``tp_check(model_class, config, world_sizes=(2,), policies=None, max_examples=10)``:
    :func:`tpcore.testing.check_model` on the session's rank pools."""
    from tpcore.testing import check_model

    def check(model_class, config, world_sizes=(2,), **options):
        check_model(model_class, config, world_sizes, pools=rank_pools, **options)

    return check
