"""nan_safe composes with every JAX transformation, each result equal to the hand-fixed function."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite

from jaxsafe import nan_safe


def f(x):
    return jnp.where(x > 0, jnp.sqrt(x) * jnp.log1p(x), x ** 2)


def hand(x):
    xs = jnp.where(x > 0, x, 1.)
    return jnp.where(x > 0, jnp.sqrt(xs) * jnp.log1p(xs), x ** 2)


X = jnp.array([-1.5, -0.0, 0.0, 0.5, 2.0])
XS = [-1.5, 0.0, 0.5, 2.0]

TRANSFORMS = {
    "jit": lambda g: jax.jit(g),
    "grad": lambda g: jax.vmap(jax.grad(g)),
    "jit_grad": lambda g: jax.jit(jax.vmap(jax.grad(g))),
    "vmap": lambda g: jax.vmap(g),
    "jvp": lambda g: (lambda x: jax.jvp(jax.vmap(g), (x,), (jnp.ones_like(x),))),
    "vjp": lambda g: (lambda x: jax.vjp(jax.vmap(g), x)[1](jnp.ones_like(x))),
    "jacfwd": lambda g: jax.vmap(jax.jacfwd(g)),
    "jacrev": lambda g: jax.vmap(jax.jacrev(g)),
    "hessian": lambda g: jax.vmap(jax.hessian(g)),
    "grad_grad_grad": lambda g: jax.vmap(jax.grad(jax.grad(jax.grad(g)))),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_of_nan_safe_equals_transform_of_hand_fix(name):
    t = TRANSFORMS[name]
    got, want = t(nan_safe(f))(X), jax.jit(t(hand))(X)  # the reference compiled once
    assert_finite(got)
    assert_close(got, want, rtol=1e-6)


@pytest.mark.parametrize("inner", ["jit", "vmap", "nan_safe"])
def test_nan_safe_of_transformed_function(inner):
    wrapped = {"jit": jax.jit(f), "vmap": jax.vmap(f), "nan_safe": nan_safe(f)}[inner]
    g = nan_safe(wrapped)
    if inner == "vmap":
        assert_bitwise(g(X), jax.jit(jax.vmap(f))(X))
        got = jax.grad(lambda x: jnp.sum(g(x)))(X)
        want = jax.grad(lambda x: jnp.sum(jax.vmap(hand)(x)))(X)
    else:
        for x in XS:
            assert_bitwise(g(x), jax.jit(f)(x))
        got = jax.vmap(jax.grad(g))(X)
        want = jax.vmap(jax.grad(hand))(X)
    assert_finite(got)
    assert_close(got, want)


def test_vmap_of_grad_of_plain_where():
    w = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.)
    assert np.isnan(jax.vmap(jax.grad(w))(X)).any()  # JAX guards vmapped cond, not where
    assert_close(jax.vmap(jax.grad(nan_safe(w)))(X), jnp.array([0., 0., 0., 0.5 / np.sqrt(.5),
                                                                 0.5 / np.sqrt(2.)]))


def test_nan_safe_of_grad_changes_nothing():
    """In grad(f)'s program the NaN is the value of a live lane (0 * inf): nothing is dropped,
    so nan_safe(grad(f)) is grad(f), NaN included. Apply nan_safe before differentiating."""
    w = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.)
    for x in XS:
        assert_bitwise(nan_safe(jax.grad(w))(x), jax.jit(jax.grad(w))(x))
    assert np.isnan(nan_safe(jax.grad(w))(0.))
    assert jax.grad(nan_safe(w))(0.) == 0.


def test_pytrees_keywords_and_scalars():
    @nan_safe
    def g(tree, *, scale):
        a, b = tree["a"], tree["b"]
        return {"out": jnp.where(a > 0, jnp.log(a), 0.) * scale + b, "n": None}

    tree = {"a": jnp.array([0., 1., 2.]), "b": 1.}
    out = g(tree, scale=2.)
    assert out["n"] is None
    assert_bitwise(out["out"], jax.jit(lambda t: jnp.where(t["a"] > 0, jnp.log(t["a"]), 0.) * 2.
                                       + t["b"])(tree))
    grads = jax.grad(lambda t: jnp.sum(g(t, scale=2.)["out"]))(tree)
    assert_close(grads, {"a": jnp.array([0., 2., 1.]), "b": jnp.asarray(3.)})


def test_closure_over_outer_tracers_is_not_cached_and_does_not_leak():
    def outer(y):
        return nan_safe(lambda x: jnp.where(x > y, jnp.sqrt(x - y), 0.))(jnp.array([0., 4.]))
    loss = lambda y: jnp.sum(outer(y))
    assert_close(jax.grad(loss)(1.), -0.5 / np.sqrt(3.))
    assert_close(jax.jit(jax.grad(loss))(1.), -0.5 / np.sqrt(3.))
    assert_close(jax.vmap(jax.grad(loss))(jnp.array([1., 5.])),
                 jnp.array([-0.5 / np.sqrt(3.), 0.]))


@pytest.mark.parametrize("differentiate", ["grad", "jvp", "jit of grad"])
def test_a_closed_over_tracer_keeps_its_live_derivative(differentiate):
    """A value closed over from an enclosing `grad` is an argument of the rewritten program,
    not a constant: at `c = 0` it is no zero factor that drops `sqrt(x)`'s lanes, and where a
    `where` takes it, it carries its derivative. Reference: plain JAX (finite here)."""
    programs = {
        "factor": lambda c: lambda x: c * jnp.sqrt(x),
        "taken side": lambda c: lambda x: jnp.sqrt(jnp.where(x > 0, x, c)),
        "max": lambda c: lambda x: jnp.sqrt(jnp.maximum(x, c)),
    }
    at = {"factor": (jnp.array([0., 1., 2.]), 4.), "taken side": (4., -1.), "max": (2., -1.)}
    for name, program in programs.items():
        c, x = at[name]
        outer = lambda c, wrap: jnp.sum(wrap(program(c))(x))  # noqa: B023, E731
        safe = functools.partial(outer, wrap=nan_safe)
        plain = functools.partial(outer, wrap=lambda f: f)
        if differentiate == "jvp":
            tangent = jnp.ones_like(c)
            got = jax.jvp(safe, (c,), (tangent,))[1]
            want = jax.jvp(plain, (c,), (tangent,))[1]
        else:
            d = jax.jit(jax.grad(safe)) if differentiate == "jit of grad" else jax.grad(safe)
            got, want = d(c), jax.grad(plain)(c)
        assert_finite(want)
        assert_bitwise(got, want)


def test_forward_mode_in_some_arguments_holds_the_others_fixed():
    """`jvp` in `w` only: `x` has no tangent, as in JAX, so `sqrt`'s infinite derivative at
    `x = 0` is never multiplied by a zero tangent (NaN). Reference: plain JAX, eager and under
    `jit`, which agree here."""
    scaled = lambda x, w: w * jnp.sqrt(x)  # noqa: E731
    masked = lambda x, w: jnp.sum(jnp.where(x > 1., 0., w * jnp.sqrt(x)))  # noqa: E731
    x = jnp.array([0., 4.])
    for g in (scaled, masked):
        for wrap in (lambda f: f, jax.jit):
            want = wrap(jax.jacfwd(g, argnums=1))(x, 2.)
            assert_finite(want)
            assert_bitwise(wrap(jax.jacfwd(nan_safe(g), argnums=1))(x, 2.), want)
            assert_bitwise(jax.jvp(lambda w: nan_safe(g)(x, w), (2.,), (1.,))[1],  # noqa: B023
                           jax.jvp(lambda w: g(x, w), (2.,), (1.,))[1])  # noqa: B023


def test_jit_false_evaluates_eagerly_and_equals_eager_f():
    """All the points in one eager call each (the leak checker turns JAX's caches off: a loop
    over the points compiled every primitive again for each)."""
    g = nan_safe(f, jit=False)
    x = jnp.asarray(XS)
    assert_bitwise(g(x), f(x))
    assert_bitwise(jax.vmap(jax.grad(g))(x), jax.vmap(jax.grad(hand))(x))


def test_debug_nans_does_not_fire_on_guarded_lanes():
    w = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.)
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError):
            jax.grad(w)(-1.)
        assert jax.grad(nan_safe(w, jit=False))(-1.) == 0.
        assert jax.grad(nan_safe(w))(-1.) == 0.
