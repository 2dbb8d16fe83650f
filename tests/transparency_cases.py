"""The case table of test_transparency.py: plain JAX API functions, and unary ops behind a where.

Every case is a function of float arrays whose inputs are built by its `kind` from the edge
values of a dtype, all of them in one array, so that each (function, dtype) pair is one compile
per check (and test_transparency runs all the cases of one kind and dtype as one program):

- "unary": the 16 edge values (0, -0, +-0.5, +-1, 2.5, -3, +-inf, NaN, +-max, tiny, +-smallest
  subnormal), shape (16,);
- "binary": the 16 x 16 grid of edge-value pairs, two arrays of shape (256,);
- "rows": the 16 edge values as a (4, 4) array; rows 0 and 1 are ordinary numbers, row 2 holds
  inf, -inf, NaN and max, row 3 -max, tiny and the subnormals (reductions, cumulative ops, sort,
  indexing, ... act along the last axis);
- "matrix": a stack of two well-conditioned 4 x 4 matrices and the edge (4, 4) matrix, (3, 4, 4);
  "spd": the same with two symmetric positive definite matrices; "matrix2": two such stacks.

`dtypes` lists where JAX supports the function (an exclusion carries a comment); `diff=False`
marks float-valued functions JAX cannot differentiate. Integer- and bool-valued functions are
found from their output dtype and get no gradient check.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import jax.scipy.special as sp
import jax.scipy.stats as stats
import ml_dtypes
import numpy as np
from jax import lax, nn

ALL = ("float16", "bfloat16", "float32", "float64")
# LAPACK-backed linear algebra (lu, cholesky, qr, eigh, svd) has no float16 or bfloat16 kernel
# on CPU: JAX raises at lowering (test_transparency checks that it still does).
NO_HALF = ("float32", "float64")
# jax.scipy.special.ndtr, ndtri and log_ndtr accept float32 and float64 only (TypeError otherwise).
NDTR = NO_HALF
# jnp.interp raises "data type bfloat16 not inexact" (it asks NumPy about the dtype) with
# ml_dtypes before 0.7, whose bfloat16 NumPy does not count as inexact; 0.7 made it one.
NO_BF16 = ("float16", "float32", "float64")
INTERP = ALL if tuple(map(int, ml_dtypes.__version__.split(".")[:2])) >= (0, 7) else NO_BF16


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    fn: Callable
    kind: str = "unary"
    dtypes: tuple = ALL
    diff: bool = True


def edge_values(dtype) -> np.ndarray:
    fi = jnp.finfo(dtype)
    vals = [0., -0., 0.5, -0.5, 1., -1., 2.5, -3.,
            math.inf, -math.inf, math.nan, float(fi.max),
            -float(fi.max), float(fi.tiny), float(fi.smallest_subnormal),
            -float(fi.smallest_subnormal)]
    out = np.asarray(vals, dtype=jnp.dtype(dtype))
    assert np.signbit(out[1]) and out[14] > 0 and out[13] > out[14]
    return out


_A = [[4., 1., 0., .5], [1., 5., .5, 0.], [0., .5, 3., 1.], [.5, 0., 1., 6.]]       # SPD
_B = [[2., -1., .5, 0.], [.25, 3., -.5, 1.], [0., 1., -4., .5], [1., 0., .5, 2.5]]  # diag. dom.
_C = [[3., .5, -1., 0.], [.5, 4., 0., .25], [-1., 0., 2., .5], [0., .25, .5, 5.]]   # SPD


def inputs(kind: str, dtype) -> tuple[jax.Array, ...]:
    dt = jnp.dtype(dtype)
    e = edge_values(dt)
    if kind == "unary":
        return (jnp.asarray(e),)
    if kind == "binary":
        return jnp.asarray(np.repeat(e, 16)), jnp.asarray(np.tile(e, 16))
    if kind == "rows":
        return (jnp.asarray(e.reshape(4, 4)),)
    if kind == "matrix":
        return (jnp.asarray(np.stack([np.asarray(_A, dt), np.asarray(_B, dt), e.reshape(4, 4)])),)
    if kind == "spd":
        return (jnp.asarray(np.stack([np.asarray(_A, dt), np.asarray(_C, dt), e.reshape(4, 4)])),)
    if kind == "matrix2":
        m = np.stack([np.asarray(_A, dt), np.asarray(_B, dt), e.reshape(4, 4)])
        n = np.stack([np.asarray(_B, dt), e[::-1].reshape(4, 4), np.asarray(_C, dt)])
        return jnp.asarray(m), jnp.asarray(n)
    raise ValueError(kind)


def batched(args: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """A batch of two for vmap: the inputs and the inputs flipped along every axis."""
    return tuple(jnp.stack([a, jnp.flip(a)]) for a in args)


# --------------------------------------------------------------------------- constants

_I = jnp.array([3, 0, 2, 2, -1])                        # gather indices (negative included)
_SORTED = np.array([-np.inf, -3., -0.5, 0., 0.5, 1., 2.5, np.inf])


def _const(values, like):
    return jnp.asarray(values, like.dtype)


def _u(id, fn, **kw):
    return Case(id, fn, "unary", **kw)


def _b(id, fn, **kw):
    return Case(id, fn, "binary", **kw)


def _r(id, fn, **kw):
    return Case(id, fn, "rows", **kw)


def _m(id, fn, kind="matrix", **kw):
    return Case(id, fn, kind, dtypes=kw.pop("dtypes", NO_HALF), **kw)


CASES: list[Case] = [
    # ------------------------------------------------------------------ jnp, elementwise unary
    _u("jnp.abs", jnp.abs),
    _u("jnp.negative", jnp.negative),
    _u("jnp.sign", jnp.sign),
    _u("jnp.signbit", jnp.signbit),
    _u("jnp.floor", jnp.floor),
    _u("jnp.ceil", jnp.ceil),
    _u("jnp.round", jnp.round),
    _u("jnp.sqrt", jnp.sqrt),
    _u("jnp.cbrt", jnp.cbrt),
    _u("jnp.square", jnp.square),
    _u("jnp.reciprocal", jnp.reciprocal),
    _u("jnp.exp", jnp.exp),
    _u("jnp.exp2", jnp.exp2),
    _u("jnp.expm1", jnp.expm1),
    _u("jnp.log", jnp.log),
    _u("jnp.log2", jnp.log2),
    _u("jnp.log10", jnp.log10),
    _u("jnp.log1p", jnp.log1p),
    _u("jnp.sin", jnp.sin),
    _u("jnp.cos", jnp.cos),
    _u("jnp.tan", jnp.tan),
    _u("jnp.arcsin", jnp.arcsin),
    _u("jnp.arccos", jnp.arccos),
    _u("jnp.arctan", jnp.arctan),
    _u("jnp.arcsinh", jnp.arcsinh),
    _u("jnp.sinh", jnp.sinh),
    _u("jnp.cosh", jnp.cosh),
    _u("jnp.tanh", jnp.tanh),
    _u("jnp.arccosh", jnp.arccosh),
    _u("jnp.arctanh", jnp.arctanh),
    _u("jnp.sinc", jnp.sinc),
    _u("jnp.isnan", jnp.isnan),
    _u("jnp.isinf", jnp.isinf),
    _u("jnp.isfinite", jnp.isfinite),
    _u("jnp.nan_to_num", jnp.nan_to_num),
    _u("jnp.frexp", jnp.frexp),
    _u("jnp.modf", jnp.modf),
    _u("jnp.clip", lambda x: jnp.clip(x, -1., 2.)),
    _u("jnp.piecewise", lambda x: jnp.piecewise(x, [x < 0, x > 1], [jnp.sin, jnp.sqrt, 0.5])),
    _u("jnp.select", lambda x: jnp.select([x < -1, x > 1], [x * 2, jnp.log(x)], x)),
    # ------------------------------------------------------------------ lax, elementwise unary
    _u("lax.rsqrt", lax.rsqrt),
    _u("lax.logistic", lax.logistic),
    _u("lax.erf_inv", lax.erf_inv),
    _u("lax.integer_pow-neg2", lambda x: lax.integer_pow(x, -2)),
    _u("lax.round-away", lax.round),
    _u("lax.reduce_precision", lambda x: lax.reduce_precision(x, exponent_bits=5,
                                                              mantissa_bits=2)),
    _u("lax.clamp", lambda x: lax.clamp(_const(-1., x), x, _const(2., x))),
    # ------------------------------------------------------------------ jax.nn, elementwise
    _u("nn.relu", nn.relu),
    _u("nn.relu6", nn.relu6),
    _u("nn.sigmoid", nn.sigmoid),
    _u("nn.log_sigmoid", nn.log_sigmoid),
    _u("nn.softplus", nn.softplus),
    _u("nn.silu", nn.silu),
    _u("nn.gelu", nn.gelu),
    _u("nn.elu", nn.elu),
    _u("nn.hard_tanh", nn.hard_tanh),
    _u("nn.mish", nn.mish),
    # ------------------------------------------------------------------ jax.scipy.special, unary
    _u("sp.erf", sp.erf),
    _u("sp.erfc", sp.erfc),
    _u("sp.erfinv", sp.erfinv),
    _u("sp.gammaln", sp.gammaln),
    _u("sp.digamma", sp.digamma),
    _u("sp.logit", sp.logit),
    _u("sp.entr", sp.entr),
    _u("sp.ndtri", sp.ndtri, dtypes=NDTR),
    _u("sp.erfcx", sp.erfcx),
    _u("sp.dawsn", sp.dawsn),
    _u("sp.log_ndtr", sp.log_ndtr, dtypes=NDTR),
    _u("sp.i0e", sp.i0e),
    _u("sp.i1e", sp.i1e),
    # ------------------------------------------------------------------ binary, on the grid
    _b("jnp.add", jnp.add),
    _b("jnp.subtract", jnp.subtract),
    _b("jnp.multiply", jnp.multiply),
    _b("jnp.divide", jnp.divide),
    _b("jnp.floor_divide", jnp.floor_divide),
    _b("jnp.remainder", jnp.remainder),
    _b("jnp.fmod", jnp.fmod),
    _b("jnp.power", jnp.power),
    _b("jnp.maximum", jnp.maximum),
    _b("jnp.minimum", jnp.minimum),
    _b("jnp.fmax", jnp.fmax),
    _b("jnp.arctan2", jnp.arctan2),
    _b("jnp.hypot", jnp.hypot),
    _b("jnp.logaddexp", jnp.logaddexp),
    _b("jnp.copysign", jnp.copysign),
    _b("jnp.nextafter", jnp.nextafter, diff=False),
    _b("jnp.heaviside", jnp.heaviside),
    _b("jnp.greater", jnp.greater),
    _b("jnp.equal", jnp.equal),
    _b("jnp.isclose", jnp.isclose),
    _b("jnp.where", lambda x, y: jnp.where(x > y, x, y)),
    _b("jnp.ldexp", lambda x, y: jnp.ldexp(x, jnp.arange(256) % 7 - 3)),
    _b("lax.select_n", lambda x, y: lax.select_n(x > 0, x, y)),
    _b("sp.xlogy", sp.xlogy),
    _b("sp.xlog1py", sp.xlog1py),
    _b("sp.rel_entr", sp.rel_entr),
    _b("sp.kl_div", sp.kl_div),
    # ------------------------------------------------------------------ reductions (last axis)
    _r("jnp.sum", lambda x: jnp.sum(x, -1)),
    _r("jnp.prod", lambda x: jnp.prod(x, -1)),
    _r("jnp.max", lambda x: jnp.max(x, -1)),
    _r("jnp.min", lambda x: jnp.min(x, -1)),
    _r("jnp.mean", lambda x: jnp.mean(x, -1)),
    _r("jnp.var", lambda x: jnp.var(x, -1)),
    _r("jnp.std", lambda x: jnp.std(x, -1)),
    _r("jnp.nansum", lambda x: jnp.nansum(x, -1)),
    _r("jnp.nanmax", lambda x: jnp.nanmax(x, -1)),
    _r("jnp.nanmean", lambda x: jnp.nanmean(x, -1)),
    _r("jnp.median", lambda x: jnp.median(x, -1)),
    _r("jnp.percentile", lambda x: jnp.percentile(x, 30., axis=-1)),
    _r("jnp.ptp", lambda x: jnp.ptp(x, -1)),
    _r("jnp.argmax", lambda x: jnp.argmax(x, -1)),
    _r("jnp.argmin", lambda x: jnp.argmin(x, -1)),
    _r("jnp.all", lambda x: jnp.all(x, -1)),
    _r("jnp.any", lambda x: jnp.any(x, -1)),
    _r("jnp.count_nonzero", lambda x: jnp.count_nonzero(x, -1)),
    _r("jnp.linalg.vector_norm", lambda x: jnp.linalg.vector_norm(x, axis=-1)),
    _r("jnp.linalg.norm-rows-inf", lambda x: jnp.linalg.norm(x, ord=jnp.inf, axis=-1)),
    _r("sp.logsumexp", lambda x: sp.logsumexp(x, -1)),
    _r("nn.softmax", lambda x: nn.softmax(x, -1)),
    _r("nn.log_softmax", lambda x: nn.log_softmax(x, -1)),
    _r("nn.softmax-where", lambda x: nn.softmax(x, -1, where=x > -1.)),
    _r("nn.standardize", lambda x: nn.standardize(x, -1)),
    # ------------------------------------------------------------------ cumulative
    _r("jnp.cumsum", lambda x: jnp.cumsum(x, -1)),
    _r("jnp.cumprod", lambda x: jnp.cumprod(x, -1)),
    _r("jnp.nancumsum", lambda x: jnp.nancumsum(x, -1)),
    _r("jnp.cumulative_sum", lambda x: jnp.cumulative_sum(x, axis=-1, include_initial=True)),
    _r("lax.cummax", lambda x: lax.cummax(x, 1)),
    _r("lax.cumlogsumexp", lambda x: lax.cumlogsumexp(x, 1)),
    _r("jnp.diff", lambda x: jnp.diff(x, axis=-1)),
    _r("jnp.trapezoid", lambda x: jnp.trapezoid(x, axis=-1)),
    # ------------------------------------------------------------------ sort and search
    _r("jnp.sort", lambda x: jnp.sort(x, -1)),
    _r("jnp.argsort", lambda x: jnp.argsort(x, -1)),
    _r("jnp.partition", lambda x: jnp.partition(x, 1, -1)),
    _r("lax.top_k", lambda x: lax.top_k(x, 2)),
    _r("jnp.searchsorted", lambda x: jnp.searchsorted(_const(_SORTED, x), x)),
    # ------------------------------------------------------------------ indexing, slicing
    _r("jnp.take", lambda x: jnp.take(x, _I, axis=-1, mode="clip")),
    _r("jnp.take_along_axis",
       lambda x: jnp.take_along_axis(x, jnp.array([[1, 0], [3, 3], [2, 0], [0, 1]]), -1)),
    _r("x[index_arrays]", lambda x: x[jnp.array([2, 0, -1]), jnp.array([1, 3, 2])]),
    _r("x[slices]", lambda x: x[1:, ::-2]),
    _r("lax.dynamic_slice", lambda x: lax.dynamic_slice(x, (1, 2), (3, 2))),
    _r("lax.dynamic_update_slice",
       lambda x: lax.dynamic_update_slice(x, x[:2, :2] * 2, (1, 1))),
    _r("x.at[].set", lambda x: x.at[1:3, 2].set(x[0, :2])),
    _r("x.at[].add", lambda x: x.at[:, jnp.array([0, 0, 2])].add(x[:, 1:])),
    _r("x.at[].max", lambda x: x.at[:, 0].max(x[:, 3])),
    _r("jnp.roll", lambda x: jnp.roll(x, 1, -1)),
    _r("jnp.concatenate", lambda x: jnp.concatenate([x, x[::-1] * 2], -1)),
    _r("jnp.stack", lambda x: jnp.stack([x, -x])),
    _r("jnp.pad-constant", lambda x: jnp.pad(x, ((1, 0), (0, 2)), constant_values=-1.)),
    _r("jnp.pad-reflect", lambda x: jnp.pad(x, 2, mode="reflect")),
    _r("lax.pad-negative", lambda x: lax.pad(x, _const(0., x), ((-1, 1, 1), (1, -2, 0)))),
    _r("jnp.transpose", jnp.transpose),
    _r("jnp.interp", lambda x: jnp.interp(x, _const([-1., 0., 1., 2.], x),
                                          _const([0., 1., -1., 3.], x)), dtypes=INTERP),
    _r("jnp.convolve", lambda x: jnp.convolve(x[1], _const([1., -.5, .25], x))),
    _r("lax.reduce_window-max",
       lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID")),
    _r("lax.conv", lambda x: lax.conv(x[None, None], _const([[[[1., -1.], [.5, 2.]]]], x),
                                     (1, 1), "SAME")),
    # ------------------------------------------------------------------ products
    _r("jnp.outer", lambda x: jnp.outer(x[0], x[2])),
    _r("jnp.dot", lambda x: jnp.dot(x, x[1])),
    _r("lax.dot_general", lambda x: lax.dot_general(x, x, (((1,), (0,)), ((), ())))),
    _m("jnp.matmul", jnp.matmul, "matrix2", dtypes=ALL),
    _m("jnp.einsum", lambda a, b: jnp.einsum("bij,bjk->bik", a, b), "matrix2", dtypes=ALL),
    _m("jnp.linalg.multi_dot", lambda a, b: jnp.linalg.multi_dot([a[0], b[1], a[2]]), "matrix2",
       dtypes=ALL),
    # ------------------------------------------------------------------ linear algebra
    _m("jnp.linalg.det", jnp.linalg.det),
    _m("jnp.linalg.slogdet", jnp.linalg.slogdet),
    _m("jnp.linalg.inv", jnp.linalg.inv),
    _m("jnp.linalg.solve", lambda a, b: jnp.linalg.solve(a, b), "matrix2"),
    _m("jnp.linalg.cholesky", jnp.linalg.cholesky, "spd"),
    _m("jnp.linalg.qr", jnp.linalg.qr),
    _m("jnp.linalg.eigh", jnp.linalg.eigh, "spd"),
    _m("jnp.linalg.svdvals", jnp.linalg.svdvals),
    _m("jnp.linalg.norm-fro", lambda a: jnp.linalg.norm(a, axis=(-2, -1)), dtypes=ALL),
    _m("jnp.linalg.matrix_power", lambda a: jnp.linalg.matrix_power(a, 3), dtypes=ALL),
    _m("jnp.linalg.pinv", jnp.linalg.pinv),
    _m("jsl.solve_triangular", lambda a, b: jsl.solve_triangular(a, b, lower=True), "matrix2",
       dtypes=ALL),
]


# ------------------------------------------------------------------------- unary ops behind a where

def _positive(x):
    return x > 0


@dataclasses.dataclass(frozen=True)
class Wrapped:
    """`jnp.where(live(x), op(x), x)`, `live` is `x > 0` unless given (a distribution's
    support); `safe` is a point where `live` holds, for the hand-written twin. `deriv`, where
    given, is op's derivative written out, for the lanes where JAX's own gradient of op is not
    finite because op selects inside (JAX's where-bug in the function itself, which the
    hand-written twin keeps and nan_safe fixes)."""
    id: str
    op: Callable
    safe: float = 1.0
    dtypes: tuple = ALL
    live: Callable = _positive
    deriv: Callable | None = None

    def f(self, x):
        return jnp.where(self.live(x), self.op(x), x)

    def hand(self, x):
        live = self.live(x)
        return jnp.where(live, self.op(jnp.where(live, x, self.safe)), x)


WRAPPED: list[Wrapped] = [
    Wrapped("jnp.negative", jnp.negative),
    Wrapped("jnp.sqrt", jnp.sqrt),
    Wrapped("lax.rsqrt", lax.rsqrt),
    Wrapped("jnp.cbrt", jnp.cbrt),
    Wrapped("jnp.log", jnp.log),
    Wrapped("jnp.log2", jnp.log2),
    Wrapped("jnp.log10", jnp.log10),
    Wrapped("jnp.log1p", jnp.log1p),
    Wrapped("jnp.exp", jnp.exp),
    Wrapped("jnp.exp2", jnp.exp2),
    Wrapped("jnp.expm1", jnp.expm1),
    Wrapped("jnp.sin", jnp.sin),
    Wrapped("jnp.cos", jnp.cos),
    Wrapped("jnp.tan", jnp.tan),
    Wrapped("jnp.arcsin", jnp.arcsin, 0.5),
    Wrapped("jnp.arccos", jnp.arccos, 0.5),
    Wrapped("jnp.arctan", jnp.arctan),
    Wrapped("jnp.sinh", jnp.sinh),
    Wrapped("jnp.cosh", jnp.cosh),
    Wrapped("jnp.tanh", jnp.tanh),
    Wrapped("jnp.arcsinh", jnp.arcsinh),
    Wrapped("jnp.arccosh", jnp.arccosh, 2.0),
    Wrapped("jnp.arctanh", jnp.arctanh, 0.5),
    Wrapped("jnp.reciprocal", jnp.reciprocal),
    Wrapped("lax.integer_pow-neg2", lambda x: lax.integer_pow(x, -2)),
    Wrapped("jnp.power-half", lambda x: x ** 0.5),
    Wrapped("jnp.square", jnp.square),
    Wrapped("jnp.abs", jnp.abs),
    Wrapped("jnp.sign", jnp.sign),
    Wrapped("jnp.floor", jnp.floor),
    Wrapped("jnp.ceil", jnp.ceil),
    Wrapped("jnp.round", jnp.round),
    Wrapped("lax.round-away", lax.round),
    Wrapped("jnp.nan_to_num", jnp.nan_to_num),
    Wrapped("jnp.clip", lambda x: jnp.clip(x, -1., 2.)),
    Wrapped("lax.reduce_precision", lambda x: lax.reduce_precision(x, exponent_bits=5,
                                                               mantissa_bits=2)),
    Wrapped("jnp.sinc", jnp.sinc),
    Wrapped("sp.erf", sp.erf),
    Wrapped("sp.erfc", sp.erfc),
    Wrapped("sp.erfinv", sp.erfinv, 0.5),
    Wrapped("lax.erf_inv", lax.erf_inv, 0.5),
    Wrapped("sp.gammaln", sp.gammaln),
    Wrapped("sp.digamma", sp.digamma),
    Wrapped("sp.logit", sp.logit, 0.5),
    Wrapped("sp.entr", sp.entr),
    Wrapped("sp.i0e", sp.i0e),
    Wrapped("sp.i1e", sp.i1e),
    Wrapped("sp.ndtri", sp.ndtri, 0.5, dtypes=NDTR),
    Wrapped("sp.erfcx", sp.erfcx),
    Wrapped("sp.dawsn", sp.dawsn),
    Wrapped("sp.log_ndtr", sp.log_ndtr, dtypes=NDTR),
    Wrapped("lax.logistic", lax.logistic),
    Wrapped("nn.sigmoid", nn.sigmoid),
    Wrapped("nn.log_sigmoid", nn.log_sigmoid),
    Wrapped("nn.softplus", nn.softplus),
    Wrapped("nn.gelu", nn.gelu),
    Wrapped("nn.relu", nn.relu),
    Wrapped("nn.relu6", nn.relu6),
    Wrapped("nn.silu", nn.silu),
    Wrapped("nn.elu", nn.elu),
    Wrapped("nn.hard_tanh", nn.hard_tanh, 0.5),
    Wrapped("nn.mish", nn.mish),
]


# ------------------------------------------------------------------ jax.scipy.stats behind a where
# Each distribution's functions behind a where on its support (the live side), so that the dropped
# lanes hold the points outside it as well as the edge values (+-inf, NaN, +-max, 0, -0, the
# subnormals): first in the variable, then in a parameter (a scale, a shape, a probability), as a
# model fitting the parameter meets them. float32 and float64 only: the half-precision runs of
# part 2 already cover the primitives these are built from, and a third program per dtype of
# ~100 functions would cost `make test` a minute.


def _between(lo, hi):
    return lambda x: (x > lo) & (x < hi)


_UNIT = _between(0., 1.)
_ANY = _positive  # support is every real: the where drops x <= 0 as a program's own test would


def _s(id, op, live=_ANY, safe=0.5, deriv=None):
    return Wrapped(f"stats.{id}", op, safe, NO_HALF, live, deriv)


STATS: list[Wrapped] = [
    # the variable, over the support. Not gumbel_r/gumbel_l.ppf: plain `jax.grad` of them raises
    # in JAX 0.10.2 (xlogy's JVP multiplies a float0 tangent).
    *(_s(f"norm.{m}", getattr(stats.norm, m))
      for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    _s("norm.ppf", stats.norm.ppf, _UNIT), _s("norm.isf", stats.norm.isf, _UNIT),
    *(_s(f"cauchy.{m}", getattr(stats.cauchy, m))
      for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    _s("cauchy.ppf", stats.cauchy.ppf, _UNIT), _s("cauchy.isf", stats.cauchy.isf, _UNIT),
    *(_s(f"laplace.{m}", getattr(stats.laplace, m)) for m in ("logpdf", "pdf")),
    # selects between exp(x) and exp(-x): at x = +inf or +max the dropped exp overflows and
    # plain JAX's derivative is NaN; the derivative is the density
    _s("laplace.cdf", stats.laplace.cdf, deriv=stats.laplace.pdf),
    *(_s(f"logistic.{m}", getattr(stats.logistic, m)) for m in ("logpdf", "pdf", "cdf", "sf")),
    _s("logistic.ppf", stats.logistic.ppf, _UNIT), _s("logistic.isf", stats.logistic.isf, _UNIT),
    _s("t.logpdf", lambda x: stats.t.logpdf(x, 3.)), _s("t.pdf", lambda x: stats.t.pdf(x, 3.)),
    *(_s(f"gennorm.{m}", lambda x, m=m: getattr(stats.gennorm, m)(x, 1.5))
      for m in ("logpdf", "pdf", "cdf")),
    *(_s(f"gumbel_r.{m}", getattr(stats.gumbel_r, m))
      for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    *(_s(f"gumbel_l.{m}", getattr(stats.gumbel_l, m))
      for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    *(_s(f"expon.{m}", getattr(stats.expon, m))
      for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    _s("expon.ppf", stats.expon.ppf, _UNIT),
    *(_s(f"gamma.{m}", lambda x, m=m: getattr(stats.gamma, m)(x, 2.5))
      for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    *(_s(f"chi2.{m}", lambda x, m=m: getattr(stats.chi2, m)(x, 3.))
      for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    *(_s(f"beta.{m}", lambda x, m=m: getattr(stats.beta, m)(x, 2., 3.), _UNIT)
      for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    *(_s(f"pareto.{m}", lambda x, m=m: getattr(stats.pareto, m)(x, 2.), lambda x: x > 1., 1.5)
      for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    _s("pareto.ppf", lambda q: stats.pareto.ppf(q, 2.), _UNIT),
    *(_s(f"truncnorm.{m}", lambda x, m=m: getattr(stats.truncnorm, m)(x, -1., 2.),
         _between(-1., 2.)) for m in ("logpdf", "pdf", "cdf", "logcdf", "sf", "logsf")),
    *(_s(f"uniform.{m}", getattr(stats.uniform, m), _UNIT) for m in ("logpdf", "pdf", "cdf")),
    _s("uniform.ppf", stats.uniform.ppf, _UNIT),
    _s("vonmises.logpdf", lambda x: stats.vonmises.logpdf(x, 2.), _between(-math.pi, math.pi)),
    _s("wrapcauchy.logpdf", lambda x: stats.wrapcauchy.logpdf(x, 0.5), _between(0., 2 * math.pi),
       1.),
    # a parameter, over its domain (the variable fixed inside the support)
    _s("norm.logpdf-scale", lambda s: stats.norm.logpdf(0.5, 0., s)),
    _s("norm.cdf-scale", lambda s: stats.norm.cdf(0.5, 0., s)),
    _s("expon.logpdf-scale", lambda s: stats.expon.logpdf(1.5, scale=s)),
    _s("gamma.logpdf-a", lambda a: stats.gamma.logpdf(1.5, a)),
    _s("gamma.cdf-a", lambda a: stats.gamma.cdf(1.5, a)),
    _s("beta.logpdf-a", lambda a: stats.beta.logpdf(0.3, a, 2.)),
    _s("t.logpdf-df", lambda df: stats.t.logpdf(0.5, df)),
    _s("chi2.logpdf-df", lambda df: stats.chi2.logpdf(1.5, df)),
    _s("pareto.logpdf-b", lambda b: stats.pareto.logpdf(2., b)),
    _s("gennorm.logpdf-beta", lambda b: stats.gennorm.logpdf(0.5, b)),
    _s("vonmises.logpdf-kappa", lambda k: stats.vonmises.logpdf(0.5, k)),
    _s("poisson.logpmf-mu", lambda mu: stats.poisson.logpmf(3., mu)),
    _s("poisson.pmf-mu", lambda mu: stats.poisson.pmf(3., mu)),
    _s("bernoulli.logpmf-p", lambda p: stats.bernoulli.logpmf(1., p), _UNIT),
    _s("binom.logpmf-p", lambda p: stats.binom.logpmf(3., 10., p), _UNIT),
    _s("geom.logpmf-p", lambda p: stats.geom.logpmf(3., p), _UNIT),
    _s("nbinom.logpmf-p", lambda p: stats.nbinom.logpmf(3., 5., p), _UNIT),
    _s("betabinom.logpmf-a", lambda a: stats.betabinom.logpmf(3., 10., a, 2.)),
]
