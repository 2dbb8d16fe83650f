"""Code that is already guarded by hand gets no guard of its own (`_by_hand.py`).

Each program below is exactly as safe as its author made it: the rewritten program must be the
original (structurally equal, nothing to guard), and its derivatives of every order equal
plain JAX's. The programs that look guarded but are not (a masked product after the double
where, a parameter that multiplies the singular branch) must keep their guards, and their
derivatives must be the hand fix's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite, structure
from jax import lax

import jaxsafe

# numerics of whole programs, not tracing paths: without the leak checker (it turns JAX's
# tracing caches off, and every case here is differentiated to the second order)
pytestmark = pytest.mark.no_leak_check


def _assert_left_as_it_is(f, *args):
    """`explain` finds nothing to guard, and the rewritten program is the original."""
    report = str(jaxsafe.explain(f)(*args))
    assert report == "nothing to guard: the program runs unchanged", report
    assert structure(jaxsafe.make_jaxpr(f)(*args)) == structure(jax.make_jaxpr(f)(*args))


def safe_mask(mask, fn, operand, placeholder=0.0):
    """jax-md's `util.safe_mask`: the inner where puts 0 (a singular point of sqrt)."""
    masked = jnp.where(mask, operand, 0)
    return jnp.where(mask, fn(masked), placeholder)


def double_where(x):
    p = x > 0
    return jnp.where(p, jnp.sqrt(jnp.where(p, x, 1.0)), 0.0)


def double_where_at_zero(x):
    p = x > 0
    return jnp.where(p, jnp.sqrt(jnp.where(p, x, 0.0)), 0.0)


def twice_compared(x):
    """The predicate is computed twice, once per where, as hand fixes are often written."""
    return jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 0.0)), 0.0)


def masked_log(x, m):
    return jnp.sum(jnp.where(m, jnp.log(jnp.where(m, x, 1.0)), 0.0))


def chain(x):
    """A chain of NaN-prone steps between the two wheres."""
    p = x > 0.5
    y = jnp.where(p, x, 0.0)
    return jnp.where(p, jnp.log(jnp.sqrt(y) - 0.5) / y, 0.0)


def pair_distances(r):
    dr = r[:, None, :] - r[None, :, :]
    r2 = jnp.sum(dr ** 2, axis=-1)
    return safe_mask(r2 > 0, jnp.sqrt, r2)


def bounded_energy(r):
    """A cutoff after a distance whose predicate bounds the sqrt's operand into its domain."""
    dr = r[:, None, :] - r[None, :, :]
    r2 = jnp.sum(dr ** 2, axis=-1)
    d = safe_mask(r2 > 1e-12, jnp.sqrt, r2)
    return jnp.sum(safe_mask(d < 1.5, lambda d: (1 - d / 1.5) ** 2, d))


def cosine_similarity(a, b):
    """optax's `cosine_similarity` (epsilon 0): each norm's `sqrt` reads a sum of squares
    clipped at 0 from below, a `max` the constant never wins alone."""
    a_norm = jnp.sqrt(jnp.maximum(jnp.sum(a ** 2, axis=-1, keepdims=True), 0.0))
    b_norm = jnp.sqrt(jnp.maximum(jnp.sum(b ** 2, axis=-1, keepdims=True), 0.0))
    return jnp.sum((a / a_norm) * (b / b_norm))


def clipped_below(x):
    """`min(-x**2, 0.)`: the constant never wins alone either (the mirror of the `max`)."""
    return jnp.sum(jnp.sqrt(-jnp.minimum(-jnp.sum(x ** 2, axis=-1), 0.0)))


def entropy_by_hand(x):
    """`x * log(x)` written as a careful hand fix does (hunt U): the product's other factor
    carries no derivative in the dropped lanes, by the inner `where`, so an argument's NaN or
    -inf there meets only cotangents the selections stop."""
    return jnp.sum(jnp.where(x > 0, x * jnp.log(jnp.where(x > 0, x, 1.0)), 0.0))


X = jnp.array([-1.0, 0.0, 0.3, 0.5, 2.0])
X_BAD = jnp.array([-jnp.inf, jnp.nan, -1.0, 0.0, 2.0])
M = jnp.array([True, False, True, False, True])
R = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.2], [0.0, 1.2]])  # a coincident pair

UNCHANGED = [  # (name, f, args, finite_args, check the Hessian too)
    ("double where", lambda x: jnp.sum(double_where(x)), (X,), False, False),
    ("double where at a singular point", lambda x: jnp.sum(double_where_at_zero(x)), (X,),
     False, True),
    ("predicate computed twice", lambda x: jnp.sum(twice_compared(x)), (X,), False, True),
    ("where(m, x, 1.) before log", masked_log, (X, M), False, False),
    ("a chain between the wheres", lambda x: jnp.sum(chain(x)), (X,), False, True),
    ("pair distances (finite positions)", lambda r: jnp.sum(pair_distances(r)), (R,), True,
     False),
    ("bounded cutoff energy", bounded_energy, (R,), True, True),
    ("a sum of squares clipped at 0 (cosine similarity)", cosine_similarity,
     (R + 0.5, R[::-1] + 0.25), False, True),
    ("a sum of squares clipped at 0 by min", clipped_below, (R + 0.5,), False, True),
    ("x * log(x) by hand, NaN and -inf arguments", entropy_by_hand, (X_BAD,), False, True),
]


@pytest.mark.parametrize("name, f, args, finite, hessian", UNCHANGED,
                         ids=[c[0] for c in UNCHANGED])
def test_hand_guarded_code_is_left_as_it_is(name, f, args, finite, hessian):
    assert structure(jaxsafe.make_jaxpr(f, finite_args=finite)(*args)) == \
        structure(jax.make_jaxpr(f)(*args))
    assert str(jaxsafe.explain(f, finite_args=finite)(*args)) == \
        "nothing to guard: the program runs unchanged"
    safe = jaxsafe.nan_safe(f, finite_args=finite)
    # against JAX's jitted program: nan_safe runs one, whose rounding eager JAX's may not share
    assert_close(jax.grad(safe)(*args), jax.jit(jax.grad(f))(*args))
    assert_finite(jax.grad(safe)(*args))
    x = args[0]
    tangent = jnp.ones_like(x)
    assert_close(jax.jvp(lambda x: safe(x, *args[1:]), (x,), (tangent,)),
                 jax.jit(lambda x: jax.jvp(lambda x: f(x, *args[1:]), (x,), (tangent,)))(x))
    if hessian:  # compile-heavy: on the cases with a singular point or a chain
        assert_close(jax.hessian(safe)(*args), jax.jit(jax.hessian(f))(*args), atol=1e-6)


def test_optax_safe_norm_is_left_as_it_is():
    optax = pytest.importorskip("optax")
    f = lambda x: jnp.sum(optax.safe_norm(x, 1e-6, axis=-1))
    x = jnp.array([[0.0, 0.0], [3.0, 4.0]])
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    assert "nothing to guard" in str(jaxsafe.explain(f)(x))
    assert_close(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(f)(x))


def test_a_clip_that_never_wins_keeps_the_real_singularity():
    """At a zero vector the norm's `sqrt(0)` is the program's own singularity (the `max` ties,
    and a tie shares the derivative): NaN in plain JAX, NaN under nan_safe, in both modes."""
    a = jnp.array([[0.0, 0.0], [1.0, 2.0]])
    b = jnp.array([[1.0, 1.0], [3.0, 1.0]])
    safe = jaxsafe.nan_safe(cosine_similarity)
    grad, ref = jax.grad(safe)(a, b), jax.grad(cosine_similarity)(a, b)
    assert np.isnan(np.asarray(ref)[0]).all()
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(ref))
    tangents = (jnp.ones_like(a), jnp.ones_like(b))
    assert np.isnan(np.asarray(jax.jvp(safe, (a, b), tangents)[1]))


# --------------------------------------------------------------------------- still guarded


@pytest.mark.parametrize("f, hand", [
    (lambda x: jnp.sum(jnp.sqrt(jnp.maximum(x ** 2 - 1.0, 0.0))),
     lambda x: jnp.sum(jnp.where(x ** 2 > 1.0, jnp.sqrt(jnp.where(x ** 2 > 1.0, x ** 2 - 1.0,
                                                                    1.0)), 0.0))),
    (lambda x: jnp.sum(jnp.sqrt(-jnp.minimum(1.0 - x ** 2, 0.0))),
     lambda x: jnp.sum(jnp.where(x ** 2 > 1.0, jnp.sqrt(jnp.where(x ** 2 > 1.0, x ** 2 - 1.0,
                                                                    1.0)), 0.0))),
], ids=["max", "min"])
def test_a_clip_that_may_win_keeps_its_guard(f, hand):
    """`max(x**2 - 1, 0.)`: the constant wins alone where |x| < 1, and there `sqrt(0)`'s
    infinite derivative meets the zero tangent in forward mode (NaN in plain JAX)."""
    x = jnp.array([-2.0, -0.5, 0.25, 1.5, 3.0])
    assert np.isnan(np.asarray(jax.jacfwd(f)(x))).any()
    got = jax.jacfwd(jaxsafe.nan_safe(f))(x)
    assert_finite(got)
    assert_close(got, jax.jacfwd(hand)(x))
    assert_close(jax.hessian(jaxsafe.nan_safe(f))(x), jax.jit(jax.hessian(hand))(x), atol=1e-6)



def test_a_masked_product_after_the_double_where_keeps_its_guard():
    """Forward mode: `m * sqrt(where(p, x, 0))` weighs the dropped lane's `inf * 0` tangent
    by 0 instead of selecting it away: the hand fix is not complete there."""
    m = jnp.array([1.0, 0.0, 1.0, 0.0, 1.0])
    f = lambda x: jnp.sum(m * jnp.sqrt(jnp.where(x > 0, x, 0.0)))
    assert np.isnan(np.asarray(jax.jacfwd(f)(X))).any()
    got = jax.jacfwd(jaxsafe.nan_safe(f))(X)
    assert_finite(got)
    assert_close(jax.grad(jaxsafe.nan_safe(f))(X), got)


@pytest.mark.parametrize("how", ["masked_product", "dropped_after_the_select"])
def test_x_log_x_by_hand_keeps_its_guard_where_a_product_drops_it(how):
    """The hand fix's selections stop the `0 * NaN` only where a selection drops the lanes: a
    product mask on the product (`m * (x * log(...))`), or after the `where` (`m * where(...)`
    with an inf in a lane the `where` takes and `m` drops), weighs forward mode's NaN tangent by
    0, so the argument keeps its guard and every derivative is the hand fix's."""
    m = jnp.array([1.0, 0.0, 1.0, 0.0, 0.0])
    x = jnp.array([2.0, -jnp.inf, 0.5, jnp.nan, jnp.inf])

    def f(x):
        if how == "masked_product":
            return jnp.sum(m * (x * jnp.log(jnp.where(x > 0, x, 1.0))))
        return jnp.sum(m * jnp.where(x > 0, x * jnp.log(jnp.where(x > 0, x, 1.0)), 0.0))

    def hand(x):
        x = jnp.where(m > 0, x, 1.0)
        return jnp.sum(m * jnp.where(x > 0, x * jnp.log(jnp.where(x > 0, x, 1.0)), 0.0))

    safe = jaxsafe.nan_safe(f)
    assert np.isnan(np.asarray(jax.jacfwd(f)(x))).any()
    assert_close(jax.jacfwd(safe)(x), jax.jacfwd(hand)(x))
    assert_close(jax.grad(safe)(x), jax.grad(hand)(x))


def test_a_power_whose_exponent_is_the_raw_argument_keeps_its_guard():
    """Hunt W: `where(x > 0, where(x > 0, x, 1.) ** x, 0.)`: the base carries no derivative in
    the dropped lanes, by selection, but the exponent's own derivative has a cross term with the
    base's zero tangent, `x * L ** (x - 1) * 0`, NaN for a NaN `x`: the Hessian's dropped rows
    would be NaN without the guard (the gradient is right either way)."""
    f = lambda x: jnp.sum(jnp.where(x > 0, jnp.where(x > 0, x, 1.0) ** x, 0.0))  # noqa: E731

    def hand(x):
        s = jnp.where(x > 0, x, 1.0)
        return jnp.sum(jnp.where(x > 0, s ** s, 0.0))

    x = jnp.array([-jnp.inf, jnp.nan, -1.0, 2.0])
    safe = jaxsafe.nan_safe(f)
    assert_close(jax.grad(safe)(x), jax.grad(hand)(x))
    assert_close(jax.hessian(safe)(x), jax.hessian(hand)(x))
    assert_close(jax.jacfwd(jax.grad(safe))(x), jax.hessian(hand)(x))


def test_a_parameter_that_multiplies_the_singular_branch_keeps_a_guard():
    """`log(where(p, x, 0.)) * w`: the zero cotangent meets log(0) = -inf in w's derivative."""
    def f(x, w):
        p = x > 0
        return jnp.sum(jnp.where(p, jnp.log(jnp.where(p, x, 0.0)) * w, 0.0))

    w = jnp.linspace(1.0, 2.0, 5)
    assert np.isnan(np.asarray(jax.grad(f, 1)(X, w))).any()
    got = jax.grad(jaxsafe.nan_safe(f), (0, 1))(X, w)
    hand = lambda x, w: jnp.sum(jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)) * w, 0.0))
    assert_close(got, jax.grad(hand, (0, 1))(X, w))


def test_a_predicate_that_admits_subnormals_does_not_bound_the_sqrt():
    """`r2 > 0` admits subnormal r2, whose sqrt XLA may flush to 0 (derivative inf) and whose
    log has an infinite derivative where it does not: in the lanes a later cutoff drops, it is
    no proof of the domain, and the guard stays. `r2 > 1e-12` is one (`bounded_energy`).
    Nor is the smallest normal number one: the second derivative of `sqrt` there overflows
    (`x ** -1.5`), and a Hessian would read it in the lanes a later drop removes."""
    def f(r2):
        d = safe_mask(r2 > 0, jnp.sqrt, r2)
        return jnp.sum(safe_mask(d > 2.0, jnp.log, d))

    r2 = jnp.array([1e-30, 9.0, 0.0], jnp.float32)
    assert "guarded sqrt" in str(jaxsafe.explain(f)(r2))
    assert_close(jax.grad(jaxsafe.nan_safe(f))(r2), jnp.array([0.0, 1 / 18, 0.0]), rtol=1e-6)
    # the lane 1e-30 passes `r2 > 0` and the log's where drops it: sqrt'' there is inf
    hessian = jax.hessian(jaxsafe.nan_safe(f, finite_args=True))(r2)
    assert_close(hessian, jnp.diag(jnp.array([0.0, -0.5 / 81, 0.0])), rtol=1e-6)


def test_a_bound_too_close_to_zero_for_the_hessian_keeps_the_guard():
    """`r2 > 1e-30` keeps `sqrt` and its first derivative finite, not its second
    (`x ** -1.5 / 4` overflows float32 there): a Hessian would read it in the lanes the log's
    where drops. A bound proves the domain up to the third order (`PROOF_ORDER`)."""
    def f(r2):
        d = safe_mask(r2 > 1e-30, jnp.sqrt, r2)
        return jnp.sum(safe_mask(d > 2.0, jnp.log, d))

    r2 = jnp.array([2e-30, 9.0], jnp.float32)
    assert np.isnan(np.asarray(jax.hessian(f)(r2))).any()
    assert "guarded sqrt" in str(jaxsafe.explain(f, finite_args=True)(r2))
    assert_close(jax.hessian(jaxsafe.nan_safe(f, finite_args=True))(r2),
                 jnp.diag(jnp.array([0.0, -0.5 / 81])), rtol=1e-6)


# --------------------------------------------------------------------------- whole powers


def test_a_whole_power_keeps_its_guard_for_the_third_derivative():
    """`x ** 2.` is finite with its first two derivatives for every finite x, but not at every
    order: JAX's derivative `y * x ** (y - 1)` selects 0 where `y == 0`, and its untaken
    `x ** -1.` is inf at 0, so the third reverse-mode derivative at a base of 0 is NaN. A dropped
    lane with a base of 0 needs the guard, whether the exponent is a literal or a constant."""
    alpha = jnp.float32(2.0)  # a constant of the program, not a literal

    def f(x):
        return jnp.where(x < 1.0, (1.0 - x) ** 2.0 + (1.0 - x) ** alpha, 0.0)

    def hand(x):
        keep = x < 1.0
        y = jnp.where(keep, x, 0.0)
        return jnp.where(keep, (1.0 - y) ** 2.0 + (1.0 - y) ** alpha, 0.0)

    third = lambda g: jax.grad(jax.grad(jax.grad(g)))
    assert np.isnan(third(f)(1.0))  # the lane x = 1 is dropped, its base is 0
    safe = jaxsafe.nan_safe(f, finite_args=True)
    for x in (1.0, 0.5, 3.0):
        for order in (jax.grad, lambda g: jax.grad(jax.grad(g)), third):
            assert_close(order(safe)(x), order(hand)(x))


@pytest.mark.parametrize("exponent", [2.5, 0.5, -1.0])
def test_a_power_that_is_not_whole_keeps_its_guard(exponent):
    """NaN below 0 (2.5, 0.5) or a pole at 0 (-1.): finite operands are not enough."""
    y = jnp.float32(exponent)

    def f(x):
        return jnp.sum(jnp.where(x > 0.0, x ** y, 0.0))

    x = jnp.array([-1.0, 0.0, 0.5, 2.0])
    assert "guarded pow" in str(jaxsafe.explain(f, finite_args=True)(x))
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()
    hand = lambda x: jnp.sum(jnp.where(x > 0.0, jnp.where(x > 0.0, x, 1.0) ** y, 0.0))
    assert_close(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x), jax.grad(hand)(x))


def assert_same_to_the_third_order(safe, ref, x):
    """Values and derivatives of orders 1 to 3 equal the reference's, the third finite. Each
    under `jax.jit`: eager JAX compiles every primitive of a Hessian on its own (seconds)."""
    assert_close(safe(x), jax.jit(ref)(x))
    assert_close(jax.jit(jax.grad(safe))(x), jax.jit(jax.grad(ref))(x), atol=1e-6)
    assert_close(jax.jit(jax.hessian(safe))(x), jax.jit(jax.hessian(ref))(x), atol=1e-5)
    third = jax.jit(jax.jacfwd(jax.hessian(safe)))(x)
    assert_finite(third)
    assert_close(third, jax.jit(jax.jacfwd(jax.hessian(ref)))(x), atol=1e-5)


def _soft_sphere_terms(r, pairs=None):
    """jax-md's soft sphere on every pair of `r` (or on `pairs` only): `sqrt` of a sum of
    squares under `safe_mask(r2 > 0)`, then `(1 - d / 1.5) ** 2.` under a cutoff, then
    `nan_to_num`."""
    i, j = (slice(None), None), (None, slice(None))  # every pair
    if pairs is not None:
        i, j = pairs
    dr = r[i] - r[j]
    r2 = jnp.sum(dr ** 2, axis=-1)
    d = safe_mask(r2 > 0, jnp.sqrt, r2)
    e = safe_mask(d < 1.5, lambda d: (1.0 - d / 1.5) ** jnp.float32(2.0), d)
    return jnp.nan_to_num(e)


def test_a_soft_sphere_with_finite_positions_needs_no_guard():
    """jax-md's soft sphere without its diagonal mask: the `sqrt` lanes `r2 > 0` keeps are
    dropped by the cutoff only where `d >= 1.5`, so `r2 >= 2.25` there; the power's base
    `1 - where(d < 1.5, d, 0) / 1.5` is in [2**-24, 1] in every lane, where `x ** 2.` is finite
    with its derivatives; and the NaN tests of `nan_to_num` read a value finite in every lane,
    so they drop nothing. Every derivative, to the third, is the one of the program on the
    pairs the cutoff keeps (the coincident pair and the diagonal included: `safe_mask` gives
    them a zero derivative, in both)."""
    energy = lambda r: jnp.sum(_soft_sphere_terms(r))
    assert str(jaxsafe.explain(energy, finite_args=True)(R)) == \
        "nothing to guard: the program runs unchanged"
    n = R.shape[0]
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    dist = np.sqrt(np.sum((np.asarray(R)[:, None] - np.asarray(R)[None]) ** 2, axis=-1))
    keep = dist < 1.5
    assert not keep.all()  # the cutoff drops pairs here
    kept = lambda r: jnp.sum(_soft_sphere_terms(r, (i[keep], j[keep])))
    assert_same_to_the_third_order(jaxsafe.nan_safe(energy, finite_args=True), kept, R)


def test_a_power_whose_base_may_reach_zero_in_a_dropped_lane_keeps_its_guard():
    """`where(d <= 1, d, 0)` admits d = 1, and `1 - 1` is 0: the third derivative of `x ** 2.`
    at a base of 0 is NaN (JAX's untaken `x ** -1.`), in a lane the outer `d < 1` drops."""
    def f(x):
        d = x ** 2
        return jnp.sum(jnp.where(d < 1.0, (1.0 - jnp.where(d <= 1.0, d, 0.0)) ** 2.0, 0.0))

    def hand(x):
        d = x ** 2
        return jnp.sum(jnp.where(d < 1.0, (1.0 - jnp.where(d < 1.0, d, 0.0)) ** 2.0, 0.0))

    x = jnp.array([1.0, 0.5, 3.0])
    third = lambda g: jax.jacfwd(jax.hessian(g))
    assert np.isnan(np.asarray(third(f)(x))).any()
    assert "guarded pow" in str(jaxsafe.explain(f, finite_args=True)(x))
    got = third(jaxsafe.nan_safe(f, finite_args=True))(x)
    assert_finite(got)
    assert_close(got, third(hand)(x))


def test_a_power_that_overflows_at_an_end_of_its_base_keeps_its_guard():
    """The base is in [2**-24, 1], but `x ** -30.` overflows near 2**-24, in lanes `d < 0.5`
    drops (`d` close to 1): no proof, the guard stays. With the base in [1, 2] there is one."""
    def f(x, shift=1.0):
        d = x ** 2
        base = shift - jnp.where(d < 1.0, d, 0.0)
        return jnp.sum(jnp.where(d < 0.5, base ** -30.0, 0.0))

    def hand(x):
        d = x ** 2
        return jnp.sum(jnp.where(d < 0.5, (1.0 - jnp.where(d < 0.5, d, 0.0)) ** -30.0, 0.0))

    x = jnp.array([0.99999994, 0.5, 3.0], jnp.float32)
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()
    assert "guarded pow" in str(jaxsafe.explain(f, finite_args=True)(x))
    assert_close(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x), jax.grad(hand)(x))
    g = lambda x: f(x, 2.0)
    assert "nothing to guard" in str(jaxsafe.explain(g, finite_args=True)(x))


# --------------------------------------------------------------------------- a later cutoff's bound

PAIRS_I, PAIRS_J = np.triu_indices(4, 1)
# four particles: a pair exactly at the cutoff (dropped: `r < 2.5` fails), pairs inside it,
# and one far out
CUTOFF_R = jnp.array([[0.0, 0.0, 0.0], [2.5, 0.0, 0.0], [0.0, 1.0, 0.5], [40.0, 3.0, -7.0]])


def _pair_r(x):
    d = x[PAIRS_I] - x[PAIRS_J]
    return jnp.sqrt(jnp.sum(d ** 2, axis=-1))


def cutoff_energy(x):
    """A cutoff on a distance, no hand guard: `sqrt`'s dropped lanes are those with
    `r >= 2.5`, where `r2 >= 6.25` keeps it finite with its derivatives."""
    r = _pair_r(x)
    return jnp.sum(jnp.where(r < 2.5, (1.0 - r / 2.5) ** 2, 0.0))


def cutoff_energy_nan_to_num(x):
    """The same, through `nan_to_num`: the NaN tests read a value that is finite in every lane,
    so the lanes they would drop do not exist."""
    r = _pair_r(x)
    return jnp.sum(jnp.nan_to_num(jnp.where(r < 2.5, 1.0 - r / 2.5, 0.0) ** 2))


def _kept_pairs_energy(x0):
    """The reference: JAX on the program with the dropped pairs removed (chosen at x0)."""
    keep = np.asarray(_pair_r(x0) < 2.5)
    i, j = PAIRS_I[keep], PAIRS_J[keep]

    def energy(x):
        r = jnp.sqrt(jnp.sum((x[i] - x[j]) ** 2, axis=-1))
        return jnp.sum((1.0 - r / 2.5) ** 2)
    return energy


@pytest.mark.parametrize("f", [cutoff_energy, cutoff_energy_nan_to_num],
                         ids=["cutoff", "cutoff through nan_to_num"])
def test_a_cutoff_on_a_distance_bounds_the_root_in_the_lanes_it_drops(f):
    """Where `r < 2.5` fails, `r = sqrt(r2) >= 2.5` (r is never NaN for finite positions):
    `r2 >= 6.25` there, and `sqrt` is finite with its derivatives to the third order. Nothing is
    guarded, and every derivative is the one of the program without the dropped pairs."""
    x = CUTOFF_R
    assert str(jaxsafe.explain(f, finite_args=True)(x)) == \
        "nothing to guard: the program runs unchanged"
    assert structure(jaxsafe.make_jaxpr(f, finite_args=True)(x)) == \
        structure(jax.make_jaxpr(f)(x))
    assert_same_to_the_third_order(jaxsafe.nan_safe(f, finite_args=True), _kept_pairs_energy(x), x)


def test_a_cutoff_on_a_root_of_what_may_be_negative_keeps_the_guard():
    """`sqrt(r2) < 2.5` fails where r2 < 0 too (NaN compares false): that lane is dropped,
    and its `sqrt` is not in the domain. The guard stays, as it does behind a NaN test."""
    def f(r2):
        r = jnp.sqrt(r2)
        return jnp.sum(jnp.where(r < 2.5, (1.0 - r / 2.5) ** 2, 0.0))

    def g(r2):
        r = jnp.sqrt(r2)
        return jnp.sum(jnp.nan_to_num(jnp.where(r < 2.5, 1.0 - r / 2.5, 0.0)))

    r2 = jnp.array([-1.0, 9.0, 1.0])
    for fun, live in ((f, 2 * 0.6 * -0.4 * 0.5), (g, -0.4 * 0.5)):
        assert np.isnan(np.asarray(jax.grad(fun)(r2))).any()
        assert "guarded sqrt" in str(jaxsafe.explain(fun, finite_args=True)(r2))
        assert_close(jax.grad(jaxsafe.nan_safe(fun, finite_args=True))(r2),
                     jnp.array([0.0, 0.0, live]), rtol=1e-6)


@pytest.mark.parametrize("f", [
    lambda x: jnp.sum(jnp.where((x < 4.0).T, jnp.sqrt(x), 0.0)),
    lambda x: jnp.sum(jnp.where(x < 4.0, jnp.sqrt(x).T, 0.0)),
], ids=["transposed predicate", "transposed value"])
def test_a_predicate_on_other_lanes_does_not_bound_the_operand(f):
    """`sqrt(x)[0, 1]` is dropped because x[1, 0] >= 4, which says nothing of x[0, 1] = -1:
    the guard stays."""
    x = jnp.array([[1.0, -1.0], [5.0, 1.0]])
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()
    assert "guarded sqrt" in str(jaxsafe.explain(f, finite_args=True)(x))
    assert_close(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x),
                 jnp.array([[0.5, 0.0], [0.5 / np.sqrt(5.0), 0.5]]))


def test_a_cutoff_too_close_to_zero_for_the_hessian_keeps_the_guard():
    """Where `sqrt(r2) < 1e-15` fails, r2 >= 1e-30: `sqrt` and its first derivative are finite
    there, not its second (`x ** -1.5 / 4` overflows float32). The guard stays for the
    Hessian's sake."""
    def f(r2):
        r = jnp.sqrt(r2)
        return jnp.sum(jnp.where(r < 1e-15, 1.0 - r, 0.0))

    r2 = jnp.array([2e-30, 9.0], jnp.float32)
    assert np.isnan(np.asarray(jax.hessian(f)(r2))).any()
    assert "guarded sqrt" in str(jaxsafe.explain(f, finite_args=True)(r2))
    assert_close(jax.hessian(jaxsafe.nan_safe(f, finite_args=True))(r2), jnp.zeros((2, 2)))


def test_a_selection_on_a_literal_predicate_has_a_range_too():
    """`lax.select_n(True, ...)` (a predicate the program fixed): its range is its cases' hull,
    and the analysis reads it without failing."""
    from jax import lax

    def f(x):
        d = lax.select_n(True, jnp.zeros_like(x), x ** 2)
        return jnp.sum(jnp.where(d < 1.0, (2.0 - jnp.where(d < 1.0, d, 0.0)) ** 2.5, 0.0))

    x = jnp.array([0.5, 3.0])
    assert "nothing to guard" in str(jaxsafe.explain(f, finite_args=True)(x))
    assert_close(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x), jax.grad(f)(x))
    from jaxsafe._bounds import of_program
    closed = jax.make_jaxpr(lambda x: lax.select_n(True, jnp.sqrt(x), x * 2.0))(1.0)
    assert of_program(closed).range_of(closed.jaxpr.outvars[0]) is None  # sqrt: no range known


# --------------------------------------------------------------------------- a pair matrix's
# diagonal: jax-md's `smap` computes every ordered pair, then drops the diagonal by multiplying
# with `1 - eye(n)` (`smap._diagonal_mask`)

def _without_diagonal(terms, eye=jnp.eye):
    """`smap`'s pair sum: every ordered pair, the diagonal dropped by a `1 - eye` factor."""
    def energy(r):
        n = r.shape[0]
        return 0.5 * jnp.sum((1.0 - eye(n, dtype=r.dtype)) * terms(r))
    return energy


def _off_diagonal_reference(terms_on_pairs, r0, keep=None):
    """JAX on the program with the dropped pairs removed: the diagonal (and the pairs `keep`
    leaves out), chosen at r0."""
    n = r0.shape[0]
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    kept = i != j if keep is None else (i != j) & keep
    return lambda r: 0.5 * jnp.sum(terms_on_pairs(r, (i[kept], j[kept])))


def test_a_pair_matrix_whose_diagonal_a_mask_drops_needs_no_guard():
    """On the diagonal, `r2 = sum((x_i - x_i) ** 2)` is exactly 0 for finite positions, so
    `r2 > 0` fails there and `safe_mask` has already put its constant under `sqrt`: the lanes
    `1 - eye(n)` drops are lanes the double where made harmless (`_diagonal.py`). Nothing to
    guard, and every derivative to the third is JAX's on the off-diagonal pairs the cutoff
    keeps (the coincident pair included)."""
    energy = _without_diagonal(_soft_sphere_terms)
    assert str(jaxsafe.explain(energy, finite_args=True)(R)) == \
        "nothing to guard: the program runs unchanged"
    dist = np.sqrt(np.sum((np.asarray(R)[:, None] - np.asarray(R)[None]) ** 2, axis=-1))
    assert not (dist < 1.5).all()
    kept = _off_diagonal_reference(_soft_sphere_terms, R, dist < 1.5)
    assert_same_to_the_third_order(jaxsafe.nan_safe(energy, finite_args=True), kept, R)


def test_the_diagonal_proof_needs_finite_positions():
    """`x_i - x_i` is NaN for an infinite or NaN position: without `finite_args` the guard
    stays, and the live pairs' derivatives are unchanged."""
    energy = _without_diagonal(_soft_sphere_terms)
    assert "guarded sqrt" in str(jaxsafe.explain(energy)(R))
    dist = np.sqrt(np.sum((np.asarray(R)[:, None] - np.asarray(R)[None]) ** 2, axis=-1))
    kept = _off_diagonal_reference(_soft_sphere_terms, R, dist < 1.5)
    assert_same_to_the_third_order(jaxsafe.nan_safe(energy), kept, R)


def _unmasked_root_terms(r, pairs=None):
    """`sqrt` under `r2 >= 0`: on the diagonal it reads `r2 = 0`, infinite derivative."""
    i, j = (slice(None), None), (None, slice(None))
    if pairs is not None:
        i, j = pairs
    r2 = jnp.sum((r[i] - r[j]) ** 2, axis=-1)
    return safe_mask(r2 >= 0, jnp.sqrt, r2)


def test_a_predicate_that_holds_on_the_diagonal_keeps_the_guard():
    """`r2 >= 0` holds where `r2 = 0`: the diagonal's `sqrt(0)` meets the zero of `1 - eye`, a
    NaN in plain JAX's gradient, which the guard removes (the pairs apart are unchanged)."""
    r = R[:3]  # no coincident pair: the reference is finite
    energy = _without_diagonal(_unmasked_root_terms)
    assert not np.isfinite(np.asarray(jax.jit(jax.grad(energy))(r))).all()
    assert "guarded sqrt" in str(jaxsafe.explain(energy, finite_args=True)(r))
    kept = _off_diagonal_reference(_unmasked_root_terms, r)
    safe = jaxsafe.nan_safe(energy, finite_args=True)
    assert_close(jax.grad(safe)(r), jax.jit(jax.grad(kept))(r), atol=1e-6)
    assert_close(jax.hessian(safe)(r), jax.jit(jax.hessian(kept))(r), atol=1e-5)


def _shifted_eye(n, dtype):
    return jnp.eye(n, k=1, dtype=dtype)


def _other_positions_terms(r, pairs=None):
    """`x[None] - y[:, None]` with `y = x + 0.`: not one array read twice."""
    i, j = (slice(None), None), (None, slice(None))
    if pairs is not None:
        i, j = pairs
    r2 = jnp.sum((r[i] - (r + 0.0)[j]) ** 2, axis=-1)
    return safe_mask(r2 > 0, jnp.sqrt, r2)


@pytest.mark.parametrize("terms, eye", [(_soft_sphere_terms, _shifted_eye),
                                        (_other_positions_terms, jnp.eye)],
                         ids=["eye shifted off the diagonal", "two arrays"])
def test_a_mask_off_the_zero_diagonal_keeps_the_guard(terms, eye):
    """A mask that drops another diagonal (`eye(n, k=1)`), or pairs of two arrays (whose
    diagonal is not known to be 0): no proof, the guard stays, the live lanes unchanged."""
    energy = _without_diagonal(terms, eye)
    assert "guarded sqrt" in str(jaxsafe.explain(energy, finite_args=True)(R))
    safe = jaxsafe.nan_safe(energy, finite_args=True)
    assert_close(jax.grad(safe)(R), jax.grad(jax.jit(energy))(R), atol=1e-6)


# --------------------------------------------------------------------------- an exp bounded above

PAIRS = (np.array([0, 0, 0, 1, 1, 2]), np.array([1, 2, 3, 2, 3, 3]))  # (2, 3) coincide in R


def _morse_terms(r, alpha=-5.0, pairs=PAIRS):
    """jax-md's Morse energy on pairs: `(1 - exp(alpha * (d - 1))) ** 2.` of a distance
    d >= 0 under `safe_mask`, then `nan_to_num`. With alpha < 0 the `exp` is at most
    `exp(-1.3 * alpha)`: the energy is finite in every lane, and `nan_to_num` drops nothing.
    (No pair of `R` sits at the minimum, d = 1.3, where JAX's own third derivative of
    `x ** 2.` at 0 is NaN.)"""
    r2 = jnp.sum((r[pairs[0]] - r[pairs[1]]) ** 2, axis=-1)
    d = safe_mask(r2 > 0, jnp.sqrt, r2)
    u = 5.0 * (1.0 - jnp.exp(alpha * (d - 1.3))) ** jnp.float32(2.0) - 5.0
    return jnp.nan_to_num(u)


def test_an_exp_bounded_above_needs_no_guard():
    """`exp(-5 * (d - 1.3))` for d >= 0 is at most e**6.5, with every derivative: the energy is
    finite, so the NaN tests of `nan_to_num` drop no lane, and the power's base is never
    dropped. The program runs unchanged; its derivatives to the third are JAX's on the pairs
    that do not coincide (the coincident pair's energy is a constant: `safe_mask`)."""
    energy = lambda r: jnp.sum(_morse_terms(r))
    assert str(jaxsafe.explain(energy, finite_args=True)(R)) == \
        "nothing to guard: the program runs unchanged"
    apart = (PAIRS[0][:-1], PAIRS[1][:-1])
    constant = float(_morse_terms(R)[-1])
    kept = lambda r: jnp.sum(_morse_terms(r, pairs=apart)) + constant
    assert_same_to_the_third_order(jaxsafe.nan_safe(energy, finite_args=True), kept, R)


def test_a_cutoff_exp_bounded_above_needs_no_guard():
    def f(r):
        r2 = jnp.sum((r[:, None] - r[None]) ** 2, axis=-1)
        d = safe_mask(r2 > 0, jnp.sqrt, r2)
        return jnp.sum(jnp.where(d < 1.5, jnp.exp(-5.0 * (d - 1.0)), 0.0))

    assert str(jaxsafe.explain(f, finite_args=True)(R)) == \
        "nothing to guard: the program runs unchanged"


def test_an_exp_unbounded_above_keeps_its_guard():
    """`exp(5 * (d - 1.3))` overflows for a far pair: the energy is inf there, `nan_to_num` drops
    it, and its zero cotangent meets the infinite derivative (NaN in plain JAX). nan_safe's
    derivatives are those of the pairs that are not that far."""
    energy = lambda r: jnp.sum(_morse_terms(r, alpha=5.0))
    far = R.at[0].set(jnp.array([40.0, 0.0]))
    assert np.isnan(np.asarray(jax.jit(jax.grad(energy))(far))).any()
    assert "guarded exp" in str(jaxsafe.explain(energy, finite_args=True)(far))
    near = (PAIRS[0][3:], PAIRS[1][3:])  # the pairs without particle 0
    kept = lambda r: jnp.sum(_morse_terms(r, alpha=5.0, pairs=near))
    got = jax.grad(jaxsafe.nan_safe(energy, finite_args=True))(far)
    assert_finite(got)
    assert_close(got, jax.jit(jax.grad(kept))(far))
    assert_close(jax.hessian(jaxsafe.nan_safe(energy, finite_args=True))(far),
                 jax.jit(jax.hessian(kept))(far), atol=1e-5)


@pytest.mark.parametrize("top, proven", [(80.0, True), (88.8, False)])
def test_an_exp_is_proven_only_below_its_overflow(top, proven):
    """float32 `exp` overflows just above 88.72: a range that ends at 80 proves it, one that
    ends at 88.8 does not, and there plain JAX's gradient of the dropped lane is NaN."""
    def f(x):
        t = top - x ** 2  # at most `top`
        return jnp.sum(jnp.where(x < 1.0, jnp.exp(t), 0.0))

    x = jnp.array([0.0, 0.5, 2.0])
    explained = str(jaxsafe.explain(f, finite_args=True)(x))
    assert ("guarded exp" not in explained) == proven
    if not proven:
        assert np.isnan(np.asarray(jax.grad(f)(x))).any()
        hand = lambda x: jnp.sum(jnp.where(x < 1.0, jnp.exp(jnp.where(x < 1.0, top - x ** 2,
                                                                       0.0)), 0.0))
        assert_close(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x), jax.grad(hand)(x))


def test_a_power_of_a_bounded_base_that_crosses_zero_is_finite():
    """`(1 - e) ** 2.` with e in [0, e**5] crosses 0: its values are finite there (a whole
    exponent), though its third derivative at 0 is not; the range says the first, the guard
    table still decides the second."""
    from jaxsafe._bounds import of_program
    from jaxsafe._flatten import flatten, inline_scalar_constants
    f = lambda x: (1.0 - jnp.exp(-5.0 * (x ** 2 - 1.0))) ** jnp.float32(2.0)
    closed = inline_scalar_constants(flatten(jax.make_jaxpr(f)(X)))
    lo, hi = of_program(closed).range_of(closed.jaxpr.outvars[0])
    assert lo == 0.0 and np.isfinite(hi)
    assert hi >= (np.exp(np.float32(5.0)) - 1) ** 2
    g = lambda x: (1.0 - jnp.exp(-5.0 * (x ** 2 - 1.0))) ** jnp.float32(2.5)  # not whole
    closed = inline_scalar_constants(flatten(jax.make_jaxpr(g)(X)))
    assert of_program(closed).range_of(closed.jaxpr.outvars[0]) is None


def _morse_on_all_pairs(r, pairs=None, sigma=1.3):
    """`_morse_terms` on every ordered pair (the diagonal included, as `smap` computes it)."""
    i, j = (slice(None), None), (None, slice(None))
    if pairs is not None:
        i, j = pairs
    r2 = jnp.sum((r[i] - r[j]) ** 2, axis=-1)
    d = safe_mask(r2 > 0, jnp.sqrt, r2)
    return jnp.nan_to_num(5.0 * (1.0 - jnp.exp(-5.0 * (d - sigma))) ** jnp.float32(2.0) - 5.0)


def test_a_power_in_its_domain_on_the_dropped_diagonal_needs_no_guard():
    """On the diagonal `1 - eye` drops, `safe_mask` puts 0 under the distance, so the power's
    base is `1 - exp(5 * 1.3)`, a constant away from 0 where `x ** 2.` is finite with its
    derivatives (`_by_hand._safe_on_diagonal`, the base's value there read through `exp`, a
    product with a computed scalar and `select_n`): nothing to guard, and every derivative to
    the third is JAX's on the off-diagonal pairs."""
    energy = _without_diagonal(_morse_on_all_pairs)
    assert str(jaxsafe.explain(energy, finite_args=True)(R)) == \
        "nothing to guard: the program runs unchanged"
    kept = _off_diagonal_reference(_morse_on_all_pairs, R)
    assert_same_to_the_third_order(jaxsafe.nan_safe(energy, finite_args=True), kept, R)


def test_a_power_at_its_singularity_on_the_dropped_diagonal_keeps_its_guard():
    """With sigma = 0 the base on the diagonal is `1 - exp(0) = 0`, where the third derivative
    of `x ** 2.` is NaN: the guard stays, the live pairs' derivatives are unchanged."""
    terms = lambda r, pairs=None: _morse_on_all_pairs(r, pairs, sigma=0.0)
    energy, r = _without_diagonal(terms), R[:3]  # no coincident pair: the reference is finite
    assert "guarded pow" in str(jaxsafe.explain(energy, finite_args=True)(r))
    kept = _off_diagonal_reference(terms, r)
    assert_same_to_the_third_order(jaxsafe.nan_safe(energy, finite_args=True), kept, r)


def _smooth_cutoff(d):
    """jax-md's `multiplicative_isotropic_cutoff` factor, onset 2, cutoff 2.5 (its squares
    `jnp` scalars, so the program computes `(r_c - r_o) ** 3`)."""
    r_c, r_o = jnp.float32(6.25), jnp.float32(4.0)
    rr = d ** jnp.float32(2.0)
    inner = jnp.where(d < 2.5, (r_c - rr) ** 2 * (r_c + 2.0 * rr - 3.0 * r_o) / (r_c - r_o) ** 3,
                      0.0)
    return jnp.where(d < 2.0, 1.0, inner)


def _cut_off_morse(r, pairs=None):
    i, j = (slice(None), None), (None, slice(None))
    if pairs is not None:
        i, j = pairs
    r2 = jnp.sum((r[i] - r[j]) ** 2, axis=-1)
    d = safe_mask(r2 > 0, jnp.sqrt, r2)
    u = jnp.nan_to_num(5.0 * (1.0 - jnp.exp(-5.0 * (d - 1.3))) ** jnp.float32(2.0) - 5.0)
    return jnp.nan_to_num(_smooth_cutoff(d) * u)


def test_a_cutoff_factor_is_finite_under_the_comparisons_that_take_it():
    """`(6.25 - d ** 2) ** 2 * ...` overflows for a huge `d`, but `where(d < 2.5, ...)` takes it
    only below 2.5 (`d >= 0`): derived again there (`Ranges.given`) its range is finite, so the
    cutoff factor is finite, the product with the Morse energy is finite, and the `nan_to_num`
    after it drops nothing: the product needs no guard (jax-md's `cutoff_fn`)."""
    energy = _without_diagonal(_cut_off_morse)
    explained = str(jaxsafe.explain(energy, finite_args=True)(R))
    assert "guarded mul" not in explained and "guarded sqrt" in explained
    from jaxsafe._bounds import of_program
    from jaxsafe._flatten import flatten, inline_scalar_constants
    closed = inline_scalar_constants(flatten(jax.make_jaxpr(
        lambda x: _smooth_cutoff(jnp.abs(x)))(X)))
    lo, hi = of_program(closed).range_of(closed.jaxpr.outvars[0])
    assert np.isfinite(lo) and np.isfinite(hi) and lo <= 0.0 and hi >= 1.0
    far = R.at[0].set(jnp.array([3.0, 0.0]))  # past the cutoff from particle 1
    for r in (R, far):
        assert_same_to_the_third_order(jaxsafe.nan_safe(energy, finite_args=True),
                                       _off_diagonal_reference(_cut_off_morse, r), r)


def test_the_cases_nan_to_num_never_takes_leave_the_range():
    """`nan_to_num` of a value whose range is finite takes none of its replacements (NaN, +inf
    and -inf fail its tests): the range is the value's, not one out to the largest float."""
    from jaxsafe._bounds import of_program
    from jaxsafe._flatten import flatten, inline_scalar_constants
    closed = inline_scalar_constants(flatten(jax.make_jaxpr(
        lambda x: jnp.nan_to_num(jnp.exp(-jnp.abs(x))))(X)))
    lo, hi = of_program(closed).range_of(closed.jaxpr.outvars[0])
    assert lo >= 0.0 and hi <= 1.0 + 1e-4
    closed = inline_scalar_constants(flatten(jax.make_jaxpr(
        lambda x: jnp.nan_to_num(jnp.exp(x)))(X)))  # may overflow: the largest float is taken
    assert of_program(closed).range_of(closed.jaxpr.outvars[0])[1] > 1e38


def test_a_cutoff_factor_of_a_far_pair_keeps_its_guard():
    """Why the cutoff's `d ** 2.` keeps a guard with finite positions: 3e19 apart, `r2`
    overflows to inf, and its derivative there is infinite where the `where` drops the pair
    (plain JAX's gradient is NaN everywhere). nan_safe's is the system's without the pair."""
    energy = _without_diagonal(_cut_off_morse)
    r = jnp.array([[0.0, 0.0], [1.3, 0.0], [3e19, 0.0]])
    assert np.isnan(np.asarray(jax.grad(energy)(r))).all()
    kept = _off_diagonal_reference(_cut_off_morse, r, np.array([[True, True, False],
                                                                [True, True, False],
                                                                [False, False, True]]))
    got = jax.grad(jaxsafe.nan_safe(energy, finite_args=True))(r)
    assert_finite(got)
    assert_close(got, jax.jit(jax.grad(kept))(r), atol=1e-5)


@pytest.mark.parametrize("case, finite", [
    (lambda d, w: (6.25 - d ** 2) ** 2, True),
    (lambda d, w: (6.25 - d ** 2) * w, False),  # another input that may be NaN
    (lambda d, w: (6.25 - d ** 2) * jnp.clip(w, -1.0, 1.0), False),  # ranged, may be NaN
    (lambda d, w: 1.0 / (d - 1.0), False),  # a pole below the limit
    (lambda d, w: (6.25 - d ** 2) ** -1.5, False),  # below 2.5, 6.25 - d ** 2 reaches 0
], ids=["finite", "another input", "a clipped input", "a pole", "a negative power"])
def test_a_case_is_finite_under_its_comparison_only_when_its_range_says_so(case, finite):
    """The taint pass (`selected_only_where_finite`): `where(d < 2.5, g(d, w), 0.)` with
    `d = |x|` (NaN and inf fail the comparison) is finite when `g`'s range for d in [0, 2.5]
    is, and `d` is the only input of `g` that may be non-finite."""
    from jaxsafe._flatten import flatten, inline_scalar_constants
    from jaxsafe._taint import nonfinite_anywhere

    def f(x, w):
        d = jnp.abs(x)
        return jnp.where(d < 2.5, case(d, w), 0.0)
    closed = inline_scalar_constants(flatten(jax.make_jaxpr(f)(X, X)))
    tainted = nonfinite_anywhere(closed, set(closed.jaxpr.invars))
    assert (closed.jaxpr.outvars[0] not in tainted) == finite


def test_a_selection_on_a_mask_that_is_no_comparison_has_no_range_under_it():
    """`jnp.where(valid[None, :], scores, -1e9)`: the predicate is a broadcast of an argument,
    not a comparison with a constant, so nothing narrows the case (found by the sharded
    attention block: the range pass asked it for two operands). An RMS norm's 0/0 in a padded
    row, dropped: nan_safe's gradient is the hand fix's."""
    def make(hand):
        def loss(x, valid):
            ms = jnp.mean(x * x, axis=-1, keepdims=True)
            if hand:
                ms = jnp.where(valid[:, None], ms, 1.0)
            h = jnp.where(valid[:, None], x / jnp.sqrt(ms), 0.0)
            s = jnp.where(valid[None, :], h @ h.T, -1e9)
            return jnp.sum(jnp.where(valid[:, None], jax.nn.softmax(s, axis=-1), 0.0) ** 2)
        return loss
    x = (jnp.arange(12.0).reshape(3, 4) / 10).at[1].set(0.0)
    valid = jnp.array([True, False, True])
    assert np.isnan(np.asarray(jax.grad(make(False))(x, valid))).any()
    assert_close(jax.grad(jaxsafe.nan_safe(make(False)))(x, valid),
                 jax.grad(make(True))(x, valid))


# --------------------------------------------------------------------------- constant predicates

@pytest.mark.parametrize("f", [
    lambda x: jnp.sum(jnp.std(x, axis=-1)),
    lambda x: jnp.sum(jnp.std(x, axis=-1, ddof=1)),
    lambda x: jnp.sum(jax.nn.standardize(x, axis=-1) ** 2 * jnp.std(x)),
], ids=["std", "std ddof=1", "std beside standardize"])
def test_a_selection_on_a_static_predicate_takes_its_case(f):
    """`jnp.std` is `sqrt(where(n - ddof > 0, var, nan))` with `n - ddof > 0` computed from
    literals: the `nan` is never taken, so the `sqrt` has no lane that carries no derivative
    (no forward-mode guard of it), and the program runs unchanged where nothing else is
    guarded. Derivatives in both modes are JAX's own."""
    x = jnp.array([[1.0, 2.0, 4.0], [0.5, 0.5, 3.0]])
    explained = jaxsafe.explain(f)(x)
    assert not [g for g in explained.guards if g.primitive == "sqrt"], str(explained)
    if not explained.guards:
        assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    safe = jaxsafe.nan_safe(f)
    # (rounding: standardize's own guards make another program, which XLA fuses its own way)
    assert_close(jax.jit(jax.grad(safe))(x), jax.jit(jax.grad(f))(x), rtol=1e-5)
    assert_close(jax.jit(jax.jacfwd(safe))(x), jax.jit(jax.jacfwd(f))(x), rtol=1e-5)


@pytest.mark.parametrize("taken_first", [True, False])
def test_a_static_predicate_s_untaken_case_that_carries_a_derivative_is_still_dropped(
        taken_first):
    """`where(True, x, sqrt(x))`: the untaken `sqrt` still meets a zero cotangent (NaN at 0 in
    plain JAX); its lanes are dropped lanes, guarded: the derivative is the taken case's."""
    if taken_first:
        f = lambda x: jnp.sum(jnp.where(True, x, jnp.sqrt(x)))
    else:
        f = lambda x: jnp.sum(lax.select(jnp.zeros(2, bool), jnp.sqrt(x), x))
    x = jnp.array([0.0, 4.0])
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()
    np.testing.assert_array_equal(np.asarray(jax.grad(jaxsafe.nan_safe(f))(x)), [1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(jaxsafe.nan_safe(f)(x)), np.asarray(f(x)))


# --------------------------------------------------------------------------- cotangents in domain

def test_an_activation_whose_derivative_is_bounded_is_left_as_it_is():
    """`jax.nn.celu` is `max(x, 0) + expm1(min(x, 0))`: the `min` drops `x` where 0 wins, and
    JAX weighs that lane's cotangent by 0. With finite inputs the cotangent is finite there:
    `expm1`'s derivative at `min(x, 0) <= 0` is at most 1 (`PrimitiveRule.increasing`, the
    ranges of `min` and `expm1`): nothing to re-decide, the program runs unchanged."""
    f = lambda x: jnp.sum(jax.nn.celu(x))
    x = jnp.linspace(-3.0, 3.0, 7)
    assert str(jaxsafe.explain(f, finite_args=True)(x)) == \
        "nothing to guard: the program runs unchanged"
    assert structure(jaxsafe.make_jaxpr(f, finite_args=True)(x)) == \
        structure(jax.make_jaxpr(f)(x))


ACTIVATIONS = {
    "relu": jax.nn.relu, "gelu": jax.nn.gelu,
    "exact gelu": lambda x: jax.nn.gelu(x, approximate=False), "silu": jax.nn.silu,
    # `where(x > 0, x, expm1(where(x > 0, 0., x)))`: the inner case is at most 0
    "elu": jax.nn.elu, "selu": jax.nn.selu, "celu": jax.nn.celu,
    "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh, "leaky relu": jax.nn.leaky_relu,
    "hard tanh": jax.nn.hard_tanh, "squareplus": jax.nn.squareplus,
    # `x / (abs(x) + 1.)`: a divisor at least 1
    "soft sign": jax.nn.soft_sign,
    "log softmax": jax.nn.log_softmax, "softmax": jax.nn.softmax,
    "standardize": jax.nn.standardize,
    "glu": lambda x: jax.nn.glu(jnp.concatenate([x, x], -1)),
}
ROW_KEPT = jnp.array([True, False, True])


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_a_jax_nn_activation_under_a_where_needs_no_guard_with_finite_arguments(name):
    act = ACTIVATIONS[name]
    f = lambda x: jnp.sum(jnp.where(ROW_KEPT[:, None], act(x), 0.))
    x = jnp.array([[1.0, -2.0], [0.0, 0.0], [3.0, -4.0]])
    assert str(jaxsafe.explain(f, finite_args=True)(x)) == \
        "nothing to guard: the program runs unchanged"
    # a NaN row, the default: the hand fix's derivative (0 in the dropped row)
    bad = x.at[1, 0].set(jnp.nan)
    hand = lambda x: jnp.sum(jnp.where(ROW_KEPT[:, None],
                                       act(jnp.where(ROW_KEPT[:, None], x, 0.)), 0.))
    assert_close(jax.grad(jaxsafe.nan_safe(f))(bad), jax.jit(jax.grad(hand))(bad))


def test_a_computed_numerator_over_a_divisor_at_least_one_keeps_its_guard():
    """`x ** 3 / (abs(x) + 1.)`: the divisor is at least 1, but the numerator is computed, and
    overflows to inf from a finite `x = 1e13` (hunt AL): the quotient's derivative in the
    divisor is -inf there, and the dropped lane takes the hand fix's 0."""
    m = jnp.array([True, False, True])
    f = lambda x: jnp.sum(jnp.where(m, (x * x * x) / (jnp.abs(x) + 1.), 0.))
    hand = lambda x: f(jnp.where(m, x, 1.))
    x = jnp.array([0.5, 1e13, 2.0])
    assert np.isnan(np.asarray(jax.grad(f)(x))[1])
    assert_close(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x), jax.grad(hand)(x))


def test_a_clip_under_an_exp_that_may_overflow_is_still_re_decided():
    """`exp(10 * min(x, 100.))`: where 100 wins (x = 200), the `exp`'s derivative is inf and
    JAX weighs it by 0 for `x`: NaN in plain JAX. The `min` is re-decided as a selection, and
    `x`'s derivative there is the 0 that the drop promises."""
    f = lambda x: jnp.sum(jnp.exp(10.0 * jnp.minimum(x, 100.0)))
    x = jnp.array([-1.0, 0.5, 200.0])
    assert np.isnan(np.asarray(jax.grad(f)(x))[2])
    got = np.asarray(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x))
    assert got[2] == 0.0
    assert_close(got[:2], np.asarray(jax.grad(f)(x))[:2])


LOGITS = jax.random.normal(jax.random.PRNGKey(3), (4, 5)) * 3.0
LABELS = jnp.array([0, 2, 4, 1])

CROSS_ENTROPIES = {
    "take_along_axis": lambda x: -jnp.take_along_axis(jax.nn.log_softmax(x), LABELS[:, None],
                                                      1).sum(),
    "one_hot": lambda x: -(jax.nn.log_softmax(x) * jax.nn.one_hot(LABELS, 5)).sum(),
    "index": lambda x: -jax.nn.log_softmax(x)[jnp.arange(4), LABELS].sum(),
    "first class": lambda x: -jax.nn.log_softmax(x)[:, 0].sum(),
}


@pytest.mark.parametrize("name", list(CROSS_ENTROPIES))
def test_a_softmax_whose_lanes_are_picked_needs_no_guard_with_finite_arguments(name):
    """`exp(x - stop_gradient(max(x)))` is at most 1 and its sum over the row at least 1 (the
    row's largest lane gives exp(0)), for finite `x` (`_maxima.py`): picking a class from a
    softmax leaves `exp` and `log` nothing to guard. Derivatives: JAX's."""
    f = CROSS_ENTROPIES[name]
    assert str(jaxsafe.explain(f, finite_args=True)(LOGITS)) == \
        "nothing to guard: the program runs unchanged"
    safe = jaxsafe.nan_safe(f, finite_args=True)
    np.testing.assert_array_equal(safe(LOGITS), jax.jit(f)(LOGITS))
    assert_close(jax.grad(safe)(LOGITS), jax.grad(f)(LOGITS))
    assert_close(jax.hessian(safe)(LOGITS), jax.hessian(f)(LOGITS), atol=1e-6)


VALID = jnp.array([True, False, True, True])

MASKED_LOG_DENSITIES = {
    # `jax.nn.logsumexp` shifts by `where(isfinite(m), m, 0.)`: `m` itself for finite `x`
    "logsumexp": lambda x: jnp.where(VALID, jax.nn.logsumexp(x, axis=1) - x[:, 0], 0.).sum(),
    "logsumexp over both axes": lambda x: jnp.where(
        VALID[:, None], x - jax.nn.logsumexp(x), 0.).sum(),
    # bounded activations (`_ranges.between`): their `log` is in its domain
    "log of a sigmoid plus eps": lambda x: jnp.where(
        VALID[:, None], jnp.log(jax.nn.sigmoid(x) + 1e-7), 0.).sum(),
    "log of one plus tanh plus eps": lambda x: jnp.where(
        VALID[:, None], jnp.log(1.0 + jnp.tanh(x) + 1e-6), 0.).sum(),
    "sqrt of two less a cosine": lambda x: jnp.where(
        VALID[:, None], jnp.sqrt(2.0 - jnp.cos(x)), 0.).sum(),
    "log of erfc plus eps": lambda x: jnp.where(
        VALID[:, None], jnp.log(jax.scipy.special.erfc(x) + 1e-6), 0.).sum(),
}


@pytest.mark.parametrize("name", list(MASKED_LOG_DENSITIES))
def test_a_masked_log_density_needs_no_guard_with_finite_arguments(name):
    f = MASKED_LOG_DENSITIES[name]
    assert str(jaxsafe.explain(f, finite_args=True)(LOGITS)) == \
        "nothing to guard: the program runs unchanged"
    safe = jaxsafe.nan_safe(f, finite_args=True)
    np.testing.assert_array_equal(safe(LOGITS), jax.jit(f)(LOGITS))
    assert_close(jax.grad(safe)(LOGITS), jax.jit(jax.grad(f))(LOGITS))


def test_a_masked_logsumexp_of_an_inf_row_is_still_guarded():
    """Arguments that may be inf (the default): `exp(x - 0.)` of a dropped row holding inf
    overflows, and its derivative meets the `where`'s zero: the hand fix's 0 there."""
    f = MASKED_LOG_DENSITIES["logsumexp"]
    x = LOGITS.at[1, 2].set(jnp.inf)
    assert np.isnan(np.asarray(jax.grad(f)(x))[1]).any()
    hand = lambda x: jnp.where(VALID, jax.nn.logsumexp(jnp.where(VALID[:, None], x, 0.), axis=1)
                               - x[:, 0], 0.).sum()
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(hand)(x))


def test_a_log_of_a_sigmoid_that_underflows_keeps_its_guard():
    """`log(sigmoid(x))` without an eps: `sigmoid(-200.)` is 0 in float32, `log(0)` -inf."""
    f = lambda x: jnp.where(x > -50.0, jnp.log(jax.nn.sigmoid(x)), 0.).sum()
    x = jnp.array([-200.0, 1.0])
    assert np.isnan(np.asarray(jax.grad(f)(x))[0])
    got = np.asarray(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x))
    assert got[0] == 0.0
    assert_close(got[1], np.asarray(jax.grad(f)(x))[1])


def test_a_shift_by_a_finite_case_of_another_maximum_keeps_the_guard():
    """`where(isfinite(m), y_max, 0.)` is not `x`'s maximum where `m` is finite."""
    y = LOGITS[::-1] + 50.0

    def f(x):
        m = jnp.max(x, axis=1, keepdims=True)
        shift = jnp.where(jnp.isfinite(m), jnp.max(y, axis=1, keepdims=True), 0.)
        e = jnp.exp(x - lax.stop_gradient(shift))
        return jnp.where(VALID[:, None], jnp.log(e.sum(1, keepdims=True)), 0.).sum()

    explained = str(jaxsafe.explain(f, finite_args=True)(LOGITS))
    assert "guarded" in explained, explained


@pytest.mark.parametrize("shift", ["another value's maximum", "a maximum along another axis",
                                   "a maximum with a constant", "a sum along another axis"])
def test_a_shift_by_what_is_not_the_maximum_keeps_the_guard(shift):
    """Only `x` less its own maximum, along the axes the sum runs over, is bounded: `y`'s
    maximum, a maximum broadcast along the wrong axis, `max(m, 0.)` (at least the maximum, not
    equal to it: the sum may be below 1) and a sum along another axis are not."""
    y = LOGITS[::-1] + 50.0

    def f(x):
        m = {"another value's maximum": jnp.max(y, axis=1, keepdims=True),
             "a maximum along another axis": jnp.max(x, axis=0, keepdims=True),
             "a maximum with a constant": jnp.maximum(jnp.max(x, axis=1, keepdims=True), 0.),
             "a sum along another axis": jnp.max(x, axis=1, keepdims=True)}[shift]
        e = jnp.exp(x - lax.stop_gradient(m))
        axis = 0 if shift == "a sum along another axis" else 1
        picked = LABELS[:, None] == jnp.arange(5)[None]
        return jnp.where(picked, jnp.log(e.sum(axis, keepdims=True)), 0.).sum()

    explained = str(jaxsafe.explain(f, finite_args=True)(LOGITS))
    assert "guarded" in explained, explained


# --------------------------------------------------------------------------- clamps before a pole
# `sqrt(maximum(x, eps))` and its kin, with arguments that may hold NaN or inf (the default): the
# clamp's constant keeps the NaN-prone primitive inside its domain wherever `x` is finite, so
# its derivative is non-finite only where its own operand is, and there the clamp's value is
# `x`'s own NaN (no one wins alone, the lane is live) or +inf (where `x` wins). Nothing to
# re-decide.

CLAMP_INPUT = jnp.array([jnp.nan, -1.0, 2.0, jnp.inf, -jnp.inf, 0.0, 1e-7, 0.25])

CLAMPED = {
    "sqrt of max": lambda x: jnp.sqrt(jnp.maximum(x, 1e-6)),
    "log of max": lambda x: jnp.log(jnp.maximum(x, 1e-6)),
    "rsqrt of max": lambda x: lax.rsqrt(jnp.maximum(x, 1e-6)),
    "sqrt of clip": lambda x: jnp.sqrt(jnp.clip(x, 1e-6, 1.0)),
    "sqrt of lax.clamp": lambda x: jnp.sqrt(lax.clamp(1e-6, x, 1.0)),
    "sqrt of a scaled max": lambda x: jnp.sqrt(2.0 * jnp.maximum(x, 1e-6)),
    "sqrt of max over 4": lambda x: jnp.sqrt(jnp.maximum(x, 1e-6) / 4.0),
    "log of max plus eps": lambda x: jnp.log(jnp.maximum(x, 0.0) + 1e-6),
    "reciprocal of clip": lambda x: 1.0 / jnp.clip(x, 1e-3, None),
    "quotient by max": lambda x: 3.0 / jnp.maximum(x, 1e-3),
}


@pytest.mark.parametrize("name", list(CLAMPED))
def test_a_clamp_before_a_pole_is_the_original_program(name):
    f = lambda x: jnp.sum(CLAMPED[name](x))
    x = CLAMP_INPUT
    assert str(jaxsafe.explain(f)(x)) == "nothing to guard: the program runs unchanged"
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    grad = np.asarray(jax.grad(jaxsafe.nan_safe(f))(x))
    # the clamp's constant wins where x is negative or -inf: the derivative there is 0
    low = np.asarray(x < 0)
    assert (grad[low] == 0).all()
    np.testing.assert_array_equal(grad, np.asarray(jax.grad(f)(x)))


# Hunt AH: an upper clamp before a pole (`log1p(-min(p, .999))`, a logit or a binary
# cross-entropy of `clip(p, eps, 1 - eps)`): the clamp's range, not a lower bound, keeps the
# pole's operand inside its domain (`1 - min(p, .999)` is at least .001).
UPPER_CLAMPED = {
    "log1p of a negated min": lambda x: jnp.log1p(-jnp.minimum(x, 0.999)),
    "sqrt of one less a min": lambda x: jnp.sqrt(1.0 - jnp.minimum(x, 0.999)),
    "log of one less a clip": lambda x: jnp.log(1.0 - jnp.clip(x, 1e-6, 1.0 - 1e-6)),
    "logit of a clip": lambda x: (jnp.log(jnp.clip(x, 1e-6, 1.0 - 1e-6))
                                  - jnp.log1p(-jnp.clip(x, 1e-6, 1.0 - 1e-6))),
    "reciprocal of one less a min": lambda x: 1.0 / (1.0 - jnp.minimum(x, 0.5)),
}


@pytest.mark.parametrize("name", list(UPPER_CLAMPED))
def test_an_upper_clamp_before_a_pole_is_the_original_program(name):
    f = lambda x: jnp.sum(UPPER_CLAMPED[name](x))
    x = jnp.concatenate([CLAMP_INPUT, jnp.array([0.9999, 1.0, 3.0])])
    assert str(jaxsafe.explain(f)(x)) == "nothing to guard: the program runs unchanged"
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    grad = np.asarray(jax.grad(jaxsafe.nan_safe(f))(x))
    high = np.asarray(x >= 1.0)  # the clamp's constant wins: the derivative there is 0
    assert (grad[high] == 0).all()
    np.testing.assert_array_equal(grad, np.asarray(jax.grad(f)(x)))


def test_binary_cross_entropy_of_a_clipped_probability_is_the_original_program():
    """Keras' binary cross-entropy with finite labels and probabilities: nothing to guard."""
    eps = 1e-7

    def bce(p, y):
        p = jnp.clip(p, eps, 1.0 - eps)
        return -jnp.mean(y * jnp.log(p) + (1.0 - y) * jnp.log(1.0 - p))
    p, y = jnp.array([0.0, 0.3, 1.0, 1.5]), jnp.array([1.0, 0.0, 0.0, 1.0])
    safe = jaxsafe.nan_safe(bce, finite_args=True)
    assert structure(jaxsafe.make_jaxpr(bce, finite_args=True)(p, y)) == \
        structure(jax.make_jaxpr(bce)(p, y))
    np.testing.assert_array_equal(np.asarray(jax.grad(safe)(p, y)),
                                  np.asarray(jax.grad(bce)(p, y)))


def test_an_upper_clamp_that_reaches_the_pole_is_still_re_decided():
    """`log1p(-min(x, 1.))`: where the constant wins, `log1p(-1)` is -inf and its derivative
    too; JAX weighs it by 0 for `x` (NaN). `x`'s lane is dropped there: its derivative is 0."""
    f = lambda x: jnp.sum(jnp.log1p(-jnp.minimum(x, 1.0)))
    x = jnp.array([2.0, 0.5])
    assert np.isnan(np.asarray(jax.grad(f)(x))[0])
    hand = lambda x: jnp.sum(jnp.where(x < 1.0, jnp.log1p(-jnp.where(x < 1.0, x, 0.0)),
                                       jnp.log1p(-1.0)))
    np.testing.assert_array_equal(np.asarray(jax.grad(jaxsafe.nan_safe(f))(x)),
                                  np.asarray(jax.grad(hand)(x)))
    assert "re-decided min" in str(jaxsafe.explain(f)(x))


def test_a_log1p_below_its_pole_keeps_its_guard():
    """`where(x > -.5, log1p(x), 0.)` at its pole: no bound keeps `log1p` in its domain."""
    f = lambda x: jnp.sum(jnp.where(x > -0.5, jnp.log1p(x), 0.0))
    x = jnp.array([-1.0, 1.0])
    assert np.isnan(np.asarray(jax.grad(f)(x))[0])
    np.testing.assert_array_equal(np.asarray(jax.grad(jaxsafe.nan_safe(f))(x)),
                                  np.array([0.0, 0.5], np.float32))


def _sqrt_of_clamp_reference(x, y):
    """`sqrt(max(x, 1e-6) + y)` with `x`'s losing lanes removed by hand."""
    wins = x > 1e-6
    return jnp.sum(jnp.sqrt(jnp.where(wins, x, 1e-6) + y))


def test_a_clamp_whose_cotangent_another_value_makes_nan_is_still_re_decided():
    """`sqrt(max(x, 1e-6) + y)`: where `y` is NaN the `sqrt`'s derivative is NaN whatever `x`
    holds; where the constant wins there, JAX weighs that NaN by 0 for `x` (NaN). `x`'s lane is
    dropped: its derivative is 0."""
    f = lambda x, y: jnp.sum(jnp.sqrt(jnp.maximum(x, 1e-6) + y))
    x = jnp.array([-1.0, 2.0, -3.0, 0.5])
    y = jnp.array([jnp.nan, 1.0, 0.0, jnp.nan])
    assert np.isnan(np.asarray(jax.grad(f)(x, y))[0])
    got = np.asarray(jax.grad(jaxsafe.nan_safe(f))(x, y))
    assert got[0] == 0.0 and got[2] == 0.0
    ref = np.asarray(jax.grad(lambda x: _sqrt_of_clamp_reference(x, y))(x))
    np.testing.assert_array_equal(got[:3], ref[:3])
    assert np.isnan(got[3])  # x wins there: the NaN is its own (contract 3)
    assert "re-decided max" in str(jaxsafe.explain(f)(x, y))


def test_a_clamp_of_two_values_is_still_re_decided():
    """`sqrt(max(x, y))`: both operands carry a derivative, so where `y` wins, `x`'s lane is
    dropped whichever value is non-finite: the rewrite keeps the selection, and the derivative
    is the hand fix's."""
    f = lambda x, y: jnp.sum(jnp.sqrt(jnp.maximum(x, y)))
    x = jnp.array([-1.0, 4.0, -jnp.inf, 1.0])
    y = jnp.array([1.0, 0.25, 2.0, jnp.inf])
    hand = lambda x, y: jnp.sum(jnp.where(x > y, jnp.sqrt(jnp.where(x > y, x, 1.0)),
                                          jnp.sqrt(jnp.where(x > y, 1.0, y))))
    got = jax.grad(jaxsafe.nan_safe(f), (0, 1))(x, y)
    ref = jax.grad(hand, (0, 1))(x, y)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "re-decided max" in str(jaxsafe.explain(f)(x, y))


def test_a_constant_numerator_over_a_clamp_in_float16_is_still_re_decided():
    """`1000 / max(x, .1)` in float16: the derivative at the clamp is -1e5, past float16's
    largest value (hunt Q): the quotient is proven finite only for the numerator it has, and
    here it is not, so the dropped lanes' derivative is the hand fix's 0."""
    h = jnp.float16
    f = lambda x: jnp.sum(h(1000.) / jnp.maximum(x, h(0.1)))
    hand = lambda x: jnp.sum(jnp.where(x > 0.1, h(1000.) / jnp.where(x > 0.1, x, h(1.)),
                                       h(1000.) / h(0.1)))
    x = jnp.array([-1., 0., 2.], h)
    assert np.isnan(np.asarray(jax.grad(f)(x), np.float32)).any()
    np.testing.assert_array_equal(np.asarray(jax.grad(jaxsafe.nan_safe(f))(x), np.float32),
                                  np.asarray(jax.grad(hand)(x), np.float32))
    assert "re-decided max" in str(jaxsafe.explain(f)(x))


def test_a_scaled_clamp_before_a_pole_in_float16_is_still_re_decided():
    """A loss scale times `sqrt`'s finite derivative at the clamp overflows float16 (2e4 * 5):
    a float16 cotangent is not taken as non-finite only where its own value is."""
    h = jnp.float16
    f = lambda x: h(2e4) * jnp.sum(jnp.sqrt(jnp.maximum(x, h(0.01))))
    x = jnp.array([-1., 0., 2.], h)
    got = np.asarray(jax.grad(jaxsafe.nan_safe(f))(x), np.float32)
    np.testing.assert_array_equal(got[:2], [0., 0.])
    assert np.isfinite(got[2])


DEG = jnp.array([1.0, 0.0, 2.0, 0.0])
FEATURES = jnp.array([[0.5, 0.0], [0.0, 0.0], [-1.5, 2.0], [jnp.inf, 0.0]])  # constant rows


def _aggregated(square):
    """A graph node's mean over its neighbours, its own (constant) features where it has none,
    then a squared norm: `h * h` as a user writes it, or `jnp.square`."""
    def f(m):
        h = jnp.where(DEG[:, None] > 0, jnp.tanh(m) / DEG[:, None], FEATURES)
        return jnp.sum(square(h), axis=-1)
    return f


def test_a_square_written_as_a_product_is_not_decided_again():
    # where `h` is 0 and carries no derivative (a constant row's zero), the lane `h * h` would
    # drop is that same lane of `h`, which carries none: no masked product to decide again
    by_mul, by_square = _aggregated(lambda h: h * h), _aggregated(jnp.square)
    m = jnp.array([[0.3, -0.2], [jnp.nan, 1.0], [0.1, 0.4], [-jnp.inf, 2.0]])
    added = [len(jaxsafe.make_jaxpr(f)(m).eqns) - len(jax.make_jaxpr(f)(m).eqns)
             for f in (by_mul, by_square)]
    assert added[0] == added[1]
    assert "re-decided" not in str(jaxsafe.explain(by_mul)(m))

    def hand(m):  # the double where: the isolated nodes' rows read a safe value
        safe = jnp.where(DEG[:, None] > 0, m, 0.0)
        h = jnp.where(DEG[:, None] > 0, jnp.tanh(safe) / jnp.where(DEG > 0, DEG, 1.0)[:, None],
                      FEATURES)
        return jnp.sum(h * h, axis=-1)
    loss = lambda f: lambda m: jnp.sum(f(m) * jnp.array([1.0, 2.0, 3.0, 0.0]))  # noqa: E731
    assert np.isnan(np.asarray(jax.grad(loss(by_mul))(m))).any()  # plain JAX leaks
    assert_close(jax.grad(loss(jaxsafe.nan_safe(by_mul)))(m), jax.grad(loss(hand))(m))
    assert_close(jax.jacfwd(jaxsafe.nan_safe(by_mul))(m), jax.jacfwd(hand)(m))
    assert_close(jax.hessian(loss(jaxsafe.nan_safe(by_mul)))(m), jax.hessian(loss(hand))(m))
    assert np.asarray(jaxsafe.nan_safe(by_mul)(m)).tobytes() == \
        np.asarray(jax.jit(by_mul)(m)).tobytes()


def test_atan2_against_a_nonzero_constant_needs_no_guard():
    # arctan2(x, 1.) is singular only where both operands are 0: with the arguments promised
    # finite, nothing to guard (found by a bug hunt); a NaN argument in a dropped lane is still
    # guarded, as any value that may be non-finite
    f = lambda x: jnp.sum(jnp.where(x > 2, jnp.arctan2(x, 1.0), 0.0))  # noqa: E731
    g = lambda x: jnp.sum(jnp.where(x > 2, jnp.arctan2(-3.0, x), 0.0))  # noqa: E731
    x = jnp.array([4.0, 1.0, 0.0, 3.0])
    for fn in (f, g):
        assert structure(jaxsafe.make_jaxpr(fn, finite_args=True)(x)) == \
            structure(jax.make_jaxpr(fn)(x))
    both = lambda x: jnp.sum(jnp.where(x > 2, jnp.arctan2(x, x - 4.0), 0.0))  # noqa: E731
    assert structure(jaxsafe.make_jaxpr(both, finite_args=True)(x)) != \
        structure(jax.make_jaxpr(both)(x))  # two operands that may both be 0: guarded
    nan = jnp.array([4.0, jnp.nan, -jnp.inf, 3.0])
    hand = lambda x: f(jnp.where(x > 2, x, 3.0))  # noqa: E731
    assert np.isnan(np.asarray(jax.grad(f)(nan))).any()
    assert_close(jax.grad(jaxsafe.nan_safe(f))(nan), jax.grad(hand)(nan))


def _relu_double_where(relu):
    def f(q):
        s = relu(q)
        return jnp.sum(jnp.where(s > 0, jnp.sqrt(jnp.where(s > 0, s, 1.)), 0.))
    return f


def _first_lane_twice(x):
    """`x[0] > 0` written in each `where`: two slices of `x`, one predicate."""
    return jnp.sum(jnp.where(x[0] > 0, jnp.sqrt(jnp.where(x[0] > 0, x, 1.)), 0.))


def _maximum_compared_by_its_operand(q):
    """The predicate compares `q`, the operand of the `max`: `q > 0` where the `max` is `q`."""
    return jnp.sum(jnp.where(q > 0, jnp.sqrt(jnp.where(q > 0, jnp.maximum(q, 0.), 1.)), 0.))


def _maximum_written_three_times(q):
    return jnp.sum(jnp.where(jnp.maximum(q, 0.) > 0,
                             jnp.sqrt(jnp.where(jnp.maximum(q, 0.) > 0, jnp.maximum(q, 0.), 1.)),
                             0.))


def _minimum_double_where(q):
    s = jnp.minimum(q, 1.)
    return jnp.sum(jnp.where(s < 1., jnp.log(1. - jnp.where(s < 1., s, 0.)), 0.))


@pytest.mark.parametrize("f", [_relu_double_where(jax.nn.relu), _first_lane_twice,
                               _relu_double_where(lambda q: jnp.maximum(q, 0.)),
                               _maximum_compared_by_its_operand, _maximum_written_three_times,
                               _minimum_double_where],
                         ids=["relu", "first_lane_twice", "maximum", "compared_operand",
                              "maximum_three_times", "minimum"])
def test_a_double_where_over_a_relu_or_an_indexed_predicate_is_left_as_it_is(f):
    """The inner `where` takes `s` only where `s > 0`: where the ReLU's 0 wins (`s` carries no
    derivative there) it takes 1., at which `sqrt` is finite with its derivatives. The outer
    `where` reads the `max`'s cotangent only where `q` wins alone: weighed by 1, never by 0, so
    the `max` is not re-decided (`_decisions.wins_wherever_live`)."""
    for x in (jnp.array([-1., 0., 2.]), jnp.array([1., 0., 2.])):
        assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
        safe = jaxsafe.nan_safe(f)
        assert_close(jax.grad(safe)(x), jax.jit(jax.grad(f))(x))
        assert_close(jax.jacfwd(safe)(x), jax.jit(jax.jacfwd(f))(x))
        assert_close(jax.hessian(safe)(x), jax.jit(jax.hessian(f))(x))


def test_a_double_where_whose_inner_where_keeps_the_singular_point_keeps_its_cut():
    """`where(s >= 0, s, 1.)` takes `s` where the ReLU's 0 wins: `sqrt(0)` there, in lanes
    that carry no derivative, whose forward-mode `inf * 0` is cut."""
    f = lambda q: jnp.sum(jnp.sqrt(jnp.where(jnp.maximum(q, 0.) >= 0, jnp.maximum(q, 0.), 1.)))
    x = jnp.array([-1., 2.])
    assert "guarded sqrt" in str(jaxsafe.explain(f)(x))
    assert_close(jax.jacfwd(jaxsafe.nan_safe(f))(x), jnp.array([0., .5 / jnp.sqrt(2.)]))


def test_a_predicate_below_the_maximum_s_constant_keeps_its_re_decision():
    """`q > -1` holds where the `max`'s 0 wins (`q` in (-1, 0]): the `max` is live there, its
    cotangent `inf` at 0 (sqrt's derivative) would be weighed by 0 for `q`: re-decided, and
    the real singularity at `q = 0` stays."""
    f = lambda q: jnp.sum(jnp.where(q > -1, jnp.sqrt(jnp.maximum(q, 0.)), 0.))  # noqa: E731
    x = jnp.array([-.5, 0., 4., -2.])
    assert "re-decided max" in str(jaxsafe.explain(f, finite_args=True)(x))
    got = jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x)
    np.testing.assert_array_equal(np.asarray(got), np.array([0., np.inf, .25, 0.], np.float32))
    assert np.isnan(np.asarray(jax.grad(f)(x))[0])  # plain JAX: 0 * inf


def test_a_comparison_read_through_a_transpose_is_not_the_lanes_own():
    """`s > 0` selects the lanes of `s.T`: the live lane (1, 0) reads `s[0, 1]`, where the
    `max`'s 0 wins and sqrt's derivative is inf. The comparison is not of the lane itself, so
    the `max` is re-decided: `q[0, 1]`'s lane gets 0, not `0 * inf`."""
    def f(q):
        s = jnp.maximum(q, 0.)
        return jnp.sum(jnp.where(s > 0, jnp.sqrt(s.T), 0.))
    q = jnp.array([[1., -1.], [4., -1.]])
    assert np.isnan(np.asarray(jax.grad(f)(q))[0, 1])
    got = jax.grad(jaxsafe.nan_safe(f))(q)
    np.testing.assert_array_equal(np.asarray(got), np.array([[.5, 0.], [0., 0.]], np.float32))


@pytest.mark.parametrize("f", [
    lambda y: jnp.maximum(jnp.sqrt(jnp.sum(y * y)), 0.),
    lambda y: jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(y))), 0.),
    lambda y: jnp.maximum(jnp.linalg.norm(y), 0.)], ids=["y * y", "square", "linalg.norm"])
def test_a_maximum_whose_operand_never_loses_is_left_as_it_is(f):
    """Hunt AH: `max(norm, 0.)` with `norm = sqrt(sum(y * y))`: the norm is at least 0, so the
    0 never wins alone and drops nothing, but `y * y` had no range (only `y ** 2` had): a guard
    of the `sqrt` whose mask is true in every lane, 4 equations to 15 (contract 4)."""
    y = jnp.array([1., 2., 0.])
    for finite in (False, True):
        assert structure(jaxsafe.make_jaxpr(f, finite_args=finite)(y)) == \
            structure(jax.make_jaxpr(f)(y))
    for x in (y, jnp.zeros(3)):  # at 0: the norm's own singularity, NaN as in plain JAX
        assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x), jax.jit(jax.grad(f))(x))


def _neg_twin(x):
    return jnp.where(x > 0, jnp.where(-x > 0, 0., jnp.sqrt(x - 1.)), 0.)


def _real_imag_twin(x):
    z = lax.complex(x, -1.)
    return jnp.where(jnp.real(z) > 0, jnp.where(jnp.imag(z) > 0, 0., jnp.sqrt(x)), 0.)


def _cast_twin(x):
    return jnp.where(x > 0, jnp.where(x.astype(jnp.int32) > 0, 0., jnp.sqrt(x - .25)), 0.)


def _summed_neg_twin(x):
    return jnp.sum(jnp.where(jnp.sum(x) > 0, jnp.where(jnp.sum(-x) > 0, 0., jnp.sqrt(x - 1.)),
                             0.))


def _random_twin(x):
    p = lax.rng_uniform(0., 1., x.shape) > .5
    q = lax.rng_uniform(0., 1., x.shape) > .5
    return jnp.sum(jnp.where(p, jnp.where(q, 0., jnp.sqrt(x)), 0.))


@pytest.mark.parametrize(("f", "x"), [
    (_neg_twin, jnp.float32(2.)), (_neg_twin, jnp.float32(.5)),
    (_real_imag_twin, jnp.float32(4.)), (_cast_twin, jnp.float32(.5)),
    (_summed_neg_twin, jnp.array([2., 3.])),
], ids=["neg", "neg-live-nan", "real-imag", "cast", "summed-neg"])
def test_predicates_on_values_an_equation_changes_are_not_one_predicate(f, x):
    """`-x > 0` is not `x > 0`, `imag(z)` is not `real(z)`, a cast to int is not its operand
    (hunt AG): the inner `where` takes its live branch, whose derivative (or NaN) stays."""
    assert_close(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(f)(x))
    assert_close(jax.hessian(jaxsafe.nan_safe(f))(x), jax.hessian(f)(x))


def test_two_calls_of_a_stateful_random_primitive_are_not_one_predicate():
    x = 4 * jnp.ones(16)
    got = jax.grad(jaxsafe.nan_safe(_random_twin))(x)
    assert np.count_nonzero(got) > 0  # the lanes where p holds and q does not: .25 each
    assert set(np.unique(np.asarray(got)).tolist()) <= {0., .25}


def test_a_negated_predicate_does_not_pass_for_the_hand_fix_s():
    """The inner `where` on `-x > 0` is no guard for the outer one on `x > 0`: every lane
    dropped, so every derivative is 0 (contract 2), not the `sqrt(-1)`'s NaN."""
    def f(x):
        y = jnp.sqrt(jnp.where(-x > 0, x, 1.))
        return jnp.sum(jnp.where(x > 0, y * .9 + jnp.sum(y) * .1, 0.))
    x = jnp.array([-1., -2.])
    assert np.isnan(jax.grad(f)(x)).all()
    assert_close(jax.grad(jaxsafe.nan_safe(f))(x), jnp.zeros(2))


MASKED_MEANS = {
    "bool mask": (lambda x, m: jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1), bool),
    "int mask": (lambda x, m: jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1), jnp.int32),
    "one plus the count": (lambda x, m: jnp.sum(x * m) / (1.0 + jnp.sum(m)), bool),
    "root of the count": (lambda x, m: jnp.sum(x * m) / jnp.sqrt(jnp.maximum(jnp.sum(m), 1)),
                          bool),
    "per row": (lambda x, m: jnp.sum(jnp.sum(x * m, -1) / jnp.maximum(jnp.sum(m, -1), 1)),
                bool),
    "masked cross-entropy": (lambda x, m: jnp.sum(
        -jnp.sum(jax.nn.one_hot(jnp.array([0, 1, 2, 0]), 3) * jax.nn.log_softmax(x), -1)
        * m[:, 0]) / jnp.maximum(jnp.sum(m[:, 0]), 1), bool),
}


# a NaN logit row makes `log_softmax`'s derivative NaN in a row the mask drops: that one needs
# its guard unless the arguments are promised finite
@pytest.mark.parametrize(("name", "finite_args"), [
    (name, finite) for name in sorted(MASKED_MEANS) for finite in (False, True)
    if finite or name != "masked cross-entropy"])
def test_a_masked_mean_over_a_count_at_least_one_is_left_as_it_is(name, finite_args):
    """`sum(loss * m) / maximum(sum(m), 1)`, the padded batch's mean: the derivative in the
    numerator is `1 / d` for a divisor at least 1 (an integer count converted to a float keeps
    its bound), so the product with the mask meets no non-finite cotangent and is not
    re-decided (hunt AO). A NaN in a masked-out lane stays in the value, as in JAX."""
    f, dtype = MASKED_MEANS[name]
    x = jnp.array([[0.3, 2.0, -1.0], [3.0, 4.0, 0.5], [1.0, -2.0, 0.0], [0.0, 1.0, 2.0]])
    if not finite_args:
        x = x.at[1, 1].set(jnp.nan)
    m = jnp.array([[1, 0, 1], [0, 0, 0], [1, 1, 1], [1, 0, 0]]).astype(dtype)
    report = str(jaxsafe.explain(f, finite_args=finite_args)(x, m))
    assert report == "nothing to guard: the program runs unchanged", report
    assert structure(jaxsafe.make_jaxpr(f, finite_args=finite_args)(x, m)) == \
        structure(jax.make_jaxpr(f)(x, m))
    safe = jaxsafe.nan_safe(f, finite_args=finite_args)
    assert_bitwise(safe(x, m), jax.jit(f)(x, m))
    assert_bitwise(jax.grad(safe)(x, m), jax.grad(f)(x, m))


@pytest.mark.parametrize("root", [False, True])
def test_a_quotient_by_a_count_that_may_be_zero_keeps_its_re_decision(root):
    """Over `maximum(n, 0)` the count may be 0: the numerator's derivative `1 / 0` is inf
    there, and the ReLU before the sum weighs it by 0 in the lanes it drops. Its `max` is
    re-decided: those lanes' derivative is the hand fix's 0, not `0 * inf` (the live lanes keep
    their inf). Over `maximum(n, 1)` nothing is, nor over its square root (at least 1, less
    rounding: `_bounds.root`)."""
    def divisor(n, least):
        d = jnp.maximum(n, least)
        return jnp.sqrt(d.astype(jnp.float32)) if root else d

    def f(x, n, least):
        return jnp.sum(jnp.maximum(x, 0.0)) / divisor(n, least)

    def hand(x, n):
        return jnp.sum(jnp.where(x > 0, x, 0.0)) / divisor(n, 0)

    x, n = jnp.array([4.0, -1.0, 9.0]), jnp.int32(0)
    assert "re-decided max" in str(jaxsafe.explain(f, static_argnums=2)(x, n, 0))
    assert "nothing to guard" in str(jaxsafe.explain(f, static_argnums=2)(x, n, 1))
    assert np.isnan(np.asarray(jax.grad(f)(x, n, 0)[1]))
    safe = jax.grad(jaxsafe.nan_safe(f, static_argnums=2))(x, n, 0)
    assert_bitwise(safe, jax.grad(hand)(x, n))
    assert np.isinf(np.asarray(safe[0]))


def _kl_to_constant_target(logits, x):
    """optax's `kl_divergence` pattern: `where(t == 0, 0, log(t))` of a target `t`."""
    t = jax.nn.softmax(logits)
    return jnp.sum(t * (jnp.where(t == 0, 0.0, jnp.log(t)) - x))


def test_a_log_of_a_value_computed_from_constants_alone_is_left_as_it_is():
    """A target computed inside `f` from a closed-over constant carries no derivative at any
    order: its `log` is never differentiated, so it needs no guard, even where the `where`
    drops a lane of it (hunt AO). Closed over as a tracer of an outer `grad`, it is an argument
    like the others, and its dropped lane's `log` is guarded: the hand fix's derivative."""
    logits = jnp.array([1.0, -jnp.inf, 2.0])
    x = jnp.array([0.5, 1.0, 2.0])

    def f(x):
        return _kl_to_constant_target(logits, x)

    report = str(jaxsafe.explain(f, finite_args=True)(x))
    assert report == "nothing to guard: the program runs unchanged", report
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(f)(x))

    def outer(logits):
        return jaxsafe.nan_safe(lambda x: _kl_to_constant_target(logits, x))(x)

    def hand(logits):
        t = jax.nn.softmax(logits)
        return jnp.sum(t * (jnp.where(t == 0, 0.0, jnp.log(jnp.where(t == 0, 1.0, t))) - x))

    assert np.isnan(np.asarray(jax.grad(lambda c: _kl_to_constant_target(c, x))(logits))).any()
    # one ulp apart in a live lane: XLA fuses the rewritten program differently
    assert_close(jax.grad(outer)(logits), jax.grad(hand)(logits), rtol=1e-6)


NAN_FREE_MAXIMA = {
    "nanmax": lambda x: jnp.nanmax(x, axis=-1),
    "nanmin": lambda x: jnp.nanmin(x, axis=-1),
    "where isnan": lambda x: jnp.where(jnp.all(jnp.isnan(x), -1), 0.0,
                                       jnp.max(jnp.where(jnp.isnan(x), -jnp.inf, x), -1)),
    "where not isnan": lambda x: jnp.where(jnp.all(jnp.isnan(x), -1), 0.0,
                                           jnp.max(jnp.where(~jnp.isnan(x), x, -jnp.inf), -1)),
    "where isfinite": lambda x: jnp.where(jnp.any(jnp.isfinite(x), -1),
                                          jnp.min(jnp.where(jnp.isfinite(x), x, jnp.inf), -1),
                                          0.0),
}


@pytest.mark.parametrize("name", sorted(NAN_FREE_MAXIMA))
def test_a_row_maximum_of_values_shown_not_nan_is_left_as_it_is(name):
    """`jnp.nanmax` maximizes `where(isnan(x), -inf, x)` and drops the result of a row of NaN
    alone: a row maximum's derivative counts the lanes equal to it, and only a NaN (which no lane
    equals: 0 / 0) makes it non-finite, so an operand shown free of NaN needs no guard, inf
    included (`Chooser.meets_nan_only`). The derivatives are JAX's, bitwise."""
    f = NAN_FREE_MAXIMA[name]
    x = jnp.array([[1.0, jnp.nan, 3.0], [jnp.nan] * 3, [jnp.inf, 2.0, -jnp.inf],
                   [-jnp.inf] * 3])
    _assert_left_as_it_is(f, x)
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    assert_bitwise(jax.grad(lambda v: jnp.sum(safe(v)))(x), jax.grad(lambda v: jnp.sum(f(v)))(x))


NAN_KEEPING_MAXIMA = {
    # the selection keeps x where it IS NaN, or tests another value, or fills with NaN
    "kept where NaN": lambda x, y: jnp.max(jnp.where(jnp.isnan(x), x, -jnp.inf), -1),
    "another value tested": lambda x, y: jnp.max(jnp.where(jnp.isnan(y), -jnp.inf, x), -1),
    "NaN fill": lambda x, y: jnp.max(jnp.where(jnp.isnan(x), jnp.nan, x), -1),
    "compared with itself by <": lambda x, y: jnp.max(jnp.where(x < x, -jnp.inf, x), -1),
}


@pytest.mark.parametrize("name", sorted(NAN_KEEPING_MAXIMA))
def test_a_row_maximum_that_may_meet_nan_keeps_its_guard(name):
    """The near misses: the row maximum may be NaN where the `where` after it drops the row, and
    JAX's `0 / 0` reaches the row's lanes; jaxsafe's derivative there is the hand fix's 0."""
    g = NAN_KEEPING_MAXIMA[name]
    x = jnp.array([[1.0, jnp.nan, 3.0], [2.0, 5.0, 4.0]])
    y = jnp.array([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    keep = jnp.array([False, True])

    def f(x):
        return jnp.sum(jnp.where(keep, g(x, y), 0.0))

    def hand(x):
        return jnp.sum(jnp.where(keep, g(jnp.where(keep[:, None], x, 0.0), y), 0.0))

    assert "nothing to guard" not in str(jaxsafe.explain(f)(x))
    assert np.isnan(np.asarray(jax.grad(f)(x))[0]).any()
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(hand)(x))


def test_a_nan_literal_in_a_selection_makes_no_cotangent_non_finite():
    """`where(c, max(v), nan)` of a `v` free of NaN: the NaN is a value, and the selection's
    derivative in the row maximum is 0 or 1, so the maximum is not re-decided (its cotangent is
    finite). Where a product with a NaN weighs the maximum's row, the cotangent is NaN there,
    and the maximum is re-decided: its losing lanes' derivative is the hand fix's 0."""
    x = jnp.array([[1.0, jnp.nan, 3.0], [0.0, 2.0, jnp.inf]])
    c = jnp.array([True, False])

    def row_max(x):
        return jnp.max(jnp.where(jnp.isnan(x), -jnp.inf, x), -1)

    def f(x):
        return jnp.sum(jnp.where(c, row_max(x), jnp.nan))

    def g(x):
        return jnp.sum(jnp.where(c, row_max(x) * jnp.array([1.0, jnp.nan]), 0.0))

    def hand(x):
        return jnp.sum(jnp.where(c, row_max(jnp.where(c[:, None], x, 0.0))
                                 * jnp.where(c, jnp.array([1.0, jnp.nan]), 0.0), 0.0))

    report = str(jaxsafe.explain(f)(x))
    assert report == "nothing to guard: the program runs unchanged", report
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(f)(x))
    assert "nothing to guard" not in str(jaxsafe.explain(g)(x))
    assert np.isnan(np.asarray(jax.grad(g)(x))[1]).all()
    assert_bitwise(jax.grad(jaxsafe.nan_safe(g))(x), jax.grad(hand)(x))


def _select_guarded_by_hand(x):
    """Each branch of `jnp.select` guarded by hand with the lanes it is taken in."""
    first, second = x > 1, x > 0
    return jnp.select([first, second],
                      [jnp.sqrt(jnp.where(first, x, 1.0)),
                       jnp.log(jnp.where(second & ~first, x, 1.0))], 0.0)


def _select_of_three_guarded_by_hand(x):
    c = [x > 2, x > 1, x > 0]
    return jnp.select(c, [jnp.sqrt(jnp.where(c[0], x - 2, 1.0)),
                          jnp.log(jnp.where(c[1] & ~c[0], x - 1, 1.0)),
                          1 / jnp.where(c[2] & ~c[1] & ~c[0], x, 1.0)], -x)


@pytest.mark.parametrize("f", [_select_guarded_by_hand, _select_of_three_guarded_by_hand])
def test_a_select_whose_branches_are_guarded_by_hand_is_left_as_it_is(f):
    """`jnp.select` picks by the index of the first condition that holds (an `argmax` over the
    stacked conditions): read so, each branch is taken where its condition holds and no earlier
    one does (`_case_index.py`), and a branch the user guarded with those lanes needs no guard.
    Derivatives of every order are JAX's."""
    x = jnp.array([1.5, -2.0, 0.5, 0.0, 1.0, 2.5, jnp.nan, jnp.inf, -jnp.inf])
    _assert_left_as_it_is(f, x)
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    for derivative in (jax.grad, jax.jacfwd, jax.hessian):
        assert_close(jax.vmap(derivative(safe))(x), jax.jit(jax.vmap(derivative(f)))(x))


def test_a_select_branch_guarded_with_a_wider_condition_keeps_its_guard():
    """The near miss: the first branch's hand guard `x > 0` lets `x - 1 <= 0` through in lanes
    where the branch is not taken (`0 < x <= 1`): JAX's gradient is NaN there, jaxsafe's the
    hand fix's, at every order."""
    def f(x):
        return jnp.select([x > 1, x > 0], [jnp.sqrt(jnp.where(x > 0, x - 1, 1.0)), 2 * x], 0.0)

    def hand(x):
        return jnp.select([x > 1, x > 0], [jnp.sqrt(jnp.where(x > 1, x - 1, 1.0)), 2 * x], 0.0)

    x = jnp.array([1.5, -2.0, 0.5, 0.0, 1.0, jnp.nan])
    assert "guarded sqrt" in str(jaxsafe.explain(f)(x))
    assert np.isnan(np.asarray(jax.vmap(jax.grad(f))(x))).any()
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    for derivative in (jax.grad, jax.jacfwd, jax.hessian):
        assert_bitwise(jax.vmap(derivative(safe))(x), jax.vmap(derivative(hand))(x))


def _branch_guarded_by_hand(x):
    p = x > 0
    return lax.cond(p, lambda x: jnp.sqrt(jnp.where(p, x, 1.0)), lambda x: 0.0 * x, x)


def test_a_batched_cond_whose_branch_is_guarded_by_hand_is_left_as_it_is():
    """Under `vmap`, a `cond` runs both branches and picks with a `select_n` on its predicate
    cast to an integer, handing each branch `select_n(taken, stop_gradient(p), p)` for `p`:
    read as `p` itself (`_case_index.py`, `Sweep.same_as`), the branch's hand guard is seen.
    Derivatives of every order are JAX's."""
    f = jax.vmap(_branch_guarded_by_hand)
    x = jnp.array([1.5, -2.0, 0.5, 0.0, -0.7, jnp.nan, -jnp.inf])
    _assert_left_as_it_is(f, x)
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    total = lambda g: lambda v: jnp.sum(g(v))  # noqa: E731
    for derivative in (jax.grad, jax.jacfwd, jax.hessian):  # one ulp: fused otherwise
        assert_close(derivative(total(safe))(x), jax.jit(derivative(total(f)))(x))


def test_a_batched_cond_branch_whose_inner_drop_meets_a_pole_keeps_its_guard():
    """The taken branch drops lanes of its own (`0 < x <= 1`) where `sqrt(x - 1)` is at or past
    its pole: JAX's gradient is NaN there, jaxsafe's the hand fix's, to the second order. (The
    lanes where the branch is not taken need nothing: the batched `cond` already hands them a
    `stop_gradient`.)"""
    def branch(x, inner):
        p = x > 0
        return lax.cond(p, lambda x: jnp.where(x > 1, jnp.sqrt(jnp.where(inner(x), x - 1, 1.0)),
                                               0.0), lambda x: 0.0 * x, x)

    def f(x):
        return jnp.sum(jax.vmap(lambda v: branch(v, lambda v: v > 0))(x))

    def hand(x):
        return jnp.sum(jax.vmap(lambda v: branch(v, lambda v: v > 1))(x))

    x = jnp.array([1.5, -2.0, 0.5, 0.0, -0.7, 1.0, jnp.nan])
    assert "nothing to guard" not in str(jaxsafe.explain(f)(x))
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    assert_bitwise(jax.grad(safe)(x), jax.jit(jax.grad(hand))(x))
    assert_bitwise(jax.hessian(safe)(x), jax.jit(jax.hessian(hand))(x))


def _nested_where_guarded_by_order(x):
    """A piecewise function as nested wheres: the inner branch's guard `x > 1` leaves `x`
    through where `x > 2` drops the branch, and there `log` is finite with its derivatives."""
    return jnp.where(x > 2, jnp.sqrt(jnp.where(x > 2, x, 1.0)),
                     jnp.where(x > 1, jnp.log(jnp.where(x > 1, x, 1.0)), 0.0))


def _select_guarded_by_order(x):
    """The second branch names only its own condition; the first one's implies it."""
    return jnp.select([x > 2, x > 1], [jnp.sqrt(jnp.where(x > 2, x, 1.0)),
                                       jnp.log(jnp.where(x > 1, x, 1.0))], 0.0)


def _nested_where_guarded_by_order_hand(x):
    return jnp.where(x > 2, jnp.sqrt(jnp.where(x > 2, x, 1.0)),
                     jnp.where(x > 1, jnp.log(jnp.where((x > 1) & ~(x > 2), x, 1.0)), 0.0))


@pytest.mark.parametrize("f", [_nested_where_guarded_by_order, _select_guarded_by_order])
def test_a_branch_whose_hand_guard_lets_through_values_an_earlier_test_bounds_is_left(f):
    """The lanes an earlier branch takes (`x > 2`) are dropped from the later one, whose guard
    (`x > 1`) does not fill them: there the guard's `where` takes `x`, which the earlier test
    bounds into `log`'s domain (`_by_hand._operand_bound` reads the operand through the
    selections the lanes decide). Derivatives of every order are the fully guarded program's."""
    x = jnp.array([1.5, -2.0, 0.5, 0.0, 1.0, 2.0, 2.5, 3.0, 1e30, jnp.nan, jnp.inf, -jnp.inf])
    _assert_left_as_it_is(f, x)
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    for derivative in (jax.grad, jax.jacfwd, jax.hessian):
        assert_close(jax.vmap(derivative(safe))(x),  # up to the sign of a zero
                     jax.vmap(derivative(_nested_where_guarded_by_order_hand))(x))


def test_a_branch_whose_earlier_test_bounds_the_value_on_the_wrong_side_keeps_its_guard():
    """The near miss: the earlier test `x < 0.5` bounds `x` from above, and the later branch's
    guard `x > -1` lets `-1 < x <= 0` through into `log` where both drop it: JAX's gradient is
    NaN there, jaxsafe's the hand fix's, to the second order."""
    def f(x):
        return jnp.where(x < 0.5, 0.0, jnp.where(x > 1, jnp.log(jnp.where(x > -1, x, 1.0)), 0.0))

    def hand(x):
        return jnp.where(x < 0.5, 0.0, jnp.where(x > 1, jnp.log(jnp.where(x > 1, x, 1.0)), 0.0))

    x = jnp.array([1.5, -2.0, -0.5, 0.0, 0.7, 1.0, 3.0, jnp.nan, jnp.inf])
    assert "guarded log" in str(jaxsafe.explain(f)(x))
    assert np.isnan(np.asarray(jax.vmap(jax.grad(f))(x))).any()
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    for derivative in (jax.grad, jax.jacfwd, jax.hessian):
        assert_bitwise(jax.vmap(derivative(safe))(x), jax.vmap(derivative(hand))(x))


EPS = 1e-12
_EDGE_ROWS = [[1.0, 2.0], [0.0, 0.0], [jnp.nan, 0.0], [jnp.inf, 0.0], [-jnp.inf, 1.0],
              [1e-7, 0.0], [1e30, 0.0]]


def _floored_norm(x):
    return jnp.sqrt(jnp.maximum(jnp.sum(x ** 2), EPS))


def _floored_norm_hand(x):
    """The dropped lanes removed by hand: `x` zeroed where the floor wins."""
    keep = ~(jnp.sum(x ** 2) < EPS)
    return jnp.sqrt(jnp.maximum(jnp.sum(jnp.where(keep, x, 0.0) ** 2), EPS))


def _floored_squares(x):
    return jnp.sum(jnp.sqrt(jnp.maximum(x ** 2, EPS)))


def _floored_squares_hand(x):
    keep = ~(x ** 2 < EPS)
    return jnp.sum(jnp.sqrt(jnp.maximum(jnp.where(keep, x, 0.0) ** 2, EPS)))


def _thresholded_norm(x):
    s = jnp.sum(x ** 2)
    return jnp.where(s < EPS, 0.0, jnp.sqrt(jnp.where(s < EPS, 1.0, s)))


def _thresholded_norm_hand(x):
    keep = ~(jnp.sum(x ** 2) < EPS)
    s = jnp.sum(jnp.where(keep, x, 0.0) ** 2)
    return jnp.where(keep, jnp.sqrt(jnp.where(keep, s, 1.0)), 0.0)


@pytest.mark.parametrize(("f", "hand"), [(_floored_norm, _floored_norm_hand),
                                         (_floored_squares, _floored_squares_hand),
                                         (_thresholded_norm, _thresholded_norm_hand)])
def test_a_value_that_the_dropping_comparison_shows_finite_needs_no_guard(f, hand):
    """`sqrt(maximum(sum(x ** 2), eps))` drops the sum where eps beats it: there the sum is in
    [0, eps), not NaN, so every `x` it sums is finite (an inf or NaN would have made it inf
    or NaN), and `x ** 2`'s derivative meets its zero cotangent as a finite number
    (`_finite_lanes.py`). NaN and inf arguments included, derivatives of every order are the
    program's with the dropped lanes removed by hand."""
    x = jnp.array([1.0, 2.0])
    _assert_left_as_it_is(f, x)
    safe = jaxsafe.nan_safe(f)
    for row in _EDGE_ROWS:
        x = jnp.array(row)
        assert_bitwise(safe(x), jax.jit(f)(x))
        for derivative in (jax.grad, jax.jacfwd, jax.hessian):
            assert_close(derivative(safe)(x), derivative(hand)(x))


@pytest.mark.parametrize(("f", "keep", "row"), [
    # a cube's sum may be -inf below the floor: its derivative there is inf
    (lambda x: jnp.sqrt(jnp.maximum(jnp.sum(x ** 3), EPS)),
     lambda x: ~(jnp.sum(x ** 3) < EPS), [-jnp.inf, 1.0]),
    # a sum above a ceiling may be inf
    (lambda x: jnp.minimum(jnp.sum(x ** 2), 1e6), lambda x: ~(jnp.sum(x ** 2) > 1e6),
     [jnp.inf, 0.0]),
    # `exp` maps -inf to 0: a finite sum does not show `x` finite
    (lambda x: jnp.maximum(jnp.sum(jnp.exp(-x ** 2)), 1e-3),
     lambda x: ~(jnp.sum(jnp.exp(-x ** 2)) < 1e-3), [jnp.inf, jnp.inf]),
], ids=["cube", "ceiling", "exp"])
def test_a_value_the_dropping_comparison_does_not_show_finite_keeps_its_guard(f, keep, row):
    """The near misses: a range unbounded on the other side, or an operation that maps an inf
    to a finite value. At an inf argument in the dropped lanes JAX's gradient is NaN;
    jaxsafe's is the hand fix's, 0."""
    def hand(x):
        return f(jnp.where(keep(x), x, 0.0))

    safe = jaxsafe.nan_safe(f)
    assert "guarded" in str(jaxsafe.explain(f)(jnp.array([1.0, 2.0])))
    for edge in [row, [1.0, 2.0], [0.0, 0.0]]:
        x = jnp.array(edge)
        assert_bitwise(safe(x), jax.jit(f)(x))
        for derivative in (jax.grad, jax.jacfwd):
            assert_close(derivative(safe)(x), derivative(hand)(x))
    assert np.isnan(np.asarray(jax.grad(f)(jnp.array(row)))).any()
    assert_bitwise(jax.grad(safe)(jnp.array(row)), jnp.zeros(2))


@pytest.mark.parametrize("f", [
    lambda x: jnp.sort(jnp.sqrt(x)),
    lambda x: jnp.sum(jnp.sort(jnp.log(x.reshape(2, 3)), axis=1) * 2.0),
    lambda x: jax.lax.sort((x, jnp.sqrt(x)), num_keys=1)[1],
], ids=["sort", "rows", "two-operand"])
def test_a_sort_whose_outputs_are_all_live_is_left_as_it_is(f):
    """Hunt AX: a sort is a permutation of each row, so a row whose sorted lanes are all live
    is live: `jnp.sort(jnp.sqrt(x))` needs no guard (it was 2 equations rewritten to 18).
    Derivatives are JAX's (its NaN at a negative `x` is a live lane's)."""
    x = jnp.array([4.0, 1.0, 0.0, 2.0, jnp.nan, -1.0])
    _assert_left_as_it_is(f, x)


def test_a_sort_whose_row_is_cut_short_keeps_its_guard():
    """The near miss: `jnp.sort(jnp.sqrt(x))[:3]` drops the lanes that sort past the third by
    value: JAX's gradient is NaN at the dropped negative `x`; jaxsafe's is the hand fix's."""
    def f(x):
        return jnp.sum(jnp.sort(jnp.sqrt(x))[:3])

    def hand(x):
        kept = jnp.zeros(x.shape, bool).at[jnp.argsort(jnp.sqrt(x))[:3]].set(True)
        return jnp.sum(jnp.sort(jnp.sqrt(jnp.where(kept, x, 1e4)))[:3])  # sorts past them

    x = jnp.array([4.0, 1.0, 0.5, 2.0, -1.0])
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    assert_close(jax.grad(safe)(x), jax.grad(hand)(x))
