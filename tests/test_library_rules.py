"""`jaxsafe.register_rule`: rows for primitives that other libraries define."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax.extend import core as jex
from jax.interpreters import ad, batching, mlir

import jaxsafe
from jaxsafe import _rules


def _identity_primitive(name):
    """A library-style primitive: the identity, linear, with its own lowering."""
    p = jex.Primitive(name)
    p.def_impl(lambda x: x)
    p.def_abstract_eval(lambda x: x)
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x, multiple_results=False))
    ad.deflinear2(p, lambda ct, x: [p.bind(ct)])
    batching.defvectorized(p)
    return p


X = jnp.array([-1.0, 0.0, 4.0, 9.0])


def test_an_unknown_primitive_passes_through_and_is_reported():
    tag = _identity_primitive("tag_unknown")
    f = lambda x: jnp.sum(jnp.where(x > 0, tag.bind(jnp.sqrt(x)), 0.0))
    text = str(jaxsafe.explain(f)(X))
    assert "unknown primitive tag_unknown" in text
    # treated as live: every lane of sqrt's output reaches it, so nothing is guarded there
    assert np.isnan(np.asarray(jax.grad(jaxsafe.nan_safe(f))(X))).any()


def test_an_elementwise_row_lets_the_drop_through():
    tag = _identity_primitive("tag_elementwise")
    jaxsafe.register_rule(tag, elementwise=True, linear=True)
    f = lambda x: jnp.sum(jnp.where(x > 0, tag.bind(jnp.sqrt(x)), 0.0))
    hand = lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.0)), 0.0))
    assert "unknown" not in str(jaxsafe.explain(f)(X))
    assert_close(jax.grad(jaxsafe.nan_safe(f))(X), jax.grad(hand)(X))
    assert _rules.rule_for(tag).elementwise


def test_a_row_without_derivative_and_one_that_makes_nonfinite():
    check = jex.Primitive("all_positive")
    check.def_impl(lambda x: jnp.all(x > 0))
    check.def_abstract_eval(lambda x: jax.core.ShapedArray((), np.bool_))
    jaxsafe.register_rule(check, differentiable=False)
    row = _rules.rule_for(check)
    assert row.known and row.zero_derivative and not row.elementwise

    solve = _identity_primitive("solve_like")
    jaxsafe.register_rule(solve, makes_nonfinite=True)
    # its output may be non-finite: a product with it in a dropped lane is guarded
    f = lambda x: jnp.sum(jnp.where(x > 0, x * solve.bind(x), 0.0))
    text = str(jaxsafe.explain(f)(X))
    assert "guarded mul" in text and "may be non-finite" in text
    assert "unknown" not in text


@pytest.mark.parametrize("bad, message", [
    (dict(primitive="sqrt"), "must be a jax.extend.core.Primitive"),
    (dict(primitive=jax.lax.sqrt_p), "one of JAX's own primitives"),
    (dict(elementwise="yes"), "`elementwise` must be True or False"),
    (dict(makes_nonfinite=1), "`makes_nonfinite` must be True or False"),
])
def test_bad_arguments_are_named(bad, message):
    kwargs = dict(primitive=_identity_primitive("tag_bad"))
    kwargs.update(bad)
    primitive = kwargs.pop("primitive")
    with pytest.raises((TypeError, ValueError), match=message):
        jaxsafe.register_rule(primitive, **kwargs)


def test_a_registration_rewrites_cached_functions_again():
    tag = _identity_primitive("tag_cached")
    f = jaxsafe.nan_safe(lambda x: jnp.sum(jnp.where(x > 0, tag.bind(jnp.sqrt(x)), 0.0)))
    assert np.isnan(np.asarray(jax.grad(f)(X))).any()
    jaxsafe.register_rule(tag, elementwise=True, linear=True)
    assert np.isfinite(np.asarray(jax.grad(f)(X))).all()


def test_equinox_rows_are_registered_once_it_is_imported():
    unvmap = pytest.importorskip("equinox._unvmap")
    nontraceable = pytest.importorskip("equinox.internal._nontraceable")
    for p in (unvmap.unvmap_any_p, unvmap.unvmap_all_p, unvmap.unvmap_max_p):
        row = _rules.rule_for(p)
        assert row.known and row.zero_derivative
    row = _rules.rule_for(nontraceable.nondifferentiable_backward_p)
    assert row.known and row.elementwise and row.linear
