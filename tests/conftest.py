"""Strict JAX settings for every test: no silent rank promotion, tracer leaks are errors."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _no_leaked_tracers():
    with jax.checking_leaks():
        yield
