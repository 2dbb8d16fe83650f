"""A custom_vjp whose outputs are dropped in places while its inputs stay live elsewhere.

The transpose of the `where` outside the call hands the backward rule a zero cotangent in the
dropped lanes; the rule multiplies it by its own values (`g[0] * 0.5 / sqrt(x)` at `x = 0`), and
the input lane is read by another output (or another output lane), so cutting the input cannot
help. The call's output masks seed the structural zeros of the guarded rule
(`_backward.SeededBackward`). References: the hand-written double where (the same rule on a safe
input in the dropped lanes), and plain JAX where nothing is dropped.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import jaxsafe

X = jnp.array([-1.0, 0.0, 4.0, 2.0])


@jax.custom_vjp
def two_outputs(x):
    return jnp.sqrt(x), 2.0 * x


two_outputs.defvjp(lambda x: ((jnp.sqrt(x), 2.0 * x), x),
                   lambda x, g: (g[0] * 0.5 / jnp.sqrt(x) + 2.0 * g[1],))


def dropped_sqrt(x):
    a, b = two_outputs(x)
    return jnp.sum(jnp.where(x > 0, a, 0.0) + b * jnp.arange(1.0, 5.0))


def dropped_sqrt_by_hand(x):
    a, _ = two_outputs(jnp.where(x > 0, x, 1.0))
    return jnp.sum(jnp.where(x > 0, a, 0.0) + 2.0 * x * jnp.arange(1.0, 5.0))


@jax.custom_vjp
def neighbours(x):
    """out[i] = sqrt(x[i + 1]) * x[i]: lane i + 1 of x is read by outputs i and i + 1."""
    return jnp.sqrt(x[1:]) * x[:-1]


def _neighbours_bwd(x, g):
    gx = jnp.zeros_like(x).at[1:].add(g * 0.5 / jnp.sqrt(x[1:]) * x[:-1])
    return (gx.at[:-1].add(g * jnp.sqrt(x[1:])),)


neighbours.defvjp(lambda x: (jnp.sqrt(x[1:]) * x[:-1], x), _neighbours_bwd)


def dropped_neighbour(x):
    return jnp.sum(jnp.where(x[1:] > 0, neighbours(x), 0.0) * jnp.arange(1.0, 4.0))


def dropped_neighbour_by_hand(x):
    ok = x[1:] > 0
    safe = jnp.concatenate([x[:1], jnp.where(ok, x[1:], 1.0)])
    # the same rule on the safe input, whose dropped lanes' cotangents are then finite zeros,
    # plus x[i + 1]'s own lane (its other output, i + 1) through the original
    y = jnp.sqrt(safe[1:]) * x[:-1]
    return jnp.sum(jnp.where(ok, y, 0.0) * jnp.arange(1.0, 4.0))


XN = jnp.array([1.0, 0.0, 3.0, 4.0])


def test_a_dropped_output_of_two_is_guarded_in_the_rule():
    assert np.isnan(np.asarray(jax.grad(dropped_sqrt)(X))).any()  # plain JAX leaks
    assert_close(jax.grad(jaxsafe.nan_safe(dropped_sqrt))(X), jax.grad(dropped_sqrt_by_hand)(X))
    assert_close(jax.jit(jax.grad(jaxsafe.nan_safe(dropped_sqrt)))(X),
                 jax.grad(dropped_sqrt_by_hand)(X))


def test_an_output_lane_dropped_whose_input_lane_another_reads():
    assert np.isnan(np.asarray(jax.grad(dropped_neighbour)(XN))).any()
    expected = jax.grad(dropped_neighbour_by_hand)(XN)
    assert np.isfinite(np.asarray(expected)).all()
    assert_close(jax.grad(jaxsafe.nan_safe(dropped_neighbour))(XN), expected)


@pytest.mark.no_leak_check
def test_values_stay_bitwise():
    for f, x in ((dropped_sqrt, X), (dropped_neighbour, XN)):
        want = jax.jit(f)(x)
        got, _ = jax.value_and_grad(jaxsafe.nan_safe(f))(x)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
        assert np.asarray(jaxsafe.nan_safe(f)(x)).tobytes() == np.asarray(want).tobytes()


@pytest.mark.no_leak_check
def test_second_order():
    # the Hessian of the rule's own derivative: reverse over reverse, and forward over reverse
    safe = jaxsafe.nan_safe(dropped_sqrt)
    want = jax.hessian(dropped_sqrt_by_hand)(X)
    assert np.isfinite(np.asarray(want)).all()
    assert_close(jax.jacrev(jax.grad(safe))(X), want)
    assert_close(jax.jacfwd(jax.grad(safe))(X), want)


@pytest.mark.no_leak_check
def test_under_vmap():
    xs = jnp.stack([X, X[::-1], jnp.abs(X) + 1.0])
    got = jax.vmap(jax.grad(jaxsafe.nan_safe(dropped_sqrt)))(xs)
    assert_close(got, jax.vmap(jax.grad(dropped_sqrt_by_hand))(xs))
    got = jax.grad(lambda xs: jnp.sum(jax.vmap(jaxsafe.nan_safe(dropped_sqrt))(xs)))(xs)
    assert_close(got, jax.vmap(jax.grad(dropped_sqrt_by_hand))(xs))


def test_a_live_singularity_stays():
    # x = 0 in a lane the where keeps (the predicate reads another value): the rule's inf there
    # is real, as in plain JAX (contract 3)
    def live(x, keep):
        a, b = two_outputs(x)
        return jnp.sum(jnp.where(keep, a, 0.0) + b)
    keep = jnp.array([False, True, True, True])
    got = jax.grad(jaxsafe.nan_safe(live))(X, keep)
    want = jax.grad(live)(X, keep)
    assert not np.isfinite(np.asarray(got)[1]) and not np.isfinite(np.asarray(want)[1])
    assert_close(got[2:], want[2:])
    assert float(got[0]) == 2.0  # the dropped lane: only b's derivative


def test_nothing_dropped_is_unchanged():
    def live(x):
        a, b = two_outputs(x)
        return jnp.sum(a + b)
    closed = jax.make_jaxpr(live)(X)
    assert str(jaxsafe.make_jaxpr(live)(X)) == str(closed)


def test_explain_names_the_backward_rule():
    text = str(jaxsafe.explain(dropped_sqrt)(X))
    assert "backward rule" in text


def test_a_row_mask_seeds_every_lane_of_its_rows():
    # the mask of the dropped output is a row mask (computed along rows, broadcast over them)
    def loss(x):
        a, b = two_outputs(x)
        ok = jnp.min(x, axis=1) > 0
        return jnp.sum(jnp.where(ok[:, None], a, 0.0) + b)

    def hand(x):
        ok = jnp.min(x, axis=1) > 0
        a, _ = two_outputs(jnp.where(ok[:, None], x, 1.0))
        return jnp.sum(jnp.where(ok[:, None], a, 0.0) + 2.0 * x)
    x = jnp.array([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 2.0, 3.0], [4.0, -1.0, 1.0, 1.0]])
    assert np.isnan(np.asarray(jax.grad(loss)(x))).any()
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(x), jax.grad(hand)(x))
