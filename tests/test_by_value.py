"""Shapes that depend on the data: an eager call (or eager jax.grad) is traced at its values.

The reference for every gradient is the hand fix (a double where on the hazard's input) or JAX on
the program with the dropped lanes removed (the indices known ahead, a static gather).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise

import jaxsafe
from jaxsafe import nan_safe


def issue_19089(x):
    delta = jnp.array((0., 1.)) * x
    return jnp.sum((delta ** 0.5)[delta > 0])  # the reporter's own form


def issue_19089_hand_fix(x):
    delta = jnp.array((0., 1.)) * x
    safe = jnp.where(delta > 0, delta, 1.)
    return jnp.sum(jnp.where(delta > 0, safe ** 0.5, 0.))


# numerics of many eager calls: without jax.checking_leaks (it turns JAX's caches off, and each
# eager call traces again); the tests below run the value tracer under it
@pytest.mark.no_leak_check
def test_the_reporters_boolean_index_gives_the_hand_fix_gradient_at_first_and_second_order():
    assert np.isnan(jax.grad(issue_19089)(1.))
    for jit in (True, False):
        f = nan_safe(issue_19089, jit=jit)
        assert jax.grad(f)(1.) == jax.grad(issue_19089_hand_fix)(1.) == 0.5
        assert jax.grad(jax.grad(f))(1.) == jax.grad(jax.grad(issue_19089_hand_fix))(1.)
        assert jax.hessian(f)(2.) == jax.hessian(issue_19089_hand_fix)(2.)
        assert jax.jacfwd(f)(2.) == jax.jacfwd(issue_19089_hand_fix)(2.)
        assert_bitwise(f(1.), issue_19089(1.))
        assert_bitwise(f(0.), issue_19089(0.))  # nothing selected: an empty sum


def test_under_jit_or_vmap_the_values_are_abstract_and_nan_safe_names_the_line_and_the_ways_out():
    line = issue_19089.__code__.co_firstlineno + 2
    for call in (lambda: jax.jit(jax.grad(nan_safe(issue_19089)))(1.),
                 lambda: jax.jit(nan_safe(issue_19089))(1.),
                 lambda: jax.vmap(jax.grad(nan_safe(issue_19089)))(jnp.ones(3))):
        with pytest.raises(jaxsafe.DataDependentShapeError) as info:
            call()
        message = str(info.value)
        assert f"test_by_value.py:{line} (issue_19089)" in message
        assert "[delta > 0]" in message
        assert "jnp.where(mask, v, 0.)" in message and "size=" in message
        assert "eager" in message
        assert isinstance(info.value.__cause__, jax.errors.NonConcreteBooleanIndexError)


@pytest.mark.no_leak_check
def test_nonzero_without_size_equals_the_program_with_the_dropped_lanes_removed():
    x = jnp.array([-1., 0., 2., 3., 0.])
    picked = np.nonzero(np.asarray(x) > 1.)[0]  # known ahead: a static gather

    def f(x):
        return jnp.sum(jnp.sqrt(x)[jnp.nonzero(x > 1.)] ** 2 * x[1:].sum())

    def reference(x):
        return jnp.sum(jnp.sqrt(x[picked]) ** 2 * x[1:].sum())

    assert not np.isfinite(jax.grad(f)(x)).all()
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x), jax.grad(reference)(x))
    np.testing.assert_array_equal(jax.hessian(nan_safe(f))(x), jax.hessian(reference)(x))
    assert_bitwise(nan_safe(f)(x), f(x))


def test_unique_of_integers_drops_the_lanes_it_does_not_pick():
    x = jnp.array([4., 0., -1., 9.])
    labels = jnp.array([3, 0, 3, 0])
    picked = np.unique(np.asarray(labels))

    def f(x, labels):
        return jnp.sum(jnp.log(x)[jnp.unique(labels)])

    reference = lambda x: jnp.sum(jnp.log(x[picked]))
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x, labels), jax.grad(reference)(x))
    assert_bitwise(nan_safe(f)(x, labels), f(x, labels))


def test_unique_of_a_float_is_traced_when_not_differentiated_and_refused_when_it_is():
    x = jnp.array([1., 2., 2., 3.])
    f = lambda x: jnp.sum(jnp.unique(x) ** 2)
    assert_bitwise(nan_safe(f)(x), f(x))
    # eager JAX turns the value into a constant and returns a zero gradient; nan_safe refuses
    np.testing.assert_array_equal(jax.grad(f)(x), np.zeros(4))
    with pytest.raises(jaxsafe.DataDependentShapeError, match="silently lost"):
        jax.grad(nan_safe(f))(x)


def test_python_control_flow_on_values_is_traced_eagerly_and_keeps_jaxs_error_under_jit():
    def f(x):
        if x[0] > 0:
            return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.))
        return jnp.sum(x)

    def hand_fix(x):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.)), 0.))

    x = jnp.array([4., 0., -1.])
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x), jax.grad(hand_fix)(x))
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(-x), np.ones(3))
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(nan_safe(f))(x)


@pytest.mark.slow  # 13 s: make fuzz runs it (make test is at its 10 minutes)
def test_custom_rules_inside_a_value_dependent_program_are_kept():
    @jax.custom_vjp
    def doubled_gradient(x):
        return x

    doubled_gradient.defvjp(lambda x: (x, None), lambda _, g: (2. * g,))

    def f(x):
        kept = x > -1.
        # relu's own rule: 0 at 0 (autodiff of its body, max(x, 0), would give 0.5)
        return jnp.sum(jax.nn.relu(x)[kept]) + jnp.sum(jnp.sqrt(doubled_gradient(x))[kept])

    x = jnp.array([0., 4., -4.])
    picked = np.array([0, 1])
    reference = lambda x: (jnp.sum(jax.nn.relu(x[picked]))
                           + jnp.sum(jnp.sqrt(doubled_gradient(x[picked]))))
    expected = jax.grad(reference)(jnp.array([0., 4., -4.]).at[0].set(1.))  # finite twin
    got = jax.grad(nan_safe(f))(x.at[0].set(1.))
    np.testing.assert_array_equal(got, expected)
    assert jax.grad(nan_safe(f))(x)[0] == np.inf  # sqrt'(0) on a kept lane is real: it stays
    assert jax.grad(nan_safe(lambda x: jnp.sum(jax.nn.relu(x)[x > -1.])))(x)[0] == 0.


def test_calls_traced_at_their_values_are_not_cached():
    f = nan_safe(issue_19089)
    assert jax.grad(f)(1.) == 0.5 and jax.grad(f)(4.) == 0.25
    assert f.cache_info()["size"] == 0


def test_make_jaxpr_at_values_shows_the_gather_at_this_calls_indices():
    closed = jaxsafe.make_jaxpr(issue_19089)(1.)
    assert "gather" in str(closed) and "f32[1]" in str(closed)


def test_a_signature_that_needed_values_is_traced_at_its_values_directly_next_time():
    """The first eager call learns that the program needs values (the jit front's trace and
    make_jaxpr's both fail); later calls of that signature trace once, at the values. The
    result is the same; under jit the same signature still gets nan_safe's error."""
    runs = []

    def f(x):
        runs.append(1)
        return issue_19089(x)
    safe = nan_safe(f)
    x = jnp.float32(1.)
    first = jax.grad(safe)(x)
    runs.clear()
    assert_bitwise(jax.grad(safe)(x), first)
    assert len(runs) == 1  # the value trace only
    assert_bitwise(safe(x), issue_19089(x))
    with pytest.raises(jaxsafe.DataDependentShapeError):
        jax.jit(safe)(x)
