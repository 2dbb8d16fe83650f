"""Shared oracles for the tests."""

import jax
import numpy as np


def assert_bitwise(a, b):
    """Equal bit for bit, NaN positions included."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def assert_close(a, b, rtol=1e-6, atol=0.0):
    """Equal up to rounding, NaN where NaN; structures must match."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=rtol, atol=atol, equal_nan=True)


def assert_finite(tree):
    for x in jax.tree.leaves(tree):
        assert np.all(np.isfinite(np.asarray(x, np.float64))), x
