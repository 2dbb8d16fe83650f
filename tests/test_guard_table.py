"""Every entry of the guard table, one `jnp.where` case each, against the hand-written double where.

Each case is `jnp.sum(jnp.where(cond(x), op(*operands(x)), 0.))` on a vector that mixes taken
(in-domain) lanes and untaken lanes where `op` is out of domain, singular or overflows. For each
case and dtype:

(a) plain JAX's gradient is NaN/inf (the bug is real), or, where plain JAX is already finite,
    `nan_safe`'s gradient equals it;
(b) `jax.grad(nan_safe(f))` is finite and equals the gradient of the twin
    `jnp.where(cond, op(jnp.where(cond, operand, SAFE), ...), 0.)` with the table's safe values;
(c) `nan_safe(f)(x)` is bitwise `jax.jit(f)(x)`.

`test_x64.py` runs the same cases in float64 (in its own JAX_ENABLE_X64=1 session) by importing
`CASES`, `SECOND_ORDER` and the `check_*` functions from here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite
from jax import lax
from jax.extend import core as jex

import jaxsafe
from jaxsafe import _guards, nan_safe
from jaxsafe._rules import RULES, guard_table

# A sweep of many library functions and dtypes, each compiled a few times: without
# jax.checking_leaks, which turns JAX's caches off and doubles the time (the other modules check
# for leaks on every test).
pytestmark = pytest.mark.no_leak_check

P = jex.primitives
sg = lax.stop_gradient


def _full(value):
    return lambda x: jnp.full_like(x, value)


def _complex(x):
    return x.astype(jnp.complex128 if x.dtype == jnp.float64 else jnp.complex64)


@dataclasses.dataclass(frozen=True)
class Case:
    """`jnp.sum(jnp.where(cond(x), outer(x, op(*operands(x))), 0.))` for one guarded primitive.

    - `safe`: the table's `{operand index: safe value}`, used by the hand-written twin.
    - `xs`: the input lanes (taken and untaken), or a dict from dtype name (or "default") to them,
      where the bad values depend on the dtype (overflow thresholds).
    - `outer`: for primitives JAX cannot differentiate (zeta, igamma_grad_a), the operands are
      `stop_gradient`-ed and the gradient reaches x through `x * op(...)`: a NaN/inf in a dropped
      lane of `op` then meets the zero cotangent in the product.
    - `plain_finite`: dtype names where plain JAX's gradient is already finite (see comments).
    """
    id: str
    primitive: jex.Primitive
    op: Callable
    operands: Callable
    safe: Mapping[int, float]
    cond: Callable
    xs: Sequence[float] | Mapping[str, Sequence[float]]
    outer: Callable | None = None
    plain_finite: frozenset = frozenset()

    def inputs(self, dtype) -> jax.Array:
        xs = self.xs
        if isinstance(xs, Mapping):
            xs = xs.get(jnp.dtype(dtype).name, xs["default"])
        return jnp.asarray(xs, dtype)

    def _body(self, x, ops):
        y = self.op(*ops)
        return y if self.outer is None else self.outer(x, y)

    def f(self, x):
        return jnp.sum(jnp.where(self.cond(x), self._body(x, self.operands(x)), 0.))

    def twin(self, x):
        """The hand-written double where, with the table's safe values."""
        c = self.cond(x)
        ops = [jnp.where(c, o, self.safe[i]) if i in self.safe else o
               for i, o in enumerate(self.operands(x))]
        return jnp.sum(jnp.where(c, self._body(x, ops), 0.))


def _unary(id, prim, op, safe, cond, xs, **kw):
    return Case(id, prim, op, lambda x: (x,), {0: safe}, cond, xs, **kw)


_pos = lambda x: x > 0
_nonzero = lambda x: x != 0
_unit = lambda x: jnp.abs(x) < 1
_small = lambda x: jnp.abs(x) < 10

# Overflow inputs: just past each dtype's threshold, and 1e4 (past every threshold).
_EXP_BIG = {"float16": [1., -2., 12., 1e4], "float64": [1., -2., 1000., 1e4],
            "default": [1., -2., 100., 1e4]}
_EXP2_BIG = {"float16": [1., -2., 17., 1e4], "float64": [1., -2., 1100., 1e4],
             "default": [1., -2., 130., 1e4]}
_HYP_BIG = {"float16": [1., -2., 12., -12., 1e4, -1e4],
            "float64": [1., -2., 1000., -1000., 1e4, -1e4],
            "default": [1., -2., 100., -100., 1e4, -1e4]}

CASES: list[Case] = [
    _unary("sqrt", P.sqrt_p, lax.sqrt, 1.0, _pos, [4., 0.25, -1., 0.]),
    _unary("rsqrt", P.rsqrt_p, lax.rsqrt, 1.0, _pos, [4., 0.25, -1., 0.]),
    # cbrt is defined for x < 0 (its derivative there is finite); the singular lane is 0
    _unary("cbrt", P.cbrt_p, lax.cbrt, 1.0, _pos, [8., 0.125, 0., -1.]),
    _unary("log", P.log_p, lax.log, 1.0, _pos, [2., 0.5, 0., -1.]),
    _unary("log1p", P.log1p_p, lax.log1p, 0.0, lambda x: x > -1, [1., -0.5, -1., -2.]),
    Case("div", P.div_p, lax.div, lambda x: (x + 1, x), {1: 1.0}, _nonzero, [2., -0.5, 0.]),
    Case("rem", P.rem_p, lax.rem, lambda x: (x + 3, x), {1: 1.0}, _nonzero, [2., -1.5, 0.]),
    Case("pow", P.pow_p, lax.pow, lambda x: (x, jnp.full_like(x, 0.5)), {0: 1.0}, _pos,
         [4., 0.25, 0., -1.]),
    _unary("integer_pow", P.integer_pow_p, lambda x: lax.integer_pow(x, -2), 1.0, _nonzero,
           [2., -0.5, 0.]),
    _unary("acos", P.acos_p, lax.acos, 0.0, _unit, [0.5, -0.5, 2., -2., 1.]),
    _unary("asin", P.asin_p, lax.asin, 0.0, _unit, [0.5, -0.5, 2., -2., 1.]),
    _unary("atanh", P.atanh_p, lax.atanh, 0.0, _unit, [0.5, -0.5, 1., -1., 2.]),
    _unary("erf_inv", P.erf_inv_p, lax.erf_inv, 0.0, _unit, [0.5, -0.5, 1., -1.]),
    _unary("acosh", P.acosh_p, lax.acosh, 2.0, lambda x: x > 1, [2., 1.5, 0.5, 1.]),
    Case("atan2", P.atan2_p, lax.atan2, lambda x: (x, x), {0: 1.0, 1: 1.0}, _nonzero,
         [1., -2., 0.]),
    _unary("exp", P.exp_p, lax.exp, 0.0, _small, _EXP_BIG),
    _unary("exp2", P.exp2_p, lax.exp2, 0.0, _small, _EXP2_BIG),
    _unary("expm1", P.expm1_p, lax.expm1, 0.0, _small, _EXP_BIG),
    _unary("sinh", P.sinh_p, lax.sinh, 0.0, _small, _HYP_BIG),
    _unary("cosh", P.cosh_p, lax.cosh, 0.0, _small, _HYP_BIG),
    # tan at the dtype's nearest value to pi/2 (about 2e3 in float16/bfloat16, 2e7 in float32,
    # 1.6e16 in float64): d tan = 1 + tan**2 overflows to inf only in float16. Elsewhere plain
    # JAX's gradient is finite (0 * finite), and nan_safe must equal it.
    _unary("tan", P.tan_p, lax.tan, 0.0, lambda x: jnp.abs(x) < 1.2, [0.5, -1., math.pi / 2],
           plain_finite=frozenset({"bfloat16", "float32", "float64"})),
    _unary("lgamma", P.lgamma_p, lax.lgamma, 1.0, _pos, [2.5, 0.5, 0., -1.]),
    _unary("digamma", P.digamma_p, lax.digamma, 1.0, _pos, [2.5, 0.5, 0., -1.]),
    Case("polygamma", P.polygamma_p, lax.polygamma, lambda x: (jnp.full_like(x, 1.), x),
         {1: 1.0}, _pos, [2.5, 0.5, 0., -1.]),
    Case("igamma-a", P.igamma_p, lax.igamma, lambda x: (x, jnp.full_like(x, 1.)),
         {0: 1.0, 1: 1.0}, _pos, [0.5, 2., 0., -1.]),
    Case("igamma-x", P.igamma_p, lax.igamma, lambda x: (jnp.full_like(x, 2.), x),
         {0: 1.0, 1: 1.0}, _pos, [0.5, 3., -1., -2.]),
    Case("igammac-a", P.igammac_p, lax.igammac, lambda x: (x, jnp.full_like(x, 1.)),
         {0: 1.0, 1: 1.0}, _pos, [0.5, 2., 0., -1.]),
    Case("igammac-x", P.igammac_p, lax.igammac, lambda x: (jnp.full_like(x, 2.), x),
         {0: 1.0, 1: 1.0}, _pos, [0.5, 3., -1., -2.]),
    # igamma_grad_a and zeta have no JAX derivative: their operands are stop_gradient-ed and the
    # gradient flows through `x * op(...)`.
    Case("igamma_grad_a", P.igamma_grad_a_p, lax.igamma_grad_a,
         lambda x: (sg(x), jnp.full_like(x, 1.)), {0: 1.0, 1: 1.0}, _pos, [0.5, 2., 0., -1.],
         outer=lambda x, y: x * y),
    Case("zeta", P.zeta_p, lax.zeta, lambda x: (jnp.full_like(x, 2.), sg(x)), {0: 2.0, 1: 1.0},
         _pos, [0.5, 3., 0., -1.], outer=lambda x, y: x * y),
    Case("regularized_incomplete_beta", P.regularized_incomplete_beta_p, lax.betainc,
         lambda x: (jnp.full_like(x, 0.5), jnp.full_like(x, 0.5), x), {0: 1.0, 1: 1.0, 2: 0.5},
         lambda x: (x > 0) & (x < 1), [0.25, 0.75, 0., 1., -0.5, 1.5]),
    # a gamma sample per lane of its shape, each from its own key (operand 0): a shape of 0 or
    # below samples NaN (or 0), with a NaN derivative
    Case("random_gamma", P.random_gamma_p,
         lambda key, a: jax.random.gamma(key, a, dtype=a.dtype),
         lambda x: (jax.random.PRNGKey(0), x), {1: 1.0}, _pos, [2.5, 0.5, 0., -1.]),
    # complex abs at 0: JAX's abs JVP already replaces |z| = 0 by 1 in z / |z|, so plain JAX's
    # gradient is finite in every dtype, and nan_safe must equal it.
    Case("abs-complex", P.abs_p, lax.abs, lambda x: (_complex(x),), {0: 1.0}, _nonzero,
         [3., -0.5, 0.], plain_finite=frozenset({"float16", "bfloat16", "float32", "float64"})),
]
CASE_IDS = [c.id for c in CASES]
BY_ID = {c.id: c for c in CASES}

# Second order: d/dx_i of sum(grad f), i.e. the diagonal of the Hessian (f is elementwise).
SECOND_ORDER = [BY_ID[i] for i in ("sqrt", "log", "div", "pow")]

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
dtype_id = lambda d: jnp.dtype(d).name


def rtol(dtype) -> float:
    return 8 * float(jnp.finfo(dtype).eps)


# --------------------------------------------------------------------------- the checks

@functools.cache
def _nan_safe(case_id: str):
    return nan_safe(BY_ID[case_id].f)


@functools.cache
def _nan_safe_grad(case_id: str):
    """`jax.grad` of the nan_safe function, compiled once per case (eager grad compiles the
    linearized program and its transpose apart; the eager form is tested in test_composition)."""
    return jax.jit(jax.grad(_nan_safe(case_id)))


@functools.cache
def _plain(case_id: str, dtype_name: str):
    """Plain JAX's forward and gradient, or the error JAX raises for this dtype."""
    case = BY_ID[case_id]
    x = case.inputs(dtype_name)
    try:
        return jax.jit(case.f)(x), jax.jit(jax.grad(case.f))(x)
    except (TypeError, ValueError, NotImplementedError, jax.errors.JaxRuntimeError) as e:
        return e


def plain_or_skip(case: Case, dtype):
    """(forward, gradient) of plain JAX; skip where JAX does not support the op in `dtype`."""
    out = _plain(case.id, dtype_id(dtype))
    if isinstance(out, Exception):
        pytest.skip(f"JAX does not support {case.id} in {dtype_id(dtype)}: "
                    f"{type(out).__name__}: {str(out).splitlines()[0]}")
    return out


def check_plain_gradient_is_broken(case: Case, dtype):
    """(a): the untaken bad lanes make plain JAX's gradient non-finite."""
    _, g_plain = plain_or_skip(case, dtype)
    if dtype_id(dtype) in case.plain_finite:
        assert_finite(g_plain)
        g_safe = _nan_safe_grad(case.id)(case.inputs(dtype))
        assert_close(g_safe, g_plain, rtol=rtol(dtype))
    else:  # finite in the taken lanes, NaN/inf in some untaken lane
        finite = np.isfinite(np.asarray(g_plain, np.float64))
        taken = np.asarray(case.cond(case.inputs(dtype)))
        assert np.all(finite[taken]) and not np.all(finite[~taken]), g_plain


def check_gradient_matches_twin(case: Case, dtype):
    """(b): nan_safe's gradient is finite and equals the double-where twin's."""
    plain_or_skip(case, dtype)
    x = case.inputs(dtype)
    g_twin = jax.jit(jax.grad(case.twin))(x)
    assert_finite(g_twin)  # the twin itself is right
    g_safe = _nan_safe_grad(case.id)(x)
    assert g_safe.dtype == x.dtype
    assert_finite(g_safe)
    assert_close(g_safe, g_twin, rtol=rtol(dtype), atol=rtol(dtype))


def check_forward_is_bitwise(case: Case, dtype):
    """(c): nan_safe changes no forward value."""
    y_plain, _ = plain_or_skip(case, dtype)
    assert_bitwise(_nan_safe(case.id)(case.inputs(dtype)), y_plain)


def _second(f):
    return jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(f)(x))))


def check_second_order_matches_twin(case: Case, dtype):
    plain_or_skip(case, dtype)
    x = case.inputs(dtype)
    h_twin = _second(case.twin)(x)
    assert_finite(h_twin)
    h_safe = _second(_nan_safe(case.id))(x)
    assert_finite(h_safe)
    assert_close(h_safe, h_twin, rtol=rtol(dtype), atol=rtol(dtype))


def check_case_uses_its_primitive(case: Case, dtype):
    """The case exercises the primitive it is named after, with the table's safe values."""
    def prims(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive
            for sub in jex.jaxprs_in_params(eqn.params):
                yield from prims(sub)
    jaxpr = jax.make_jaxpr(case.f)(case.inputs(dtype)).jaxpr
    assert case.primitive in set(prims(jaxpr))
    assert dict(guard_table()[case.primitive].safe) == dict(case.safe)


# --------------------------------------------------------------------------- the tests

cases = pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)


def test_every_primitive_of_the_guard_table_has_a_case():
    assert set(guard_table()) <= {c.primitive for c in CASES}


@cases
def test_case_uses_its_primitive_with_the_table_safe_values(case):
    check_case_uses_its_primitive(case, jnp.float32)


@cases
@dtypes
def test_untaken_bad_lanes_make_the_plain_jax_gradient_non_finite(case, dtype):
    check_plain_gradient_is_broken(case, dtype)


@cases
@dtypes
def test_nan_safe_gradient_is_finite_and_equals_the_double_where_twin(case, dtype):
    check_gradient_matches_twin(case, dtype)


@cases
@dtypes
def test_nan_safe_forward_is_bitwise_equal_to_jit(case, dtype):
    check_forward_is_bitwise(case, dtype)


@pytest.mark.parametrize("case", SECOND_ORDER, ids=[c.id for c in SECOND_ORDER])
@dtypes
def test_nan_safe_second_derivative_is_finite_and_equals_the_double_where_twin(case, dtype):
    check_second_order_matches_twin(case, dtype)


def test_sqrt_untaken_negative_and_zero_lanes_have_zero_gradient():
    f = lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.))
    g = jax.grad(nan_safe(f))(jnp.asarray([4., -1., 0.], jnp.float32))
    assert_bitwise(g, jnp.asarray([0.25, 0., 0.], jnp.float32))


# --------------------------------------------------------------------------- register_guard

@pytest.mark.parametrize("not_a_primitive", ["sqrt", jnp.sqrt, lax.sqrt, None, 0],
                         ids=["str", "jnp-function", "lax-function", "None", "int"])
def test_register_guard_rejects_a_non_primitive_with_a_type_error_naming_primitive(
        not_a_primitive):
    before = guard_table()
    with pytest.raises(TypeError, match="primitive"):
        jaxsafe.register_guard(not_a_primitive, {0: 1.0})
    assert guard_table() == before


@pytest.mark.parametrize("safe", [float("nan"), float("inf"), -float("inf"), np.float32("nan"),
                                  {0: float("nan")}, {0: 1.0, 1: float("inf")}],
                         ids=["nan", "inf", "-inf", "np.float32-nan", "dict-nan",
                              "dict-second-operand-inf"])
def test_register_guard_rejects_a_non_finite_safe_value_with_a_value_error(safe):
    prim = jex.Primitive("jaxsafe_test_register_guard")  # a fresh one: the table stays clean
    try:
        with pytest.raises(ValueError, match="finite"):
            jaxsafe.register_guard(prim, safe)
        assert prim not in RULES
    finally:
        RULES.pop(prim, None)



@pytest.mark.parametrize(("safe", "applies", "match"), [
    ({0: "1.0"}, None, "`safe` value '1.0'.*real number"),
    ({0: 1j}, None, "`safe` value 1j.*real number"),
    ({0: complex(1.0, float("nan"))}, None, "real number"),
    ({0: True}, None, "real number"),
    ({0: np.ones(2)}, None, "real number"),
    ({True: 1.0}, None, "operand index True"),
    ({0: 1.0}, 3, "`applies` must be a callable"),
], ids=["string", "complex", "complex-nan", "bool", "array", "bool-index", "applies-not-callable"])
def test_register_guard_rejects_what_is_not_a_guard_with_a_type_error_naming_it(safe, applies,
                                                                                 match):
    prim = jex.Primitive("jaxsafe_test_register_guard")  # a fresh one: the table stays clean
    try:
        with pytest.raises(TypeError, match=match):
            jaxsafe.register_guard(prim, safe, applies=applies)
        assert prim not in RULES
    finally:
        RULES.pop(prim, None)


def test_a_guard_naming_an_operand_its_primitive_lacks_raises_at_the_call_naming_it(
        monkeypatch):
    """sqrt has one operand: a guard of operand 5 is the user's to fix, not a failure of the
    analysis (which would run the original program with a warning)."""
    monkeypatch.delenv("JAXSAFE_STRICT", raising=False)  # as users run it
    before = RULES[lax.sqrt_p]
    try:
        jaxsafe.register_guard(lax.sqrt_p, {5: 1.0})
        f = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.)
        with pytest.raises(ValueError, match=r"register_guard\(sqrt\).*operand\(s\) \[5\]"):
            jax.grad(lambda x: jaxsafe.nan_safe(f)(x).sum())(jnp.array([0., 1.]))
    finally:
        RULES[lax.sqrt_p] = before
        _guards.GENERATION += 1


def test_a_safe_value_outside_the_operand_s_dtype_raises_at_the_call_naming_it(monkeypatch):
    """1e300 is finite as a Python float and inf in float32: the guard would put inf in the
    dropped lanes."""
    monkeypatch.delenv("JAXSAFE_STRICT", raising=False)
    before = RULES[lax.tan_p]
    try:
        jaxsafe.register_guard(lax.tan_p, {np.int64(0): 1e300})  # a NumPy index is an index
        f = lambda x: jnp.where(x < 1., jnp.tan(x), 0.)
        with pytest.raises(ValueError, match=r"1e\+300 of operand 0 is not finite in .*float32"):
            jax.grad(lambda x: jaxsafe.nan_safe(f)(x).sum())(jnp.array([0., 2.]))
    finally:
        RULES[lax.tan_p] = before
        _guards.GENERATION += 1


def test_register_guard_rejects_a_safe_mapping_that_names_no_operand():
    prim = jex.Primitive("jaxsafe_test_register_guard")
    try:
        with pytest.raises(ValueError, match="`safe` names no operand"):
            jaxsafe.register_guard(prim, {})
        assert prim not in RULES
    finally:
        RULES.pop(prim, None)
