"""A call differentiated inside `jax.jit` replays its rewritten program in the caller's trace.

- `replay` is `jax.core.eval_jaxpr`: the same values, the same staged program (the single-
  primitive jits are inlined), literals told apart by their bits and dtype, the user's lines kept.
- `jax.jit(jax.grad(nan_safe(f)))` stages the rewritten program itself: no jit front, no
  custom_jvp around it; with nothing to guard, the very program `jax.grad(f)` stages.
- The replayed path gives what the custom_jvp path gives (eager grad, `grad` of a jitted call),
  at every order, and the hand fix's derivatives.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, structure
from jax.extend import source_info_util

import jaxsafe
from jaxsafe import _replay
from jaxsafe._compat import eval_jaxpr


def program(x, y):
    a = jnp.sin(x) * 2. + y
    b = jnp.where(a > 0, jnp.sqrt(jnp.abs(a)), jnp.nan)
    c = jnp.concatenate([b, x[::-1]]) @ jnp.ones((2 * x.shape[0], 3))
    return jnp.cumsum(c) / jnp.float32(3.), (x * 2).astype(jnp.int32) * 2


ARGS = (jnp.linspace(-2., 2., 8, dtype=jnp.float32), jnp.float32(0.25))


def _replayed(closed):
    return lambda *a: _replay.replay(closed.jaxpr, closed.consts, *a)


def _evaluated(closed):
    return lambda *a: eval_jaxpr(closed.jaxpr, closed.consts, *a)


def test_replay_has_the_values_and_the_program_of_eval_jaxpr():
    closed = jax.make_jaxpr(program)(*ARGS)
    assert_bitwise(_replayed(closed)(*ARGS), _evaluated(closed)(*ARGS))
    assert_bitwise(jax.jit(_replayed(closed))(*ARGS), jax.jit(_evaluated(closed))(*ARGS))
    assert structure(jax.make_jaxpr(_replayed(closed))(*ARGS)) == \
        structure(jax.make_jaxpr(_evaluated(closed))(*ARGS))


def test_replay_has_the_derivatives_of_eval_jaxpr():
    closed = jax.make_jaxpr(lambda x, y: program(x, y)[0])(*ARGS)

    def loss(run):
        return lambda x, y: jnp.sum(jnp.nan_to_num(run(x, y)[0]))
    for run in (_replayed(closed), _evaluated(closed)):
        assert np.isfinite(jax.jit(jax.grad(loss(run), (0, 1)))(*ARGS)[0]).any()
    assert_bitwise(jax.jit(jax.grad(loss(_replayed(closed)), (0, 1)))(*ARGS),
                   jax.jit(jax.grad(loss(_evaluated(closed)), (0, 1)))(*ARGS))
    assert_bitwise(jax.jit(jax.hessian(loss(_replayed(closed))))(*ARGS),
                   jax.jit(jax.hessian(loss(_evaluated(closed))))(*ARGS))


def test_literals_of_equal_value_and_other_dtypes_are_told_apart():
    """`x * 2` on int32, float32 and (weak) float literals, and NaN literals, share no
    single-primitive function: the cache keys literals by dtype and bits."""
    def f(x, i):
        return (x * 2., i * 2, x * np.float32(2.), jnp.where(x > 0, x, np.nan),
                jnp.where(x > 1, x, np.float32(np.nan)))
    x, i = jnp.arange(3., dtype=jnp.float32), jnp.arange(3, dtype=jnp.int32)
    closed = jax.make_jaxpr(f)(x, i)
    outs = jax.jit(_replayed(closed))(x, i)
    assert_bitwise(tuple(outs), jax.jit(f)(x, i))
    assert [o.dtype for o in outs] == [jnp.float32, jnp.int32, jnp.float32, jnp.float32,
                                       jnp.float32]


def test_equations_of_one_primitive_and_parameters_with_other_arities_are_told_apart():
    """`select_n` with two and three cases, `concatenate` of two and three arrays: the same
    primitive and parameters; a cache keyed without the arity bound one with the other's
    function, and a case was silently dropped (`jnp.piecewise`'s gradient)."""
    def f(x, i):
        return (jax.lax.select_n(x > 0, x, -x), jax.lax.select_n(i, x, 2 * x, 3 * x),
                jnp.concatenate([x, x]), jnp.concatenate([x, 2 * x, 3 * x]))
    x, i = jnp.array([-1., 2., 3.], jnp.float32), jnp.array([0, 1, 2], jnp.int32)
    closed = jax.make_jaxpr(f)(x, i)
    assert_bitwise(tuple(jax.jit(_replayed(closed))(x, i)), jax.jit(f)(x, i))


def test_equations_that_are_not_plain_are_bound_as_they_are():
    """Bodies (cond, scan, custom_jvp), effects (a callback): bound as eval_jaxpr binds them."""
    seen = []

    def f(x):
        y = jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)
        y = jax.lax.scan(lambda c, v: (c + v, c * v), 0., y)[1]
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), y)
        return jax.nn.relu(y)
    x = jnp.linspace(.1, 1., 4, dtype=jnp.float32)
    closed = jax.make_jaxpr(f)(x)
    assert_bitwise(jax.jit(_replayed(closed))(x)[0], jax.jit(f)(x))
    assert len(seen) == 2
    assert_bitwise(seen[0], seen[1])


def test_replayed_equations_keep_the_users_lines():
    def f(x):
        return jnp.where(x > 0, jnp.sqrt(x), 0.)   # the line the sqrt comes from
    line = f.__code__.co_firstlineno + 1
    g = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jaxsafe.nan_safe(f)(x))))(jnp.ones(3))
    sqrts = [e for e in g.jaxpr.eqns if e.primitive is jax.extend.core.primitives.sqrt_p]
    assert sqrts
    for e in sqrts:
        assert f"test_replay.py:{line}" in source_info_util.summarize(e.source_info)


# --------------------------------------------------------------------------- the replayed path

def hazard(x):
    return jnp.where(x > 0, jnp.log(x) * jnp.sqrt(x), x ** 2)


def hazard_by_hand(x):
    safe = jnp.where(x > 0, x, 1.)
    return jnp.where(x > 0, jnp.log(safe) * jnp.sqrt(safe), x ** 2)


XS = jnp.array([-1., 0., -1e-30, .5, 2.], jnp.float32)


def _primitives(closed):
    return {e.primitive.name for e in closed.jaxpr.eqns}


def test_a_staged_gradient_replays_the_rewritten_program_without_a_front():
    g = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jaxsafe.nan_safe(hazard)(x))))(XS)
    assert not _primitives(g) & {"custom_jvp_call", "jit", "pjit"}
    # the custom_jvp path (a jitted call, differentiated outside it) has both
    g_front = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jax.jit(jaxsafe.nan_safe(hazard))(x))))
    assert "jit" in _primitives(g_front(XS))


def test_with_nothing_to_guard_the_staged_gradient_is_the_originals():
    def f(x, w):
        h = jnp.tanh(x @ w)
        return jnp.sum(jnp.roll(h, 1, 0) * h) + jnp.max(x)
    x, w = jnp.ones((4, 3)), jnp.full((3, 2), .5)
    for transform, args in ((lambda g: jax.grad(g, (0, 1)), (x, w)), (jax.hessian, (x, w)),
                            (lambda g: jax.vmap(jax.grad(g), (0, None)),
                             (jnp.stack([x, 2 * x]), w))):
        ours = jax.make_jaxpr(transform(jaxsafe.nan_safe(f)))(*args)
        theirs = jax.make_jaxpr(transform(f))(*args)
        assert structure(ours) == structure(theirs)


@pytest.mark.parametrize("order", [1, 2, 3])
def test_the_replayed_path_gives_the_hand_fixs_derivatives_at_every_order(order):
    def d(f):
        for _ in range(order):  # elementwise: the order-th derivative, lane by lane
            f = jax.grad(lambda x, f=f: jnp.sum(f(x)))
        return f
    ours = jax.jit(d(jaxsafe.nan_safe(hazard)))(XS)
    assert_close(ours, jax.jit(d(hazard_by_hand))(XS), rtol=1e-5)
    # the custom_jvp paths: eager, and a jitted call differentiated from outside
    assert_close(ours, d(jaxsafe.nan_safe(hazard))(XS), rtol=1e-5)
    assert_close(ours, jax.jit(d(jax.jit(jaxsafe.nan_safe(hazard))))(XS), rtol=1e-5)
    assert np.isnan(jax.jit(d(hazard))(XS)).any()  # the leak it fixes


def test_the_replayed_path_keeps_forward_values_and_mixed_arguments():
    """`value_and_grad` under jit: the value is `jax.jit(f)`'s; an argument that is not
    differentiated, a keyword argument and a static one pass through."""
    def f(x, scale, *, power):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x) ** power, 0.)) * scale
    g = jaxsafe.nan_safe(f, static_argnames="power")
    hand = lambda x, scale, *, power: jnp.sum(  # noqa: E731
        jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.)) ** power, 0.)) * scale
    run = jax.jit(jax.value_and_grad(g), static_argnames="power")
    value, grad = run(XS, 2., power=3)
    assert_bitwise(value, jax.jit(f, static_argnames="power")(XS, 2., power=3))
    assert_close(grad, jax.jit(jax.grad(hand), static_argnames="power")(XS, 2., power=3))
    # differentiated with respect to the scale only: the positions are constants of the trace
    assert_close(jax.jit(jax.grad(g, 1), static_argnames="power")(XS, 2., power=3),
                 jax.jit(jax.grad(hand, 1), static_argnames="power")(XS, 2., power=3))


def test_the_replayed_path_under_jvp_and_vmap():
    ours = jax.jit(jax.vmap(lambda t: jax.jvp(jaxsafe.nan_safe(hazard), (XS,), (t,))[1]))(
        jnp.eye(len(XS), dtype=jnp.float32))
    assert_close(ours, jax.jit(jax.jacfwd(hazard_by_hand))(XS).T, rtol=1e-6)


def test_collectives_over_named_axes_in_a_replayed_gradient():
    """A `psum` and an `axis_index` over a vmapped axis, differentiated under jit, at two axis
    sizes: bound as they are, never through a jit cached across axis sizes."""
    def f(x):
        total = jax.lax.psum(x, "i") + jax.lax.axis_index("i")
        return jnp.where(x > 0, jnp.sqrt(x) * total, 0.)

    def hand(x):
        total = jax.lax.psum(x, "i") + jax.lax.axis_index("i")
        return jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.)) * total, 0.)
    for n in (2, 3, 5):
        xs = jnp.linspace(-1., 2., n, dtype=jnp.float32)
        ours = jax.jit(jax.vmap(jax.grad(jaxsafe.nan_safe(f)), axis_name="i"))(xs)
        assert_close(ours, jax.jit(jax.vmap(jax.grad(hand), axis_name="i"))(xs))
        assert_close(jax.jit(jax.vmap(jaxsafe.nan_safe(f), axis_name="i"))(xs),
                     jax.jit(jax.vmap(f, axis_name="i"))(xs))
