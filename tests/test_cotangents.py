"""A lane that `max`, `min` or `clamp` drops gets exactly zero, even where the cotangent of
the result is inf or NaN (jaxsafe/_cotangents.py).

JAX weighs the cotangent of `max(a, b)` by 0, 1/2 or 1; a live lane whose own derivative is
infinite (`sqrt` at 0, a real singularity) hands the loser `0 * inf = NaN`. The reference is
the hand-written form: the same selection written with `jnp.where` on the same decision.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, structure
from jax import lax

import jaxsafe
from jaxsafe import nan_safe

# Numerics: conftest's leak checker is for the modules that exercise the API's tracing paths
# (test_api, test_composition, ...); here it would only turn JAX's caches off (2-3x slower).
pytestmark = pytest.mark.no_leak_check

X = jnp.array([-2., -0.5, 0., 0.25, 2., 4.], jnp.float32)


def _all_orders(f, hand, x):
    """Forward bitwise; first and second order equal the hand form's, under jit and vmap."""
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    g_safe, g_hand = jax.grad(lambda v: nan_safe(f)(v).sum()), jax.grad(lambda v: hand(v).sum())
    assert_close(g_safe(x), g_hand(x))
    assert_close(jax.jit(g_safe)(x), jax.jit(g_hand)(x))
    assert_close(jax.vmap(g_safe)(x[:, None]), jax.vmap(g_hand)(x[:, None]))
    h_safe = jax.jacfwd(g_safe)(x)
    assert_close(h_safe, jax.jacfwd(g_hand)(x))
    return g_safe(x)


def test_sqrt_of_relu_gives_zero_where_relu_drops_x():
    f = lambda x: jnp.sqrt(jnp.maximum(x, 0.))
    hand = lambda x: jnp.sqrt(jnp.where(x > 0., x, jnp.where(x < 0., 0., jnp.maximum(x, 0.))))
    assert np.isnan(jax.grad(lambda v: f(v).sum())(X)[:2]).all()  # the bug, in plain JAX
    g = _all_orders(f, hand, X)
    assert (np.asarray(g)[:2] == 0).all()
    assert np.isinf(np.asarray(g)[2])  # the tie at 0 stays live: a real singularity


def test_a_winner_against_a_literal_alone_needs_no_select():
    """In `max(x, 0.)` the literal's wins are a select (x's lane gets an exact 0); x's own wins
    need none: max's derivative gives x the cotangent times 1 and the literal's share goes
    nowhere. One select fewer than when the rival is differentiable, the same derivatives."""
    def selects(f, *args):
        return sum(e.primitive.name == "select_n" for e in jaxsafe.make_jaxpr(f)(*args).eqns)
    y = jnp.zeros_like(X)
    # (`log`: no forward-mode guard, whose selects `sqrt` would add where the literal wins)
    assert selects(lambda x: jnp.log(jnp.maximum(x, 0.)), X) + 1 == \
        selects(lambda x, y: jnp.log(jnp.maximum(x, y)), X, y)
    g = jax.grad(lambda v: nan_safe(lambda u: jnp.sqrt(jnp.maximum(u, 0.)))(v).sum())(X)
    want = np.where(np.asarray(X) > 0, 0.5 / np.sqrt(np.maximum(np.asarray(X), 1e-30)), 0.)
    g, want = np.asarray(g), want.astype(np.float32)
    assert (g[np.asarray(X) < 0] == 0).all() and np.isinf(g[np.asarray(X) == 0]).all()
    np.testing.assert_allclose(g[np.asarray(X) > 0], want[np.asarray(X) > 0], rtol=1e-6)


def test_min_and_clip_losers_get_zero():
    f = lambda x: jnp.log(jnp.minimum(x, 1.)) + jnp.sqrt(jnp.clip(x, 0., 2.))
    def hand(x):
        lo = jnp.where(x < 1., x, jnp.where(x > 1., 1., jnp.minimum(x, 1.)))
        cl = jnp.where(x < 0., 0., jnp.where(x > 2., 2., jnp.clip(x, 0., 2.)))
        return jnp.log(lo) + jnp.sqrt(cl)
    x = jnp.abs(X) + 0.5  # log's operand stays positive
    _all_orders(f, hand, x)
    clipped = lambda v: jnp.where(v < 0., 0., jnp.where(v > 2., 2., jnp.clip(v, 0., 2.)))
    g = _all_orders(lambda v: jnp.sqrt(jnp.clip(v, 0., 2.)), lambda v: jnp.sqrt(clipped(v)), X)
    assert (np.asarray(g)[:2] == 0).all()


def test_two_differentiable_operands_the_loser_gets_zero():
    # y loses in every lane; the winner's lane is singular (sqrt at 0): y's gradient is 0
    def f(x, y):
        return jnp.sqrt(jnp.minimum(x, y))

    def hand(x, y):
        return jnp.sqrt(jnp.where(x < y, x, jnp.where(y < x, y, jnp.minimum(x, y))))
    x, y = jnp.array([0., 1., 0.]), jnp.array([3., 4., 5.])
    for argnum in (0, 1):
        got = jax.grad(lambda a, b: nan_safe(f)(a, b).sum(), argnum)(x, y)
        want = jax.grad(lambda a, b: hand(a, b).sum(), argnum)(x, y)
        assert_close(got, want)
    assert np.isnan(jax.grad(lambda a, b: f(a, b).sum(), 1)(x, y)).any()  # plain JAX


def test_inside_a_scan_body():
    def f(x):
        def body(c, xi):
            return c + jnp.sqrt(jnp.maximum(xi, 0.)), None
        return lax.scan(body, jnp.zeros(()), x)[0]

    def hand(x):
        def body(c, xi):
            return c + jnp.sqrt(jnp.where(xi > 0., xi, jnp.where(xi < 0., 0., xi))), None
        return lax.scan(body, jnp.zeros(()), x)[0]
    g = jax.grad(nan_safe(f))(X)
    assert_close(g, jax.grad(hand)(X))
    assert (np.asarray(g)[:2] == 0).all()


def test_a_cotangent_that_stays_finite_changes_nothing():
    # sin's and a finite product's derivatives are finite: the max is left as it is
    def f(x, w):
        return (jnp.sin(jnp.maximum(x, 0.)) * 3.).sum() + (jnp.maximum(x, w) * w).sum()
    args = (X, X[::-1])
    plain = jax.make_jaxpr(f)(*args)
    assert structure(jaxsafe.make_jaxpr(f, finite_args=True)(*args)) == structure(plain)
    # an argument may hold inf by default: `* w` may hand the max a non-finite cotangent
    assert structure(jaxsafe.make_jaxpr(f)(*args)) != structure(plain)


def test_mean_divides_by_a_literal_and_is_not_nan_prone():
    # `x / 3.` makes no inf from finite operands: a max under a mean is left as it is
    def f(x):
        return jnp.mean(jnp.maximum(x, 0.).reshape(2, 3), axis=0).sum()
    assert structure(jaxsafe.make_jaxpr(f, finite_args=True)(X)) == \
        structure(jax.make_jaxpr(f)(X))


@pytest.mark.parametrize("x0", [-1., 0., 1.])
def test_the_forward_value_is_the_max(x0):
    f = lambda x: jnp.sqrt(jnp.maximum(x, jnp.float32(0.)))
    x = jnp.array([x0, np.nan, np.inf, -np.inf, -0.], jnp.float32)
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    assert_bitwise(nan_safe(f, jit=False)(x), f(x))


def test_integer_arithmetic_in_a_branch_is_not_a_hazard():
    # jnp.remainder on indices (an iota mask) has the row of `rem`, whose guard is for floats:
    # integers hold no NaN, so the branch's max, under sin of a finite argument, stays a max
    # (as found by the fuzzer, nothing-to-guard property, run 7)
    def f(s, m):
        def branch_a(u):
            return jnp.sin(jnp.maximum(u, u))

        def branch_b(u):
            p = (jnp.arange(3)[:, None] + jnp.arange(4)[None, :]) % 2 == 0
            return jnp.where(p, u, u)
        return jnp.where(s >= 0., lax.cond(s >= 0., branch_a, branch_b, m), m)
    args = (np.float32(1.), np.ones((3, 4), np.float32))
    assert structure(jaxsafe.make_jaxpr(f, finite_args=True)(*args)) == \
        structure(jax.make_jaxpr(f)(*args))
