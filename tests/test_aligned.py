"""Scans whose body keeps some axes aligned (`jaxsafe/_aligned.py`): a scan over layers carries
a batch of rows that no step mixes, so a row that a `where` drops after the scan is dropped at
every step, and its NaN no longer reaches the weights' gradients.

References: JAX on the same program with the dropped rows removed (the rows never meet, so the
live rows' results and every weight's gradient are the same), the hand fix (the padded rows
cleaned before the scan), and plain JAX where nothing is NaN (a body that mixes rows must keep
every row live).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, structure
from jax import lax

import jaxsafe
from jaxsafe._aligned import aligned_axes

pytestmark = pytest.mark.no_leak_check

nan, inf = np.nan, np.inf
LIVE = np.array([True, True, False, True, False])


def _weights(key, layers=3, width=4):
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    return (jax.random.normal(k1, (layers, width, width)) * 0.5,
            jax.random.normal(k2, (layers, width)) * 0.1)


def _rows(key=7, width=4):
    x = jax.random.normal(jax.random.PRNGKey(key), (len(LIVE), width))
    return x.at[2].set(nan).at[4].set(inf)  # the padded rows hold what they hold


def _layers(h, params, norm=False):
    def layer(h, wb):
        w, b = wb
        if norm:  # a pre-norm: a zero row has variance 0, and sqrt's derivative there is inf
            mu = h.mean(-1, keepdims=True)
            var = ((h - mu) ** 2).mean(-1, keepdims=True)
            h = (h - mu) / jnp.sqrt(var)
        h = jnp.tanh(h @ w + b[None, :])
        return h, h.sum(-1)
    return lax.scan(layer, h, params)


def _loss(params, x, live, norm=False):
    h, per_layer = _layers(x, params, norm)
    out = jnp.sum(jnp.where(live[:, None], h, 0.) ** 2)
    return out + jnp.sum(jnp.where(live[None, :], per_layer, 0.))


@pytest.mark.parametrize("norm", [False, True], ids=["tanh", "layer_norm"])
def test_scan_over_layers_drops_padded_rows_from_the_weights_gradients(norm):
    params, x = _weights(0), _rows()
    if norm:
        x = x.at[2].set(0.).at[4].set(0.)  # a zero row: its variance is 0, sqrt's derivative inf
    f = lambda p, x: _loss(p, x, jnp.asarray(LIVE), norm)  # noqa: E731
    only_live = lambda p, x: _loss(p, x, jnp.ones(x.shape[0], bool), norm)  # noqa: E731
    safe = jaxsafe.nan_safe(f)

    assert_bitwise(safe(params, x), jax.jit(f)(params, x))
    assert np.isnan(np.asarray(jax.grad(f)(params, x)[0])).any()  # plain JAX leaks
    g_params, g_x = jax.jit(jax.grad(safe, argnums=(0, 1)))(params, x)
    r_params, r_x = jax.grad(only_live, argnums=(0, 1))(params, x[LIVE])
    assert_close(g_params, r_params, rtol=2e-5, atol=1e-6)
    assert_close(g_x[LIVE], r_x, rtol=2e-5, atol=1e-6)
    assert np.all(np.asarray(g_x)[~LIVE] == 0)


def test_second_order_and_forward_mode_through_a_scan_over_layers():
    params, x = _weights(1, layers=2), _rows()
    w, b = params
    xl = x.at[2].set(0.).at[4].set(0.)
    f = lambda s: _loss((w * s, b), xl, jnp.asarray(LIVE), True)  # noqa: E731
    ref = lambda s: _loss((w * s, b), xl[LIVE], jnp.ones(LIVE.sum(), bool), True)  # noqa: E731
    safe = jaxsafe.nan_safe(f)
    s = jnp.float32(1.3)
    assert np.isnan(np.asarray(jax.hessian(f)(s)))
    assert_close(jax.jacfwd(safe)(s), jax.jacfwd(ref)(s), rtol=1e-4)
    assert_close(jax.hessian(safe)(s), jax.hessian(ref)(s), rtol=1e-4)


def test_an_rnn_over_time_drops_padded_batch_rows():
    """Batch rows (axis 1 of the stacked inputs, axis 0 of the carry) never meet."""
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    wx, wh = jax.random.normal(k[0], (3, 4)) * .5, jax.random.normal(k[1], (4, 4)) * .5
    xs = jax.random.normal(k[2], (6, len(LIVE), 3)).at[:, 2].set(nan).at[:, 4].set(-inf)

    def f(wh, xs, live):
        def step(h, x):
            h = jnp.tanh(x @ wx + h @ wh)
            return h, jnp.log1p(h ** 2)
        h, ys = lax.scan(step, jnp.zeros((xs.shape[1], 4)), xs)
        return jnp.sum(jnp.where(live[None, :, None], ys, 0.)) + jnp.sum(
            jnp.where(live[:, None], h, 0.))

    safe = jaxsafe.nan_safe(f)
    live = jnp.asarray(LIVE)
    assert_bitwise(safe(wh, xs, live), jax.jit(f)(wh, xs, live))
    assert np.isnan(np.asarray(jax.grad(f)(wh, xs, live))).all()
    ref = jax.grad(f)(wh, xs[:, LIVE], jnp.ones(LIVE.sum(), bool))
    assert_close(jax.grad(safe)(wh, xs, live), ref, rtol=2e-5, atol=1e-6)


def test_a_residual_from_the_input():
    """A constant with rows (the input, read by every layer) keeps them aligned: its padded
    rows are dropped too."""
    params, x = _weights(2), _rows()
    live = jnp.asarray(LIVE)

    def f(params, x):
        def layer(h, wb):
            w, b = wb
            return 0.5 * h + jnp.tanh(h @ w + b[None, :]) + x, None
        h, _ = lax.scan(layer, x, params)
        return jnp.sum(jnp.where(live[:, None], jnp.sqrt(jnp.abs(h)), 0.))

    def hand(params, x):
        return f(params, jnp.where(live[:, None], x, 0.))

    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(params, x), jax.jit(f)(params, x))
    assert np.isnan(np.asarray(jax.grad(f)(params, x)[0])).any()
    assert_close(jax.grad(safe)(params, x), jax.grad(hand)(params, x), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("mix", ["roll", "mean", "transpose_matmul", "cumsum"])
def test_a_body_that_mixes_rows_keeps_every_row_live(mix):
    """Rows that meet at a later step stay live: with finite values, nan_safe's gradient is
    plain JAX's (a row dropped by mistake would lose its contribution to the others)."""
    mixes = {"roll": lambda h: jnp.roll(h, 1, axis=0),
             "mean": lambda h: h - h.mean(0, keepdims=True),
             "transpose_matmul": lambda h: (h @ h.T) @ h / 4.,
             "cumsum": lambda h: jnp.cumsum(h, 0) / 3.}

    _assert_rows_stay_live(mixes[mix], lambda z, h: jnp.tanh(z), key=4)


def _assert_rows_stay_live(mix, activation, key):
    """Layers `activation(mix(h) @ w + b, h)` scanned over, on finite rows: nan_safe's gradient
    is plain JAX's (a row dropped by mistake would lose what it gives the others)."""
    def f(params, x):
        def layer(h, wb):
            return activation(mix(h) @ wb[0] + wb[1][None, :], h), None
        h, _ = lax.scan(layer, x, params)
        return jnp.sum(jnp.where(jnp.asarray(LIVE)[:, None], jnp.sqrt(h + 3.), 0.))

    params = _weights(key)
    x = jax.random.normal(jax.random.PRNGKey(key + 1), (len(LIVE), 4))
    assert_close(jax.grad(jaxsafe.nan_safe(f))(params, x), jax.grad(f)(params, x),
                 rtol=2e-5, atol=1e-7)


def test_a_scan_over_layers_with_nothing_dropped_is_the_original():
    params, x = _weights(0), _rows()
    f = lambda p, x: jnp.sum(_layers(x, p)[0] ** 2)  # noqa: E731
    assert structure(jaxsafe.make_jaxpr(f)(params, x)) == structure(jax.make_jaxpr(f)(params, x))


def test_a_live_padded_row_keeps_its_nan():
    """Contract 3: a row the program reads keeps plain JAX's NaN."""
    params, x = _weights(0), _rows()
    every = jnp.ones(len(LIVE), bool)
    f = lambda p: _loss(p, x, every)  # noqa: E731
    assert np.isnan(np.asarray(jax.grad(jaxsafe.nan_safe(f))(params)[0])).all()


def _placements(body, *args, loops=()):
    al = aligned_axes(jax.make_jaxpr(body)(*args), loops)
    return None if al is None else (al.inputs, al.outputs)


def test_aligned_axes_keeps_rows_and_spoils_what_mixes_them():
    h, w, v = jnp.ones((5, 4)), jnp.ones((4, 3)), jnp.ones(5)
    ins, outs = _placements(lambda h, w: jnp.tanh(h @ w), h, w)
    rows, cols = outs[0]
    assert ins[0] == (rows, None) and ins[1] == (None, cols) and rows != cols
    # a reduction along the rows keeps the features; reversals, cumulative sums, h @ h.T and a
    # reshape that transposes first leave no class for the rows
    assert _placements(lambda h: h.sum(0), h)[0][0][0] is None
    assert _placements(lambda h: h[::-1] * 2., h)[0][0][0] is None
    assert _placements(lambda h: jnp.cumsum(h, 0), h)[0][0][0] is None
    assert _placements(lambda h: (h @ h.T) @ h, h) is None
    assert _placements(lambda h: lax.reshape(h, (4, 5), dimensions=(1, 0)), h)[0][0] == (None,
                                                                                         None)
    # a transpose keeps the classes on other axes; a row vector broadcast along features too
    ins, outs = _placements(lambda h, v: h.T * v[None, :], h, v)
    assert ins[1] == (ins[0][0],) and outs[0] == ins[0][::-1]
    # a loop whose carry comes back transposed cannot keep its rows
    assert _placements(lambda c: c.T, jnp.ones((3, 3)), loops=[(0, 0)]) is None


def test_an_output_without_the_row_axis_does_not_keep_rows_live():
    """A per-feature carry `s` (D,) never reads the (B, D) state: its liveness says nothing of
    the state's rows, so the padded rows stay dropped (hunt S)."""
    rows = jnp.asarray(LIVE)
    x = jnp.where(rows[:, None], jax.random.normal(jax.random.PRNGKey(2), (5, 3)), nan)
    a = jax.random.normal(jax.random.PRNGKey(4), (3, 3))
    s0 = jax.random.normal(jax.random.PRNGKey(5), (3,))

    def f(x, s0, a):
        def step(carry, at):
            h, s = carry
            return (jnp.sqrt(h * h + 0.3) * s[None, :] + at[None, :], jnp.sin(s)), None
        (h, s), _ = lax.scan(step, (x, s0), a)
        return jnp.sum(jnp.where(rows[:, None], h, 0.)) + jnp.sum(s)

    hand = lambda x, s0, a: f(jnp.where(rows[:, None], x, 1.), s0, a)  # noqa: E731
    assert np.isnan(np.asarray(jax.grad(f, argnums=1)(x, s0, a))).all()
    assert_close(jax.grad(jaxsafe.nan_safe(f), argnums=(1, 2))(x, s0, a),
                 jax.grad(hand, argnums=(1, 2))(x, s0, a), rtol=2e-5, atol=1e-6)


def _row_mixing_custom_vjp():
    @jax.custom_vjp
    def mix(h):
        return h
    mix.defvjp(lambda h: (h, None), lambda _, g: (g + g.mean(0, keepdims=True),))
    return mix


def _row_mixing_custom_jvp():
    @jax.custom_jvp
    def mix(h):
        return h
    mix.defjvp(lambda p, t: (p[0], t[0] + t[0].mean(0, keepdims=True)))
    return mix


@pytest.mark.parametrize("mix", [
    lambda h: lax.reshape(h, h.shape[::-1], dimensions=(1, 0)),  # a transpose, as a reshape
    _row_mixing_custom_vjp(),                                    # a rule that mixes rows
    _row_mixing_custom_jvp(),
], ids=["reshape_dimensions", "custom_vjp", "custom_jvp"])
def test_rows_that_a_rule_or_a_transposing_reshape_mixes_stay_live(mix):
    """Hunt S: the primal of each keeps rows apart (or seems to), its derivative or the
    reshape's `dimensions` does not: with finite values nan_safe's gradient is plain JAX's."""
    live = jnp.array([True, True, False, True])
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 4)) * .5
    x = jax.random.normal(jax.random.PRNGKey(2), (4, 4)) * .5

    def f(w, x):
        def layer(h, ww):
            return jnp.tanh(mix(h) @ ww) + jnp.sqrt(h * h + 0.5), None
        h, _ = lax.scan(layer, x, w)
        return jnp.sum(jnp.where(live[:, None], h, 0.) ** 2)

    assert_close(jax.grad(jaxsafe.nan_safe(f), argnums=(0, 1))(w, x),
                 jax.grad(f, argnums=(0, 1))(w, x), rtol=2e-5, atol=1e-7)


def test_per_step_outputs_computed_from_the_new_rows():
    """The per-step output is computed from the carry the step returns, and only it is read
    after the scan: the body's per-step masks run along the rows alone (their formula outside,
    at one step), so the first matmul's operand in a padded row is guarded (hunt S)."""
    params, x = _weights(6), _rows()
    live = jnp.asarray(LIVE)

    def f(params, x, live):
        def layer(h, wb):
            h = jnp.tanh(h @ wb[0] + wb[1][None, :])
            return h, jnp.log1p(h ** 2)
        _, ys = lax.scan(layer, x, params)
        return jnp.sum(jnp.where(live[None, :, None], ys, 0.))

    safe = jaxsafe.nan_safe(f)
    assert np.isnan(np.asarray(jax.grad(f)(params, x, live)[0])).all()
    reference = jax.grad(f)(params, x[LIVE], jnp.ones(LIVE.sum(), bool))
    assert_close(jax.grad(safe)(params, x, live), reference, rtol=2e-5, atol=1e-6)


def test_a_step_dropped_whole_guards_a_matmul_in_the_body():
    """A per-step output dropped whole at one step (`where(step_mask[:, None, None], ys, 0.)`):
    at that step the body's mask is the same in every lane, so `x @ w`'s operand holding NaN
    there is guarded without a run-time reduction (it was left before)."""
    def f(w, xs):
        ys = lax.scan(lambda c, x: (c, x @ w), 0., xs)[1]
        return jnp.sum(jnp.where(jnp.array([True, False])[:, None, None], ys, 0.) ** 2)

    w = jax.random.normal(jax.random.PRNGKey(8), (2, 2))
    xs = jax.random.normal(jax.random.PRNGKey(9), (2, 2, 2)).at[1].set(nan)
    assert np.isnan(np.asarray(jax.grad(f)(w, xs))).all()
    reference = jax.grad(lambda w: jnp.sum((xs[0] @ w) ** 2))(w)
    assert_close(jax.grad(jaxsafe.nan_safe(f))(w, xs), reference, rtol=1e-5)


def test_softmax_layers_with_finite_arguments_are_the_original():
    """Contract 4 (hunt T): with `finite_args`, a carry that a softmax makes is finite (its
    quotient has a divisor at least 1 and a numerator at most 1), so the body's matmul of the
    carry needs no guard in the rows dropped after the scan; unrolled, it never did."""
    live = jnp.array([True, True, False, True])
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 3, 3)) * .5
    x = jax.random.normal(jax.random.PRNGKey(2), (4, 3))

    def f(w, x):
        h, _ = lax.scan(lambda h, ww: (jax.nn.softmax(h @ ww, axis=1), None), x, w)
        return jnp.sum(jnp.where(live[:, None], h, 0.) ** 2)

    assert structure(jaxsafe.make_jaxpr(f, finite_args=True)(w, x)) == \
        structure(jax.make_jaxpr(f)(w, x))


def test_the_carry_mask_enters_the_loop_as_its_rows():
    """The carries' mask runs along rows: its core (one flag per row) enters the scan and is
    broadcast inside, so no step ORs a row's features to find it again."""
    params, x = _weights(0), _rows()
    f = lambda p, x: _loss(p, x, jnp.asarray(LIVE), True)  # noqa: E731
    closed = jaxsafe.make_jaxpr(f)(params, x)
    scans = [e for e in closed.jaxpr.eqns if e.primitive is lax.scan_p]
    assert len(scans) == 1
    body = scans[0].params["jaxpr"].jaxpr
    assert any(v.aval.shape == (len(LIVE),) and v.aval.dtype == bool for v in body.invars)
    assert not any(e.primitive is lax.reduce_or_p for e in body.eqns)


# --------------------------------------------------------------------------- gates and ReLUs
# An LSTM splits its gates along the features and a GRU concatenates its input with its state:
# rows stay rows through both (`PrimitiveRule.works_along`). A ReLU or a clip drops lanes by
# value: the body's matmul operand is then guarded where the carry's row mask, which the body is
# given, drops it (`_symbolic.output_mask_literal`), as a hand fix would clean the padded rows.

def _lstm(params, xs):
    wx, wh, b = params

    def cell(carry, x):
        c, h = carry
        i, f, g, o = jnp.split(x @ wx + h @ wh + b[None, :], 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h

    zeros = jnp.zeros((xs.shape[1], wh.shape[0]))
    return lax.scan(cell, (zeros, zeros), xs)


def _gru(params, xs):
    wz, wr, wn = params

    def cell(h, x):
        xh = jnp.concatenate([x, h], axis=-1)
        z, r = jax.nn.sigmoid(xh @ wz), jax.nn.sigmoid(xh @ wr)
        n = jnp.tanh(jnp.concatenate([x, r * h], axis=-1) @ wn)
        h = (1 - z) * n + z * h
        return h, h

    h, hs = lax.scan(cell, jnp.zeros((xs.shape[1], wz.shape[1])), xs)
    return (h, h), hs


def _recurrent_params(kind, d=3, hidden=4):
    k = jax.random.split(jax.random.PRNGKey(11), 3)
    if kind == "lstm":
        return (jax.random.normal(k[0], (d, 4 * hidden)) * .4,
                jax.random.normal(k[1], (hidden, 4 * hidden)) * .4,
                jax.random.normal(k[2], (4 * hidden,)) * .1)
    return tuple(jax.random.normal(kk, (d + hidden, hidden)) * .4 for kk in k)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_cells_drop_padded_batch_rows(kind):
    """Reference: JAX on the batch without its padded rows (the rows never meet)."""
    cell = {"lstm": _lstm, "gru": _gru}[kind]
    params = _recurrent_params(kind)
    xs = jax.random.normal(jax.random.PRNGKey(12), (5, len(LIVE), 3))
    xs = xs.at[:, 2].set(nan).at[:, 4].set(inf)

    def f(params, xs, live):
        (c, h), hs = cell(params, xs)
        return jnp.sum(jnp.where(live[:, None], h, 0.) ** 2) + jnp.sum(
            jnp.where(live[None, :, None], jnp.sin(hs), 0.)) + jnp.sum(
            jnp.where(live[:, None], c, 0.))

    live = jnp.asarray(LIVE)
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(params, xs, live), jax.jit(f)(params, xs, live))
    assert np.isnan(np.asarray(jax.grad(f)(params, xs, live)[0])).all()
    g_params, g_xs = jax.jit(jax.grad(safe, argnums=(0, 1)))(params, xs, live)
    r_params, r_xs = jax.grad(f, argnums=(0, 1))(params, xs[:, LIVE],
                                                 jnp.ones(LIVE.sum(), bool))
    assert_close(g_params, r_params, rtol=2e-5, atol=1e-6)
    assert_close(g_xs[:, LIVE], r_xs, rtol=2e-5, atol=1e-6)
    assert np.all(np.asarray(g_xs)[:, ~LIVE] == 0)


ACTIVATIONS = {"relu": jax.nn.relu, "clip": lambda h: jnp.clip(h, -1., 1.),
               "leaky_relu": lambda h: jax.nn.leaky_relu(h, .1), "relu6": jax.nn.relu6}


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_relu_layers_in_a_scan_drop_padded_rows(act):
    """A ReLU's mask varies along every axis: the matmul's operand is guarded where the carry's
    row mask drops it. Reference: the program on the live rows alone, through grad, jit(grad)
    and the biases' Hessian."""
    fn = ACTIVATIONS[act]
    params, x = _weights(13), _rows()

    def f(params, x, live):
        h, _ = lax.scan(lambda h, wb: (fn(h @ wb[0] + wb[1][None, :]), None), x, params)
        return jnp.sum(jnp.where(live[:, None], h, 0.) ** 2)

    live, every = jnp.asarray(LIVE), jnp.ones(LIVE.sum(), bool)
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(params, x, live), jax.jit(f)(params, x, live))
    assert np.isnan(np.asarray(jax.grad(f)(params, x, live)[0])).all()
    assert_close(jax.jit(jax.grad(safe))(params, x, live),
                 jax.grad(f)(params, x[LIVE], every), rtol=2e-5, atol=1e-6)
    w, b = params
    hess = jax.hessian(lambda b: safe((w, b), x, live))(b)
    assert_close(hess, jax.hessian(lambda b: f((w, b), x[LIVE], every))(b), rtol=1e-4,
                 atol=1e-5)


def test_relu_layers_in_a_cond_in_a_scan():
    """The carry's row mask is a name in its own body only: a `cond` in the body is given its
    outputs' masks, and a coarse guard there names those (a name read in the wrong body would
    guard live lanes, or read another output's mask)."""
    params, x = _weights(14), _rows()
    live = jnp.asarray(LIVE)

    def f(params, x, live):
        def layer(h, wb):
            w, b = wb
            h = lax.cond(b[0] > 0, lambda h: jax.nn.relu(h @ w), lambda h: jnp.tanh(h @ w), h)
            return h, None
        h, _ = lax.scan(layer, x, params)
        return jnp.sum(jnp.where(live[:, None], h, 0.) ** 2)

    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(params, x, live), jax.jit(f)(params, x, live))
    assert np.isnan(np.asarray(jax.grad(f)(params, x, live)[0])).all()
    reference = jax.grad(f)(params, x[LIVE], jnp.ones(LIVE.sum(), bool))
    assert_close(jax.grad(safe)(params, x, live), reference, rtol=2e-5, atol=1e-6)


def _inner_loop(kind, h, w, b):
    """A loop in a layer: sub-steps of a ReLU update, as a `fori_loop` (a scan), a scan with
    per-step outputs, or a `while_loop` on a counter."""
    step = lambda g: jax.nn.relu(g @ w + b[None, :]) * .5 + .5 * g  # noqa: E731
    if kind == "fori_loop":
        return lax.fori_loop(0, 2, lambda i, g: step(g), h)
    if kind == "scan_outputs":
        g, gs = lax.scan(lambda g, _: (step(g), g), h, None, length=2)
        return g + gs.sum(0)
    return lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, step(c[1])), (0, h))[1]


@pytest.mark.parametrize("kind", ["fori_loop", "scan_outputs", "while_loop"])
def test_a_loop_in_the_body_keeps_the_rows_its_body_keeps(kind):
    """A loop nested in the body is read with its own body (`PrimitiveRule.loop_links`): its
    carries keep their rows, so the padded rows stay dropped through it. Reference: the program
    on the live rows alone. (Reverse mode cannot differentiate a `while_loop`, and forward
    mode never meets the padded rows' NaN: its case is checked in forward mode only.)"""
    params, x = _weights(14), _rows()
    live, every = jnp.asarray(LIVE), jnp.ones(LIVE.sum(), bool)

    def f(params, x, live):
        h, _ = lax.scan(lambda h, wb: (_inner_loop(kind, h, *wb), None), x, params)
        return jnp.sum(jnp.where(live[:, None], h, 0.) ** 2)

    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(params, x, live), jax.jit(f)(params, x, live))
    w, b = params
    assert_close(jax.jacfwd(lambda b: safe((w, b), x, live))(b),
                 jax.jacfwd(lambda b: f((w, b), x[LIVE], every))(b), rtol=2e-5, atol=1e-6)
    if kind != "while_loop":
        assert np.isnan(np.asarray(jax.grad(f)(params, x, live)[0])).all()
        assert_close(jax.grad(safe)(params, x, live), jax.grad(f)(params, x[LIVE], every),
                     rtol=2e-5, atol=1e-6)


INNER_MIXES = {
    "rolls_rows": lambda h: lax.fori_loop(0, 2, lambda i, g: jnp.roll(g, 1, 0) * .9, h),
    "steps_over_rows": lambda h: h + lax.scan(lambda c, r: (c + r, c), jnp.zeros(h.shape[1]),
                                              h)[1],
    "stops_on_the_largest_row": lambda h: lax.while_loop(
        lambda g: jnp.max(jnp.abs(g)) > 0.5, lambda g: g * .5, h),
}


@pytest.mark.parametrize("mix", list(INNER_MIXES))
def test_a_loop_in_the_body_that_mixes_rows_keeps_them_live(mix):
    """A nested loop that moves rows, steps over them, or stops on a value reduced over them
    (its trip count depends on every row): with finite values, nan_safe's derivatives are plain
    JAX's."""
    params = _weights(14)
    x = jax.random.normal(jax.random.PRNGKey(15), (len(LIVE), 4)) * 3.

    def f(b, x):
        def layer(h, wb):
            return jnp.tanh(INNER_MIXES[mix](h) @ wb[0] + wb[1][None, :]), None
        h, _ = lax.scan(layer, x, (params[0], b))
        return jnp.sum(jnp.where(jnp.asarray(LIVE)[:, None], jnp.sqrt(h + 2.), 0.))

    b = params[1]
    assert_close(jax.jacfwd(jaxsafe.nan_safe(f))(b, x), jax.jacfwd(f)(b, x), rtol=2e-5,
                 atol=1e-7)


@pytest.mark.parametrize("mix", ["shift", "sort", "swap_halves", "pad_shift", "reverse",
                                 "cummax"])
def test_a_body_that_moves_rows_keeps_every_row_live(mix):
    """A slice, a concatenation, a split, a pad, a sort or a running max along the rows moves
    them: every row stays live, and with finite values nan_safe's gradient is plain JAX's."""
    mixes = {"shift": lambda h: jnp.concatenate([h[1:], h[:1]], 0),
             "sort": lambda h: jnp.sort(h, axis=0),
             "swap_halves": lambda h: jnp.concatenate(jnp.split(h, [2], 0)[::-1], 0),
             "pad_shift": lambda h: jnp.pad(h, ((1, 0), (0, 0)))[:-1],
             "reverse": lambda h: h[::-1],
             "cummax": lambda h: lax.cummax(h, axis=0)}

    _assert_rows_stay_live(mixes[mix], lambda z, h: jax.nn.relu(z) + .1 * h, key=16)


def test_aligned_axes_keep_rows_through_a_split_and_a_concatenation():
    g, x = jnp.ones((5, 8)), jnp.ones((5, 3))
    ins, _ = _placements(lambda g: jnp.split(g, 2, 1)[0] * jnp.split(g, 2, 1)[1], g)
    assert ins[0][0] is not None and ins[0][1] is None
    ins, outs = _placements(lambda x, g: jnp.concatenate([x, g], 1), x, g)
    assert ins[0][0] == ins[1][0] == outs[0][0] is not None
    assert ins[0][1] is None and ins[1][1] is None
    # along the rows, each moves them
    assert _placements(lambda g: jnp.split(g, [2], 0)[1] * 2., g)[0][0][0] is None
    assert _placements(lambda g: jnp.sort(g, 0), g)[0][0] == (None, _placements(
        lambda g: jnp.sort(g, 0), g)[1][0][1])


def test_a_stacked_lstm_drops_padded_rows_in_both_layers():
    """The upper layer reads the lower one's per-step outputs: the scan's static rule carries
    the drop after the upper scan onto them along the rows (`_lanewise.scan_syms`), so the lower
    body's matmul operands in a padded row are guarded too."""
    lower = _recurrent_params("lstm")
    k = jax.random.split(jax.random.PRNGKey(18), 2)
    upper = (jax.random.normal(k[0], (4, 16)) * .4, jax.random.normal(k[1], (4, 16)) * .4,
             jnp.zeros(16))
    xs = jax.random.normal(jax.random.PRNGKey(19), (5, len(LIVE), 3))
    xs = xs.at[:, 2].set(nan).at[:, 4].set(inf)

    def f(params, xs, live):
        _, hs = _lstm(params[0], xs)
        (_, h), _ = _lstm(params[1], hs)
        return jnp.sum(jnp.where(live[:, None], h, 0.) ** 2)

    live, params = jnp.asarray(LIVE), (lower, upper)
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(params, xs, live), jax.jit(f)(params, xs, live))
    assert np.isnan(np.asarray(jax.grad(f)(params, xs, live)[0][0])).all()
    reference = jax.grad(f)(params, xs[:, LIVE], jnp.ones(LIVE.sum(), bool))
    assert_close(jax.jit(jax.grad(safe))(params, xs, live), reference, rtol=2e-5, atol=1e-6)
