"""A `where` after a loop whose body mixes lanes (a carry that sums, a `lax.map` over a closed-over
value): the loop's operands are live where any output lane is, so work before the loop that
the `where` drops whole is guarded. And the hand-written double where around such a loop, or
around a sum, stays as it is (contract 4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, structure
from jax import lax

import jaxsafe
from jaxsafe import nan_safe

pytestmark = pytest.mark.no_leak_check

LOOPS = {
    "fori_loop": lambda y: lax.fori_loop(0, 3, lambda i, c: c * .9 + .1 * jnp.sin(c), y),
    "scan_outputs": lambda y: lax.scan(lambda c, t: (c * 1.1, c * t), y,
                                       jnp.arange(3.))[1].sum(0),
    "lax_map_closed_over": lambda y: lax.map(lambda t: t * y, jnp.arange(3.)).sum(0),
    "carry_that_sums": lambda y: lax.fori_loop(0, 3, lambda i, c: c * .9 + jnp.sum(c) * .1, y),
}


def _scalar(loop, guard):
    def f(x):
        y = jnp.sqrt(jnp.where(x > 0, x, 1.) if guard else x)
        return jnp.where(x > 0, loop(y), 0.)
    return f


def _rows(loop, guard):
    """The predicate reads one lane (`x[0] > 0`), written twice by the hand fix."""
    def f(x):
        y = jnp.sqrt(jnp.where(x[0] > 0, x, 1.) if guard else x)
        return jnp.sum(jnp.where(x[0] > 0, loop(y), 0.))
    return f


@pytest.mark.parametrize("name", sorted(LOOPS))
@pytest.mark.parametrize("x", [-1., 0., 2.])
def test_a_scalar_where_after_a_loop_drops_what_the_loop_reads(name, x):
    f, hand = _scalar(LOOPS[name], False), _scalar(LOOPS[name], True)
    x = jnp.float32(x)
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    assert_close(jax.grad(nan_safe(f))(x), jax.grad(hand)(x))
    assert_close(jax.hessian(nan_safe(f))(x), jax.hessian(hand)(x))
    assert_close(jax.jacfwd(nan_safe(f))(x), jax.jacfwd(hand)(x))
    if x <= 0:
        assert np.isnan(jax.grad(f)(x))  # plain JAX leaks


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_a_where_after_a_loop_keeps_live_lanes_and_their_singularities(name):
    f, hand = _rows(LOOPS[name], False), _rows(LOOPS[name], True)
    for x in (jnp.array([-1., 2.]), jnp.array([2., 3.]), jnp.array([1., -1.])):
        assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
        got, plain = jax.grad(nan_safe(f))(x), jax.grad(f)(x)
        if x[0] > 0:  # every lane live: plain JAX's derivatives, its NaN included
            assert_bitwise(got, plain)
            assert_bitwise(jax.hessian(nan_safe(f))(x), jax.hessian(f)(x))
        else:
            assert_close(got, jax.grad(hand)(x))
            assert_close(jax.hessian(nan_safe(f))(x), jax.hessian(hand)(x))
    assert np.isnan(jax.grad(nan_safe(f))(jnp.array([1., -1.]))).any()  # a live sqrt(-1)


@pytest.mark.parametrize(("name", "make"), [("fori_loop", _scalar), ("carry_that_sums", _scalar),
                                           ("carry_that_sums", _rows)])
def test_the_hand_fix_around_a_loop_is_left_as_it_is(name, make):
    """Not yet where the body meets the carry in a product with a zero step value (`c * t` at
    `t = 0`) or in `sin`: the carry's lanes are not followed into the body as the constant the
    hand fix took, and a guard stays there (it did before the loop's operands were dropped)."""
    hand = make(LOOPS[name], True)
    x = jnp.float32(2.) if make is _scalar else jnp.array([1., 2.])
    assert structure(jaxsafe.make_jaxpr(hand)(x)) == structure(jax.make_jaxpr(hand)(x))


@pytest.mark.parametrize("pred", ["lanes", "first_lane"])
def test_the_hand_fix_around_a_sum_over_its_lanes_is_left_as_it_is(pred):
    """`where(p, y * .9 + sum(y) * .1, 0.)` with `y = sqrt(where(p, x, 1.))`: where every lane
    is dropped, `y` took the constant 1 in each; no forward walk follows a sum."""
    p = (lambda x: x > 0) if pred == "lanes" else (lambda x: x[0] > 0)

    def hand(x):
        y = jnp.sqrt(jnp.where(p(x), x, 1.))
        return jnp.sum(jnp.where(p(x), y * .9 + jnp.sum(y) * .1, 0.))
    x = jnp.array([1., 2.])
    assert structure(jaxsafe.make_jaxpr(hand)(x)) == structure(jax.make_jaxpr(hand)(x))
    for x in (jnp.array([-1., -2.]), jnp.array([-1., 2.]), jnp.array([0., 3.])):
        assert_bitwise(jax.grad(nan_safe(hand))(x), jax.grad(hand)(x))


def test_a_where_after_a_loop_is_guarded_as_its_hand_fix_under_vmap_and_jit():
    f, hand = _scalar(LOOPS["carry_that_sums"], False), _scalar(LOOPS["carry_that_sums"], True)
    xs = jnp.array([-1., 0., .5, 2.])
    got = jax.jit(jax.vmap(jax.grad(nan_safe(f))))(xs)
    assert_close(got, jax.vmap(jax.grad(hand))(xs))


def _two_carries(b_reads_a, steps=3):
    def f(x, by_hand=False):
        a0 = jnp.sqrt(jnp.where(x > 0, x, 1.) if by_hand else x)
        def step(carry, _):
            a, b = carry
            return (a * .9, b + (a if b_reads_a else 1.)), None
        (a, b), _ = lax.scan(step, (a0, 2. * x), None, length=steps)
        return jnp.where(x > 0, a, 0.) + b
    return f


@pytest.mark.parametrize("steps", [3, 0])
def test_a_carry_dropped_whole_drops_its_init_while_another_carry_is_live(steps):
    """`a` is dropped after the loop where `x <= 0`; `b` is live and never reads `a`: `a`'s
    init reaches no live output, and its `sqrt` is guarded (with no steps, the final carry is
    the init)."""
    f = _two_carries(False, steps)
    hand = lambda x: f(x, by_hand=True)
    for x in (jnp.float32(-1.), jnp.float32(0.), jnp.float32(2.)):
        assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
        assert_close(jax.grad(nan_safe(f))(x), jax.grad(hand)(x))
        assert_close(jax.hessian(nan_safe(f))(x), jax.hessian(hand)(x))


def test_a_dropped_carry_that_a_live_one_reads_stays_live():
    f = _two_carries(True)
    for x in (jnp.float32(-1.), jnp.float32(0.), jnp.float32(2.)):
        assert_bitwise(jax.grad(nan_safe(f))(x), jax.grad(f)(x))  # NaN and inf included
