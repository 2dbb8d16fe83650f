"""Strict JAX settings for every test: no silent rank promotion, tracer leaks are errors.

The leak checker runs on the modules that exercise nan_safe's tracing paths (test_api,
test_composition, test_control_flow, test_by_value, test_hostile, ...). JAX turns its
tracing caches off under it (2-3x slower), so the numerics sweeps, which run the same paths on
many more programs, opt out with `pytestmark = pytest.mark.no_leak_check` (a test may too).
"""

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
