"""The guard-table cases of test_guard_table.py in float64.

Run in its own session with test_x64_transparency.py and test_x64_where.py: `JAX_ENABLE_X64=1
pytest tests/test_x64.py tests/test_x64_transparency.py tests/test_x64_where.py` (the Makefile
does, one file per worker). Without x64,
`test_session_runs_with_x64` fails, and so does every case (asking for float64 then warns, and
warnings are errors).
"""

import jax.numpy as jnp
import pytest
import test_drop_table as drops
from test_guard_table import (
    CASE_IDS,
    CASES,
    SECOND_ORDER,
    check_case_uses_its_primitive,
    check_forward_is_bitwise,
    check_gradient_matches_twin,
    check_plain_gradient_is_broken,
    check_second_order_matches_twin,
)

F64 = jnp.float64
cases = pytest.mark.parametrize("case", CASES, ids=CASE_IDS)


def test_session_runs_with_x64():
    assert jnp.zeros(1, jnp.float64).dtype == jnp.float64
    assert jnp.asarray(1.0).dtype == jnp.float64


@cases
def test_float64_case_uses_its_primitive_with_the_table_safe_values(case):
    assert case.inputs(F64).dtype == jnp.float64
    check_case_uses_its_primitive(case, F64)


@cases
def test_float64_untaken_bad_lanes_make_the_plain_jax_gradient_non_finite(case):
    check_plain_gradient_is_broken(case, F64)


@cases
def test_float64_nan_safe_gradient_is_finite_and_equals_the_double_where_twin(case):
    check_gradient_matches_twin(case, F64)


@cases
def test_float64_nan_safe_forward_is_bitwise_equal_to_jit(case):
    check_forward_is_bitwise(case, F64)


@pytest.mark.parametrize("case", SECOND_ORDER, ids=[c.id for c in SECOND_ORDER])
def test_float64_nan_safe_second_derivative_is_finite_and_equals_the_double_where_twin(case):
    check_second_order_matches_twin(case, F64)



# --------------------------------------------------------------------------- the drop table

# the rows of issue 13's examples (the other new rows: float32 only)
ISSUE_ROWS = [r for r in drops.NEW_ROWS if r.id in (
    "reduce_max", "cummax", "top_k", "sort", "mul-heaviside", "mul-constant-mask", "scatter",
    "scatter-runtime-index")]
new_rows = pytest.mark.parametrize("row", ISSUE_ROWS, ids=[r.id for r in ISSUE_ROWS])


@pytest.fixture(scope="module", autouse=True)
def _programs_built_before_the_leak_checker():
    drops.precompute(F64, ISSUE_ROWS)
    yield


@new_rows
def test_float64_drop_gradient_equals_the_double_where_twin(row):
    drops.check_gradient_matches_twin(row, F64)


@new_rows
def test_float64_drop_forward_is_bitwise(row):
    drops.check_forward_is_bitwise(row, F64)


@pytest.mark.slow  # 11 s: make fuzz runs it (make test is at its 10 minutes)
def test_float64_boolean_index_traced_at_its_values_gives_the_hand_fix_gradient():
    import jax
    from helpers import assert_bitwise
    from test_by_value import issue_19089, issue_19089_hand_fix

    from jaxsafe import nan_safe
    x = jnp.float64(1.)
    assert jax.grad(nan_safe(issue_19089))(x) == jax.grad(issue_19089_hand_fix)(x) == 0.5
    assert jax.hessian(nan_safe(issue_19089))(x) == jax.hessian(issue_19089_hand_fix)(x)
    assert jax.grad(nan_safe(issue_19089))(x).dtype == jnp.float64
    assert_bitwise(nan_safe(issue_19089)(x), issue_19089(x))


@pytest.mark.parametrize("combine", ["sum", "max"])
def test_float64_segment_reduction_of_closed_over_ids(combine):
    """A scatter's combiner is typed in its operand's dtype: its liveness rule reads it in
    float64 (hunt O: it did not lower, and the analysis fell back to the original's NaN)."""
    import jax

    import jaxsafe
    senders = jnp.array([0, 1, 2])  # segment 2 is padding
    segment = jax.ops.segment_sum if combine == "sum" else jax.ops.segment_max
    f = lambda r2: jnp.sum(segment(jnp.sqrt(r2), senders, num_segments=2))
    r2 = jnp.array([4., 9., -1.], F64)
    got = jax.grad(jaxsafe.nan_safe(f))(r2)
    want = jnp.concatenate([jax.grad(lambda r: jnp.sum(jnp.sqrt(r[:2])))(r2)[:2], jnp.zeros(1)])
    assert got.dtype == F64
    assert jnp.array_equal(got, want)
