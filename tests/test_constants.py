"""What the planning passes evaluate on concrete values (`_constants.py`) is remembered only
where the question is plain data, and the answers are the ones JAX gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxsafe._constants import _MEMO, finite_with_derivatives, fold


def _eqn(f, *args):
    return jax.make_jaxpr(f)(*args).jaxpr.eqns[-1]


def test_a_remembered_fold_is_the_value_jax_computes_and_read_only():
    eqn = _eqn(lambda x: lax.pow(x, 2.5), np.float32(3.0))
    point = [np.float32(3.0), np.float32(2.5)]
    first, again = fold(eqn, point)[0], fold(eqn, point)[0]
    assert again is first  # remembered
    np.testing.assert_array_equal(first, np.asarray(lax.pow(np.float32(3.0), np.float32(2.5))))
    with pytest.raises(ValueError, match="read-only"):
        first[...] = 0.0


def test_answers_differ_by_operand_value_and_dtype():
    eqn = _eqn(jnp.log, np.float32(1.0))
    assert finite_with_derivatives(eqn, [np.float32(1.0)])
    assert not finite_with_derivatives(eqn, [np.float32(0.0)])
    assert not finite_with_derivatives(eqn, [np.float32(-1.0)])
    keys = {_MEMO.key("finite", eqn, [v]) for v in (np.float32(0.0), np.float32(-0.0),
                                                    np.float16(0.0))}
    assert len(keys) == 3


def test_questions_that_are_not_plain_data_are_not_remembered():
    eqn = _eqn(jnp.sin, np.float32(1.0))
    assert _MEMO.key("fold", eqn, [np.zeros(1024, np.float32)]) is None  # too large

    def traced(x):
        assert _MEMO.key("fold", eqn, [x]) is None  # a tracer
        return x
    jax.jit(traced)(1.0)
    body = _eqn(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x), np.float32(1.0))
    assert _MEMO.key("fold", body, [np.True_, np.float32(1.0)]) is None  # bodies


def test_scalar_constants_become_literals_and_the_program_computes_the_same():
    from jax.extend.core import Literal

    from jaxsafe._compat import eval_jaxpr
    from jaxsafe._flatten import inline_scalar_constants

    alpha, table = jnp.float32(2.5), jnp.arange(3.0)
    closed = jax.make_jaxpr(lambda x: (x * alpha + table) / alpha)(jnp.ones(3))
    assert len(closed.consts) == 2
    inlined = inline_scalar_constants(closed)
    assert [np.shape(c) for c in inlined.consts] == [(3,)]  # the array stays a constant
    literals = [a for e in inlined.jaxpr.eqns for a in e.invars if isinstance(a, Literal)]
    assert len(literals) == 2 and all(float(a.val) == 2.5 for a in literals)
    x = jnp.array([1.0, -2.0, 3.0])
    np.testing.assert_array_equal(eval_jaxpr(inlined.jaxpr, inlined.consts, x)[0],
                                  eval_jaxpr(closed.jaxpr, closed.consts, x)[0])
    assert inline_scalar_constants(jax.make_jaxpr(jnp.sin)(1.0)) is not None
    plain = jax.make_jaxpr(lambda x: x * table)(jnp.ones(3))
    assert inline_scalar_constants(plain) is plain  # nothing to inline: the same object
