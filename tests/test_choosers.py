"""Choosers (jaxsafe/_choosers.py): what the drop table does not show row by row.

Ties stay live and share the derivative; the choice is made on the original values, so a guard
never bends it; a zero that depends on the inputs is a real singularity, not a mask; with no
hazard, a program of choosers is not changed at all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite, structure
from jax import lax

import jaxsafe
from jaxsafe import nan_safe

# Numerics: conftest's leak checker is for the modules that exercise the API's tracing paths
# (test_api, test_composition, ...); here it would only turn JAX's caches off (2-3x slower).
pytestmark = pytest.mark.no_leak_check


def h(x):
    return jnp.sqrt(jnp.abs(x))


def test_a_tie_at_the_maximum_shares_the_derivative_and_the_other_lanes_get_zero():
    f = lambda x: jnp.max(h(x))
    x = jnp.array([4., -4., 0.])
    assert np.isnan(jax.grad(f)(x)[2])  # plain JAX: 0 * inf in the singular lane
    assert_close(jax.grad(nan_safe(f))(x), jnp.array([0.125, -0.125, 0.]))


def test_the_choice_is_made_on_the_original_values_not_the_guarded_ones():
    # log's guard puts log(1) = 0 in the dropped lanes, above the live maximum log(0.5)
    f = lambda x: jnp.max(jnp.log(x))
    x = jnp.array([0.5, 0.25, 0.])
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    assert_close(jax.grad(nan_safe(f))(x), jnp.array([2., 0., 0.]))
    g = lambda x: lax.top_k(jnp.log(x), 1)[0].sum() + jnp.sort(jnp.log(x))[-1]
    assert_bitwise(nan_safe(g)(x), jax.jit(g)(x))
    assert_close(jax.grad(nan_safe(g))(x), jnp.array([4., 0., 0.]))


def test_a_singular_lane_that_is_chosen_stays_singular():
    x = jnp.array([0., 0.])  # a tie at sqrt(0), whose derivative is inf
    f = lambda x: jnp.max(h(x))  # both lanes share the maximum: both live
    assert_bitwise(jax.grad(nan_safe(f))(x), jax.grad(f)(x))
    # a permutation moves one lane to the live position; the other is dropped
    for f, chosen in ((lambda x: jnp.sort(h(x))[-1], 1), (lambda x: lax.top_k(h(x), 1)[0][0], 0)):
        got, plain = np.asarray(jax.grad(nan_safe(f))(x)), np.asarray(jax.grad(f)(x))
        assert np.isinf(got[chosen]) and got[chosen] == plain[chosen]
        assert got[1 - chosen] == 0 and np.isnan(plain[1 - chosen])


def test_a_segment_maximum_chooses_as_a_row_maximum():
    """`segment_max`/`segment_min`/`x.at[i].max`: a losing lane holding `sqrt(0)` or `log(0)`
    gets zero, ties share as in JAX, a chosen singular lane stays singular, and the choice is
    the original's though the guard puts `log(1) = 0` above a live maximum `log(0.5)`."""
    seg = jnp.array([0, 0, 0, 1, 1])
    cases = {
        "sqrt": lambda x: jax.ops.segment_max(jnp.sqrt(x), seg, 2).sum(),
        "log": lambda x: jax.ops.segment_max(jnp.log(x), seg, 2).sum(),
        "min": lambda x: jax.ops.segment_min(-jnp.log(x), seg, 2).sum(),
        "at max": lambda x: jnp.full(2, -9.).at[seg].max(jnp.log(x)).sum(),
    }
    for name, f in cases.items():
        x = jnp.array([.5, 0., .25, 4., 0.])  # losers: lanes 1, 2 and 4
        assert np.isnan(jax.grad(f)(x)).any(), name  # plain JAX: 0 * inf in a loser
        want = jax.grad(lambda x, f=f: f(jnp.where(jnp.arange(5) % 3 == 0, x, 1e-3)))(x)
        assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
        assert_close(jax.grad(nan_safe(f))(x), want)
        assert_close(jax.jacfwd(nan_safe(f))(x), want)
        assert_close(jax.hessian(nan_safe(f))(x), jax.hessian(
            lambda x, f=f: f(jnp.where(jnp.arange(5) % 3 == 0, x, 1e-3)))(x))
    ties = jnp.array([2., 2., 1., 0., 0.])  # a tie of two live lanes; a tie at sqrt(0)
    f = cases["sqrt"]
    got, plain = jax.grad(nan_safe(f))(ties), jax.grad(f)(ties)
    assert_bitwise(got[:3], plain[:3])  # shared as JAX shares it, the loser 0
    assert np.isinf(got[3:]).all() and np.isinf(plain[3:]).all()  # chosen: singular


def test_a_zero_factor_that_depends_on_the_inputs_is_not_a_mask():
    for f in (lambda x: (jnp.sqrt(x) * jnp.sqrt(x)).sum(),
              lambda x: (jax.nn.relu(x) * jnp.sqrt(x)).sum()):
        x = jnp.array([0., 4.])
        assert_bitwise(jax.grad(nan_safe(f))(x), jax.grad(f)(x))
        assert np.isnan(jax.grad(f)(x)[0])


def test_a_masked_product_keeps_its_forward_value_sign_of_zero_and_nan_included():
    mask = jnp.array([0., 1., 0., 1.])
    f = lambda x: mask * jnp.log(x)
    x = jnp.array([0.5, 2., -1., 0.])  # log: -0.69 (masked: -0.), NaN (masked: NaN), -inf
    out = nan_safe(f)(x)
    assert_bitwise(out, jax.jit(f)(x))
    assert np.signbit(np.asarray(out)[0]) and np.isnan(np.asarray(out)[2])
    assert_close(jax.grad(lambda v: nan_safe(f)(v).sum())(x), jnp.array([0., 0.5, 0., np.inf]))


def test_with_no_hazard_a_program_of_choosers_is_the_original():
    mask = np.array([0., 0., 1., 1.], np.float32)
    def f(x):
        pooled = lax.reduce_window(jnp.tanh(x), -jnp.inf, lax.max, (2,), (1,), "VALID")
        return (jnp.max(x * x) + jnp.sort(x * x)[2:].sum() + lax.top_k(x * x, 2)[0].sum()
                + lax.cummax(x * x)[-1] + pooled.sum() + (mask * jnp.tanh(x)).sum()
                + (x * x).at[1].set(0.).sum())
    x = jnp.array([-1., 0., 2., 3.])
    new = jaxsafe.make_jaxpr(f, finite_args=True)(x)  # (an inf argument would be guarded)
    assert structure(new) == structure(jax.make_jaxpr(f)(x))


def test_indexing_forms_that_worked_before_keep_working():
    x = jnp.array([-1., 0., 2., 3.])
    for f, live in ((lambda x: h(x)[jnp.argsort(x)[2:]].sum(), [0., 0., 1., 1.]),
                    (lambda x: h(x)[jnp.nonzero(x > 1, size=2)[0]].sum(), [0., 0., 1., 1.]),
                    (lambda x: jnp.compress(x > 1, h(x), size=2).sum(), [0., 0., 1., 1.]),
                    (lambda x: lax.dynamic_update_slice(h(x), jnp.ones(2), (0,)).sum(),
                     [0., 0., 1., 1.])):
        twin = jax.grad(lambda v, f=f, live=live: f(jnp.where(jnp.asarray(live) > 0, v, 1.)))(x)
        assert_close(jax.grad(nan_safe(f))(x), twin)
        assert np.isfinite(np.asarray(jax.grad(nan_safe(f))(x))).all()


@pytest.mark.slow  # 9 s: make fuzz runs it (make test is at its 10 minutes)
def test_pooling_windows_that_tile_are_chosen_as_jaxs_derivative_chooses():
    # the tiling fast path (elementwise: the first lane equal to the window's result) against
    # the lanes JAX's own derivative (select_and_scatter_add) hands each live window to, on
    # inputs full of ties, signed zeros and infinities, with lanes after the last whole window
    from jax.extend import core as jex

    from jaxsafe import _choosers as C
    rng = np.random.default_rng(0)
    for _ in range(8):
        rank = int(rng.integers(1, 4))
        window = tuple(int(rng.integers(1, 4)) for _ in range(rank))
        shape = tuple(int(rng.integers(1, 4)) * w + int(rng.integers(0, 2)) for w in window)
        x = rng.choice(np.array([0., -0., 1., 2., -1., np.inf, -np.inf], np.float32), shape)
        for init, op in ((-jnp.inf, lax.max), (jnp.inf, lax.min)):
            def f(v, init=init, op=op, window=window):
                return lax.reduce_window(v, init, op, window, window, "VALID")
            eqn = jax.make_jaxpr(f)(x).jaxpr.eqns[0]
            out = f(x)
            live = [jnp.asarray(rng.random(out.shape) < 0.6)]
            reads = C.window_reads(jex.primitives.reduce_window_sum_p)
            np.testing.assert_array_equal(C.window_choice(reads)(eqn, live, jnp.asarray(x), out),
                                          C._chosen_by_derivative(eqn, live, jnp.asarray(x), out))
            sums = C.reads_as(jex.primitives.reduce_window_sum_p)(eqn, live[0], x)
            np.testing.assert_array_equal(reads(eqn, live[0], x), sums)


def _pool2(v):
    return lax.reduce_window(v, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID")


def _pool_loss(guard, tail=None):
    """A 2x2 max pooling of sqrt(max(x, 0)): the lanes the pooling drops and those the clamp
    drops are sqrt's singular lanes. `guard`: the hand-written double where."""
    def f(x):
        if guard:
            pos = x > 0
            h = jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.)), 0.)
        else:
            h = jnp.sqrt(jnp.maximum(x, 0.))
        p = _pool2(h)
        p = p + 0.5 * p * p  # a second derivative of its own
        return p if tail is None else tail(p)
    return f


# zeros in every window (a zero-padded border, exact ties at 0), negatives, and positives
X_POOL = jnp.array([[0., 0., 1., -2.], [0., -1., 0.5, 4.], [-3., -1., 2., 2.],
                    [-0.5, -2., 0., 3.]])
X_LIVE = X_POOL + jnp.array([[1., 1., 0., 0.], [1., 1., 0., 0.], [0.] * 4, [0.] * 4])


@pytest.mark.parametrize("x", [X_POOL, X_LIVE], ids=["ties_at_zero", "no_ties"])
def test_a_sqrt_read_only_by_a_pooling_is_cut_and_gives_the_hand_fix_at_every_order(x):
    """Only the pooling reads the sqrt, and every pooled lane is live: the dropped lanes are
    cut (`select_n(live, stop_gradient(x), x)`: the pooling runs once, on the original values)
    instead of guarded and pooled again; the derivatives are the hand fix's, in both modes, to
    the second order, wherever the lanes the hand fix treats alike (x < 0) are not exact ties
    at 0 (where nan_safe keeps the tie live: a real singularity)."""
    f, hand = _pool_loss(False), _pool_loss(True)
    report = nan_safe(f).trace(x)[1]
    sqrt_site = next(s for s in report.sites if s.eqn.primitive.name == "sqrt")
    assert sqrt_site.cut == {0} and not sqrt_site.replace
    assert not any(e.primitive.name == "reduce_window_max" for e in report.selections)
    # the liveness pools the original values, the cut program pools values equal to them:
    # XLA computes one pooling
    hlo = jax.jit(nan_safe(f)).lower(x).compile().as_text()
    assert hlo.count("reduce-window(") == 1
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    safe = nan_safe(f)
    tie = np.asarray(x) == 0  # the hand fix gives 0 there, nan_safe the tie's real inf or 0
    loss_s, loss_h = (lambda v: safe(v).sum()), (lambda v: hand(v).sum())
    g = np.asarray(jax.grad(loss_s)(x))
    assert_close(g[~tie], np.asarray(jax.grad(loss_h)(x))[~tie])
    assert not np.isnan(g).any()
    if not tie.any():
        assert_close(jax.jacfwd(safe)(x), jax.jacfwd(hand)(x))
        assert_close(jax.hessian(loss_s)(x), jax.hessian(loss_h)(x))
        assert_close(jax.jacrev(jax.grad(loss_s))(x), jax.jacrev(jax.grad(loss_h))(x))
        assert_close(jax.vmap(jax.grad(loss_s))(jnp.stack([x, x + 0.25])),
                     jax.vmap(jax.grad(loss_h))(jnp.stack([x, x + 0.25])))
    else:  # the windows without a tie at 0 still match at second order
        rows = ~tie.reshape(-1)
        hs, hh = jax.hessian(loss_s)(x).reshape(16, 16), jax.hessian(loss_h)(x).reshape(16, 16)
        assert_close(np.asarray(hs)[np.ix_(rows, rows)], np.asarray(hh)[np.ix_(rows, rows)])


def test_a_pooling_whose_windows_are_dropped_in_part_cuts_the_output_too():
    """Where a `where` drops some pooled windows, a dropped window may pick a lane whose
    tangent the cut leaves at `0 * inf` (forward mode): the cut stays (the pooling runs once,
    on the original values) and the `sqrt`'s output is cut in its dropped lanes too. Reverse,
    forward and second order equal the hand fix's."""
    keep = jnp.array([[True, False], [False, True]])
    f = _pool_loss(False, tail=lambda p: jnp.where(keep, p, 0.))
    hand = _pool_loss(True, tail=lambda p: jnp.where(keep, p, 0.))
    report = nan_safe(f).trace(X_LIVE)[1]
    sqrt_site = next(s for s in report.sites if s.eqn.primitive.name == "sqrt")
    assert not sqrt_site.replace and sqrt_site.cut == {0} and sqrt_site.cut_output
    assert "reduce_window_max" not in [e.primitive.name for e in report.selections]
    assert_bitwise(nan_safe(f)(X_LIVE), jax.jit(f)(X_LIVE))
    loss_s, loss_h = (lambda v: nan_safe(f)(v).sum()), (lambda v: hand(v).sum())
    for order in (jax.grad, jax.jacfwd, jax.hessian):
        got = jax.jit(order(loss_s))(X_LIVE)
        assert_finite(got)
        assert_close(got, jax.jit(order(loss_h))(X_LIVE))


@pytest.mark.parametrize("reduce", [lax.max, lax.min])
def test_a_dilated_pooling_runs_in_forward_mode(reduce):
    """Dilated windows: JAX has no reverse-mode derivative for them (nor for nan_safe), but
    forward mode works, and so it must under nan_safe (it raised: the choice was read off the
    reverse-mode derivative). Lanes no window reads (1 and 4) are dropped: their sqrt of 0 and
    of -1 take no part, and the derivatives are plain JAX's, first and second order."""
    init = -jnp.inf if reduce is lax.max else jnp.inf

    def f(x):
        pooled = lax.reduce_window(jnp.sqrt(x), init, reduce, (2,), (3,), "VALID",
                                   window_dilation=(2,))
        return jnp.sum(pooled)

    x = jnp.array([1., 0., 4., 9., -1., 16.])
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    for order in (jax.jacfwd, lambda g: jax.jacfwd(jax.jacfwd(g))):
        got = jax.jit(order(nan_safe(f)))(x)
        assert_close(got, jax.jit(order(f))(x))
    first = jax.jacfwd(nan_safe(f))(x)
    assert first[1] == 0. and first[4] == 0.


def test_a_running_maximum_of_dropped_rows_keeps_their_infinities_for_a_product():
    """`cummax` is emitted again on the original values, and its dropped lanes hold them: a
    row of -inf (an argument) that a `where` drops is still -inf after it, so the matmul that
    reads it takes 0 there, as the hand fix's `where` does (`w`'s gradient reads `c`: plain
    JAX's is `0 * -inf`). A guard of `cummax`'s operand does not make its output finite."""
    keep = jnp.array([False, True, True])[:, None]

    def make(clean):
        def f(x, w):
            return jnp.sum(jnp.where(keep, clean(lax.cummax(x, axis=1)) @ w, 0.) ** 2)
        return f
    f, hand = make(lambda c: c), make(lambda c: jnp.where(keep, c, 0.))
    x = jnp.array([[-jnp.inf, -jnp.inf], [1., 2.], [3., -1.]])
    w = jnp.array([[1., 0.5], [-0.5, 1.]])
    assert np.isnan(np.asarray(jax.grad(f, 1)(x, w))).all()
    assert_bitwise(nan_safe(f)(x, w), jax.jit(f)(x, w))
    for order in (jax.grad, jax.hessian):
        for argnums in (0, 1):
            got = jax.jit(order(nan_safe(f), argnums))(x, w)
            assert_finite(got)
            assert_close(got, jax.jit(order(hand, argnums))(x, w))


@pytest.mark.parametrize("running", [lax.cummax, lax.cummin], ids=["cummax", "cummin"])
@pytest.mark.parametrize("reverse", [False, True])
def test_a_running_extreme_reads_no_lane_after_its_last_live_output(running, reverse):
    """Lanes after the last live output of a `cummax` (before the first, reversed) are read by
    no live output: dropped, whatever they hold, an inf equal to the running maximum of
    nothing included (`1 / 0`, or an inf argument)."""
    keep = jnp.array([True, True, False, False])
    keep = keep[::-1] if reverse else keep
    sign = 1. if running is lax.cummax else -1.

    def f(x, d):
        y = running(sign / x + d, reverse=reverse)
        return jnp.sum(jnp.where(keep, y * y, 0.))

    def hand(x, d):
        y = running(sign / jnp.where(keep, x, 1.) + jnp.where(keep, d, 0.), reverse=reverse)
        return jnp.sum(jnp.where(keep, y * y, 0.))

    x = jnp.array([2., 4., 0., 0.5])
    d = jnp.array([0., 1., 0., jnp.inf])
    x, d = (x[::-1], d[::-1]) if reverse else (x, d)
    assert not np.isfinite(jax.grad(f)(x, d)).all()  # the leak is real
    assert_bitwise(nan_safe(f)(x, d), jax.jit(f)(x, d))
    for order in (jax.grad, jax.jacfwd, jax.hessian):
        got = order(nan_safe(f), (0, 1))(x, d)
        assert_finite(got)
        assert_close(got, order(hand, (0, 1))(x, d))


def test_a_segment_maximum_whose_results_are_dropped_in_part_still_drops_its_losers():
    """A padded graph's readout: a `where` (or a slice, or a constant weight) after the
    `segment_max` drops a segment; a loser of a live segment is dropped too (hunt X: it was
    left live once any result was dropped, and `0 * inf` reached it)."""
    seg = jnp.array([0, 0, 1, 1, 2])
    x = jnp.array([4., 0., 1., 9., 1.])  # segment 0: sqrt 0 loses; segment 2 dropped
    keep = jnp.array([True, True, False])
    cases = {
        "where": lambda x: jnp.sum(jnp.where(keep, jax.ops.segment_max(h(x), seg, 3), 0.)),
        "slice": lambda x: jnp.sum(jax.ops.segment_max(h(x), seg, 3)[:2]),
        "at max": lambda x: jnp.sum(jnp.full(3, -jnp.inf).at[seg].max(h(x))[:2]),
        "min": lambda x: jnp.sum(jnp.where(keep, jax.ops.segment_min(-h(x), seg, 3), 0.)),
    }
    live = jnp.array([True, False, True, True, False])
    for name, f in cases.items():
        assert np.isnan(jax.grad(f)(x)).any(), name
        by_hand = lambda x, f=f: f(jnp.where(live, x, 1e-3))  # the losers' values never win
        assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
        assert_close(jax.grad(nan_safe(f))(x), jax.grad(by_hand)(x))
        assert_close(jax.jacfwd(nan_safe(f))(x), jax.jacfwd(by_hand)(x))


def test_a_nan_update_in_a_live_segment_keeps_plain_jax_s_nan():
    """As for `jnp.max`: a NaN never counts as lost (contract 3). JAX's derivative gives the
    NaN update no share, and plain JAX's `0 * NaN` stays; the loser at `sqrt(0)` is 0."""
    seg = jnp.array([0, 0, 1, 1, 1])
    f = lambda x: jnp.sum(jax.ops.segment_max(jnp.sqrt(x), seg, num_segments=2))
    x = jnp.array([4., 0., 1., 9., -1.])  # sqrt(-1): NaN in live segment 1
    got, plain = np.asarray(jax.grad(nan_safe(f))(x)), np.asarray(jax.grad(f)(x))
    assert np.isnan(plain[4]) and np.isnan(got[4])
    assert got[1] == 0 and np.isnan(plain[1])
    assert_bitwise(got[[0, 2, 3]], plain[[0, 2, 3]])
    square = lambda x: jnp.sum(jax.ops.segment_max(x * x, seg, num_segments=2))
    nan_arg = jnp.array([4., 0., 1., 9., np.nan])
    assert_bitwise(jax.grad(nan_safe(square))(nan_arg), jax.grad(square)(nan_arg))
