"""Strict JAX settings for every test: no silent rank promotion, tracer leaks are errors."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _no_leaked_tracers(request):
    if request.node.get_closest_marker("no_leak_check"):
        yield  # JAX bypasses its caches while checking leaks: too slow for 20,000 equations
        return
    with jax.checking_leaks():
        yield
