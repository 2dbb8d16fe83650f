"""The merging pass (`_repeats.py`): an equation the rewritten program computes twice on the same
operands is computed once, and nothing else changes: values bit for bit, derivatives equal to the
hand-written double where's, and equations that may differ when run twice stay."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_bitwise, assert_close
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

import jaxsafe


def _repeats(closed) -> list[str]:
    """The equations of `closed` (top level) that compute what an earlier one computed; not
    broadcasts, kept one per reader on purpose (tests/test_multidevice.py checks why)."""
    seen, found = set(), []
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive is lax.broadcast_in_dim_p:
            continue
        operands = tuple(repr(v) if hasattr(v, "val") else id(v) for v in eqn.invars)
        key = (eqn.primitive, operands, repr(sorted(eqn.params.items())))
        if key in seen:
            found.append(str(eqn))
        seen.add(key)
    return found


def clipped_log(x):
    return jnp.clip(jnp.log(x), -5., 5.)


def clipped_log_by_hand(x):
    safe = jnp.where(x > 0, x, 1.)
    return jnp.where(x > 0, jnp.clip(jnp.log(safe), -5., 5.), -5.)


def test_a_re_decided_clamp_compares_once():
    """The re-decided `max` of a clip compares the original operands as the masks did: once."""
    x = jnp.array([0., 1e-3, 1., 2., 1e4])
    rewritten = jaxsafe.make_jaxpr(clipped_log)(x)
    assert _repeats(rewritten) == []
    assert len(rewritten.eqns) > len(jax.make_jaxpr(clipped_log)(x).eqns)  # a guard is there
    assert_bitwise(jaxsafe.nan_safe(clipped_log)(x), jax.jit(clipped_log)(x))
    safe = jaxsafe.nan_safe(clipped_log)
    for power in (1, 2):
        got = jax.grad(lambda v, p=power: jnp.sum(safe(v) ** p))(x)
        want = jax.grad(lambda v, p=power: jnp.sum(clipped_log_by_hand(v) ** p))(x)
        assert_close(got, want)
    hess = jax.hessian(lambda v: jnp.sum(safe(v) ** 2))(x)
    want = jax.hessian(lambda v: jnp.sum(clipped_log_by_hand(v) ** 2))(x)
    assert_close(hess, want)


def test_two_guards_on_one_predicate_read_its_mask_once():
    def f(x):
        return jnp.where(x > 0, jnp.sqrt(x), 0.) + jnp.where(x > 0, jnp.log(x), 0.)

    def by_hand(x):
        safe = jnp.where(x > 0, x, 1.)
        return jnp.where(x > 0, jnp.sqrt(safe), 0.) + jnp.where(x > 0, jnp.log(safe), 0.)

    x = jnp.array([-1., 0., 0.5, 3.])
    assert _repeats(jaxsafe.make_jaxpr(f)(x)) == []
    assert_bitwise(jaxsafe.nan_safe(f)(x), jax.jit(f)(x))
    assert_close(jax.grad(lambda v: jnp.sum(jaxsafe.nan_safe(f)(v)))(x),
                 jax.grad(lambda v: jnp.sum(by_hand(v)))(x))


def test_a_stateful_draw_is_not_merged():
    """`rng_uniform` is XLA's stateful generator: two draws are two numbers."""
    def f(x):
        a = lax.rng_uniform(0., 1., (4,))
        b = lax.rng_uniform(0., 1., (4,))
        return jnp.where(x > 0, jnp.sqrt(x), 0.) + a - b

    rewritten = jaxsafe.make_jaxpr(f)(jnp.ones(4))
    draws = [e for e in rewritten.eqns if e.primitive is lax.rng_uniform_p]
    assert len(draws) == 2
    assert any(e.primitive.name == "select_n" for e in rewritten.eqns)  # a rewritten program


twice = Primitive("jaxsafe_test_unknown_twice")
twice.def_impl(lambda x: 2 * x)
twice.def_abstract_eval(lambda x: x)
mlir.register_lowering(twice, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))


def test_an_unknown_primitive_is_not_merged():
    """jaxsafe knows nothing of a primitive without a row: it may draw, count or call out."""
    def f(x):
        return jnp.where(x > 0, jnp.sqrt(x), 0.) + twice.bind(x) + twice.bind(x)

    x = jnp.array([-1., 4.])
    rewritten = jaxsafe.make_jaxpr(f)(x)
    assert sum(e.primitive is twice for e in rewritten.eqns) == 2
    np.testing.assert_array_equal(jaxsafe.nan_safe(f)(x), f(x))


def test_nothing_to_guard_keeps_the_original_repeats():
    """Contract 4: with nothing to guard the program is the original, its own repeats too."""
    def f(x):
        return jnp.sin(x) + jnp.sin(x)

    x = jnp.arange(3.)
    original = jax.make_jaxpr(f)(x)
    assert len(_repeats(original)) == 1
    assert str(jaxsafe.make_jaxpr(f)(x)) == str(original)


def test_a_registered_library_primitive_is_not_merged():
    """A library's row says nothing of hidden state: its repeats stay."""
    counted = Primitive("jaxsafe_test_registered_twice")
    counted.def_impl(lambda x: 2 * x)
    counted.def_abstract_eval(lambda x: x)
    mlir.register_lowering(counted, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))
    jaxsafe.register_rule(counted, elementwise=True, differentiable=False)

    def f(x):
        return jnp.where(x > 0, jnp.sqrt(x), 0.) + counted.bind(x) + counted.bind(x)

    x = jnp.array([-1., 4.])
    assert sum(e.primitive is counted for e in jaxsafe.make_jaxpr(f)(x).eqns) == 2
