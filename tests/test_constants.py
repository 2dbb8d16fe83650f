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
