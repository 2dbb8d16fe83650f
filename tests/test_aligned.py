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

    def f(params, x):
        def layer(h, wb):
            w, b = wb
            return jnp.tanh(mixes[mix](h) @ w + b[None, :]), None
        h, _ = lax.scan(layer, x, params)
        return jnp.sum(jnp.where(jnp.asarray(LIVE)[:, None], jnp.sqrt(h + 2.), 0.))

    params = _weights(4)
    x = jax.random.normal(jax.random.PRNGKey(5), (len(LIVE), 4))
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
    return None if al is None else (al.groups, al.inputs, al.outputs)


def test_aligned_axes_keeps_rows_and_spoils_what_mixes_them():
    h, w, v = jnp.ones((5, 4)), jnp.ones((4, 3)), jnp.ones(5)
    groups, ins, outs = _placements(lambda h, w: jnp.tanh(h @ w), h, w)
    assert groups == ((5, 3),) and ins[0] == ((0, 0), None) and ins[1] == (None, (0, 1))
    assert outs[0] == ((0, 0), (0, 1))
    # reductions along the rows, reversals, cumulative sums, h @ h.T: no class left for rows
    assert _placements(lambda h: h.sum(0), h)[1][0] == (None, (0, 0))
    assert _placements(lambda h: h[::-1] * 2., h)[1][0][0] is None
    assert _placements(lambda h: jnp.cumsum(h, 0), h)[1][0][0] is None
    assert _placements(lambda h: (h @ h.T) @ h, h) is None
    # a transpose keeps the class on another axis; a row vector broadcast along features too
    groups, ins, outs = _placements(lambda h, v: h.T * v[None, :], h, v)
    assert ins[0] == ((0, 0), (0, 1)) and ins[1] == ((0, 0),) and outs[0] == ((0, 1), (0, 0))
    # a loop whose carry comes back transposed cannot keep its rows
    assert _placements(lambda c: c.T, jnp.ones((3, 3)), loops=[(0, 0)]) is None
