"""Diagnostics (issue 16): `explain` names each guard, the drop that made its lanes dead, and
the user's lines (checked against `diagnostics_fixture.py`'s marked lines)."""

import diagnostics_fixture as fx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diagnostics_fixture import LINES
from helpers import assert_bitwise

import jaxsafe

pytestmark = pytest.mark.no_leak_check

X = jnp.array([1.0, -1.0, 2.0])
FIXTURE = fx.__file__
SHOWN = jaxsafe.Location(FIXTURE, 1, "").shown_file  # relative to the working directory


def _only_guard(report, primitive):
    guards = [g for g in report.guards if g.primitive == primitive]
    assert len(guards) == 1, report
    return guards[0]


def _at(location, mark):
    assert location is not None
    assert (location.file, location.line) == (FIXTURE, LINES[mark]), location


CASES = [  # (function, arguments, guarded primitive, its line, drop primitive, drop's line)
    (fx.issue_19089, (1.0,), "pow", "19089", "select_n", "19089"),
    (fx.two_calls_deep, (X,), "log", "inner log", "select_n", "deep where"),
    (fx.in_scan, (X,), "sqrt", "scan sqrt", "select_n", "scan where"),
    (fx.sliced, (X,), "log", "sliced log", "slice", "slice"),
    (fx.in_shard_map, (X,), "log", "shard body", "select_n", "shard body"),
    (fx.gathered, (X, jnp.array([0, 2])), "log", "gathered log", "gather", "gather"),
    (fx.pooled, (X,), "log", "pooled", "reduce_max", "pooled"),
]


@pytest.mark.parametrize("f, args, primitive, line, drop, drop_line", CASES,
                         ids=[c[0].__name__ for c in CASES])
def test_explain_names_the_guard_the_drop_and_their_lines(f, args, primitive, line, drop,
                                                          drop_line):
    report = jaxsafe.explain(f)(*args)
    guard = _only_guard(report, primitive)
    _at(guard.location, line)
    assert guard.kind == "value" and guard.safe_values[0] == 1.0
    assert [d.primitive for d in guard.drops] == [drop]
    _at(guard.drops[0].location, drop_line)
    text = str(report)
    assert f"{SHOWN}:{LINES[line]}:" in text and f"guarded {primitive}" in text
    assert f"dropped by {drop} at {SHOWN}:{LINES[drop_line]}:" in text


def test_the_hazard_two_calls_deep_is_named_in_its_helper_and_the_drop_in_the_caller():
    guard = _only_guard(jaxsafe.explain(fx.two_calls_deep)(X), "log")
    assert guard.location.function == "_inner"
    assert guard.drops[0].location.function == "two_calls_deep"


def test_a_body_guard_says_which_body_it_is_in():
    scan = _only_guard(jaxsafe.explain(fx.in_scan)(X), "sqrt")
    assert len(scan.inside) == 1 and scan.inside[0].startswith("scan at ")
    shard = _only_guard(jaxsafe.explain(fx.in_shard_map)(X), "log")
    assert shard.inside[0].startswith(f"shard_map at {SHOWN}:")


def test_nan_data_gets_a_stop_gradient_guard_on_the_custom_rule():
    args = (2.0, jnp.array([1.0, jnp.nan]), jnp.array([True, False]))
    report = jaxsafe.explain(fx.nan_data)(*args)
    cut = _only_guard(report, "custom_jvp_call")
    assert cut.kind == "stop-gradient" and cut.safe_values == {0: None}
    _at(cut.location, "nan data")
    _at(cut.drops[0].location, "nan data")
    assert "stop-gradient guard" in str(report)
    # and what it protects: the NaN lane passes nothing (softplus' derivative at 2 * 1.)
    np.testing.assert_allclose(jax.grad(jaxsafe.nan_safe(fx.nan_data))(*args),
                               jax.nn.sigmoid(2.0), rtol=1e-6)


def test_no_location_points_into_jax_or_jaxsafe():
    for f, args, *_ in CASES:
        report = jaxsafe.explain(f)(*args)
        for guard in report.guards:
            for where in (guard.location, *(d.location for d in guard.drops)):
                assert where is not None and where.file == FIXTURE, (f.__name__, where)


def test_the_text_quotes_the_line_and_marks_the_call():
    text = str(jaxsafe.explain(fx.sliced)(X))
    lines = text.splitlines()
    quoted = next(i for i, s in enumerate(lines) if "y = jnp.log(x)" in s)
    marker = lines[quoted + 1]
    column = lines[quoted].index("jnp.log(x)")
    assert marker[column:column + len("jnp.log(x)")] == "^" * len("jnp.log(x)")
    assert lines[-1] == "1 guard; equations: 3 before, 5 after"


def test_the_last_line_counts_the_selections_re_decided():
    """A program can change for a re-decided selection alone (a `max` whose cotangent may be
    inf): the count line says so, beside the guards."""
    def f(x):
        return jnp.sum(jnp.maximum(x, 0.) * x)

    report = jaxsafe.explain(f)(jnp.array([1., -2.]))
    assert not report.guards and len(report.selections) == 1
    assert str(report).splitlines()[-1].startswith("0 guards, 1 re-decided selection; equations:")


def test_a_hand_written_double_where_has_no_guards():
    report = jaxsafe.explain(fx.by_hand)(X)
    assert report.guards == ()
    assert str(report) == "nothing to guard: the program runs unchanged"
    assert report.equations[0] == report.equations[1]
    assert report.diff() == "(no difference: the program runs unchanged)"


def test_diff_shows_the_guard_marked():
    report = jaxsafe.explain(fx.leaky)(X)
    diff = report.diff()
    assert diff.startswith("--- original\n+++ rewritten")
    marked = [s for s in diff.splitlines() if "# <- guarded log" in s]
    assert len(marked) == 1 and marked[0].startswith("+") and "= log " in marked[0]
    assert f"{SHOWN}:{LINES['leaky']}" in marked[0]


def test_explain_returns_the_report_trace_returns():
    explained = jaxsafe.explain(fx.leaky)(X)
    _, traced = jaxsafe.nan_safe(fx.leaky).trace(X)
    assert type(explained) is type(traced) is jaxsafe.Report
    assert explained.guards == traced.guards
    assert repr(explained) == "<jaxsafe.Report: 1 guard>"


def test_guards_are_frozen_data():
    guard = jaxsafe.explain(fx.leaky)(X).guards[0]
    with pytest.raises(AttributeError):
        guard.primitive = "exp"
    assert hash(guard) == hash(jaxsafe.explain(fx.leaky)(X).guards[0])
    assert np.isclose(guard.safe_values[0], 1.0)


# --------------------------------------------------------------------------- diagnose


def test_diagnose_tells_a_leak_from_a_genuine_singularity():
    x = jnp.array([-1.0, 0.0, 4.0])
    plain = jax.grad(fx.leak_and_singularity)(x)
    safe = jax.grad(jaxsafe.nan_safe(fx.leak_and_singularity))(x)
    assert np.isnan(plain[0]) and np.isfinite(safe[0])  # the leak
    assert not np.isfinite(safe[1])  # sqrt(|x|) at 0: the taken branch is singular
    found = jaxsafe.diagnose(fx.leak_and_singularity)(x)
    (leak,), (genuine,) = found.leaks, found.genuine
    assert leak.entries == ((0,),) and genuine.entries == ((1,),)
    _at(leak.origins[0].location, "leak")
    assert [g.primitive for g in leak.guards] == ["sqrt"]
    _at(leak.guards[0].drops[0].location, "leak")
    _at(genuine.origins[0].location, "singularity")
    assert genuine.origins[0].primitive == "sqrt" and genuine.origins[0].derivative
    text = str(found)
    assert "leak: argument 0 entries [0]" in text
    assert "genuine: argument 0 entries [1]" in text
    assert f"the derivative of sqrt at {SHOWN}:{LINES['singularity']}:" in text
    assert f"fed a zero cotangent by the select_n at {SHOWN}:{LINES['leak']}:" in text


def test_diagnose_names_the_derivative_that_leaked():
    found = jaxsafe.diagnose(fx.leaky)(jnp.array([0.0, 1.0]))
    (leak,) = found.leaks
    assert leak.entries == ((0,),) and not found.genuine
    origin = leak.origins[0]
    assert (origin.primitive, origin.derivative) == ("log", True)
    _at(origin.location, "leaky")
    # log(0) = -inf in the dropped lane of the forward pass: harmless
    (masked,) = found.masked
    assert masked.origins[0].primitive == "log" and masked.entries == ((0,),)
    assert "masked: log at" in str(found) and "(harmless)" in str(found)


def test_diagnose_on_the_issue_19089_example_and_on_the_hand_fix():
    found = jaxsafe.diagnose(fx.issue_19089)(1.0)
    (leak,) = found.leaks
    assert leak.entries == ((),) and leak.origins[0].primitive == "pow"
    assert str(found).startswith("leak: argument 0: non-finite in jax.grad")
    clean = jaxsafe.diagnose(fx.by_hand)(X)
    assert clean.leaks == clean.genuine == ()
    assert str(clean) == "the gradient is finite: nothing to diagnose"


def test_diagnose_checks_its_arguments():
    with pytest.raises(TypeError, match="must return a scalar"):
        jaxsafe.diagnose(lambda x: jnp.sqrt(x))(X)
    with pytest.raises(ValueError, match="argnums"):
        jaxsafe.diagnose(fx.leaky, argnums=3)(X)
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda x: jaxsafe.diagnose(fx.leaky)(x).leaks and 0.0)(X)


def test_a_body_left_unguarded_is_still_reported():
    """A scan body whose per-step output the program drops, and whose only leak it leaves (a
    product with an argument that may be NaN, needing a run-time OR of the liveness): the body
    is not rewritten, and `explain` says what was left, as it does outside a body."""
    keep = np.array([[[True, False], [False, False]], [[False, False], [False, True]]])

    def f(w, xs):  # a drop that varies along every axis of each step's output
        ys = jax.lax.scan(lambda c, x: (c, x @ w), 0., xs)[1]
        return jnp.sum(jnp.where(keep, ys, 0.))
    w, xs = jnp.eye(2), jnp.ones((2, 2, 2)).at[1, 0].set(jnp.nan)
    report = jaxsafe.explain(f)(w, xs)
    assert not report.changed and not report.guards
    text = str(report)
    assert "left dot_general operand 0 unguarded" in text and "run-time reduction" in text


def test_diagnose_tells_inf_held_in_dropped_lanes_from_a_singularity():
    # a value net over every step's observations, taken before a `fori_loop` that reads them
    # at its counter and drops the terminal steps: the NaN observations are dropped, but reach
    # w's gradient through the matmul before the loop, which nan_safe does not guard (the
    # counter is a carry: a documented limitation). Not a singularity of the branch that is
    # taken: "left", naming the value that holds them.
    done = jnp.array([[False, True], [False, False], [True, False]])
    obs = jnp.ones((3, 2, 2)).at[0, 1].set(jnp.nan).at[2, 0].set(jnp.nan)

    def returns(w):
        values = jnp.tanh(obs @ w)
        step = lambda i, c: c + jnp.where(done[i], 0.0, values[i])  # noqa: E731
        return jnp.sum(jax.lax.fori_loop(0, 3, step, jnp.zeros(2)))
    w = jnp.array([0.3, -0.5])
    assert np.isnan(np.asarray(jax.grad(jaxsafe.nan_safe(returns))(w))).all()
    found = jaxsafe.diagnose(returns)(w)
    assert not found.genuine and not found.leaks
    (left,) = found.left
    assert left.entries == ((0,), (1,))
    assert "closed-over constant of shape (3, 2, 2)" in left.origins[0].primitive
    assert str(found).startswith("left: argument 0 entries [0], [1]: non-finite under nan_safe")


def test_diagnose_keeps_inf_held_in_a_live_lane_genuine():
    # the same NaN in a lane the program reads: a real NaN of the taken branch (contract 3)
    def f(w, x):
        return jnp.sum(jnp.where(w > -10.0, x * w, 0.0))  # keeps every lane of x * w
    x = jnp.array([1.0, jnp.nan])
    found = jaxsafe.diagnose(f)(jnp.ones(2), x)
    assert not found.left and not found.leaks
    (genuine,) = found.genuine
    assert genuine.entries == ((1,),)
    assert genuine.origins[0].primitive == "inf or NaN held by argument leaf 1"


def test_diagnose_names_an_argument_that_holds_the_leaked_nan():
    # nan_safe fixes it: a leak, from the argument's NaN, fed a zero cotangent by the where
    def f(w, x):
        return jnp.sum(jnp.where(jnp.isfinite(x), x * w, 0.0))
    found = jaxsafe.diagnose(f)(jnp.ones(2), jnp.array([1.0, jnp.nan]))
    (leak,) = found.leaks
    assert leak.entries == ((1,),) and not found.genuine and not found.left
    assert "held by argument leaf 1" in str(found)


def test_diagnose_does_not_call_a_saturated_or_nan_output_a_drop():
    # found by a bug hunt: an input's inf in a live lane looked dropped when the output kept its
    # bits with 1 in its place (exp(-1e3 * x * x) is 0 at 1 too), or was NaN from elsewhere
    saturated = lambda x: jnp.sum(jnp.exp(-1e3 * x * x))  # noqa: E731
    found = jaxsafe.diagnose(saturated)(jnp.array([jnp.inf, 0.5, 2.0]))
    assert not found.left and len(found.genuine) == 1
    nan_loss = lambda x, y: jnp.sum(x * jnp.exp(-x)) + jnp.sum(jnp.sqrt(y))  # noqa: E731
    found = jaxsafe.diagnose(nan_loss)(jnp.array([jnp.inf, 1.0]), jnp.array([-1.0, 4.0]))
    assert not found.left and len(found.genuine) == 1
    assert not found.masked  # the sqrt(-1) reaches the loss: not harmless


def test_diagnose_replaces_every_dropped_input_at_once():
    # two inputs whose NaN meet in one entry (xs @ w + zs @ w before a loop that reads them at
    # its counter and drops their first row): neither replaced alone makes it finite;
    # together they do
    done = jnp.array([True, False])

    def f(xs, zs, w):
        values = xs @ w + zs @ w
        step = lambda i, c: c + jnp.where(done[i], 0.0, values[i])  # noqa: E731
        return jax.lax.fori_loop(0, 2, step, 0.0)
    xs = jnp.ones((2, 2)).at[0, 0].set(jnp.nan)
    zs = jnp.ones((2, 2)).at[0, 1].set(jnp.inf)
    found = jaxsafe.diagnose(f, argnums=2)(xs, zs, jnp.array([0.5, -0.5]))
    assert not found.genuine
    (left,) = found.left
    assert {o.primitive for o in left.origins} == {"inf or NaN held by argument leaf 0",
                                                   "inf or NaN held by argument leaf 1"}


def test_diagnose_reads_past_random_keys():
    """Hunt AY: a PRNG key among the values (made in `f` or passed in) raised a TypeError when
    `diagnose` looked for inf and NaN in it; keys are not floats and are skipped."""
    def made_inside(x):
        noise = jax.random.normal(jax.random.PRNGKey(0), x.shape)
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0) * noise)

    def passed_in(key, x):
        return made_inside(x) + jnp.sum(jax.random.normal(key, x.shape) * x)

    x = jnp.array([-1.0, 4.0])
    for found in (jaxsafe.diagnose(made_inside)(x),
                  jaxsafe.diagnose(passed_in, 1)(jax.random.key(1), x)):
        assert [leak.entries for leak in found.leaks] == [((0,),)], str(found)
        assert found.plain_error is None


def test_diagnose_reports_a_plain_gradient_that_raises():
    """Hunt AY: where plain `jax.grad` raises because a check in the program meets the leak's
    NaN (equinox's in a diffrax solve; here a callback in a `custom_vjp`), `diagnose` says so
    and describes nan_safe's gradient, instead of raising."""
    def check(ct):
        if not np.isfinite(ct).all():
            raise ValueError("non-finite cotangent")

    @jax.custom_vjp
    def checked(x):
        return x

    def backward(_, ct):
        jax.debug.callback(check, ct)
        return (ct,)

    checked.defvjp(lambda x: (x, None), backward)

    def f(x):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(checked(x)), 0.0))

    x = jnp.array([-1.0, 4.0])
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x), jnp.array([0.0, 0.25]))
    found = jaxsafe.diagnose(f)(x)
    assert found.plain_error is not None and "non-finite cotangent" in found.plain_error
    assert not found.leaks and not found.genuine
    assert str(found).startswith("jax.grad raised, and nan_safe's gradient ran: ValueError")
