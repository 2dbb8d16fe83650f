"""What values hold on the diagonal of two axes (`_diagonal.py`), checked against NumPy.

Each fact is read off the original program: the analysis never runs it. Where the answer is
"known", it must be the value every diagonal lane holds when the program runs; where the
program does not make it one scalar (another array, an axis read twice, positions that may be
NaN), the answer must be "unknown".
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsafe._compat import Literal, bind_eqn
from jaxsafe._diagonal import DiagonalValues
from jaxsafe._flatten import flatten

# a numerics sweep: the modules of nan_safe's tracing paths check for tracer leaks (conftest)
pytestmark = pytest.mark.no_leak_check

X = jnp.array([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5], [2.0, 2.0, 7.0]])


class _Program:
    """A traced function, answering what `_diagonal.py` asks of the program around it."""

    def __init__(self, f, *args, finite=True):
        self.closed = flatten(jax.make_jaxpr(f)(*args))  # `jnp.where` is a jit call
        self.producer = {o: e for e in self.closed.jaxpr.eqns for o in e.outvars}
        self._finite = finite
        self.values = DiagonalValues(self)

    def finite(self, v):
        return self._finite

    def same_as(self, v):
        return v

    def producer_of(self, v):
        return self.producer.get(v)

    def constant(self, v):
        """Computed from literals alone: evaluated, equation by equation (small programs)."""
        if isinstance(v, Literal):
            return np.asarray(v.val)
        eqn = self.producer.get(v)
        if eqn is None:
            return None
        operands = [self.constant(u) for u in eqn.invars]
        if any(o is None for o in operands):
            return None
        return np.asarray(bind_eqn(eqn, operands)[0])

    @property
    def out(self):
        return self.closed.jaxpr.outvars[0]


def _on_diagonal(f, *args):
    """What running `f` gives on the diagonal of axes 0 and 1: one scalar, or None."""
    value = np.asarray(f(*args))
    n = value.shape[0]
    diagonal = {value[(i, i)].item() for i in range(n)}
    return diagonal.pop() if len(diagonal) == 1 else None


def squared_distances(x):
    return jnp.sum((x[None] - x[:, None]) ** 2, axis=-1)


def apart(x):
    return squared_distances(x) > 0


def not_mirrored(x):
    """`x[j, k] - x[i, j]`: one array, but on the diagonal it reads `x[i, k]` and `x[i, i]`."""
    return jnp.sum((x[None, :, :] - x[:, :, None]) ** 2, axis=-1)


def two_arrays(x):
    return jnp.sum((x[None] - (2.0 * x)[:, None]) ** 2, axis=-1)


@pytest.mark.parametrize("f", [squared_distances, apart], ids=["r2", "r2 > 0"])
def test_the_squared_distances_of_finite_points_are_known_on_the_diagonal(f):
    program = _Program(f, X)
    got = program.values.holds(program.out, (0, 1))
    assert got is not None and got.item() == _on_diagonal(f, X)
    assert got.item() == (0.0 if f is squared_distances else False)


def morse_base(x):
    """jax-md's Morse base on `safe_mask`'s distance: `1 - exp(-5 * (d - 1))`, with `-5` a
    scalar the program computes and `d` the placeholder 0 where `r2 > 0` fails."""
    r2 = squared_distances(x)
    d = jnp.where(r2 > 0, jnp.sqrt(jnp.where(r2 > 0, r2, 0.0)), 0)
    return 1.0 - jnp.exp(-jnp.float32(5.0) * (d - 1.0))


def test_a_selection_and_a_computed_scalar_carry_the_diagonal():
    """`select_n` takes the case its predicate's value there names; a scalar computed from
    literals is its own value."""
    program = _Program(morse_base, X)
    got = program.values.holds(program.out, (0, 1))
    assert got is not None and np.isclose(got.item(), _on_diagonal(morse_base, X))
    assert np.isclose(got.item(), 1.0 - np.exp(5.0))


@pytest.mark.parametrize("f", [not_mirrored, two_arrays], ids=["not mirrored", "two arrays"])
def test_a_difference_that_is_not_one_array_mirrored_is_unknown(f):
    assert _on_diagonal(f, X) is None  # its diagonal is not one value here
    program = _Program(f, X)
    assert program.values.holds(program.out, (0, 1)) is None


def test_points_that_may_be_nan_make_the_diagonal_unknown():
    """`x_i - x_i` is NaN for a NaN or infinite point."""
    bad = X.at[1, 0].set(jnp.inf)
    assert np.isnan(np.asarray(squared_distances(bad))[1, 1])
    program = _Program(squared_distances, bad, finite=False)
    assert program.values.holds(program.out, (0, 1)) is None


@pytest.mark.parametrize("k, n, diagonal", [(0, 4, (0, 1)), (1, 4, None), (-2, 5, None)])
def test_eye_is_the_predicate_of_its_own_diagonal_only(k, n, diagonal):
    """`jnp.eye(n, k=0)` holds exactly where i == j; `k != 0` names another diagonal."""
    program = _Program(lambda: jnp.eye(n, k=k, dtype=bool))
    eqn = program.producer_of(program.out)
    key = program.out if eqn.params.get("new_dtype") is None else eqn.invars[0]
    assert program.values.of_predicate(key, (0, 1)) == diagonal
    if diagonal is not None:  # and it is: True exactly on the diagonal
        np.testing.assert_array_equal(np.asarray(jnp.eye(n, k=k, dtype=bool)), np.eye(n) == 1)
