"""The float64 half of test_transparency.py, part 2: each unary op and stats function behind a
`where` (DTYPES is ("float64",) here). Part 1 is test_x64_transparency.py.
"""

import jax.numpy as jnp
from test_transparency import (  # noqa: F401  (pytest collects the imported tests)
    pytestmark,
    test_every_unary_float_function_is_also_wrapped_in_a_where,
    test_where_wrapped_op_forward_is_bitwise_equal_to_jit,
    test_where_wrapped_op_gradient_equals_the_hand_written_double_where,
    test_where_wrapped_op_gradient_is_finite_on_the_dropped_side_and_where_the_branch_is,
    test_where_wrapped_op_hand_twin_gradient_is_one_on_the_dropped_side,
    transparency_programs_built_before_the_leak_checker,
)


def test_where_session_runs_with_x64():
    assert jnp.asarray(1.0).dtype == jnp.float64
