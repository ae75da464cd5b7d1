"""Markers of tpcore's own suite. The ``rank_pools`` fixture comes from tpcore's pytest plugin."""


def pytest_configure(config):
    config.addinivalue_line("markers", "packaging: builds wheels and installs them into a fresh environment")
    config.addinivalue_line("markers", "gpu: needs CUDA devices (nox -s gpu_equivalence)")
