"""The float64 half of test_transparency.py (its DTYPES is ("float64",) in this session).

Run with test_x64.py in the x64 session (`JAX_ENABLE_X64=1`, the Makefile does): a file of its
own, so that pytest-xdist runs it beside the guard-table cases.
"""

import jax.numpy as jnp
from test_transparency import *  # noqa: F403  (pytest collects the imported tests)


def test_transparency_session_runs_with_x64():
    assert jnp.asarray(1.0).dtype == jnp.float64
