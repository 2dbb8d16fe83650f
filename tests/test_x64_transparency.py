"""The float64 half of test_transparency.py, part 1: the table (DTYPES is ("float64",) here).

Run in the x64 session (`JAX_ENABLE_X64=1`, the Makefile does) with test_x64.py and
test_x64_where.py (part 2): files of their own, so that pytest-xdist runs them side by side.
"""

import jax.numpy as jnp
from test_transparency import (  # noqa: F401  (pytest collects the imported tests)
    pytestmark,
    test_case_table_has_at_least_150_functions,
    test_every_function_runs_in_every_dtype_of_the_session_it_supports,
    test_nan_safe_forward_is_bitwise_equal_to_jit,
    test_nan_safe_gradient_equals_the_original_with_the_same_nan_lanes,
    test_nan_safe_of_the_function_object_runs_what_nan_safe_of_a_call_to_it_runs,
    test_nan_safe_without_jit_is_bitwise_equal_to_eager_jax,
    test_vmap_of_nan_safe_is_bitwise_equal_to_jit_of_vmap,
    transparency_programs_built_before_the_leak_checker,
)


def test_transparency_session_runs_with_x64():
    assert jnp.asarray(1.0).dtype == jnp.float64
