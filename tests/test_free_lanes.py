"""Lanes that carry no derivative: forward mode's dropped lanes (jaxsafe/_free.py).

`jnp.sqrt(jnp.where(x > 0, x, 0.))`: where `x <= 0` the `where` takes the constant, so the lane's
tangent is an exact zero, and `sqrt`'s derivative at that 0 is inf: plain JAX's forward mode
(`jvp`, `jacfwd`) gives `0 * inf = NaN`, mixed by the sum into every column, while reverse mode
gives 0 there (the `where` hands the inf cotangent to the constant). The reference for each case
is its hand fix: the NaN-prone operand replaced by a safe value in those lanes and the constant
result put back with `jnp.where`; derivatives are compared in both modes, at first and second
order, under `jit` and `vmap`, and the forward value bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite, structure
from jax import lax

import jaxsafe
from jaxsafe import nan_safe

pytestmark = pytest.mark.no_leak_check  # numerics only (see conftest)

X = jnp.array([-2., -0.5, 0.25, 1., 2., 4.], jnp.float32)
MASK = jnp.array([0., 1., 0., 1., 1., 1.], jnp.float32)


def _fixed(free, v):
    """The hand fix of `sqrt(v)` where the lanes `free` carry no derivative and hold 0."""
    return jnp.where(free, 0., jnp.sqrt(jnp.where(free, 1., v)))


CASES = {
    "where": (lambda x: jnp.sqrt(jnp.where(x > 0, x, 0.)),
              lambda x: _fixed(x <= 0, jnp.where(x > 0, x, 0.))),
    "maximum": (lambda x: jnp.sqrt(jnp.maximum(x, 0.)),
                lambda x: _fixed(x < 0, jnp.where(x > 0, x, 0.))),
    "minimum": (lambda x: jnp.sqrt(-jnp.minimum(x, 0.)),
                lambda x: _fixed(x > 0, -jnp.where(x < 0, x, 0.))),
    "clip": (lambda x: jnp.sqrt(jnp.clip(x, 0., 3.)),
             lambda x: jnp.where(x > 3., jnp.sqrt(3.), _fixed(x < 0, jnp.where(x > 0, x, 0.)))),
    "constant mask": (lambda x: jnp.sqrt(MASK * jnp.abs(x)),
                      lambda x: _fixed(MASK == 0, MASK * jnp.abs(x))),
    "boolean mask": (lambda x: jnp.sqrt((x > 0).astype(x.dtype) * x),
                     lambda x: _fixed(x <= 0, jnp.where(x > 0, x, 0.))),
    "overwrite": (lambda x: jnp.sqrt(jnp.abs(x).at[2].set(0.)),
                  lambda x: _fixed(jnp.arange(6) == 2, jnp.abs(x).at[2].set(0.))),
    "dynamic_update_slice": (
        lambda x: jnp.sqrt(lax.dynamic_update_slice(jnp.abs(x), jnp.zeros(2), (1,))),
        lambda x: _fixed((jnp.arange(6) >= 1) & (jnp.arange(6) < 3),
                         lax.dynamic_update_slice(jnp.abs(x), jnp.zeros(2), (1,)))),
    "pad": (lambda x: jnp.sqrt(jnp.pad(jnp.abs(x[1:]), (1, 0))),
            lambda x: _fixed(jnp.arange(6) == 0, jnp.pad(jnp.abs(x[1:]), (1, 0)))),
    "concatenate": (lambda x: jnp.sqrt(jnp.concatenate([jnp.abs(x[:4]), jnp.zeros(2)])),
                    lambda x: _fixed(jnp.arange(6) >= 4,
                                     jnp.concatenate([jnp.abs(x[:4]), jnp.zeros(2)]))),
    "moved": (lambda x: jnp.sqrt(jnp.where(x > 0, x, 0.).reshape(2, 3).T).T.reshape(6),
              lambda x: _fixed(x <= 0, jnp.where(x > 0, x, 0.))),
    # a custom_jvp whose rule selects its tangent (`_custom_carries.py`): relu's 0, as max's
    "relu": (lambda x: jnp.sqrt(jax.nn.relu(x)),
             lambda x: _fixed(x < 0, jnp.where(x > 0, x, 0.))),
    "relu6": (lambda x: jnp.sqrt(jax.nn.relu6(x + 1.)),
              lambda x: jnp.where(x + 1. > 6., jnp.sqrt(6.),
                                  _fixed(x + 1. < 0, jnp.where(x + 1. > 0, x + 1., 0.)))),
    "relu of a where": (lambda x: jnp.sqrt(jax.nn.relu(jnp.where(x > 1., x, 0.))),
                        lambda x: _fixed(x <= 1., jnp.where(x > 1., x, 0.))),
}


def _loss(f):
    return lambda v: jnp.sum(f(v) * jnp.arange(1., 7.)) if f(v).ndim else f(v)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_mode_matches_the_hand_fix(name):
    f, hand = CASES[name]
    assert_bitwise(nan_safe(f)(X), jax.jit(f)(X))
    assert_close(nan_safe(f)(X), hand(X))
    safe = nan_safe(f)
    assert np.isnan(np.asarray(jax.jacfwd(f)(X))).any()  # plain JAX: the bug this fixes
    assert_close(jax.jacfwd(safe)(X), jax.jacfwd(hand)(X))
    assert_close(jax.jacrev(safe)(X), jax.jacrev(hand)(X))
    t = jnp.linspace(-1., 1., 6)
    assert_close(jax.jvp(safe, (X,), (t,))[1], jax.jvp(hand, (X,), (t,))[1])
    loss_safe, loss_hand = _loss(safe), _loss(hand)
    assert_close(jax.hessian(loss_safe)(X), jax.hessian(loss_hand)(X))


@pytest.mark.parametrize("name", ["where", "maximum", "constant mask", "pad", "relu"])
def test_every_order_and_transformation_matches_the_hand_fix(name):
    """Under jit and vmap, reverse over reverse and forward over forward: one case of each
    kind (a selection, a comparison re-decided as one, a product, a lane mover)."""
    f, hand = CASES[name]
    safe = nan_safe(f)
    t = jnp.linspace(-1., 1., 6)
    assert_close(jax.jit(jax.jacfwd(safe))(X), jax.jacfwd(hand)(X))
    assert_close(jax.vmap(lambda v: jax.jvp(safe, (v,), (t,))[1])(jnp.stack([X, X + 0.25])),
                 jax.vmap(lambda v: jax.jvp(hand, (v,), (t,))[1])(jnp.stack([X, X + 0.25])))
    loss_safe, loss_hand = _loss(safe), _loss(hand)
    assert_close(jax.jacrev(jax.grad(loss_safe))(X), jax.jacrev(jax.grad(loss_hand))(X))
    assert_close(jax.jacfwd(jax.jacfwd(safe))(X), jax.jacfwd(jax.jacfwd(hand))(X))


@pytest.mark.parametrize("f", [lambda x: jnp.log(jnp.where(x > 0, x, 0.)),
                               lambda x: 1. / jnp.where(x > 0, x, 0.),
                               lambda x: jnp.exp(jnp.where(x > 0, x, 1e30))],
                         ids=["log", "div", "exp"])
def test_a_singularity_that_the_forward_value_shows_takes_no_forward_mode_guard(f):
    """`log(0) = -inf`, `1 / 0 = inf`, an overflowing `exp`: the output lane is itself non-finite
    where the derivative is, so the forward value shows it (as a real singularity); no guard, and
    plain JAX's forward mode."""
    assert structure(jaxsafe.make_jaxpr(f)(X)) == structure(jax.make_jaxpr(f)(X))
    assert not np.isfinite(np.asarray(f(X))).all()


def test_a_singularity_of_a_lane_that_carries_stays():
    """`x >= 0` keeps x at 0 itself: sqrt's infinite derivative there is real."""
    f = lambda x: jnp.sqrt(jnp.where(x >= 0, x, 0.))
    x = jnp.array([-1., 0., 4.])
    jac = np.asarray(jax.jacfwd(nan_safe(f))(x))
    assert jac[0, 0] == 0 and np.isinf(jac[1, 1])
    assert_close(jac[2], np.array([0., 0., 0.25]))


def test_a_product_of_two_carrying_zeros_is_no_drop():
    """`sqrt(x * x)` at 0: both factors carry, the zero is the inputs' own (a real
    singularity), as for `sqrt(x) * sqrt(x)` in the product rule."""
    f = lambda x: jnp.sqrt(x * x)
    x = jnp.array([0., 2.])
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    assert np.isnan(np.asarray(jax.jacfwd(nan_safe(f))(x))[0, 0])


def _double_where(x):
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.)), 0.)


@pytest.mark.parametrize("f", [
    lambda x: jnp.sqrt(jnp.where(x > 0, x, 1.)),  # the double where's inner half
    lambda x: jnp.log(jnp.pad(jnp.abs(x) + 1., (1, 1), constant_values=1.)),
    lambda x: jnp.sqrt(2. * jnp.abs(x) + 1.),  # a nonzero literal factor
], ids=["inner", "pad-one", "scaled"])
def test_known_safe_constants_need_no_guard(f):
    """The lanes that carry nothing hold values known when the rewrite is planned, where the
    primitive and its derivative are finite: the program is unchanged."""
    assert structure(jaxsafe.make_jaxpr(f)(X)) == structure(jax.make_jaxpr(f)(X))
    assert_bitwise(nan_safe(f)(X), jax.jit(f)(X))


@pytest.mark.parametrize("f", [lambda x: jnp.sqrt(jnp.maximum(x, 1e-12)), _double_where],
                         ids=["clamp", "double-where"])
def test_known_safe_constants_take_no_forward_mode_guard(f):
    """(Other guards may stay: see issue 15 for hand-guarded code.)"""
    assert not any(site.free for site in nan_safe(f).trace(X)[1].sites)
    assert_close(jax.jacfwd(nan_safe(f))(X), jax.jacfwd(f)(X))


def test_a_zero_placeholder_inside_a_double_where_takes_no_guard():
    """jax-md's `safe_mask` puts 0 under the sqrt where the outer `where` drops the result: no
    lane is both live and free (no forward-mode guard), and the dropped lanes are already
    guarded by hand (`_by_hand.py`: the inner where stops their cotangent, the outer drops
    their tangent by selection), so nothing is added."""
    def f(x):
        mask = x > 0
        return jnp.where(mask, jnp.sqrt(jnp.where(mask, x, 0.)), 0.)
    assert nan_safe(f).trace(X)[1].sites == []
    assert_close(jax.jacfwd(nan_safe(f))(X), jax.jacfwd(f)(X))
    assert_close(jax.jacrev(nan_safe(f))(X), jax.jacrev(f)(X))
    assert_finite(jax.jacrev(nan_safe(f))(X))


def test_explain_names_the_forward_mode_guard():
    text = str(jaxsafe.explain(lambda x: jnp.sqrt(jnp.where(x > 0, x, 0.)))(X))
    assert "where it carries none (forward mode)" in text and "guarded sqrt" in text


def test_an_unknown_constant_under_the_hazard_is_guarded_where_zero():
    """A constant array of unknown values (a closed-over device array) in the lanes that carry
    nothing: guarded, and the hand fix's derivatives where it is zero."""
    data = jnp.array([0., 4., 0., 9., 1., 0.])
    f = lambda x: jnp.sqrt(jnp.where(x > 0, x, data))
    hand = lambda x: jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.)), jnp.sqrt(data))
    assert_bitwise(nan_safe(f)(X), jax.jit(f)(X))
    assert_close(jax.jacfwd(nan_safe(f))(X), jax.jacfwd(hand)(X))


# --------------------------------------------------------------------------- through a sum

ROWS = jnp.array([[3., 4.], [0., 0.], [1., -2.], [0.5, 0.]])
PADDED = jnp.array([True, False, True, True])  # row 1 is padding: a constant zero vector


def _padded_row_norms(x):
    return jnp.linalg.norm(jnp.where(PADDED[:, None], x, 0.), axis=1)


def _padded_row_norms_by_hand(x):
    s = jnp.sum(jnp.where(PADDED[:, None], x, 0.) ** 2, axis=1)
    return jnp.where(PADDED, jnp.sqrt(jnp.where(PADDED, s, 1.)), 0.)


def _padded_row_roots(x):
    return jnp.sqrt(jnp.sum(jnp.where(PADDED[:, None], jnp.abs(x), 0.), axis=1))


def _padded_row_roots_by_hand(x):
    s = jnp.sum(jnp.where(PADDED[:, None], jnp.abs(x), 0.), axis=1)
    return jnp.where(PADDED, jnp.sqrt(jnp.where(PADDED, s, 1.)), 0.)


@pytest.mark.parametrize("f,hand", [(_padded_row_norms, _padded_row_norms_by_hand),
                                    (_padded_row_roots, _padded_row_roots_by_hand)],
                         ids=["norm", "root of a sum"])
def test_a_sum_over_a_padded_row_carries_no_derivative(f, hand):
    """The norm of a padding row that a `where` filled with zeros: the row's sum carries no
    derivative, so `sqrt`'s infinite derivative at 0 meets an exact zero tangent (forward
    mode's NaN, in every column jacfwd mixes it into). Reverse mode was right already."""
    safe = nan_safe(f)
    assert_bitwise(safe(ROWS), jax.jit(f)(ROWS))
    assert np.isnan(np.asarray(jax.jacfwd(f)(ROWS))).any()  # plain JAX: the bug this fixes
    assert_close(jax.jacfwd(safe)(ROWS), jax.jacfwd(hand)(ROWS))
    assert_close(jax.jacrev(safe)(ROWS), jax.jacrev(hand)(ROWS))
    t = jnp.ones_like(ROWS)
    assert_close(jax.jvp(safe, (ROWS,), (t,))[1], jax.jvp(hand, (ROWS,), (t,))[1])
    loss = lambda g: lambda x: jnp.sum(g(x) * jnp.arange(1., 5.))
    assert_close(jax.hessian(loss(safe))(ROWS), jax.hessian(loss(hand))(ROWS))


def test_a_live_row_of_zeros_keeps_its_singularity():
    """A live row that sums to 0 carries its tangent: `sqrt`'s infinite derivative is real."""
    x = ROWS.at[2].set(0.)
    jac = np.asarray(jax.jacfwd(nan_safe(_padded_row_norms))(x))
    assert np.isnan(jac[2, 2]).all() and np.isfinite(jac[0]).all() and (jac[1] == 0).all()


def test_a_row_of_ones_sums_to_a_known_value():
    """optax's `safe_norm` form: the rows a `where` fills with ones sum to 2 (exactly, in any
    order), where `sqrt` is finite with its derivatives: nothing to guard. Rows of halves sum to
    exactly 1, where `arccos`'s derivative is infinite: forward mode's guard stays."""
    small = jnp.array([False, True, False, False])
    ones = lambda x: jnp.sqrt(jnp.sum(jnp.where(small[:, None], 1., x) ** 2, axis=1))
    assert structure(jaxsafe.make_jaxpr(ones)(ROWS)) == structure(jax.make_jaxpr(ones)(ROWS))
    # a row of two tenths squared: 2 * 0.010000001 is exact (a doubling), sqrt finite there
    tenths = lambda x: jnp.sqrt(jnp.sum(jnp.where(small[:, None], 0.1, x) ** 2, axis=1))
    assert structure(jaxsafe.make_jaxpr(tenths)(ROWS)) == \
        structure(jax.make_jaxpr(tenths)(ROWS))
    halves = lambda x: jnp.arccos(jnp.sum(jnp.where(small[:, None], 0.5, x / 8.), axis=1))
    by_hand = lambda x: jnp.where(small, jnp.arccos(1.), jnp.arccos(
        jnp.where(small, 0., jnp.sum(jnp.where(small[:, None], 0.5, x / 8.), axis=1))))
    assert np.isnan(np.asarray(jax.jacfwd(halves)(ROWS))).any()
    assert_close(jax.jacfwd(nan_safe(halves))(ROWS), jax.jacfwd(by_hand)(ROWS))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_the_forward_mode_guard_in_half_precision(dtype):
    """bfloat16 is not a NumPy `inexact` type: the check that a primitive's derivative is finite
    at the values such lanes hold took it for an integer and found nothing to guard."""
    x = jnp.array([-1., 4., 0.25], dtype)
    f = lambda x: jnp.sum(jnp.sqrt(jnp.where(x > 0, x, 0.)))
    hand = lambda x: jnp.sum(_fixed(x <= 0, jnp.where(x > 0, x, 0.)))
    assert np.isnan(np.asarray(jax.jacfwd(f)(x), np.float32)).any()
    np.testing.assert_array_equal(np.asarray(jax.jacfwd(nan_safe(f))(x), np.float32),
                                  np.asarray(jax.jacfwd(hand)(x), np.float32))


@pytest.mark.parametrize("name,f,hand", [
    ("padding ** 1.5",
     lambda x: jnp.sum(jnp.pad(x, (1, 0)) ** 1.5),
     lambda x: jnp.sum(jnp.pad(x, (1, 0), constant_values=1.) ** 1.5) - 1.),
    ("max(x, 0) ** 1.5",
     lambda x: jnp.sum(jnp.maximum(x, 0.) ** 1.5),
     lambda x: jnp.sum(jnp.where(x > 0, jnp.where(x > 0, x, 1.) ** 1.5, 0.))),
    ("where(x > 0, x, 0) ** 2.",
     lambda x: jnp.sum(jnp.where(x > 0, x, 0.) ** 2.),
     lambda x: jnp.sum(jnp.where(x > 0, jnp.where(x > 0, x, 1.) ** 2., 0.))),
])
def test_a_power_of_a_held_zero_is_guarded_for_forward_over_forward(name, f, hand):
    """`0. ** 1.5` is finite with its first derivative, not its second; `0. ** 2.` with its
    first two, not its third (JAX differentiates `y * x ** (y - 1)` again): forward over
    forward differentiates the lanes that carry no derivative to each order, as reverse mode's
    guards do not reach them."""
    x = jnp.array([0.25 if name.startswith("padding") else -2., 0.5, 4.])  # x > 0 under pad
    third = lambda g: jax.jacfwd(jax.jacfwd(jax.jacfwd(g)))  # noqa: E731
    assert not np.isfinite(np.asarray(third(f)(x))).all()  # plain JAX's NaN
    for order in (jax.jacfwd, lambda g: jax.jacfwd(jax.jacfwd(g)), third,
                  jax.hessian, lambda g: jax.jacrev(jax.jacrev(g))):
        got = order(nan_safe(f))(x)
        assert_finite(got)
        assert_close(got, order(hand)(x), rtol=1e-5)
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))


@pytest.mark.parametrize("name", ["relu", "relu6"])
def test_relu_at_its_kink_carries_nothing_in_forward_mode_as_in_reverse(name):
    """At exactly 0 (and 6 for relu6), the body's `max` ties, but the rule hands back an exact
    zero tangent (JAX's relu'(0) = 0): reverse mode reads the lane as dropped (0), and forward
    mode did not (NaN in every column a sum mixes it into)."""
    x = jnp.array([-1., 0., 0.5, 2., 5., 6., 7.])
    f = {"relu": lambda v: jnp.sqrt(jax.nn.relu(v)),
         "relu6": lambda v: jnp.sqrt(6. - jax.nn.relu6(v)) + jnp.sqrt(jax.nn.relu6(v))}[name]
    loss = lambda v: jnp.sum(f(v) * jnp.arange(1., 8.))  # noqa: E731

    def hand(v):
        kept = (v > 0) & (v < 6) if name == "relu6" else v > 0
        inner = jnp.where(kept, v, 1.)
        if name == "relu":
            return jnp.sum(jnp.where(kept, jnp.sqrt(inner), 0.) * jnp.arange(1., 8.))
        r = jnp.where(v >= 6, 6., jnp.where(v <= 0, 0., inner))
        return jnp.sum((jnp.where(kept, jnp.sqrt(6. - inner), jnp.sqrt(6. - r))
                        + jnp.where(kept, jnp.sqrt(inner), jnp.sqrt(r))) * jnp.arange(1., 8.))
    safe = nan_safe(loss)
    assert np.isnan(np.asarray(jax.jacfwd(loss)(x))).any()
    assert_close(jax.grad(safe)(x), jax.grad(hand)(x))
    assert_close(jax.jacfwd(safe)(x), jax.grad(hand)(x))
    assert_close(jax.jacfwd(safe)(x), jax.grad(safe)(x))


def test_a_product_with_relu_at_its_kink_carries_nothing_as_below_it():
    """`relu(v) * v` at v == 0: relu's rule takes its constant branch there (an exact zero
    tangent), so the product is that branch's constant 0 times v, as it is for v < 0: sqrt's
    infinite derivative meets a zero that carries nothing, in both modes (plain JAX: NaN)."""
    x = jnp.array([-1., 0., 0.5])
    for f in (lambda v: jnp.sqrt(jax.nn.relu(v) * v),
              lambda v: jnp.sqrt(jax.nn.relu(v) * jnp.exp(v))):
        safe = nan_safe(f)
        forward, reverse = np.diag(jax.jacfwd(safe)(x)), np.diag(jax.jacrev(safe)(x))
        assert np.isnan(np.diag(jax.jacrev(f)(x))[1])
        assert forward[0] == reverse[0] == 0. and forward[1] == reverse[1] == 0.
        assert_close(forward[2], np.diag(jax.jacrev(f)(x))[2])


# --------------------------------------------------------------------------- near a pole
# A pole shows in the forward value (`log(0) = -inf`), but near it, in finite precision, the
# value can be finite where the derivative overflows: `log(1e-5)` in float16 is -11.5, its
# derivative 1e5 is inf. Where a lane carries no derivative and holds such a value, forward
# mode's zero tangent meets that inf.

@pytest.mark.parametrize("name,f,hand,dtype", [
    ("log of a float16 clamp",
     lambda x: jnp.log(jnp.maximum(x, jnp.float16(1e-5))),
     lambda x: jnp.where(x > 1e-5, jnp.log(jnp.where(x > 1e-5, x, 1.)), jnp.log(jnp.float16(1e-5))),
     jnp.float16),
    ("rsqrt of a tiny placeholder",
     lambda x: lax.rsqrt(jnp.where(x > 0, x, 1e-30)),
     lambda x: jnp.where(x > 0, lax.rsqrt(jnp.where(x > 0, x, 1.)), lax.rsqrt(1e-30)),
     jnp.float32),
    ("reciprocal of a tiny placeholder",
     lambda x: 1. / jnp.where(x > 0, x, 1e-20),
     lambda x: jnp.where(x > 0, 1. / jnp.where(x > 0, x, 1.), 1e20),
     jnp.float32),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_held_value_near_a_pole_is_guarded_for_forward_mode(name, f, hand, dtype):
    """Hunt BA: the lanes that carry no derivative hold a known value where the primitive is
    finite and its derivative is not; plain JAX's forward mode is NaN there, reverse mode 0."""
    x = jnp.array([0., 2., 1e-6, -1.], dtype)
    assert np.isnan(np.asarray(jax.jacfwd(f)(x), np.float32)).any()
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    for order in (jax.jacfwd, jax.jacrev):
        got = np.asarray(order(nan_safe(f))(x), np.float32)
        np.testing.assert_array_equal(got, np.asarray(order(hand)(x), np.float32))
    assert_close(jax.hessian(nan_safe(f))(x[:2].astype(jnp.float32)),
                 jax.hessian(hand)(x[:2].astype(jnp.float32)))


def _normalized(v, eps):
    return v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), eps)


def _normalized_by_hand(v, eps):
    n = jnp.linalg.norm(jnp.where(jnp.any(v != 0, axis=-1, keepdims=True), v, 1.), axis=-1,
                        keepdims=True)
    big = jnp.linalg.norm(v, axis=-1, keepdims=True) > eps
    return jnp.where(big, v / jnp.where(big, n, 1.), v / eps)


@pytest.mark.parametrize("name,f,hand,dtype", [
    ("where divisor",
     lambda x: x / jnp.where(x > 1, x, 1e-20),
     lambda x: jnp.where(x > 1, x / jnp.where(x > 1, x, 1.), x / 1e-20), jnp.float32),
    ("normalize, float32",
     lambda v: _normalized(v, 1e-20), lambda v: _normalized_by_hand(v, 1e-20), jnp.float32),
    ("normalize, float16",
     lambda v: _normalized(v, jnp.float16(1e-3)),
     lambda v: _normalized_by_hand(v, jnp.float16(1e-3)), jnp.float16),
    ("scalar divisor",
     lambda v: v / jnp.maximum(jnp.sqrt(jnp.sum(v * v)), 1e-20),
     lambda v: _normalized_by_hand(v.reshape(1, -1), 1e-20).reshape(-1), jnp.float32),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_divisor_that_carries_nothing_beside_a_numerator_that_does(name, f, hand, dtype):
    """`v / jnp.maximum(norm(v), eps)` at `v = 0`: the constant wins, so the divisor's tangent
    is an exact zero, but the output carries `v`'s derivative. JAX's derivative in the
    divisor, `-v * y ** -2`, overflows at `eps = 1e-20` in float32 (or `1e-3` in float16):
    forward mode's `0 * inf`. The output is computed again there with the divisor's
    derivative cut; the reference is the double where, with the literal `eps` as divisor."""
    x = jnp.array([[0., 0., 0.], [3., 4., 0.5]], dtype)
    if name.startswith("scalar"):
        x = x[0]
    elif name.startswith("where"):
        x = jnp.array([0.5, 2., -1.], dtype)
    assert np.isnan(np.asarray(jax.jacfwd(f)(x), np.float32)).any()
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    rtol = 1e-2 if dtype == jnp.float16 else 1e-6
    for order in (jax.jacfwd, jax.jacrev):
        got = np.asarray(order(nan_safe(f))(x), np.float32)
        assert_close(got, np.asarray(order(hand)(x), np.float32), rtol=rtol)
    if dtype == jnp.float32:
        assert_close(jax.hessian(nan_safe(f))(x), jax.hessian(hand)(x), rtol=1e-5)
    text = str(jaxsafe.explain(f)(x))
    assert "beside operands that carry one" in text


@pytest.mark.parametrize("f", [
    lambda x: x / jnp.where(x > 1, x, 1.),  # 1 / 1 ** 2: finite
    lambda x: jnp.log(jnp.maximum(x, 1e-5)),  # float32: 1e5
    lambda x: x / jnp.where(x > 1, x, 1e-6),  # -x / 1e-12, -6 / 1e-24: finite in float32
], ids=["one", "log clamp", "small eps"])
def test_a_held_value_far_enough_from_the_pole_takes_no_forward_mode_guard(f):
    x = jnp.array([0.5, 2., -1.])
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    assert_close(jax.jacfwd(nan_safe(f))(x), jax.jacfwd(f)(x))


@pytest.mark.parametrize("name,f,hand", [
    ("masked numerator",
     lambda x, y: jnp.where(x > 0, x, 0.) / jnp.where(y > 0, y, 1e-20),
     lambda x, y: jnp.where(y > 0, jnp.where(x > 0, x, 0.) / jnp.where(y > 0, y, 1.),
                            jnp.where(x > 0, x, 0.) / 1e-20)),
    ("relu row normalized",
     lambda x, y: jax.nn.relu(x) * y / jnp.maximum(jnp.linalg.norm(jax.nn.relu(x)), 1e-20),
     lambda x, y: jnp.where(jnp.linalg.norm(jax.nn.relu(x)) > 1e-20,
                            jax.nn.relu(x) * y / jnp.where(
                                jnp.linalg.norm(jax.nn.relu(x)) > 1e-20,
                                jnp.linalg.norm(jnp.where(x > 0, x, 1.)), 1.),
                            jax.nn.relu(x) * y / 1e-20)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_divisor_cut_beside_an_output_that_carries_nothing_in_other_lanes(name, f, hand):
    """Hunt BD: where the output also had lanes that carry no derivative (a masked numerator),
    the divisor's cut was left out for the whole equation: `jacfwd` NaN where `jacrev` is
    finite. The two cuts take disjoint lanes now."""
    x, y = jnp.array([2., -1., 3.]), jnp.array([-1., 2., -3.])
    if name.startswith("relu"):
        x = jnp.array([-2., -1., -3.])  # every entry cut by the ReLU: the norm's clamp wins
    assert np.isnan(np.asarray(jax.jacfwd(f, argnums=(0, 1))(x, y))).any()
    assert_bitwise(nan_safe(f)(x, y), jax.jit(f)(x, y))
    for order in (jax.jacfwd, jax.jacrev):
        got = order(nan_safe(f), argnums=(0, 1))(x, y)
        want = order(hand, argnums=(0, 1))(x, y)
        for g, w in zip(got, want, strict=True):
            assert_close(g, w)
    assert_close(jax.hessian(nan_safe(f))(x, y), jax.hessian(hand)(x, y))
