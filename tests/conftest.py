"""Strict JAX settings for every test: no silent rank promotion, tracer leaks are errors; and
the order and cache hygiene that keep `make test` within its time.

The leak checker runs on the modules that exercise nan_safe's tracing paths (test_api,
test_composition, test_control_flow, test_by_value, test_hostile, ...). JAX turns its
tracing caches off under it (2-3x slower), so the numerics sweeps, which run the same paths on
many more programs, opt out with `pytestmark = pytest.mark.no_leak_check` (a test may too).
"""

import gc
import os
import pathlib
import zlib

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")
# A failure inside jaxsafe's analysis raises in the tests: users' programs fall back to the
# original program with an AnalysisFailedWarning instead (tests/test_architecture.py).
os.environ["JAXSAFE_STRICT"] = "1"


@pytest.fixture(scope="module", autouse=True)
def _fresh_caches_per_module():
    """JAX's leak checker looks through the live objects: in a worker that has compiled a
    thousand programs before, each check takes seconds. Each module leaves its caches behind."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _no_leaked_tracers(request):
    if request.node.get_closest_marker("no_leak_check"):
        yield  # JAX bypasses its caches while checking leaks: too slow for 20,000 equations
        return
    with jax.checking_leaks():
        yield


# The files that take longest, longest first (worker seconds of `make test`'s main session,
# from a --junitxml run on 2 cores shared with three other jobs, 2026-11-29; test_found_by_hunts
# then checked for leaks, 257 s, about 70 without):
# `make test` runs one worker per file (--dist loadfile, --no-loadscope-reorder) in this order,
# so that a long file never starts last and runs alone at the end. Other files follow in
# collection order. A stale order costs time, never a test.
_LONGEST_FIRST = (
    "test_nonfinite_data.py",      # 498
    "test_already_safe.py",        # 247
    "test_backward_rules.py",      # 225
    "test_transparency.py",        # 202 (float32, the stats functions' where checks apart)
    "test_nn.py",                  # 164
    "test_linalg.py",              # 125
    "test_found_by_hunts.py",
    "test_drop_table.py",          # 66
    "test_control_flow.py",        # 59
    "test_choosers.py",            # 52
    "test_by_value.py",            # 44
    "test_free_lanes.py",          # 42
    "test_lanewise.py",            # 41
    "test_hostile.py",             # 40
    "test_api.py",                 # 34
    "test_composition.py",         # 34
    "test_x64_transparency.py",    # the x64 sessions
    "test_x64_where.py",
    "test_x64.py",
)


# The table sweeps run their cases in float32 in `make test` (half of them, below). Their other
# dtypes (float16 and
# bfloat16; float64 in the x64 session) are marked `tables`: `make test-tables` runs them, and
# CI runs both (.ci/run): `make test` goes from 18-19 minutes to about 13 on 2 cores. The
# `jax.scipy.stats` functions behind a `where` (104 of the transparency suite's where checks)
# are `tables` in float32 too: compiling their gradients took 65 of make test's 1244
# worker-seconds (truncnorm's cdf alone 7 s); make test keeps the 62 unary ops behind a `where`
# and the stats functions behind a constant mask (test_nonfinite_data.py).
_TABLE_MODULES = frozenset({"test_transparency.py", "test_x64_transparency.py",
                            "test_x64_where.py", "test_guard_table.py"})
# 2026-11-30: the float32 tables of the main session took about a fifth of make test's
# worker-seconds (the transparency suite's programs alone 205 s, the drop table's 118 s, on a
# host shared with other jobs). `make test` runs half of their cases, the same half in every
# check of a case (chosen by a hash of the case's id: stable across runs and processes); the
# other half is `tables` (`make test-tables`, which CI runs).
_HALVED_TABLES = frozenset({"test_transparency.py", "test_guard_table.py", "test_drop_table.py"})
_CASE_PARAMS = ("cid", "wid", "row")
_FLOAT64_TABLES = frozenset({"test_x64.py"})  # the guard and drop tables' cases, in float64
_STATS_PREFIX = "stats."  # the ids of transparency_cases.STATS


def _dtype_name(value) -> str | None:
    try:
        return jax.numpy.dtype(value).name
    except TypeError:
        return None


def _in_other_half(item, callspec) -> bool:
    """A case of a halved table that `make test` leaves to `make test-tables`."""
    if item.path.name not in _HALVED_TABLES or not any(p in callspec.params
                                                       for p in _CASE_PARAMS):
        return False
    case = callspec.id.split("-float")[0].split("-bfloat")[0]  # the case, whatever its dtype
    return zlib.crc32(case.encode()) % 2 == 1


def _in_tables(item) -> bool:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return False
    if item.path.name in _FLOAT64_TABLES or _in_other_half(item, callspec):
        return True
    if item.path.name not in _TABLE_MODULES or "dtype" not in callspec.params:
        return False
    if str(callspec.params.get("wid", "")).startswith(_STATS_PREFIX):
        return True
    return _dtype_name(callspec.params["dtype"]) != "float32"


# The longest parametrized sweeps outside the tables: `make test` runs the first cases of each
# (in collection order), the rest are `tables` too (`make test-tables`, CI). Together they took
# 340 of make test's 1206 worker-seconds (2026-11-29); the first cases cover each sweep's
# mechanism, the others its variants (more matrices, ops, distributions, wrappers).
_SAMPLED = {
    ("test_linalg.py", "test_one_dropped_singular_matrix_of_a_batched_solve_is_cut"): 4,
    ("test_nonfinite_data.py",
     "test_a_padded_row_reaches_through_an_op_along_the_feature_axis"): 5,
    ("test_nonfinite_data.py", "test_a_shared_parameter_of_a_custom_rule_over_masked_data"): 3,
    ("test_nonfinite_data.py",
     "test_padded_rows_through_jaxsafe_nn_are_guarded_as_through_jax_nn"): 2,
    ("test_nonfinite_data.py",
     "test_non_finite_inputs_in_the_dropped_lanes_of_ops_safe_for_finite_inputs"): 3,
    ("test_backward_rules.py",
     "test_a_rule_whose_hazard_is_in_an_output_the_program_does_not_read"): 1,
    ("test_hostile.py", "test_debug_nans_raises_no_false_alarm_on_value_guarded_lanes"): 6,
    ("test_found_by_hunts.py", "test_an_integer_constant_moved_inside_a_body"): 7,
    ("test_linalg.py", "test_dropped_batch_elements_contribute_zero"): 3,
    ("test_choosers.py", "test_a_running_extreme_reads_no_lane_after_its_last_live_output"): 2,
    ("test_nonfinite_data.py", "test_an_activation_between_padded_rows_and_a_row_where"): 3,
    ("test_found_by_hunts.py",
     "test_a_custom_rule_whose_body_indexes_by_its_own_values_cuts_a_dropped_row"): 6,
    ("test_composition.py", "test_transform_of_nan_safe_equals_transform_of_hand_fix"): 5,
    ("test_already_safe.py", "test_hand_guarded_code_is_left_as_it_is"): 5,
    ("test_found_by_hunts.py", "test_a_gamma_sample_s_shape_in_a_dropped_lane_is_guarded"): 1,
    # 2026-11-30: about 120 of make test's 1980 worker-seconds, on a slower host
    ("test_api.py", "test_equal_static_values_of_other_types_are_other_signatures"): 1,
    ("test_free_lanes.py", "test_forward_mode_matches_the_hand_fix"): 7,
    ("test_found_by_hunts.py", "test_a_segment_reduction_of_constant_ids_in_a_narrow_dtype"): 3,
    ("test_aligned.py", "test_relu_layers_in_a_scan_drop_padded_rows"): 2,
    ("test_found_by_hunts.py",
     "test_a_drop_after_a_loop_reaches_a_carry_through_a_body_inside_the_loop"): 2,
    ("test_backward_rules.py",
     "test_reverse_over_reverse_through_a_rule_in_a_loss_not_linear_in_it"): 1,
    ("test_nonfinite_data.py",
     "test_a_maximum_over_rows_a_slice_keeps_guards_the_rows_it_cuts_before_the_matmul"): 2,
    ("test_nonfinite_data.py",
     "test_a_row_overwritten_at_a_constant_index_is_guarded_before_a_matmul"): 2,
    ("test_aligned.py", "test_a_body_that_moves_rows_keeps_every_row_live"): 3,
    ("test_found_by_hunts.py", "test_a_contraction_with_zero_weights_drops_the_lanes_they_meet"): 3,
    ("test_linalg.py",
     "test_a_slice_of_the_matrix_axes_before_the_where_still_drops_whole_matrices"): 3,
}


def _whole_modules(config) -> bool:
    """Whether the command line named modules or folders, not single tests (`file::test`): only
    then can a missing test of `_SAMPLED` or long_tests.txt be told from one not asked for."""
    return not any("::" in str(arg) for arg in config.args)


def _mark_sampled(items, check: bool) -> None:
    seen: dict = {}
    for item in items:
        key = (item.path.name, getattr(item, "originalname", item.name))
        keep = _SAMPLED.get(key)
        if keep is None:
            continue
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > keep:
            item.add_marker(pytest.mark.tables)
    collected = {item.path.name for item in items} if check else set()
    missing = [key for key in _SAMPLED if key[0] in collected and key not in seen]
    assert not missing, f"_SAMPLED names tests that do not exist: {missing}"


# 2026-11-30: still 17-18 minutes in a fresh clone on 2 cores, against the 10 the house allows.
# `make test`'s time is compile-bound (about 60 ms of XLA per program on this host, a dozen
# programs a test) and long-tailed: the 308 tests that took 2 s or more took 1596 of its 2074
# worker-seconds. `tests/long_tests.txt` (written by tests/long_tests.py from a --junitxml
# report) lists those of 1.5 s or more, less the quickest case of each parametrized test and
# the first test of each module; they are marked `long` and run by `make test-tables` (CI runs
# both).
_LONG_TESTS = pathlib.Path(__file__).with_name("long_tests.txt")


def _listed_long_tests() -> frozenset[str]:
    lines = _LONG_TESTS.read_text().splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def _mark_long(items, check: bool) -> None:
    listed = _listed_long_tests()
    seen = set()
    for item in items:
        nodeid = "tests/" + item.nodeid.split("tests/", 1)[-1]
        if nodeid in listed:
            item.add_marker(pytest.mark.long)
            seen.add(nodeid)
    collected = {"tests/" + item.path.name for item in items} if check else set()
    missing = sorted(n for n in listed - seen if n.split("::")[0] in collected)
    assert not missing, f"tests/long_tests.txt names tests that do not exist: {missing}"


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if _in_tables(item):
            item.add_marker(pytest.mark.tables)
    _mark_sampled(items, _whole_modules(config))
    _mark_long(items, _whole_modules(config))
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
