"""The oracles: `structure` (equal for two traces of one program, unequal for any other
program) and the value checks (`assert_bitwise` is stricter than chex's equality)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite, structure
from jax import lax
from jax.extend import core as jex

P = jex.primitives
X = jnp.array([-1., 0., 4.])
C, C2 = jnp.array([1., 2., 3.]), jnp.array([1., 2., 5.])  # closed over: constants


@jax.custom_jvp
def soft_sqrt(x):
    return jnp.sqrt(x)


@soft_sqrt.defjvp
def _soft_sqrt_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return soft_sqrt(x), t / (2. * jnp.sqrt(jnp.abs(x) + 1.))


def _scan(xs):
    return lax.scan(lambda c, x: (c + jnp.sin(x), c * 2.), 0., xs)


def _traced_twice(f, *args):
    """Two independent traces: the caches that would hand back the same nested jaxpr object
    (jnp.where's jit, the scan body) are cleared in between."""
    first = jax.make_jaxpr(f)(*args)
    jax.clear_caches()
    return first, jax.make_jaxpr(f)(*args)


@pytest.mark.parametrize("f", [
    lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.)),  # a nested jit (jnp.where)
    _scan,
    lambda x: jnp.where(x > 0, soft_sqrt(x), x),           # custom_jvp_call, its jvp a function
    lambda x: x * jnp.nan,                                 # a NaN literal
    lambda x: x + C,                                       # a constant
    jax.grad(lambda x: jnp.sum(jnp.where(x > 0, soft_sqrt(x), x))),
], ids=["where", "scan", "custom_jvp", "nan_literal", "constant", "grad"])
def test_two_traces_of_one_function_have_one_structure(f):
    first, second = _traced_twice(f, X)
    assert structure(first) == structure(second)
    assert hash(structure(first)) == hash(structure(second))
    assert structure(first.jaxpr) == structure(second.jaxpr)  # open jaxprs too


def test_nested_jaxprs_are_compared_by_content():
    first, second = _traced_twice(lambda x: jnp.where(x > 0, x, 0.), X)
    inner = [e.params["jaxpr"] for e in (first.eqns[-1], second.eqns[-1])]
    assert inner[0] is not inner[1]  # really two traces
    assert structure(first) == structure(second)


def _neg_named_like_lax_neg():
    """A primitive whose name (and so its printed text) is `neg`, but is not `lax.neg_p`."""
    fake = jex.Primitive("neg")
    fake.def_abstract_eval(lambda x: x)
    return fake


@pytest.mark.parametrize("f, g", [
    (lambda x: x * 2., lambda x: x * 3.),                   # a literal
    (lambda x: x * 0., lambda x: x * -0.),                  # a literal's sign bit
    (lambda x: x + jnp.nan, lambda x: x + 1.),              # a NaN literal and a NaN-free one
    (jnp.sin, jnp.cos),                                     # a primitive
    (lax.neg, _neg_named_like_lax_neg().bind),              # a primitive object, one name
    (lambda x: lax.select_n(x > 0, x, x),                   # one select_n more
     lambda x: lax.select_n(x > 0, lax.select_n(x > 0, x, x), x)),
    (lambda x: x + C, lambda x: x + C2),                    # a constant's value
    (lambda x: jnp.where(x > 0, soft_sqrt(x), x),           # a custom_jvp call or its body
     lambda x: jnp.where(x > 0, jnp.sqrt(x), x)),
    (lambda x: _scan(x)[0], lambda x: _scan(x)[1][0]),      # the outputs
    (lambda x: lax.scan(lambda c, x: (c + x, c), 0., x),    # a nested body
     lambda x: lax.scan(lambda c, x: (c - x, c), 0., x)),
], ids=["literal", "negative_zero", "nan_literal", "primitive", "same_name", "extra_select_n",
        "constant", "custom_jvp", "outvars", "scan_body"])
def test_different_programs_have_different_structures(f, g):
    assert structure(jax.make_jaxpr(f)(X)) != structure(jax.make_jaxpr(g)(X))


@pytest.mark.parametrize("f, g", [
    (lambda x, y: x - y, lambda x, y: y - x),
    (lambda x, y: (x - y) * x, lambda x, y: (x - y) * y),
    (lambda x, y: (x, y), lambda x, y: (y, x)),
], ids=["operands", "reuse", "outputs"])
def test_different_wiring_gives_different_structures(f, g):
    y = jnp.array([1., 2., 3.])
    assert structure(jax.make_jaxpr(f)(X, y)) != structure(jax.make_jaxpr(g)(X, y))


def test_avals_are_part_of_the_structure():
    f = lambda x: jnp.sin(x)
    assert structure(jax.make_jaxpr(f)(X)) != structure(jax.make_jaxpr(f)(X[:2]))
    assert structure(jax.make_jaxpr(f)(1.)) != structure(jax.make_jaxpr(f)(np.float32(1.)))
    assert structure(jax.make_jaxpr(f)(X)) != structure(jax.make_jaxpr(f)(X.astype(jnp.bfloat16)))


def test_assert_bitwise_sees_what_chex_equality_does_not():
    import chex
    zero, minus_zero = jnp.array([0.]), jnp.array([-0.])
    quiet = jnp.array([np.nan], jnp.float32)
    other = jnp.asarray(np.array([0x7FC00001], np.uint32).view(np.float32))  # another payload
    assert np.isnan(other[0])
    for a, b in [(zero, minus_zero), (quiet, other)]:
        chex.assert_trees_all_equal(a, b)  # equal as values
        with pytest.raises(AssertionError):
            assert_bitwise(a, b)
    assert_bitwise({"a": quiet, "b": (zero,)}, {"a": quiet, "b": (zero,)})
    with pytest.raises(AssertionError):  # same leaves, another structure
        assert_bitwise({"a": quiet, "b": (zero,)}, {"a": quiet, "b": [zero]})
    with pytest.raises(AssertionError):  # same bytes, another dtype
        assert_bitwise(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.float32))


def test_assert_close_and_assert_finite():
    assert_close(jnp.array([1., np.nan]), jnp.array([1. + 1e-7, np.nan]))
    with pytest.raises(AssertionError):
        assert_close(jnp.array([1., np.nan]), jnp.array([1., 0.]))  # NaN only where NaN
    with pytest.raises(AssertionError):
        assert_close(jnp.array([1.]), jnp.array([1.1]), rtol=1e-3)
    with pytest.raises(AssertionError):
        assert_close((jnp.ones(1),), [jnp.ones(1)])
    assert_finite({"w": jnp.ones(3)})
    with pytest.raises(AssertionError):
        assert_finite({"w": jnp.array([1., np.inf])})
