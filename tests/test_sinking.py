"""Elementwise work done on a scan's stacked operand before the loop, dropped in the loop's body
(`jaxsafe/_sinking.py`): a padded sequence's `log` of every step at once, read only by the steps
that are not padding.

References: the hand fix (the `log` computed in the body, on a double where), which is the
program with the dropped steps' values never reaching a derivative, and plain JAX, NaN where
the drop is not guarded (so each test can fail) and equal where nothing is dropped.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, structure
from jax import lax

import jaxsafe

pytestmark = pytest.mark.no_leak_check

X = jnp.array([[1., 2.], [3., 0.5], [0., -1.], [-2., 0.]])


def padded_log(x, length):
    """A sequence model's step: each time step's features' log, computed for all steps at
    once, added to the state by the steps before `length` only."""
    features = jnp.log(x)

    def step(state, inputs):
        t, feature = inputs
        return jnp.where(t < length, state + feature, state), None
    return jnp.sum(lax.scan(step, jnp.zeros(2), (jnp.arange(len(x)), features))[0])


def padded_log_by_hand(x, length):
    def step(state, inputs):
        t, xt = inputs
        live = t < length
        return jnp.where(live, state + jnp.log(jnp.where(live, xt, 1.)), state), None
    return jnp.sum(lax.scan(step, jnp.zeros(2), (jnp.arange(len(x)), x))[0])


def test_padded_steps_of_a_feature_computed_before_the_loop_get_zero_gradient():
    assert np.isnan(jax.grad(padded_log)(X, 2)).any()  # the leak
    safe = jaxsafe.nan_safe(padded_log)
    assert_bitwise(safe(X, 2), jax.jit(padded_log, static_argnums=1)(X, 2))
    assert_close(jax.grad(safe)(X, 2), jax.grad(padded_log_by_hand)(X, 2))
    assert_close(jax.jit(jax.grad(safe), static_argnums=1)(X, 2),
                 jax.grad(padded_log_by_hand)(X, 2))
    assert_close(jax.jacfwd(safe)(X, 2), jax.jacfwd(padded_log_by_hand)(X, 2))
    assert_close(jax.hessian(safe)(X, 2), jax.hessian(padded_log_by_hand)(X, 2))


def test_the_report_names_the_moved_hazard_at_its_own_line():
    text = str(jaxsafe.explain(padded_log)(X, 2))
    assert "inside scan" in text and "guarded log" in text
    assert "features = jnp.log(x)" in text


def test_a_drop_decided_on_the_carry_with_a_chain_of_operations_and_a_scalar():
    """Reverse scan; the step is dropped once the state reaches 5 (decided on the carry, step
    by step); the stacked value is `2 log(x s) + 1`, with `s` a differentiated scalar."""
    def f(x, s):
        y = jnp.log(x * s) * 2. + 1.

        def step(c, yt):
            return jnp.where(c < 5., c + yt, c), c
        c, cs = lax.scan(step, jnp.zeros(2), y, reverse=True)
        return jnp.sum(c) + jnp.sum(cs)

    def by_hand(x, s):
        def step(c, xt):
            live = c < 5.
            return jnp.where(live, c + jnp.log(jnp.where(live, xt * s, 1.)) * 2. + 1., c), c
        c, cs = lax.scan(step, jnp.zeros(2), x, reverse=True)
        return jnp.sum(c) + jnp.sum(cs)

    x = jnp.array([[0., -1.], [3., 0.], [1., 2.], [40., 1e3]])  # the last row runs first
    assert np.isnan(jax.grad(f, (0, 1))(x, 2.)[0]).any()
    safe = jaxsafe.nan_safe(f)
    value, grads = jax.jit(jax.value_and_grad(safe, (0, 1)))(x, 2.)
    assert_bitwise(value, jax.jit(f)(x, 2.))
    assert_close(grads, jax.grad(by_hand, (0, 1))(x, 2.), rtol=1e-6)
    assert_close(jax.hessian(safe)(x, 2.), jax.hessian(by_hand)(x, 2.), rtol=1e-5)


def test_a_value_stacked_twice_and_a_map_and_a_nested_scan():
    def twice(xs):
        ys = jnp.sqrt(xs)
        return jnp.sum(lax.map(lambda a: jnp.where(a[0] > 0, a[1] + a[2], 0.), (xs, ys, ys)))

    def twice_by_hand(xs):
        return jnp.sum(lax.map(
            lambda a: jnp.where(a > 0, 2 * jnp.sqrt(jnp.where(a > 0, a, 1.)), 0.), xs))

    def nested(xss):
        def outer(c, xs):
            inner = lambda c2, xy: (c2 + jnp.where(xy[0] > 0, xy[1], 0.), None)
            return c + lax.scan(inner, jnp.zeros(2), (xs, jnp.log(xs)))[0], None
        return jnp.sum(lax.scan(outer, jnp.zeros(2), xss)[0])

    def nested_by_hand(xss):
        def outer(c, xs):
            inner = lambda c2, x: (c2 + jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.)), 0.),
                                   None)
            return c + lax.scan(inner, jnp.zeros(2), xs)[0], None
        return jnp.sum(lax.scan(outer, jnp.zeros(2), xss)[0])

    for f, by_hand, x in [(twice, twice_by_hand, X),
                          (nested, nested_by_hand, jnp.stack([X, X[::-1]]))]:
        assert np.isnan(jax.grad(f)(x)).any()
        assert_close(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(by_hand)(x))
        assert_close(jax.jacfwd(jaxsafe.nan_safe(f))(x), jax.jacfwd(by_hand)(x))


def test_a_singularity_in_a_step_the_body_reads_stays():
    """`sqrt` at 0 in a step the `where` takes (`>= 0`): inf, as in plain JAX; the steps the
    body drops are 0."""
    def f(xs):
        step = lambda c, xy: (c + jnp.where(xy[0] >= 0, xy[1], 0.), None)
        return jnp.sum(lax.scan(step, jnp.zeros(2), (xs, jnp.sqrt(xs)))[0])

    g = jax.grad(jaxsafe.nan_safe(f))(X)
    plain = jax.grad(f)(X)
    live = np.asarray(X) >= 0
    assert_bitwise(g[live], plain[live])
    assert np.isinf(g[2, 0]) and np.isinf(g[3, 1])
    assert (np.asarray(g)[~live] == 0).all()


@pytest.mark.parametrize("op", [jnp.log, jnp.sqrt, jnp.exp, lambda a: 1. / a,
                                lambda a: jnp.abs(a) ** 1.7, jnp.tanh])
def test_values_under_differentiation_are_the_original_bit_for_bit(op):
    data = jnp.asarray(np.random.default_rng(0).normal(size=(16, 9)) * 3, jnp.float32)

    def f(xs):
        step = lambda c, xy: (c * 0.5 + jnp.where(xy[0] > 0, xy[1], 0.), c)
        c, cs = lax.scan(step, jnp.zeros(9), (xs, op(xs)))
        return jnp.sum(c) + jnp.sum(cs)

    value, g = jax.jit(jax.value_and_grad(jaxsafe.nan_safe(f)))(data)
    assert_bitwise(value, jax.jit(f)(data))
    assert np.isfinite(g).all()


def test_nothing_moved_where_nothing_needs_it():
    """Linear work before the loop (no operand value meets a cotangent), and a body that drops
    no lane of its steps: the program is the original."""
    def linear_work(xs):
        step = lambda c, xy: (c + jnp.where(xy[0] > 0, xy[1], 0.), None)
        return jnp.sum(lax.scan(step, jnp.zeros(2), (xs, 2. * xs + 1.))[0])

    def nothing_dropped(xs):
        return jnp.sum(lax.scan(lambda c, y: (c + y, None), jnp.zeros(2), jnp.sqrt(xs))[0])

    for f in (linear_work, nothing_dropped):
        assert structure(jaxsafe.make_jaxpr(f)(X)) == structure(jax.make_jaxpr(f)(X))


def test_composes_with_vmap_over_sequences():
    lengths = jnp.array([1, 3])
    xs = jnp.stack([X, X[::-1]])
    safe = jax.vmap(jax.grad(jaxsafe.nan_safe(padded_log)))(xs, lengths)
    by_hand = jax.vmap(jax.grad(padded_log_by_hand))(xs, lengths)
    assert np.isnan(jax.vmap(jax.grad(padded_log))(xs, lengths)).any()
    assert_close(safe, by_hand)
