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
