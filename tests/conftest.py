"""tpcore's own suite. Markers live in pyproject.toml; the ``rank_pools`` fixture comes from tpcore's pytest plugin."""
