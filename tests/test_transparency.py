"""Transparency: `nan_safe` on 150+ plain JAX functions changes no value, fixes `where` gradients.

Part 1, plain API functions (`transparency_cases.CASES`: jax.numpy, jax.lax, jax.nn,
jax.scipy.special; elementwise, binary on a grid of edge-value pairs, reductions, cumulative ops,
sort, gather/slicing, padding, products, linear algebra). Each (function, dtype) pair runs on one
array holding all the edge values of the dtype (0, -0, +-0.5, +-1, 2.5, -3, +-inf, NaN, +-max,
tiny, +-smallest subnormal):

- `nan_safe(f)(x)` is bit for bit `jax.jit(f)(x)`, NaN positions included;
- the gradient of a weighted sum of the float outputs equals the original's: close where the
  original is finite, the same NaN/inf lanes elsewhere. These functions are called without a
  `where` of ours, so nothing of ours is dropped; the functions in `FIXED_BY_INTERNAL_SELECTION`
  select inside JAX's own implementation, and there nan_safe may turn a non-finite lane of the
  original gradient finite (and nothing else);
- `nan_safe(f, jit=False)(x)` is bit for bit eager `f(x)`, NaN payloads apart: a jaxpr evaluated
  equation by equation can give another NaN payload than the eager call, in plain JAX
  (`jax.core.eval_jaxpr` of `jax.make_jaxpr(jnp.log10)` on float16 -0.5 gives 0xFE00, eager
  `jnp.log10` 0xFFFF), so there a NaN matches any NaN in the same position;
- `jax.vmap(nan_safe(f))` is bit for bit `jax.jit(jax.vmap(f))` on a batch of two;
- `nan_safe(fn)` of the API function object itself runs what `nan_safe` of a call to it runs.

Part 2, each unary float op behind `jnp.where(x > 0, op(x), x)` (`transparency_cases.WRAPPED`),
and the jax.scipy.stats functions behind a where on their support (`transparency_cases.STATS`:
the variable, and a parameter such as a scale or a probability, so that the dropped lanes hold
points outside the support): on every lane, the edge values included (+-inf, NaN, +-max, 0, -0,
subnormals), the nan_safe gradient equals the gradient of the hand-written double where (itself
checked to give the dropped side exactly the derivative of the `x` branch); it is finite on the
dropped side and wherever the taken branch's derivative is finite, and not finite where that
derivative is not (real singularities stay); the forward value is bit for bit `jax.jit`'s.

Cost. Compiling is what costs, so the cases of one (check, kind, dtype) run as ONE function
`F(xs) = [f_1(*xs[0]), f_2(*xs[1]), ...]`, each case with its own copy of the inputs (its outputs,
gradient and batch are its own); `nan_safe(F)` against `jax.jit(F)` is the contract for F, read
per case. The programs are built once, before conftest's per-test leak checker switches on (JAX
disables its tracing caches under it, three times slower here; leaks are tested elsewhere). The
eager and vmap checks run each function in one dtype, in turn through the dtypes, so that every
function and every dtype is covered; the other (function, dtype) pairs of those two checks are
marked `slow` (`make fuzz`). If a group fails as a whole (a jaxsafe bug in one of its cases), it
is split in halves until each failing case holds its own error, and the others still pass.

dtypes: without x64 this file runs float16, bfloat16 and float32; with `JAX_ENABLE_X64=1` it runs
float64 only (the others ran in the normal session). `make test` runs the float32 cases
but the stats functions' where checks; conftest marks the others `tables`, for `make
test-tables` (CI runs both).
`test_x64_transparency.py` (the table) and `test_x64_where.py` (the where-wrapped ops) import
the tests, so that two workers share the float64 cases. The eager/vmap rotation runs through
all four dtypes, so each function has those two checks in one session or the other (about a
quarter in the x64 one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import jax.scipy.special as sp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, structure
from jax import lax, nn
from transparency_cases import ALL, CASES, STATS, WRAPPED, batched, inputs

import jaxsafe
from jaxsafe import nan_safe

# A sweep of many library functions and dtypes, each compiled a few times: without
# jax.checking_leaks, which turns JAX's caches off and doubles the time (the other modules check
# for leaks on every test).
pytestmark = pytest.mark.no_leak_check

X64 = bool(jax.config.jax_enable_x64)
DTYPES = ("float64",) if X64 else ("float16", "bfloat16", "float32")

BY_ID = {c.id: c for c in CASES}
WHERE_CASES = WRAPPED + STATS
WBY_ID = {w.id: w for w in WHERE_CASES}
assert len(BY_ID) == len(CASES) and len(WBY_ID) == len(WHERE_CASES), "duplicate case ids"

# JAX's own implementation selects between a NaN-prone computation and something else; nan_safe
# guards the side it drops, so where plain JAX's gradient is NaN because a dropped lane added
# 0 * inf to it, nan_safe's is what the live lanes give: finite, or the inf of a real overflow
# (contract point 2). Everywhere else, and wherever plain JAX gives +-inf, the gradients agree.
FIXED_BY_INTERNAL_SELECTION = {
    "jnp.select": "our own selection: log(x) is dropped where x <= 1",
    "sp.entr": "where(x > 0, -x * log(x), ...): log is dropped at x <= 0",
    "jnp.hypot": "where(x1 == 0, ..., x2 / x1) and where(isinf, inf, ...) drop the division; "
                 "in float16, hypot(0.5, 65504) has the losing side of maximum(|x|, |y|) add "
                 "0 * inf to the overflowing cotangent (NaN), nan_safe leaves the inf alone",
}


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


@functools.cache
def _output_shapes(cid):
    """The outputs of a case (in the last dtype of the session), as ShapeDtypeStructs."""
    case = BY_ID[cid]
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inputs(case.kind, DTYPES[-1])]
    return jax.eval_shape(case.fn, *args)


def _differentiable(case) -> bool:
    """Float-valued and differentiable by JAX (integer/bool outputs carry no gradient)."""
    return case.diff and any(_is_float(a) for a in jax.tree.leaves(_output_shapes(case.id)))


def _rotated(case_index: int, case) -> str:
    """The one dtype, of all four, in which the eager and vmap checks run `case` in `make test`
    (the session of that dtype runs it; the x64 session the float64 ones)."""
    supported = [dt for dt in ALL if dt in case.dtypes]
    return supported[case_index % len(supported)]


PAIRS = [(c.id, dt) for c in CASES for dt in DTYPES if dt in c.dtypes]
GRAD_PAIRS = [(cid, dt) for cid, dt in PAIRS if _differentiable(BY_ID[cid])]
ROTATION = {c.id: _rotated(i, c) for i, c in enumerate(CASES)}
ROTATED = {(cid, dt) for cid, dt in ROTATION.items() if dt in DTYPES}
WPAIRS = [(w.id, dt) for w in WHERE_CASES for dt in DTYPES if dt in w.dtypes]
TRACE_PAIRS = [(c.id, DTYPES[-1]) for c in CASES if DTYPES[-1] in c.dtypes]
# (case, dtype) pairs of this session left out of the table because JAX itself does not support
# them (see the comments at the dtype lists of transparency_cases.py); checked below to really fail.
UNSUPPORTED = [(c.id, dt) for c in CASES for dt in DTYPES if dt not in c.dtypes]


def _params(pairs, rotated_only=False):
    return [pytest.param(a, b, id=f"{a}-{b}",
                         marks=() if not rotated_only or (a, b) in ROTATED else pytest.mark.slow)
            for a, b in pairs]


pairs = pytest.mark.parametrize("cid,dtype", _params(PAIRS))
rotated_pairs = pytest.mark.parametrize("cid,dtype", _params(PAIRS, rotated_only=True))
grad_pairs = pytest.mark.parametrize("cid,dtype", _params(GRAD_PAIRS))
def _half_rotation(index: int, w) -> str | None:
    halves = [dt for dt in ("float16", "bfloat16") if dt in w.dtypes]
    return halves[index % len(halves)] if halves else None


# The where checks run every function in float32 (float64 in the x64 session) and in one of the
# half-precision dtypes, alternating, in `make test`; `make fuzz` runs the rest.
W_FAST = {(w.id, dt) for i, w in enumerate(WHERE_CASES) for dt in DTYPES
          if dt in w.dtypes and (dt in ("float32", "float64") or dt == _half_rotation(i, w))}


def _wparams(pairs):
    return [pytest.param(a, b, id=f"{a}-{b}", marks=() if (a, b) in W_FAST else pytest.mark.slow)
            for a, b in pairs]


wpairs = pytest.mark.parametrize("wid,dtype", _wparams(WPAIRS))


def _tol(dtype) -> float:
    return 8 * float(jnp.finfo(dtype).eps)


# -------------------------------------------------------------------------- computed once per group

@functools.cache
def _args(kind, dtype):
    return inputs(kind, dtype)


def _combined(cids):
    fns = [BY_ID[c].fn for c in cids]
    return lambda xs: [fn(*x) for fn, x in zip(fns, xs, strict=True)]


def _inputs_of(cids, dtype):
    return [_args(BY_ID[c].kind, dtype) for c in cids]


class _Failed:
    """The error of a case that failed alone, raised again by each test that reads the case."""

    def __init__(self, error: Exception):
        self.error = error


# Cases per compiled program: XLA's compile time grows faster than the program, and one program
# of 166 functions takes about 15 times as long as chunks of 24 do.
_GROUP = 24


def _per_case(pairs, kind_of=lambda cid: BY_ID[cid].kind):
    """`compute(cids, dtype) -> list`, run once for each chunk of `_GROUP` cases of a
    (kind, dtype) group of `pairs` and read per case. If a chunk fails as a whole, it is split
    in halves, recursively, so that a failing case raises its own error (computed alone) and
    costs its chunk a few more compiles, not one compile per case."""
    def wrap(compute):
        results: dict = {}

        def solve(cids, dtype):
            try:
                out = compute(cids, dtype)
            except Exception as e:  # noqa: BLE001 - kept, raised by the case's own test
                if len(cids) == 1:
                    results[cids[0], dtype] = _Failed(e)
                    return
                solve(cids[:len(cids) // 2], dtype)
                solve(cids[len(cids) // 2:], dtype)
                return
            results.update(((c, dtype), o) for c, o in zip(cids, out, strict=True))

        def get(cid, dtype):
            if (cid, dtype) not in results:
                kind = kind_of(cid)
                group = tuple(c for c, dt in pairs if dt == dtype and kind_of(c) == kind)
                start = group.index(cid) // _GROUP * _GROUP
                solve(group[start:start + _GROUP], dtype)
            out = results[cid, dtype]
            if isinstance(out, _Failed):
                raise out.error
            return out
        get.compute = compute
        return get
    return wrap


@_per_case(PAIRS)
def _forward(cids, dtype):
    f, xs = _combined(cids), _inputs_of(cids, dtype)
    return list(zip(jax.jit(f)(xs), nan_safe(f)(xs), strict=True))


@_per_case([p for p in PAIRS if p in ROTATED])
def _vmapped(cids, dtype):
    f, xbs = _combined(cids), [batched(x) for x in _inputs_of(cids, dtype)]
    return list(zip(jax.jit(jax.vmap(f))(xbs), jax.vmap(nan_safe(f))(xbs), strict=True))


@_per_case([p for p in PAIRS if p not in ROTATED])
def _vmapped_slow(cids, dtype):
    return _vmapped.compute(cids, dtype)


def _cotangent_weights(leaf):
    """1, 1.5, 2, 1, ... : exact in every dtype, and a permuted gradient shows."""
    return (1 + 0.5 * (jnp.arange(leaf.size) % 3)).reshape(leaf.shape).astype(leaf.dtype)


def _loss(fn):
    def loss(*args):
        leaves = [leaf for leaf in jax.tree.leaves(fn(*args)) if _is_float(leaf)]
        return sum(jnp.sum(leaf * _cotangent_weights(leaf)).astype(jnp.float32)
                   for leaf in leaves)
    return loss


@_per_case(GRAD_PAIRS)
def _grads(cids, dtype):
    """Per case: the (original, nan_safe) gradients, in one compiled program."""
    f, xs = _combined(cids), _inputs_of(cids, dtype)
    g_ref, g_safe = jax.grad(_loss(f)), jax.grad(_loss(nan_safe(f)))
    return list(zip(*jax.jit(lambda xs: (g_ref(xs), g_safe(xs)))(xs), strict=True))


@functools.cache
def _eager(cid, dtype):
    """Eager runs primitive by primitive: grouping saves nothing, one case at a time. The
    reference is `fn` called eagerly where nothing is guarded; where something is, nan_safe
    inlines the `jit` calls of `fn` (`jnp.hypot` is one) and runs their equations one by one:
    `fn` under `jax.disable_jit()` (docs/api.md, `jit`)."""
    fn, args = BY_ID[cid].fn, _args(BY_ID[cid].kind, dtype)
    if jaxsafe.nan_safe(fn).trace(*args)[1].changed:
        with jax.disable_jit():
            ref = fn(*args)
    else:
        ref = fn(*args)
    return ref, nan_safe(lambda *a: fn(*a), jit=False)(*args)


@functools.cache
def _traced(cid, dtype):
    fn, args = BY_ID[cid].fn, _args(BY_ID[cid].kind, dtype)
    return (structure(jaxsafe.make_jaxpr(fn)(*args)),
            structure(jaxsafe.make_jaxpr(lambda *a: fn(*a))(*args)))


def _wrapped(wid, dtype):
    return (_wrapped_fast if (wid, dtype) in W_FAST else _wrapped_slow)(wid, dtype)


def _wrapped_values(wids, dtype):
    """Per op: x, its `live(x)` as JAX sees it (subnormals are flushed to zero on CPU), the jit
    and nan_safe forward values, and the nan_safe and hand-written gradients. Where
    `live(x)`, the hand-written gradient is the taken branch's derivative op'(x) itself."""
    ws = [WBY_ID[w] for w in wids]
    x = inputs("unary", dtype)[0]
    xs = [x] * len(ws)  # one leaf per op: their gradients stay apart

    def combine(method):
        return lambda xs: [method(w)(x) for w, x in zip(ws, xs, strict=True)]
    f, hand = combine(lambda w: w.f), combine(lambda w: w.hand)
    safe = nan_safe(f)
    grad = lambda fn: jax.grad(lambda xs: sum(jnp.sum(y).astype(jnp.float32) for y in fn(xs)))
    taken, *grads = jax.jit(lambda xs: ([w.live(x) for w, x in zip(ws, xs, strict=True)],
                                        *(grad(g)(xs) for g in (safe, hand))))(xs)
    forward = zip(jax.jit(f)(xs), safe(xs), strict=True)
    return [(x, t, fw, *g) for t, fw, *g in zip(taken, forward, *grads, strict=True)]


_wrapped_fast = _per_case([p for p in WPAIRS if p in W_FAST],
                          kind_of=lambda wid: "unary")(_wrapped_values)
_wrapped_slow = _per_case([p for p in WPAIRS if p not in W_FAST],
                          kind_of=lambda wid: "unary")(_wrapped_values)


@functools.cache
def _lowering_error(cid, dtype):
    """What `jax.jit(fn).lower` raises for a (case, dtype) left out of the table; None if none."""
    try:
        jax.jit(BY_ID[cid].fn).lower(*_args(BY_ID[cid].kind, dtype))
    except Exception as e:  # noqa: BLE001 - the test checks its type
        return e
    return None


_PRECOMPUTE = {
    "test_nan_safe_forward_is_bitwise_equal_to_jit": _forward,
    "test_nan_safe_gradient_equals_the_original_with_the_same_nan_lanes": _grads,
    "test_nan_safe_without_jit_is_bitwise_equal_to_eager_jax": _eager,
    "test_vmap_of_nan_safe_is_bitwise_equal_to_jit_of_vmap":
        lambda cid, dtype: (_vmapped if (cid, dtype) in ROTATED else _vmapped_slow)(cid, dtype),
    "test_nan_safe_of_the_function_object_runs_what_nan_safe_of_a_call_to_it_runs": _traced,
    "test_where_wrapped_op_hand_twin_gradient_is_one_on_the_dropped_side": _wrapped,
    "test_where_wrapped_op_forward_is_bitwise_equal_to_jit": _wrapped,
    "test_where_wrapped_op_gradient_is_finite_on_the_dropped_side_and_where_the_branch_is":
        _wrapped,
    "test_where_wrapped_op_gradient_equals_the_hand_written_double_where": _wrapped,
    "test_dtypes_left_out_of_the_table_are_unsupported_by_jax_itself": _lowering_error,
}


@pytest.fixture(scope="module", autouse=True)
def transparency_programs_built_before_the_leak_checker(request):
    """Build the programs of the selected tests before conftest's function-scoped leak checker.

    Under `jax.checking_leaks()` JAX turns its tracing caches off, and these ~2000 programs take
    three times as long. An error here is the test's to raise: a failed case of a group keeps
    its own error, the other checks compute again (and raise) under the test.
    """
    for item in request.session.items:
        if item.getparent(pytest.Module) is not request.node:
            continue  # another module's (test_x64_where.py imports the where tests)
        fn = getattr(item, "function", None)
        if getattr(fn, "__module__", None) != __name__ or fn.__name__ not in _PRECOMPUTE:
            continue
        try:  # positionally, as the tests call them: functools.cache keys on the call form
            _PRECOMPUTE[fn.__name__](*item.callspec.params.values())
        except Exception:  # noqa: BLE001, S112 - reported by the test itself
            continue
    yield


# --------------------------------------------------------------------------- checks

def assert_bitwise_up_to_nan_payloads(got, ref):
    """Bit for bit, except that a NaN matches a NaN of another payload (the positions match)."""
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        g, r = np.asarray(g), np.asarray(r)
        assert g.dtype == r.dtype and g.shape == r.shape, (g.dtype, r.dtype, g.shape, r.shape)
        if jnp.issubdtype(g.dtype, jnp.floating):
            nan = np.isnan(r)
            np.testing.assert_array_equal(np.isnan(g), nan, err_msg="NaN positions")
            g, r = g[~nan], r[~nan]
        assert_bitwise(g, r)


def check_gradient_matches(ref, got, dtype, may_fix: bool):
    """Close where `ref` is finite, the same where it is not; with `may_fix`, anything where
    `ref` is NaN (a dropped 0 * inf)."""
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        assert r.dtype == g.dtype and r.shape == g.shape
        r, g = np.asarray(r, np.float64).ravel(), np.asarray(g, np.float64).ravel()
        fin = np.isfinite(r)
        np.testing.assert_allclose(g[fin], r[fin], rtol=_tol(dtype), atol=_tol(dtype),
                                   err_msg=f"lanes where the original is finite: "
                                           f"{np.flatnonzero(fin)}")
        bad = ~fin
        if may_fix:
            bad &= ~np.isnan(r)
        np.testing.assert_array_equal(g[bad], r[bad], err_msg=f"lanes where the original is "
                                                              f"not finite: {np.flatnonzero(bad)}")


# --------------------------------------------------------------------------- part 1: the table

def _function_name(case_id: str) -> str:
    return case_id.split("-")[0]  # "jnp.pad-reflect" is jnp.pad


_NAMESPACES = {"jnp": jnp, "lax": lax, "nn": nn, "sp": sp, "jsl": jsl}
_INDEXING = {"x[index_arrays]", "x[slices]", "x.at[].set", "x.at[].add", "x.at[].max"}


def test_case_table_has_at_least_150_functions():
    """Counted by the object each id names (an id names a real function), indexing apart."""
    names = {_function_name(c.id) for c in CASES}
    functions = set()
    for name in names - _INDEXING:
        head, *path = name.split(".")
        functions.add(functools.reduce(getattr, path, _NAMESPACES[head]))
    assert all(callable(f) for f in functions)
    assert len(functions) + len(names & _INDEXING) >= 150, (len(functions), len(names))
    assert {n.split(".")[0] for n in names} >= set(_NAMESPACES)


def test_every_function_runs_in_every_dtype_of_the_session_it_supports():
    assert {dt for _, dt in PAIRS} == set(DTYPES)
    assert set(PAIRS) == {(c.id, dt) for c in CASES for dt in DTYPES if dt in c.dtypes}
    # eager and vmap: every function in one dtype it supports, every dtype in some functions
    assert set(ROTATION) == set(BY_ID)
    assert all(dt in BY_ID[cid].dtypes for cid, dt in ROTATION.items())
    assert set(ROTATION.values()) == set(ALL)
    assert set(PAIRS) >= ROTATED and {dt for _, dt in ROTATED} == set(DTYPES)
    assert set(FIXED_BY_INTERNAL_SELECTION) <= {cid for cid, _ in GRAD_PAIRS}


@pairs
def test_nan_safe_forward_is_bitwise_equal_to_jit(cid, dtype):
    ref, got = _forward(cid, dtype)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert_bitwise(got, ref)


@grad_pairs
def test_nan_safe_gradient_equals_the_original_with_the_same_nan_lanes(cid, dtype):
    ref, got = _grads(cid, dtype)
    check_gradient_matches(ref, got, dtype, cid in FIXED_BY_INTERNAL_SELECTION)


@rotated_pairs
def test_nan_safe_without_jit_is_bitwise_equal_to_eager_jax(cid, dtype):
    ref, got = _eager(cid, dtype)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert_bitwise_up_to_nan_payloads(got, ref)


@rotated_pairs
def test_vmap_of_nan_safe_is_bitwise_equal_to_jit_of_vmap(cid, dtype):
    ref, got = _PRECOMPUTE["test_vmap_of_nan_safe_is_bitwise_equal_to_jit_of_vmap"](cid, dtype)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert_bitwise(got, ref)


@pytest.mark.parametrize("cid,dtype", _params(TRACE_PAIRS))
def test_nan_safe_of_the_function_object_runs_what_nan_safe_of_a_call_to_it_runs(cid, dtype):
    """The checks above call each function inside a larger one; users pass `jnp.sin` itself."""
    direct, called = _traced(cid, dtype)
    assert direct == called


if UNSUPPORTED:  # every case runs in float64: none in the x64 session
    @pytest.mark.parametrize("cid,dtype", _params(UNSUPPORTED))
    def test_dtypes_left_out_of_the_table_are_unsupported_by_jax_itself(cid, dtype):
        if jax.default_backend() != "cpu":
            pytest.skip("the exclusions were established for the CPU backend")
        error = _lowering_error(cid, dtype)
        assert isinstance(error, (TypeError, ValueError, NotImplementedError)), repr(error)


# ------------------------------------------------------------------------ part 2: op behind a where

# Unary cases of part 1 that part 2 does not wrap in a where.
NOT_WRAPPED = {
    "jnp.piecewise": "selects itself (part 1 checks it)",
    "jnp.select": "selects itself (part 1 checks it)",
    "lax.clamp": "wrapped as jnp.clip, the same clamp",
}


def test_every_unary_float_function_is_also_wrapped_in_a_where():
    def one_float_output(case):  # jnp.frexp, jnp.modf have two
        out = _output_shapes(case.id)
        return isinstance(out, jax.ShapeDtypeStruct) and _is_float(out)
    unary = {c.id for c in CASES if c.kind == "unary" and c.diff and one_float_output(c)}
    assert unary - set(WBY_ID) == set(NOT_WRAPPED)


@wpairs
def test_where_wrapped_op_hand_twin_gradient_is_one_on_the_dropped_side(wid, dtype):
    """The reference is what a double where gives: on the dropped side (finite x, x > 0 false),
    exactly the derivative of the `x` branch, whatever op' is at the twin's safe value."""
    x, taken, _, _, g_hand = _wrapped(wid, dtype)
    x, taken, g_hand = np.asarray(x, np.float64), np.asarray(taken), np.asarray(g_hand, np.float64)
    dropped = np.isfinite(x) & ~taken
    np.testing.assert_array_equal(g_hand[dropped], 1.0)


@wpairs
def test_where_wrapped_op_forward_is_bitwise_equal_to_jit(wid, dtype):
    _, _, (ref, got), *_ = _wrapped(wid, dtype)
    assert_bitwise(got, ref)


def _reference(wid, x, taken, g_hand):
    """The hand-written double where's gradient; in the taken lanes where it is not finite
    because op selects inside (JAX's own where-bug, `Wrapped.deriv`), op's derivative written
    out."""
    g = np.asarray(g_hand, np.float64)
    deriv = WBY_ID[wid].deriv
    if deriv is None:
        return g
    fixed = np.asarray(taken) & ~np.isfinite(g)
    assert fixed.any(), f"{wid}: JAX's own derivative is finite everywhere: drop `deriv`"
    return np.where(fixed, np.asarray(deriv(x), np.float64), g)


@wpairs
def test_where_wrapped_op_gradient_is_finite_on_the_dropped_side_and_where_the_branch_is(
        wid, dtype):
    x, taken, _, g_safe, g_hand = _wrapped(wid, dtype)
    g_branch = _reference(wid, x, taken, g_hand)
    x, g_safe = (np.asarray(a, np.float64) for a in (x, g_safe))
    taken = np.asarray(taken)  # where taken, the reference is op'(x)
    # every dropped lane, at the edges too: +-inf, NaN, +-max, 0, -0 and subnormals
    expect_finite = ~taken | np.isfinite(g_branch)
    assert np.all(np.isfinite(g_safe[expect_finite])), (
        f"not finite at x = {x[expect_finite & ~np.isfinite(g_safe)]}")
    # real singularities stay: where the taken branch's derivative is not finite, neither is ours
    singular = taken & ~np.isfinite(g_branch)
    assert np.all(~np.isfinite(g_safe[singular])), f"hidden at x = {x[singular]}"


@wpairs
def test_where_wrapped_op_gradient_equals_the_hand_written_double_where(wid, dtype):
    x, taken, _, g_safe, g_hand = _wrapped(wid, dtype)
    assert g_safe.dtype == g_hand.dtype
    # every lane, the edge inputs included (+-inf, NaN, +-max, 0, -0, subnormals)
    assert_close(np.asarray(g_safe, np.float64), _reference(wid, x, taken, g_hand),
                 rtol=_tol(dtype), atol=_tol(dtype))


__all__ = [name for name in dir() if name.startswith("test_")] + [
    "transparency_programs_built_before_the_leak_checker", "pytestmark"]

