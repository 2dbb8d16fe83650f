"""A scan's per-step drops, hoisted (`jaxsafe/_hoisted.py`): a stacked input that the body drops
by one step's stacked inputs alone is dropped before the loop too, so what computes it there
(a value network over every step's observations) is guarded as outside a loop. A loop
constant that the body drops at every step (a cost matrix whose padded pairs each Sinkhorn step
masks) is dropped before the loop by the OR over the steps.

References: the hand-written double where on the observations, and plain JAX on the program
with the dropped rows replaced by finite ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close

import jaxsafe

T, D = 6, 3
DONE = jnp.array([False, False, True, False, True, False])


def _observations(bad=jnp.nan):
    obs = jnp.arange(T * D, dtype=jnp.float32).reshape(T, D) / 10 + 0.5
    return obs.at[2].set(bad).at[4, 1].set(bad)


def gae(w, obs, done, rew):
    """Advantages over a rollout: a terminal step's delta and advantage are dropped."""
    values = jnp.tanh(obs @ w)

    def body(adv, xs):
        v, d, r = xs
        delta = jnp.where(d, 0., r - v)
        adv = jnp.where(d, 0., delta + 0.9 * adv)
        return adv, adv
    _, advs = jax.lax.scan(body, 0., (values, done, rew), reverse=True)
    return jnp.sum(advs ** 2)


def gae_by_hand(w, obs, done, rew):
    return gae(w, jnp.where(done[:, None], 0., obs), done, rew)


W = jnp.array([0.1, -0.2, 0.3])
REW = jnp.linspace(0.5, 1.5, T)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_terminal_step_s_non_finite_observation_reaches_no_weight_gradient(bad):
    obs = _observations(bad)
    args = (W, obs, DONE, REW)
    assert not np.all(np.isfinite(jax.grad(gae)(*args)))  # the leak being fixed
    safe = jaxsafe.nan_safe(gae)
    assert np.array_equal(safe(*args), jax.jit(gae)(*args), equal_nan=True)
    np.testing.assert_allclose(jax.grad(safe)(*args), jax.grad(gae_by_hand)(*args), rtol=1e-6)
    np.testing.assert_allclose(jax.jacfwd(safe)(*args), jax.jacfwd(gae_by_hand)(*args),
                               rtol=1e-6)
    np.testing.assert_allclose(jax.hessian(safe)(*args), jax.hessian(gae_by_hand)(*args),
                               rtol=1e-5, atol=1e-7)


def test_the_guard_is_the_hand_fix_s_double_where_before_the_matmul():
    args = (W, _observations(), DONE, REW)
    text = str(jaxsafe.make_jaxpr(gae)(*args))
    head = text[:text.index("dot_general")]
    assert "select_n" in head and "not" in head  # the observations' rows, by `~done`
    assert text.count("scan[") == 1


def test_under_vmap_and_jit_each_rollout_drops_its_own_steps():
    obs = jnp.stack([_observations(), _observations(1.0)])
    done = jnp.stack([DONE, ~DONE])
    rew = jnp.stack([REW, REW])
    batched = jax.jit(jax.vmap(jax.grad(jaxsafe.nan_safe(gae)), in_axes=(None, 0, 0, 0)))
    by_hand = jax.vmap(jax.grad(gae_by_hand), in_axes=(None, 0, 0, 0))
    np.testing.assert_allclose(batched(W, obs, done, rew), by_hand(W, obs, done, rew), rtol=1e-6)


def test_a_non_finite_observation_of_a_live_step_stays():
    obs = _observations().at[1, 0].set(jnp.nan)  # step 1 is not terminal: a real NaN
    grads = jax.grad(jaxsafe.nan_safe(gae))(W, obs, DONE, REW)
    assert np.all(np.isnan(grads))


def test_a_predicate_the_body_computes_from_a_stacked_input_is_hoisted_bit_for_bit():
    """`done` computed in the body from the step's reward: the hoisted mask computes it the
    same way, so the dropped rows are exactly the body's."""
    rew = jnp.array([0.5, 1.0, 7.0, 0.25, 9.0, 1.5])  # > 5 at the terminal steps 2 and 4

    def by_reward(w, obs, rew):
        values = obs @ w

        def body(adv, xs):
            v, r = xs
            adv = jnp.where(r > 5., 0., r - v + 0.9 * adv)
            return adv, adv
        return jnp.sum(jax.lax.scan(body, 0., (values, rew), reverse=True)[1] ** 2)

    obs = _observations()
    hand = jax.grad(lambda w, o, r: by_reward(w, jnp.where(r[:, None] > 5., 0., o), r))
    np.testing.assert_allclose(jax.grad(jaxsafe.nan_safe(by_reward))(W, obs, rew),
                               hand(W, obs, rew), rtol=1e-6)


def test_a_drop_decided_by_a_carry_is_not_hoisted():
    """The body drops a step by its running advantage: not known before the loop, so the
    stacked input stays live (contract 5): nothing before the loop changes, and a NaN
    observation reaches the gradient as in plain JAX."""
    def by_carry(w, obs, rew):
        values = obs @ w

        def body(adv, xs):
            v, r = xs
            adv = jnp.where(adv > 1., 0., r - v + 0.9 * adv)
            return adv, adv
        return jnp.sum(jax.lax.scan(body, 0., (values, rew))[1])

    args = (W, _observations(), REW)
    before = str(jax.make_jaxpr(by_carry)(*args)).split("scan[")[0]
    assert str(jaxsafe.make_jaxpr(by_carry)(*args)).split("scan[")[0] == before
    assert np.all(np.isnan(jax.grad(jaxsafe.nan_safe(by_carry))(*args)))


def test_a_padded_rnn_s_input_projection_is_guarded_at_its_padded_steps():
    """An RNN over padded steps keeps its state there (`where(mask[t], new, h)`): the log
    features of a padded step (log 0) reach no gradient."""
    wx = jnp.array([[0.3, -0.1], [0.2, 0.4], [-0.5, 0.1]])
    wh = jnp.array([[0.5, 0.2], [-0.3, 0.1]])
    mask = jnp.array([True, True, True, False, False, True])
    feats = jnp.abs(_observations(1.0)).at[3].set(0.).at[4].set(0.)

    def rnn(wx, wh, feats, mask):
        xs = jnp.log(feats) @ wx

        def body(h, step):
            x, m = step
            return jnp.where(m, jnp.tanh(x + h @ wh), h), None
        return jnp.sum(jax.lax.scan(body, jnp.zeros(2), (xs, mask))[0])

    def by_hand(wx, wh, feats, mask):
        return rnn(wx, wh, jnp.where(mask[:, None], feats, 1.), mask)

    args = (wx, wh, feats, mask)
    assert not np.all(np.isfinite(jax.grad(rnn)(*args)))
    got = jax.grad(jaxsafe.nan_safe(rnn), argnums=(0, 1))(*args)
    for g, r in zip(got, jax.grad(by_hand, argnums=(0, 1))(*args), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6)


def _padded_features():
    mask = jnp.array([True, False, True, False])
    feats = jnp.array([[1., 2.], [0., 0.], [2., 1.5], [-1., -1.]])  # log: -inf, NaN
    return jnp.array([[0.3, -0.1], [0.2, 0.4]]), feats, mask


def test_a_gate_elementwise_with_its_carry_is_hoisted_along_its_aligned_axes_too():
    """`where(m, tanh(x + h), h)`: x runs along the carry's axis (aligned), and the body drops
    it by the step's mask: both hold (found by a bug hunt: the aligned mask alone kept it)."""
    wx, feats, mask = _padded_features()

    def rnn(wx, feats, mask):
        xs = jnp.log(feats) @ wx

        def body(h, step):
            x, m = step
            return jnp.where(m, jnp.tanh(x + h), h), None
        return jnp.sum(jax.lax.scan(body, jnp.ones(2), (xs, mask))[0])

    by_hand = lambda wx, feats, mask: rnn(wx, jnp.where(mask[:, None], feats, 1.), mask)  # noqa: E731
    assert not np.all(np.isfinite(jax.grad(rnn)(wx, feats, mask)))
    np.testing.assert_allclose(jax.grad(jaxsafe.nan_safe(rnn))(wx, feats, mask),
                               jax.grad(by_hand)(wx, feats, mask), rtol=1e-6)


def test_a_cond_on_the_step_s_flag_that_also_takes_the_carry_is_hoisted():
    """A `cond` reads its operands lazily: its predicate is the step's, the carry it also takes
    is never read to decide the drop."""
    def returns(w, obs, done):
        values = jnp.log(obs) @ w

        def body(c, xs):
            v, d = xs
            c = jax.lax.cond(d, lambda c: c, lambda c: 0.9 * c + v, c)
            return c, None
        return jax.lax.scan(body, 0., (values, done))[0]

    w = jnp.array([0.3, -0.2])
    obs = jnp.array([[1., 2.], [0., -1.], [2., 0.5]])
    done = jnp.array([False, True, False])
    by_hand = lambda w, obs, done: returns(w, jnp.where(done[:, None], 1., obs), done)  # noqa: E731
    assert not np.all(np.isfinite(jax.grad(returns)(w, obs, done)))
    np.testing.assert_allclose(jax.grad(jaxsafe.nan_safe(returns))(w, obs, done),
                               jax.grad(by_hand)(w, obs, done), rtol=1e-6)


def test_a_map_s_per_lane_drop_reaches_before_the_loop():
    """`lax.map` (no carries): besides the steps no output reads, the lanes its body drops."""
    wx, feats, mask = _padded_features()

    def mapped(wx, feats, mask):
        return jnp.sum(jax.lax.map(lambda z: jnp.where(z[1], 0., z[0] ** 2),
                                   (jnp.log(feats) @ wx, mask)))

    padded = ~mask
    by_hand = lambda wx, feats, padded: mapped(  # noqa: E731
        wx, jnp.where(padded[:, None], 1., feats), padded)
    assert not np.all(np.isfinite(jax.grad(mapped)(wx, feats, padded)))
    np.testing.assert_allclose(jax.grad(jaxsafe.nan_safe(mapped))(wx, feats, padded),
                               jax.grad(by_hand)(wx, feats, padded), rtol=1e-6)


def test_a_step_mask_that_cannot_run_for_every_step_at_once_is_not_hoisted():
    """A predicate from a `pure_callback` without a `vmap_method` cannot be batched: the input
    stays live (found by a bug hunt: this raised), with plain JAX's gradient."""
    def host_pred(r):
        return np.asarray(r > 5.)

    def f(w, obs, rew):
        values = jnp.log(obs) @ w

        def body(c, xs):
            v, r = xs
            d = jax.pure_callback(host_pred, jax.ShapeDtypeStruct((), jnp.bool_), r)
            c = jnp.where(d, 0., r - v + .9 * c)
            return c, c
        return jnp.sum(jax.lax.scan(body, 0., (values, rew))[1] ** 2)

    args = (jnp.array([0.1, -0.2]), jnp.array([[.5, .6], [-1., -1.], [.9, 1.], [0., 0.]]),
            jnp.array([.5, 7., 1., 9.]))
    assert np.array_equal(jaxsafe.nan_safe(f)(*args), jax.jit(f)(*args))
    np.testing.assert_array_equal(jax.grad(jaxsafe.nan_safe(f))(*args), jax.grad(f)(*args))


MX, MY = jnp.array([True, True, False]), jnp.array([True, True, True, False])


def _sinkhorn(x, y, loop, by_hand=False):
    """Log-domain Sinkhorn between padded point clouds, the cost matrix made before the loop and
    read whole by every step, its padded pairs masked in the body by closed-over masks."""
    if by_hand:
        x, y = jnp.where(MX[:, None], x, 0.), jnp.where(MY[:, None], y, 0.)
    cost = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)
    pairs = MX[:, None] & MY[None, :]
    la = jnp.where(MX, -jnp.log(MX.sum()), -jnp.inf)
    lb = jnp.where(MY, -jnp.log(MY.sum()), -jnp.inf)

    def step(fg):
        f, g = fg
        f = jnp.where(MX, -.5 * jax.scipy.special.logsumexp(
            jnp.where(pairs, (g[None] - cost) / .5 + lb[None], -jnp.inf), axis=1), 0.)
        g = jnp.where(MY, -.5 * jax.scipy.special.logsumexp(
            jnp.where(pairs, (f[:, None] - cost) / .5 + la[:, None], -jnp.inf), axis=0), 0.)
        return f, g
    fg = (jnp.zeros(3), jnp.zeros(4))
    if loop == "fori_loop":
        fg = jax.lax.fori_loop(0, 3, lambda i, c: step(c), fg)
    else:
        fg = jax.lax.scan(lambda c, _: (step(c), None), fg, None, length=3)[0]
    f, g = fg
    plan = jnp.exp(jnp.where(pairs, (f[:, None] + g[None] - cost) / .5 + la[:, None]
                             + lb[None], -jnp.inf))
    return jnp.sum(jnp.where(pairs, plan * cost, 0.))


@pytest.mark.no_leak_check  # numerics of whole loops
@pytest.mark.parametrize("loop", ["fori_loop", "scan"])
def test_a_loop_constant_its_body_masks_by_closed_over_masks_is_dropped_before_the_loop(loop):
    """The padded points' NaN and inf reach the cost matrix before the loop; every step reads it
    whole and masks its padded pairs: the OR over the steps of the body's mask drops them."""
    x = jnp.array([[0., 1.], [1., .5], [jnp.nan, jnp.inf]])
    y = jnp.array([[.2, .3], [1., 1.], [.5, -.5], [jnp.inf, jnp.nan]])
    f = lambda x, y: _sinkhorn(x, y, loop)
    hand = lambda x, y: _sinkhorn(x, y, loop, by_hand=True)
    assert_bitwise(jaxsafe.nan_safe(f)(x, y), jax.jit(f)(x, y))
    assert np.isnan(jax.grad(f)(x, y)).all()  # plain JAX: NaN in every entry
    assert_close(jax.grad(jaxsafe.nan_safe(f), (0, 1))(x, y), jax.grad(hand, (0, 1))(x, y),
                 rtol=1e-5, atol=1e-7)


@pytest.mark.no_leak_check  # numerics of whole loops
@pytest.mark.parametrize("by", ["closed_over_mask", "step_flag"])
def test_a_loop_constant_dropped_at_every_step_is_guarded_at_every_order(by):
    m = jnp.array([True, False])
    flags = jnp.array([[True, False], [True, False], [True, False]])

    def f(x, by_hand=False):
        c = jnp.log(jnp.where(m, x, 1.) if by_hand else x)
        if by == "closed_over_mask":
            return jax.lax.fori_loop(0, 3, lambda i, s: s + jnp.sum(jnp.where(m, c, 0.)), 0.)
        return jax.lax.scan(lambda s, t: (s + jnp.sum(jnp.where(t, c, 0.)), None), 0.,
                            flags)[0]
    hand = lambda x: f(x, by_hand=True)
    for x in (jnp.array([2., 0.]), jnp.array([2., -1.]), jnp.array([2., jnp.nan])):
        assert_bitwise(jaxsafe.nan_safe(f)(x), jax.jit(f)(x))
        assert_close(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(hand)(x))
    assert_close(jax.hessian(jaxsafe.nan_safe(f))(x), jax.hessian(hand)(x))
    assert_close(jax.jacfwd(jaxsafe.nan_safe(f))(x), jax.jacfwd(hand)(x))
    live = jnp.array([0., 1.])  # a live log(0): plain JAX's inf stays
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(live), jax.grad(f)(live))
    assert np.isinf(jax.grad(f)(live)[0])


def test_a_loop_constant_a_carry_decides_on_stays_as_plain_jax():
    """Which lanes of `c` a step reads depends on the carry: not known before the loop."""
    def f(x):
        c = jnp.log(x)
        return jax.lax.fori_loop(0, 2, lambda i, s: s + jnp.where(s < 1., c, 0.), 0. * x)
    x = jnp.array([2., 0.])
    assert_bitwise(jax.grad(lambda x: jaxsafe.nan_safe(f)(x).sum())(x),
                   jax.grad(lambda x: f(x).sum())(x))
