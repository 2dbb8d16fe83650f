"""The acceptance examples of the core: each against the hand-written double where."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite, structure
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jaxsafe
from jaxsafe import nan_safe

# Numerics: conftest's leak checker is for the modules that exercise the API's tracing paths
# (test_api, test_composition, ...); here it would only turn JAX's caches off (2-3x slower).
pytestmark = pytest.mark.no_leak_check

P = jax.extend.core.primitives


def issue_19089(x, pre_filter=False):
    delta = jnp.array((0, 1)) * x
    if pre_filter:
        return jnp.sum(jnp.where(delta > 0, delta, 0) ** 0.5)
    return jnp.sum(jnp.where(delta > 0, delta ** 0.5, 0))


def test_issue_19089_gradient_is_half():
    assert np.isnan(jax.grad(issue_19089)(1.))  # the bug is real
    assert jax.grad(nan_safe(issue_19089))(1.) == 0.5
    assert jax.grad(lambda x: issue_19089(x, True))(1.) == 0.5


def test_issue_19089_forward_bitwise():
    assert_bitwise(nan_safe(issue_19089)(1.), jax.jit(issue_19089)(1.))


@pytest.mark.parametrize("x", [-1., 0., 2.])
def test_sqrt_times_log_branch(x):
    f = lambda x: jnp.where(x > 0, jnp.sqrt(x) * jnp.log(x), x ** 2)

    def hand(x):
        xs = jnp.where(x > 0, x, 1.)
        return jnp.where(x > 0, jnp.sqrt(xs) * jnp.log(xs), x ** 2)
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    g = jax.grad(nan_safe(f))(x)
    assert_finite(g)
    assert g == jax.grad(hand)(x)


def test_real_singularity_is_kept():
    f = lambda x: jnp.where(x >= 0, jnp.sqrt(x), 0.)
    assert jax.grad(nan_safe(f))(0.) == jnp.inf


def test_maximum_drops_the_losing_side():
    f = lambda x: jnp.maximum(jnp.sqrt(x), 1.)
    assert np.isnan(jax.grad(f)(0.))
    assert nan_safe(f)(0.) == 1.
    assert jax.grad(nan_safe(f))(0.) == 0.
    # ties stay live: d/dx max(sqrt(x), 1) at x = 1 is JAX's 0.5 * 0.5
    assert jax.grad(nan_safe(f))(1.) == jax.grad(f)(1.)
    assert jax.grad(nan_safe(f))(4.) == 0.25


def test_maximum_with_two_differentiable_sides_keeps_the_winner():
    # the guarded side must not turn into a tie with the winner (d/db would become 0.5)
    f = lambda x, b: jnp.maximum(jnp.log(x), b)
    gx, gb = jax.grad(nan_safe(f), (0, 1))(0.5, -0.1)  # log(0.5) = -0.69 < b
    assert (gx, gb) == (0., 1.)
    gx, gb = jax.grad(nan_safe(f), (0, 1))(0., 0.)  # log(0) = -inf, b = 0 wins
    assert (gx, gb) == (0., 1.)


def test_clip_keeps_decision_and_zero_gradient():
    f = lambda x: jnp.clip(jnp.log(x), -5., 5.)
    assert nan_safe(f)(0.) == -5.
    assert jax.grad(nan_safe(f))(0.) == 0.
    assert jax.grad(nan_safe(f))(1.) == 1.


def test_drops_by_slicing_and_indexing():
    x = jnp.array([0., 1., 4.])
    assert_close(jax.grad(nan_safe(lambda x: jnp.sum(jnp.sqrt(x)[1:])))(x),
                 jax.grad(lambda x: jnp.sum(jnp.sqrt(x[1:])))(x))
    assert_close(jax.grad(nan_safe(lambda x: jnp.log(x)[2]))(x),
                 jax.grad(lambda x: jnp.log(x[2]))(x))
    idx = np.array([1, 2])
    assert_close(jax.grad(nan_safe(lambda x: jnp.sum(jnp.log(x)[idx])))(x),
                 jax.grad(lambda x: jnp.sum(jnp.log(x[idx])))(x))


def test_dynamic_slice_drop():
    x = jnp.array([0., 1., 4.])
    f = lambda x, i: jnp.sum(lax.dynamic_slice(jnp.sqrt(x), (i,), (2,)))
    ref = lambda x, i: jnp.sum(jnp.sqrt(lax.dynamic_slice(x, (i,), (2,))))
    assert_close(jax.grad(nan_safe(f))(x, 1), jax.grad(ref)(x, 1))
    assert_close(jax.grad(nan_safe(f))(x, 0), jax.grad(ref)(x, 0))  # the singular lane is live


def test_sum_with_where_argument():
    x = jnp.array([0., 1., 4.])
    f = lambda x: jnp.sum(jnp.log(x), where=x > 0)
    hand = lambda x: jnp.sum(jnp.log(jnp.where(x > 0, x, 1.)), where=x > 0)
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    assert_close(jax.grad(nan_safe(f))(x), jax.grad(hand)(x))


def test_predicate_computed_from_the_guarded_value():
    def f(x):
        y = jnp.sqrt(x)
        return jnp.where(jnp.isnan(y), 0., y)
    x = jnp.array([-1., 0.25, 4.])
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    g = jax.grad(lambda x: jnp.sum(nan_safe(f)(x)))(x)
    assert_close(g, jnp.array([0., 1., 0.25]))


def test_nan_targets_in_the_data():
    y = jnp.array([1., jnp.nan, 3.])

    def loss(w, x):
        return jnp.sum(jnp.where(jnp.isnan(y), 0., w * jnp.abs(x - y)))

    def hand(w, x):
        y0 = jnp.where(jnp.isnan(y), 0., y)
        return jnp.sum(jnp.where(jnp.isnan(y), 0., w * jnp.abs(x - y0)))
    args = (2., jnp.array([0.5, 1., 2.]))
    assert any(np.isnan(g).any() for g in jax.grad(loss, (0, 1))(*args))
    assert_close(jax.grad(nan_safe(loss), (0, 1))(*args), jax.grad(hand, (0, 1))(*args))


def masked_attention(s, v, mask):
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s)
    return jnp.where(mask.any(-1, keepdims=True), p @ v, 0.)


def test_masked_softmax_rows_match_the_valid_rows_alone():
    mask = np.array([[True, False, True, False], [False] * 4, [True] * 4, [False] * 4])
    s = jnp.linspace(-1., 2., 16).reshape(4, 4)
    v = jnp.linspace(0., 1., 12).reshape(4, 3)
    valid = np.array([0, 2])
    loss = lambda s, v: jnp.sum(jnp.sin(masked_attention(s, v, mask)))
    ref = lambda s, v: jnp.sum(jnp.sin(masked_attention(s[valid], v, mask[valid])))
    assert any(np.isnan(g).any() for g in jax.grad(loss, (0, 1))(s, v))
    gs, gv = jax.grad(nan_safe(loss), (0, 1))(s, v)
    gs_ref, gv_ref = jax.grad(ref, (0, 1))(s, v)
    assert_finite((gs, gv))
    assert_close(gs, gs_ref, rtol=1e-5)  # the reference never reads rows 1 and 3: zero there
    assert np.all(np.asarray(gs)[[1, 3]] == 0)
    assert_close(gv, gv_ref, rtol=1e-5)
    assert_bitwise(nan_safe(loss)(s, v), jax.jit(loss)(s, v))


def test_nothing_to_guard_is_the_original_program():
    # (f, args, finite_args): a dropped lane of x * x or sin(x) needs a guard only if the
    # argument may be non-finite (test_nonfinite_data.py); promised finite, nothing does
    for f, args, finite in [(lambda x: jnp.where(x > 0, x * x, 0.), (1.,), True),
                            (lambda x: jnp.sum(jnp.sin(x)[1:]), (jnp.ones(3),), True),
                            (lambda x: jnp.where(x > 0, x * 2., 0.), (1.,), False),
                            (lambda x: jnp.sum(x[1:] * 2. + 1.), (jnp.ones(3),), False),
                            (lambda x: jnp.sqrt(x) * 2., (1.,), False)]:
        orig = jax.make_jaxpr(f)(*args)
        new = jaxsafe.make_jaxpr(f, finite_args=finite)(*args)
        assert [e.primitive for e in new.eqns] == [e.primitive for e in orig.eqns]
        assert structure(new) == structure(orig)


def test_rewrite_is_the_double_where():
    new = jaxsafe.make_jaxpr(lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.))(1.)
    prims = [e.primitive for e in new.eqns]
    assert prims.count(P.select_n_p) == 2 and prims.count(P.sqrt_p) == 1


def test_n_way_select_with_int_predicates():
    x = jnp.array([-1., 0., 0.25, 4.])
    f = lambda x: lax.select_n(jnp.clip(x, 0, 2).astype(jnp.int32),
                               jnp.log(x), jnp.sqrt(x - 0.25), x)
    loss = lambda f: (lambda x: jnp.sum(f(x)))
    g = jax.grad(loss(nan_safe(f)))(x)
    assert np.isnan(jax.grad(loss(f))(x)).any()
    # taken branches: log at -1 (finite slope -1), log at 0 (a real singularity: inf), log at
    # 0.25 (4), identity at 4 (1)
    np.testing.assert_array_equal(g, [-1., np.inf, 4., 1.])
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))

    s = lambda x: jnp.select([x < 0, x == 0], [jnp.log(x + 2), jnp.log(x)], jnp.sqrt(x))
    hand = lambda x: jnp.select([x < 0, x == 0], [jnp.log(jnp.where(x < 0, x, -1.) + 2),
                                                  jnp.log(jnp.where(x == 0, x, 1.))],
                                jnp.sqrt(jnp.where(x > 0, x, 1.)))
    np.testing.assert_array_equal(jax.grad(loss(nan_safe(s)))(x), jax.grad(loss(hand))(x))


def test_liveness_through_reshape_transpose_and_dot():
    def f(a, b):
        m = jnp.log(a).reshape(2, 2).T @ b
        return jnp.sum(jnp.where(jnp.arange(2)[:, None] > 0, m, 0.))

    def dropped_removed(a, b):  # row 0 of m never reaches the output: compute row 1 only
        return jnp.sum(jnp.log(a.reshape(2, 2).T[1]) @ b)
    a, b = jnp.array([0., 1., 0., 2.]), jnp.linspace(1., 2., 6).reshape(2, 3)
    assert any(np.isnan(g).any() for g in jax.grad(f, (0, 1))(a, b))
    assert_close(jax.grad(nan_safe(f), (0, 1))(a, b), jax.grad(dropped_removed, (0, 1))(a, b))


def test_masked_attention_second_order_matches_the_valid_rows():
    mask = np.array([[True, False, True], [False] * 3, [True] * 3])
    s = jnp.linspace(-1., 2., 9).reshape(3, 3)
    v = jnp.linspace(0., 1., 6).reshape(3, 2)
    valid = np.array([0, 2])
    loss = lambda s, v: jnp.sum(jnp.sin(masked_attention(s, v, mask)))
    ref = lambda s, v: jnp.sum(jnp.sin(masked_attention(s[valid], v, mask[valid])))
    h = jax.hessian(nan_safe(loss), (0, 1))(s, v)
    h_ref = jax.jit(jax.hessian(ref, (0, 1)))(s, v)
    assert_finite(h)
    assert_close(h, h_ref, rtol=1e-4, atol=1e-6)


def test_logsumexp_isfinite_test_does_not_taint_the_program():
    """logsumexp tests its max with isfinite only to feed stop_gradient, and starts from
    max(-inf, .): neither makes the products around it suspect, so no guard lands there. Nor
    on the exp and the log: its shift, `x - where(isfinite(m), m, 0.)`, is at most 0 for
    finite `x` (`_maxima.py`), so the sum of its exp is at least 1: nothing to guard."""
    f = lambda w, x: jnp.sum(jnp.where(x > 0, (w * x) * jax.nn.logsumexp(x), 0.))
    # finite arguments: the products would be guarded for non-finite ones (test_nonfinite_data)
    _, report = jaxsafe.nan_safe(f, finite_args=True).trace(1., jnp.ones(3))
    assert not report.sites and not report.changed
    # a shift that is not x's maximum keeps the exp's guard, and no product is guarded
    g = lambda w, x: jnp.sum(jnp.where(x > 0, (w * x) * jnp.log(jnp.sum(jnp.exp(x - 1.))), 0.))
    _, report = jaxsafe.nan_safe(g, finite_args=True).trace(1., jnp.ones(3))
    assert [site.eqn.primitive for site in report.sites] == [P.exp_p]
    assert all(reason == "table" for site in report.sites for reason in site.reasons.values())


def _assert_hand_fix_to_the_third_order(f, hand, x):
    """Plain JAX's gradient of `f` is NaN at `x`; nan_safe's forward is bitwise jit's, and its
    derivatives of orders 1 to 3 are finite and the hand fix's (each under jit)."""
    assert np.isnan(np.asarray(jax.jit(jax.grad(f))(x))).any()
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    for order in (jax.grad, jax.hessian, lambda g: jax.jacfwd(jax.hessian(g))):
        got = jax.jit(order(nan_safe(f)))(x)
        assert_finite(got)
        assert_close(got, jax.jit(order(hand))(x), atol=1e-6)


@pytest.mark.parametrize("policy", [None, "save_only_these_names"])
def test_a_drop_reaches_through_checkpoint_name(policy):
    """`checkpoint_name` tags a value for a remat policy: the value itself. A `where` after it
    drops the lanes of the `log` before it (plain JAX: NaN at x = 0, 0 * inf)."""
    def make(clean):
        def f(x):
            y = checkpoint_name(jnp.log(clean(x)), "lg")
            return jnp.where(x > 0, y, 0.)
        if policy is not None:
            f = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("lg"))
        return lambda x: jnp.sum(f(x) ** 2)
    f, hand = make(lambda x: x), make(lambda x: jnp.where(x > 0, x, 1.))
    x = jnp.array([-1., 0., 0.5, 2.])
    _assert_hand_fix_to_the_third_order(f, hand, x)


PLACED = {"device_put": jax.device_put,
          "optimization_barrier": lambda t: lax.optimization_barrier(t)}


@pytest.mark.parametrize("place", list(PLACED))
def test_a_drop_reaches_through_a_placement_or_a_fence(place):
    """`jax.device_put` and `lax.optimization_barrier` inside a traced function: each operand
    is its output (a pair of them here). A `where` after them drops the lanes of the `log` and
    `sqrt` before them (plain JAX: NaN where x <= 0)."""
    def make(clean):
        def f(x):
            a, b = PLACED[place]((jnp.log(clean(x)), jnp.sqrt(clean(x))))
            return jnp.sum(jnp.where(x > 0, a * b, 0.))
        return f
    f, hand = make(lambda x: x), make(lambda x: jnp.where(x > 0, x, 1.))
    x = jnp.array([-1., 0., 0.5, 2.])
    _assert_hand_fix_to_the_third_order(f, hand, x)
    assert "unknown" not in str(jaxsafe.explain(f)(x))


def test_split_is_data_movement_not_an_unknown_primitive():
    f = lambda x: jnp.split(jnp.log(x), 2)[1].sum()
    x = jnp.array([0., -1., 1., 2.])
    assert "unknown primitive" not in str(jaxsafe.explain(f)(x))
    assert_close(jax.grad(nan_safe(f))(x), jnp.array([0., 0., 1., 0.5]))


# --------------------------------------------------------------------------- constant predicates
# `jnp.where(True, ...)` binds a Python bool literal as the predicate (this crashed the mask
# rules once: a Python bool has no dtype); `full((), 0.) >= 0.` computes one from literals.

@pytest.mark.parametrize("pred", [True, "computed"])
def test_constant_true_predicate_changes_nothing(pred):
    def f(x):
        p = jnp.full((), 0.) >= 0. if pred == "computed" else pred
        return jnp.where(p, jnp.sqrt(x), 0.)
    x = jnp.array([-1., 0., 4.])
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))


@pytest.mark.parametrize("pred", [False, "computed"])
def test_constant_false_predicate_drops_the_whole_side(pred):
    def f(x):
        p = jnp.full((), 0.) < 0. if pred == "computed" else pred
        return jnp.sum(jnp.where(p, jnp.sqrt(x), x ** 2))
    x = jnp.array([-1., 0., 4.])
    assert np.isnan(jax.grad(f)(x)).any()  # the bug is real: sqrt'(-1) * 0
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x), 2 * x)  # d(x^2)/dx, exactly


def test_mixed_constant_predicate_is_a_selection():
    def f(x):
        return jnp.sum(jnp.where(jnp.array([True, False, True]), jnp.sqrt(x), x))
    x = jnp.array([4., -1., 1.])
    hand = lambda x: jnp.sum(jnp.where(jnp.array([True, False, True]),
                                       jnp.sqrt(jnp.where(jnp.array([True, False, True]), x, 1.)),
                                       x))
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x), jax.grad(hand)(x))


def test_guard_needed_only_by_an_unused_scan_output_is_not_planned():
    # JAX prunes the unused stacked output before differentiating, so nothing needs a guard.
    def f(x, m):
        def body(c, xi):
            return c + c, jnp.where(xi > 0., jnp.arccos(c), c)
        return lax.scan(body, x, m)[0]
    args = (jnp.full(4, 2.), jnp.ones((3, 4)))
    assert np.isfinite(jax.grad(lambda x, m: f(x, m).sum())(*args)).all()
    assert structure(jaxsafe.make_jaxpr(f)(*args)) == structure(jax.make_jaxpr(f)(*args))


# ------------------------------------------------------------------------ guards that cannot matter
# jaxsafe/_bounds.py: an operand bounded below, for every finite input, by a point where the
# primitive and its derivative are finite needs no guard (a layer norm's rsqrt).

def _layer_norm_rows(x, keep, eps):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return jnp.sum(jnp.where(keep, (x - mu) * jax.lax.rsqrt(var + eps), 0.))


def test_layer_norm_rsqrt_is_not_guarded():
    f = lambda x, keep: _layer_norm_rows(x, keep, 1e-5)
    x = jnp.array([[1., 2., 4.], [3., 3., 3.]])   # row 1: variance 0
    keep = jnp.array([[True], [False]])
    # finite x (non-finite x would guard the products, test_nonfinite_data.py)
    assert structure(jaxsafe.make_jaxpr(f, finite_args=True)(x, keep)) == \
        structure(jax.make_jaxpr(f)(x, keep))
    assert_finite(jax.grad(f)(x, keep))            # plain JAX is fine already


@pytest.mark.parametrize("dtype, eps", [(jnp.float32, 1e-40), (jnp.float16, 1e-5)])
def test_rsqrt_whose_derivative_overflows_at_the_bound_stays_guarded(dtype, eps):
    # rsqrt'(v) = -v ** -1.5 / 2 overflows at v = 1e-40 (float32) and at 1e-5 (float16)
    f = lambda x, keep: _layer_norm_rows(x, keep, eps)

    def hand(x, keep):
        return _layer_norm_rows(jnp.where(keep, x, jnp.array([0., 1., 2.], dtype)), keep, eps)
    x = jnp.array([[1., 2., 4.], [3., 3., 3.]], dtype)
    keep = jnp.array([[True], [False]])
    assert np.isnan(np.asarray(jax.grad(f)(x, keep), np.float32)).any()
    got = jax.grad(nan_safe(f))(x, keep)
    assert_finite(got)
    assert_close(got, jax.grad(hand)(x, keep), rtol=1e-2 if dtype == jnp.float16 else 1e-6)


def test_bounded_operand_tested_for_nan_stays_guarded():
    # x is tested with isnan, so it may be NaN in the lanes the where drops: no bound holds
    f = lambda x: jnp.sum(jnp.where(jnp.isnan(x), 0., jax.lax.rsqrt(x ** 2 + 1.)))
    x = jnp.array([jnp.nan, 0., 2.])
    g = jax.grad(nan_safe(f))(x)
    assert_close(g, jnp.array([0., 0., -2. * 5. ** -1.5]))


# Known values in dropped rows (DroppedValues): the row sums of a softmax whose dropped rows are
# guarded to exp(0) = 1 hold the row length there, so the division needs no guard.

def _masked_attention_rows(s, v, mask, hand=False):
    s = jnp.where(mask, s, -jnp.inf)
    valid = jnp.any(mask, axis=-1, keepdims=True)
    if hand:
        s = jnp.where(valid, s, 0.)
    e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    return jnp.sum(jnp.where(valid, (e / jnp.sum(e, axis=-1, keepdims=True)) @ v, 0.) ** 2)


def test_softmax_row_sums_over_dropped_rows_are_not_guarded():
    mask = jnp.array([[True, False, True], [False, False, False]])
    s, v = jnp.array([[1., 2., 3.], [4., 5., 6.]]), jnp.array([[1., -1.], [2., 0.], [0., 3.]])
    _, report = jaxsafe.nan_safe(_masked_attention_rows).trace(s, v, mask)
    assert [site.eqn.primitive for site in report.sites] == [P.exp_p]  # as the hand fix
    assert np.isnan(jax.grad(_masked_attention_rows, 1)(s, v, mask)).any()
    got = jax.grad(nan_safe(_masked_attention_rows), (0, 1))(s, v, mask)
    assert_close(got, jax.grad(_masked_attention_rows, (0, 1))(s, v, mask, hand=True))


def test_a_sum_that_reads_live_lanes_keeps_its_guard():
    # the exps are live (returned), so where the division is dropped its sum may be anything:
    # here 0, and 1 / 0 would give 0 * inf = NaN in the gradient
    def f(x, c):
        e = jnp.exp(x)
        return jnp.sum(e) + jnp.where(c, 1. / jnp.sum(e), 0.)
    x = jnp.array([-200., -300.])
    assert np.isnan(jax.grad(f)(x, False)).any()
    _, report = jaxsafe.nan_safe(f).trace(x, False)
    assert [site.eqn.primitive for site in report.sites] == [P.div_p]
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x, False), jnp.exp(x))



# One guard at the start of a dropped chain (DroppedValues.move_chain_guards): where a NaN-prone
# step reads a chain of elementwise steps from an earlier guard, that guard takes a safe value
# carrying the whole chain into the domain, as a hand fix guards x once.

def _log_of_square(x, hand=False):
    if hand:
        x = jnp.where(x > 0, x, 1.)
    return jnp.sum(jnp.where(x > 0, jnp.log(x * x), 0.))


def test_the_guard_at_the_start_of_a_chain_takes_a_value_that_carries_it():
    x = jnp.array([np.nan, -np.inf, 0., 2., 3.])
    assert np.isnan(jax.grad(_log_of_square)(x)).any()
    _, report = jaxsafe.nan_safe(_log_of_square).trace(x)
    # x may be NaN (an argument): the product guards it; at 0 the log would need a guard of its
    # own, at 1 it does not
    assert [(site.eqn.primitive, set(site.replace.values())) for site in report.sites] == \
        [(P.mul_p, {1.0})]
    assert_bitwise(nan_safe(_log_of_square)(x), jax.jit(_log_of_square)(x))
    np.testing.assert_array_equal(jax.grad(nan_safe(_log_of_square))(x),
                                  jax.grad(lambda v: _log_of_square(v, hand=True))(x))


def test_a_chain_value_read_twice_keeps_the_later_guard():
    # y is read by the log and returned: its dropped value may not change, the log keeps a guard
    def f(x):
        y = x * x
        return jnp.sum(jnp.where(x > 0, jnp.log(y), 0.)), y
    x = jnp.array([np.nan, 0., 2.])
    _, report = jaxsafe.nan_safe(f).trace(x)
    assert [site.eqn.primitive for site in report.sites] == [P.log_p]
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))


def test_gennorm_cdf_keeps_xla_rewrite_of_its_live_lanes():
    """gennorm.cdf's igamma reads |x| ** 1.5, whose log XLA rewrites to 1.5 * log|x|: a guard
    between the power and igamma stops it and the live lane x = tiny gets inf, not 0.55."""
    from jax.scipy import stats
    f = lambda x: jnp.sum(jnp.where(x > 0, stats.gennorm.cdf(x, 1.5), 0.5))
    x = jnp.array([np.finfo(np.float32).tiny, 1., -1., np.nan])
    hand = lambda v: f(jnp.where(v > 0, v, 1.))
    g = jax.jit(jax.grad(nan_safe(f)))(x)
    assert_bitwise(g, jax.jit(jax.grad(hand))(x))
    assert np.isfinite(g[0])

# ---------------------------------------------------------------------- literal and scalar operands
# A guard on a literal that the op broadcasts (`x / 0.`) is applied lane by lane, at the output's
# shape: the dropped lanes get the safe value, the live ones keep the literal.

def test_literal_zero_denominator_is_guarded_in_dropped_lanes():
    f = lambda x: jnp.sum(jnp.where(x > 0, x / 0., 0.))
    x = jnp.array([-1., 2., 3.])
    assert np.isnan(jax.grad(f)(x)[0])
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x), [0., np.inf, np.inf])  # real: kept
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))


@pytest.mark.parametrize("s", [0., 2.])
def test_scalar_denominator_keeps_its_shape(s):
    # A broadcast operand is guarded where every lane it feeds is dropped, and keeps its shape:
    # the live lanes are divided exactly as in f (bitwise, also under value_and_grad).
    f = lambda x, s: jnp.sum(jnp.where(x > 0, x / s, 0.))
    x = jnp.array([-1., 2., 3.])
    value, _ = jax.value_and_grad(nan_safe(f), (0, 1))(x, s)
    assert_bitwise(value, jax.jit(f)(x, s))
    x = -jnp.ones(3)  # every lane dropped: s is guarded
    for got, want in zip(jax.grad(nan_safe(f), (0, 1))(x, s), (jnp.zeros(3), 0.),
                         strict=True):
        np.testing.assert_array_equal(got, want)


def test_in_domain_literal_is_not_guarded():
    f = lambda x: jnp.where(x > 0, x / 2., 0.)
    x = jnp.array([-1., 2.])
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))


# --------------------------------------------------------------------------- stack, unstack, tile


def test_stack_unstack_and_tile_pass_liveness():
    """`jnp.stack`, `jnp.unstack` and `jnp.tile` (primitives of their own in newer JAX): a
    dropped entry of a stack, an unused part of an unstack, a copy of a tile that no live lane
    reads; each against the program with the dropped lanes removed."""
    p = jnp.array([0., 2.])
    active = jnp.array([True, True, False])
    losses = lambda p: jnp.sum(jnp.where(active, jnp.stack([p[1], 3 * p[1], jnp.log(p[0])]),
                                         0.))
    assert np.isnan(jax.grad(losses)(p)).any()
    assert_bitwise(nan_safe(losses)(p), jax.jit(losses)(p))
    np.testing.assert_array_equal(jax.grad(nan_safe(losses))(p),
                                  jax.grad(lambda p: p[1] + 3 * p[1])(p))

    x = jnp.array([4., -1., 9.])
    first = lambda x: jnp.unstack(jnp.sqrt(x))[0]
    assert np.isnan(jax.grad(first)(x)).any()
    np.testing.assert_array_equal(jax.grad(nan_safe(first))(x),
                                  jax.grad(lambda x: jnp.sqrt(x[0]))(x))

    keep = jnp.array([True, False, True, True, False, True])
    tiled = lambda x: jnp.sum(jnp.where(keep, jnp.tile(jnp.sqrt(x), 2), 0.))
    hand = lambda x: jnp.sum(jnp.where(keep, jnp.tile(jnp.sqrt(jnp.where(x > 0, x, 1.)), 2), 0.))
    assert np.isnan(jax.grad(tiled)(x)).any()
    assert_bitwise(nan_safe(tiled)(x), jax.jit(tiled)(x))
    np.testing.assert_array_equal(jax.grad(nan_safe(tiled))(x), jax.grad(hand)(x))
    assert_close(jax.hessian(nan_safe(tiled))(x), jax.hessian(hand)(x))


def test_a_scatter_add_drops_only_what_it_may_drop():
    """`x.at[i].add(u)` drops `u` where `i` is out of range (its default mode): an index the
    program fixes in range drops nothing (the program is unchanged), one out of range drops the
    update (the hand fix's zero), and a clipped index drops nothing either."""
    x = jnp.ones(3)
    inside = lambda x, v: jnp.sum(x.at[1].add(jnp.sqrt(v)))
    assert structure(jaxsafe.make_jaxpr(inside)(x, 2.)) == structure(jax.make_jaxpr(inside)(x, 2.))
    for ids in (jnp.array([0, 1, 1, 0]), jnp.arange(4) % 2):  # constants in range
        segments = lambda x, ids=ids: jnp.sum(jax.ops.segment_sum(jnp.sqrt(x), ids, 2))
        assert structure(jaxsafe.make_jaxpr(segments)(jnp.ones(4))) == \
            structure(jax.make_jaxpr(segments)(jnp.ones(4)))
    clipped = lambda x, v, i: jnp.sum(x.at[i].add(jnp.sqrt(v), mode="clip"))
    assert structure(jaxsafe.make_jaxpr(clipped)(x, 2., 7)) == \
        structure(jax.make_jaxpr(clipped)(x, 2., 7))
    outside = lambda x, v: jnp.sum(x.at[5].add(jnp.sqrt(v)))
    assert np.isnan(jax.grad(outside, 1)(x, -2.))
    assert jax.grad(nan_safe(outside), 1)(x, -2.) == 0.
    assert_bitwise(nan_safe(outside)(x, -2.), jax.jit(outside)(x, -2.))
