"""Every way a program drops lanes, one row each, against the hand-written double where.

Each row applies one dropping primitive to `h(x) = sqrt(|x|)` on `x = [-1, 0, 2, 3]`: `h` is
singular at 0 (its derivative is inf), and lane 1 holds the 0. The row's `live` is written by
hand: the lanes the drop keeps. The reference (`twin`) is the same program on
`h(where(live, x, 1.))`, the double where a careful user writes. For each row:

(a) plain JAX's gradient is not finite (the leak is real);
(b) `grad(nan_safe(f))` equals the twin's, eager, under `jit` and under `vmap`;
(c) the second derivative equals the twin's;
(d) `nan_safe(f)(x)` is bitwise `jax.jit(f)(x)`.

`test_x64.py` runs the same rows in float64.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close
from jax import lax
from jax.extend import core as jex

from jaxsafe import nan_safe
from jaxsafe._rules import RULES, _never

# a numerics sweep: the modules of nan_safe's tracing paths check for tracer leaks (conftest)
pytestmark = pytest.mark.no_leak_check

P = jex.primitives
X = [-1., 0., 2., 3.]
sg = lax.stop_gradient


def h(x):
    return jnp.sqrt(jnp.abs(x))


@dataclasses.dataclass(frozen=True)
class Drop:
    """`body(x, h)`: a scalar loss that drops lanes of `h(x)` with `primitive`; `live(x)`: the
    lanes it keeps, by hand."""
    id: str
    primitive: jex.Primitive
    body: Callable
    live: Callable
    everywhere: bool = True
    """Second order, jit and vmap too, and the forward with NaN, -0 and inf (the drops older than
    this table are checked there by test_core.py, test_cotangents.py, the transparency suite
    and the fuzzer: here first order, eager)."""

    def f(self, x):
        return self.body(x, h)

    def twin(self, x):
        keep = self.live(sg(x))
        return self.body(x, lambda v: h(jnp.where(keep, v, 1.)))


def _idx(x):
    return jnp.arange(x.shape[-1])


_KERNEL = jnp.array([[[1., -2.]]])  # a negative weight: no lane is read by cancellation


ROWS: list[Drop] = [
    Drop("select_n", P.select_n_p, lambda x, h: jnp.where(x > 0, h(x), 0.).sum(),
         lambda x: x > 0, everywhere=False),
    Drop("max", P.max_p, lambda x, h: jnp.maximum(h(x), 1.2).sum(), lambda x: h(x) > 1.2,
         everywhere=False),
    Drop("min", P.min_p, lambda x, h: jnp.minimum(-h(x), -1.2).sum(), lambda x: h(x) > 1.2,
         everywhere=False),
    Drop("clamp", P.clamp_p, lambda x, h: lax.clamp(0.5, h(x), 1.5).sum(),
         lambda x: (h(x) > 0.5) & (h(x) < 1.5), everywhere=False),
    # a custom rule whose tangent follows its body's selection: relu's 0 wins (`_custom_rules.py`)
    Drop("relu", P.custom_jvp_call_p, lambda x, h: jax.nn.relu(h(x) - 1.2).sum(),
         lambda x: h(x) > 1.2),
    Drop("slice", P.slice_p, lambda x, h: h(x)[2:].sum(), lambda x: _idx(x) >= 2, everywhere=False),
    Drop("gather", P.gather_p, lambda x, h: h(x)[jnp.argsort(-x)[:2]].sum(),
         lambda x: _idx(x) >= 2, everywhere=False),
    Drop("argmax", P.dynamic_slice_p, lambda x, h: h(x)[jnp.argmax(x)],
         lambda x: _idx(x) == jnp.argmax(x), everywhere=False),
    Drop("dynamic_slice", P.dynamic_slice_p,
         lambda x, h: lax.dynamic_slice(h(x), (jnp.argmax(x) - 1,), (2,)).sum(),
         lambda x: _idx(x) >= 2, everywhere=False),
    Drop("dynamic_update_slice", P.dynamic_update_slice_p,
         lambda x, h: lax.dynamic_update_slice(h(x), jnp.zeros(2, x.dtype), (0,)).sum(),
         lambda x: _idx(x) >= 2, everywhere=False),
    Drop("pad", P.pad_p, lambda x, h: lax.pad(h(x), 0., [(-2, 0, 0)]).sum(),
         lambda x: _idx(x) >= 2, everywhere=False),
    # overwrites: static, run-time and duplicate indices, window dimensions
    Drop("scatter", P.scatter_p, lambda x, h: h(x).at[1].set(0.).sum(), lambda x: _idx(x) != 1),
    Drop("scatter-runtime-index", P.scatter_p,
         lambda x, h: h(x).at[jnp.argmin(jnp.abs(x))].set(1.).sum(),
         lambda x: _idx(x) != jnp.argmin(jnp.abs(x))),
    Drop("scatter-duplicates", P.scatter_p,
         lambda x, h: h(x).at[jnp.array([1, 1])].set(jnp.array([5., 6.], x.dtype)).sum(),
         lambda x: _idx(x) != 1),
    Drop("scatter-column", P.scatter_p,
         lambda x, h: (h(x).reshape(2, 2).at[:, 1].set(0.) * jnp.array([[1., 2.]], x.dtype)
                       ).sum(),
         lambda x: _idx(x) % 2 == 0),
    # a sum by index: an out-of-range segment drops its updates (the padding id of
    # `segment_sum`); a segment the program drops afterwards drops the updates it sums
    Drop("scatter_add-out-of-range", P.scatter_add_p,
         lambda x, h: jax.ops.segment_sum(h(x), jnp.array([0, 2, 1, 1]), num_segments=2).sum(),
         lambda x: _idx(x) != 1),
    Drop("scatter_add-dropped-segment", P.scatter_add_p,
         lambda x, h: jnp.where(jnp.array([True, False]), jax.ops.segment_sum(
             h(x), jnp.array([0, 1, 0, 0]), num_segments=2), 0.).sum(),
         lambda x: _idx(x) != 1),
    # the other scatters are read as a scatter-add: an update sent out of range is dropped
    # (`segment_max`'s padding id), every other update is live (max and min: but its losers)
    Drop("scatter_sub-out-of-range", lax.scatter_sub_p,
         lambda x, h: jnp.zeros(2, x.dtype).at[jnp.array([0, 2, 1, 1])].subtract(h(x)).sum(),
         lambda x: _idx(x) != 1),
    Drop("scatter_mul-out-of-range", P.scatter_mul_p,
         lambda x, h: jnp.ones(2, x.dtype).at[jnp.array([0, 2, 1, 3])].multiply(
             h(x), unique_indices=True).sum(),
         lambda x: _idx(x) % 2 == 0),
    Drop("scatter_max-out-of-range", P.scatter_max_p,
         lambda x, h: jax.ops.segment_max(h(x), jnp.array([0, 2, 1, 1]), num_segments=2).sum(),
         lambda x: _idx(x) != 1),
    Drop("scatter_min-out-of-range", P.scatter_min_p,
         lambda x, h: jax.ops.segment_min(-h(x), jnp.array([0, 2, 1, 1]), num_segments=2).sum(),
         lambda x: _idx(x) != 1),
    # `segment_max`, `x.at[i].max(u)`: choosers, as `reduce_max` (a losing update or operand
    # lane is dropped; before, every lane in range was live). The twin's 1. must not tie.
    Drop("scatter_max-losers", P.scatter_max_p,
         lambda x, h: jax.ops.segment_max(h(x), jnp.array([1, 0, 0, 1]), num_segments=2).sum(),
         lambda x: _idx(x) >= 2),
    Drop("scatter_min-losers", P.scatter_min_p,
         lambda x, h: jax.ops.segment_min(-h(x), jnp.array([1, 0, 0, 1]), num_segments=2).sum(),
         lambda x: _idx(x) >= 2),
    Drop("scatter_max-into-a-larger-operand", P.scatter_max_p,
         lambda x, h: jnp.full(2, 1.5, x.dtype).at[jnp.array([0, 0, 1, 1])].max(h(x)).sum(),
         lambda x: _idx(x) == 3),
    # chooser reductions
    Drop("reduce_max", P.reduce_max_p, lambda x, h: jnp.max(h(x)), lambda x: h(x) == h(x).max()),
    Drop("reduce_min", P.reduce_min_p, lambda x, h: jnp.min(-h(x)), lambda x: h(x) == h(x).max()),
    Drop("cummax", P.cummax_p, lambda x, h: lax.cummax(h(x))[2:].sum(), lambda x: _idx(x) >= 2),
    Drop("cummin", P.cummin_p, lambda x, h: lax.cummin(-h(x), reverse=True)[0],
         lambda x: _idx(x) == 3),
    Drop("reduce_window_max", P.reduce_window_max_p,
         lambda x, h: (lax.reduce_window(h(x), -jnp.inf, lax.max, (2,), (1,), "VALID")
                       * jnp.array([1., 2., 3.], x.dtype)).sum(),
         lambda x: _idx(x) != 1),
    Drop("reduce_window_min", P.reduce_window_min_p,
         lambda x, h: lax.reduce_window(-h(x), jnp.inf, lax.min, (2,), (2,), "VALID").sum(),
         lambda x: (_idx(x) == 0) | (_idx(x) == 3)),
    # windows that skip lanes: a stride longer than the window, padding in front
    Drop("reduce_window_sum", P.reduce_window_sum_p,
         lambda x, h: (lax.reduce_window(h(x), 0., lax.add, (2,), (3,), [(1, 0)])
                       * jnp.array([1., 2.], x.dtype)).sum(),
         lambda x: _idx(x) != 1),
    Drop("conv_general_dilated", P.conv_general_dilated_p,
         lambda x, h: lax.conv_general_dilated(h(x)[None, None], _KERNEL.astype(x.dtype),
                                               (3,), [(1, 0)])[0, 0].sum(),
         lambda x: _idx(x) != 1),
    # permutations
    Drop("sort", P.sort_p, lambda x, h: (jnp.sort(h(x))[2:] * jnp.array([1., 2.], x.dtype)).sum(),
         lambda x: _idx(x) >= 2),
    Drop("sort-payload", P.sort_p, lambda x, h: lax.sort((x, h(x)), num_keys=1)[1][2:].sum(),
         lambda x: _idx(x) >= 2),
    Drop("top_k", P.top_k_p, lambda x, h: (lax.top_k(h(x), 2)[0] * jnp.array([1., 2.], x.dtype)
                                           ).sum(),
         lambda x: _idx(x) >= 2),
    Drop("approx_max_k", P.approx_top_k_p,
         lambda x, h: (lax.approx_max_k(h(x), 2)[0] * jnp.array([1., 2.], x.dtype)).sum(),
         lambda x: _idx(x) >= 2),
    # multiplicative masks
    Drop("mul-constant-mask", P.mul_p, lambda x, h: (jnp.array([0., 0., 1., 1.], x.dtype)
                                                     * h(x)).sum(),
         lambda x: _idx(x) >= 2),
    Drop("mul-heaviside", P.mul_p, lambda x, h: (jnp.heaviside(x, 0.) * h(x)).sum(),
         lambda x: x > 0),
    Drop("mul-boolean", P.mul_p, lambda x, h: (h(x) * (x > 0).astype(x.dtype)).sum(),
         lambda x: x > 0),
    # a contraction's zero weights drop the lanes only they meet (`_choosers.py`)
    Drop("dot-constant-weights", P.dot_general_p,
         lambda x, h: jnp.array([0., 0., 1., 2.], x.dtype) @ h(x), lambda x: _idx(x) >= 2),
    Drop("dot-one-hot", P.dot_general_p,
         lambda x, h: (jax.nn.one_hot(jnp.array([3, 2]), 4, dtype=x.dtype) @ h(x)).sum(),
         lambda x: _idx(x) >= 2),
]
ROW_IDS = [r.id for r in ROWS]
NEW_ROWS = [r for r in ROWS if r.everywhere]
rows = pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)


def _x(dtype):
    return jnp.asarray(X, dtype)


def _tol(dtype):
    return 1e-12 if dtype == jnp.float64 else 1e-6


def check_uses_its_primitive_and_the_twin_agrees(row: Drop, dtype):
    x = _x(dtype)
    jaxpr = jax.make_jaxpr(row.f)(x)
    found, todo = set(), [jaxpr.jaxpr]
    while todo:
        j = todo.pop()
        for e in j.eqns:
            found.add(e.primitive)
            todo.extend(v.jaxpr if hasattr(v, "jaxpr") else v for v in e.params.values()
                        if isinstance(v, jex.ClosedJaxpr | jex.Jaxpr))
    assert row.primitive in found
    assert_close(jax.jit(row.twin)(x), jax.jit(row.f)(x), rtol=_tol(dtype))  # keeps what f keeps


def _edge_batch(x):
    return jnp.stack([x, -x[::-1], jnp.asarray([jnp.nan, -0., jnp.inf, -2.], x.dtype)])


def _row_values(row: Drop, dtype) -> dict[str, object]:
    """Everything the checks compare for one row, each program called on its own, as a user
    calls it."""
    x = _x(dtype)
    values = {
        "plain_grad": jax.grad(row.f)(x),  # eager: under jit, XLA may simplify `0 * inf` in a
        "safe_grad": jax.grad(nan_safe(row.f))(x),  # product with a converted boolean
        "twin_grad": jax.jit(jax.grad(row.twin))(x),
        "safe": nan_safe(row.f)(x), "plain": jax.jit(row.f)(x)}
    if row.everywhere:
        xs = _edge_batch(x)
        values.update(safe_vmap=jax.vmap(nan_safe(row.f))(xs),
                      plain_vmap=jax.jit(jax.vmap(row.f))(xs))
    return jax.block_until_ready(values)


_VALUES: dict[tuple, dict] = {}
"""(dtype, row id) -> `_row_values`; a row that raised is missing (its test computes it and
raises)."""


_SELECTED: dict[object, frozenset[str]] = {}
"""dtype -> the ids of the rows `precompute` was given (the rows of the selected tests); the
rows of every dtype not named here are all built."""


def _all_rows(transform: Callable, dtype, x) -> dict[str, tuple]:
    """`transform(f)(x)` of nan_safe and of the twin, for every row of `NEW_ROWS` the session
    selected, in two compiled programs (a compile per row would take most of this module's
    time); a row that fails to trace is computed alone, so that its own test raises its own
    error."""
    wanted = _SELECTED.get(jnp.dtype(dtype))
    rows = [r for r in NEW_ROWS if wanted is None or r.id in wanted]
    if not rows:
        return {}

    def run(fns):
        return jax.jit(lambda x: [transform(f)(x) for f in fns])(x)
    try:
        safe = run([nan_safe(r.f) for r in rows])
        twin = run([r.twin for r in rows])
        return {r.id: (s, t) for r, s, t in zip(rows, safe, twin, strict=True)}
    except Exception:  # noqa: BLE001 - each row's test computes it alone and raises
        return {}


@functools.cache
def _vmapped_gradients(dtype) -> dict[str, tuple]:
    x = _x(dtype)
    return _all_rows(lambda f: jax.vmap(jax.grad(f)), dtype, jnp.stack([x, 2 * x]))


@functools.cache
def _hessians(dtype) -> dict[str, tuple]:
    return _all_rows(jax.hessian, dtype, _x(dtype))


def precompute(dtype, rows: list[Drop]) -> None:
    """Build the rows' programs before conftest's function-scoped leak checker: under
    `jax.checking_leaks()` JAX turns its tracing caches off and this table takes three times as
    long. The leak checker still runs over test_core.py, test_choosers.py and the rest."""
    _SELECTED[jnp.dtype(dtype)] = frozenset(row.id for row in rows)
    for row in rows:
        if (dtype, row.id) not in _VALUES:
            try:
                _VALUES[dtype, row.id] = _row_values(row, dtype)
            except Exception:  # noqa: BLE001, S112 - reported by the row's own test
                continue
    _vmapped_gradients(dtype)
    _hessians(dtype)


def _value(row: Drop, dtype, key: str, compute: Callable):
    got = _VALUES.get((dtype, row.id))
    return got[key] if got is not None else compute()


def check_plain_gradient_is_broken(row: Drop, dtype):
    got = _value(row, dtype, "plain_grad", lambda: jax.grad(row.f)(_x(dtype)))
    assert not np.isfinite(np.asarray(got)).all()


def check_gradient_matches_twin(row: Drop, dtype):
    """Eager, and under jit of vmap (2x keeps the rows' hand masks)."""
    x = _x(dtype)
    want = _value(row, dtype, "twin_grad", lambda: jax.jit(jax.grad(row.twin))(x))
    assert np.isfinite(np.asarray(want)).all()
    got = _value(row, dtype, "safe_grad", lambda: jax.grad(nan_safe(row.f))(x))
    assert_close(got, want, rtol=_tol(dtype))
    if not row.everywhere:
        return
    got, want = _vmapped_gradients(dtype).get(row.id) or (
        jax.jit(jax.vmap(jax.grad(nan_safe(row.f))))(jnp.stack([x, 2 * x])),
        jax.vmap(jax.grad(row.twin))(jnp.stack([x, 2 * x])))
    assert_close(got, want, rtol=_tol(dtype))


def check_second_order_matches_twin(row: Drop, dtype):
    got, want = _hessians(dtype).get(row.id) or (
        jax.hessian(nan_safe(row.f))(_x(dtype)), jax.hessian(row.twin)(_x(dtype)))
    assert_close(got, want, rtol=_tol(dtype))


def check_forward_is_bitwise(row: Drop, dtype):
    x = _x(dtype)
    assert_bitwise(_value(row, dtype, "safe", lambda: nan_safe(row.f)(x)),
                   _value(row, dtype, "plain", lambda: jax.jit(row.f)(x)))
    if not row.everywhere:
        return
    xs = _edge_batch(x)
    assert_bitwise(_value(row, dtype, "safe_vmap", lambda: jax.vmap(nan_safe(row.f))(xs)),
                   _value(row, dtype, "plain_vmap", lambda: jax.jit(jax.vmap(row.f))(xs)))


@pytest.fixture(scope="module", autouse=True)
def _programs_built_before_the_leak_checker(request):
    """The rows of the tests this session runs (`make test` runs half of them: conftest)."""
    selected = {item.callspec.params["row"].id for item in request.session.items
                if item.getparent(pytest.Module) is request.node
                and "row" in getattr(getattr(item, "callspec", None), "params", {})}
    precompute(jnp.float32, [row for row in ROWS if row.id in selected])
    yield


def test_every_dropping_primitive_has_a_row():
    droppers = {p for p, r in RULES.items()
                if (r.drops is not _never or r.chooser is not None)}
    assert droppers <= {r.primitive for r in ROWS}, droppers - {r.primitive for r in ROWS}


@rows
def test_row_uses_its_primitive_and_its_hand_mask_keeps_the_value(row):
    check_uses_its_primitive_and_the_twin_agrees(row, jnp.float32)


@rows
def test_dropped_singular_lane_makes_the_plain_jax_gradient_non_finite(row):
    check_plain_gradient_is_broken(row, jnp.float32)


@rows
def test_nan_safe_gradient_equals_the_double_where_twin_eager_jit_and_vmap(row):
    check_gradient_matches_twin(row, jnp.float32)


@pytest.mark.parametrize("row", NEW_ROWS, ids=[r.id for r in NEW_ROWS])
def test_nan_safe_second_derivative_equals_the_double_where_twin(row):
    check_second_order_matches_twin(row, jnp.float32)


@rows
def test_nan_safe_forward_is_bitwise_equal_to_jit_nan_lanes_included(row):
    check_forward_is_bitwise(row, jnp.float32)
