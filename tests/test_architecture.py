"""The rewrite's architecture: iterative passes, one table of primitive facts, no global state.

- Deep programs: a 10,000-step unrolled chain (about 20,000 equations) and a program of 100,000
  equations rewrite at the default recursion limit, and the rewritten program does not depend on
  the interpreter's stack (the same structure at recursion limits 1,000 and 20,000).
- The table: only jaxsafe/_primitives.py names particular primitives; every row is consistent;
  `register_guard` describes a user primitive in one row.
- Failures inside a pass name the pass, the equation and the user's source line.
- No global side effects: the collector is never off and the user's thresholds come back; no
  jaxpr outlives its rewrite.
"""

import ast
import gc
import pathlib
import sys
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, structure
from jax.interpreters import ad, mlir

import jaxsafe
from jaxsafe import _collector, _rules
from jaxsafe._compat import ClosedJaxpr
from jaxsafe._rewrite import assert_same_signature, rewrite_with_report

P = jax.extend.core.primitives
PACKAGE = pathlib.Path(jaxsafe.__file__).parent


def euler(steps: int):
    """The issue's integrator: a hazard, `steps` unrolled steps, a `where`-guarded log."""
    def f(x):
        y = jnp.sqrt(x)
        for _ in range(steps):
            y = y * 1.0001 + .5
        return jnp.where(x > 0, jnp.log(y), 0.)
    return f


def euler_hand(steps: int):
    """The same integrator with the double where written by hand."""
    def f(x):
        y = jnp.sqrt(jnp.where(x > 0, x, 1.))
        for _ in range(steps):
            y = y * 1.0001 + .5
        return jnp.where(x > 0, jnp.log(y), 0.)
    return f


class recursion_limit:
    def __init__(self, limit: int):
        self.limit = limit

    def __enter__(self):
        self.saved = sys.getrecursionlimit()
        sys.setrecursionlimit(self.limit)

    def __exit__(self, *exc):
        sys.setrecursionlimit(self.saved)


# --------------------------------------------------------------------------- deep programs

@pytest.mark.no_leak_check
def test_an_unrolled_chain_of_300_steps_has_the_hand_fix_gradient():
    """The issue's example: `jax.grad(nan_safe(f))` raised RecursionError at 300 steps."""
    f, hand = euler(300), euler_hand(300)
    xs = jnp.array([-1., 0., 0.5, 2.])
    g = jax.jit(jax.vmap(jax.grad(jaxsafe.nan_safe(f))))(xs)
    assert_close(g, jax.jit(jax.vmap(jax.grad(hand)))(xs))
    assert np.isnan(jax.jit(jax.vmap(jax.grad(f)))(xs)).any()  # the bug it fixes
    assert_bitwise(jaxsafe.nan_safe(f)(xs), jax.jit(f)(xs))


@pytest.mark.no_leak_check
@pytest.mark.slow  # 10 s: make fuzz runs it (make test keeps under its 10 minutes)
def test_a_chain_of_10000_steps_rewrites_the_same_at_recursion_limits_1000_and_20000():
    f = euler(10_000)
    with recursion_limit(1_000):
        closed = jax.make_jaxpr(f)(2.)
        low, low_report = rewrite_with_report(closed)
    with recursion_limit(20_000):
        high, high_report = rewrite_with_report(closed)
    assert len(closed.jaxpr.eqns) > 20_000
    assert structure(low) == structure(high)
    # the hand fix: the sqrt's operand is guarded; the log's is known to be in its domain
    assert [s.eqn.primitive for s in low_report.sites] == [P.sqrt_p]
    assert [s.eqn.primitive for s in high_report.sites] == [P.sqrt_p]
    selects = [e for e in low.jaxpr.eqns if e.primitive is P.select_n_p]
    assert len(selects) == 2  # the guard and the program's own where


@pytest.mark.no_leak_check
@pytest.mark.slow  # 18 s: make fuzz runs it (make test keeps under its 10 minutes)
def test_a_program_of_100000_equations_rewrites_at_the_default_recursion_limit():
    def f(x):
        for _ in range(20_000):
            x = jnp.where(x > .5, jnp.sqrt(x), x * .5) + .25
        return x

    with recursion_limit(1_000):
        closed = jax.make_jaxpr(f)(jnp.ones(3))
        flat_eqns = sum(1 + sum(len(getattr(p, "jaxpr", p).eqns) for p in e.params.values()
                                if hasattr(getattr(p, "jaxpr", p), "eqns"))
                        for e in closed.jaxpr.eqns)
        new, report = rewrite_with_report(closed)
    assert flat_eqns >= 100_000
    assert len(report.sites) == 20_000
    assert all(s.eqn.primitive is P.sqrt_p for s in report.sites)
    assert sum(e.primitive is P.sqrt_p for e in new.jaxpr.eqns) == 20_000


# --------------------------------------------------------------------------- the table

def _named_primitives(path: pathlib.Path) -> list[str]:
    """`<module>.<name>_p` attribute reads in a module's code (docstrings and comments aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.endswith("_p"):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_table_names_particular_primitives():
    """No pass, rule or helper tests for a particular primitive: each primitive's facts are in
    its row (jaxsafe/_primitives.py). jaxsafe/nn.py builds programs, it does not analyse them."""
    offenders = [hit for path in sorted(PACKAGE.glob("*.py"))
                 if path.name not in ("_primitives.py", "nn.py")
                 for hit in _named_primitives(path)]
    assert offenders == []


PROCESS_LOCAL = ("process_index", "process_count", "local_devices", "devices", "device_count",
                 "environ", "getenv", "random", "time", "perf_counter", "getpid", "hostname")


# The one read of the environment allowed: whether an analysis failure raises (`strict`,
# JAXSAFE_STRICT). It never changes a rewritten program: a program whose analysis fails on one
# host fails on every host, which all run the original program or all raise where it is set.
ERROR_POLICY = ("_report.py", "strict")


def test_the_rewrite_reads_nothing_process_local():
    """On many hosts every process traces the same program and must rewrite it the same way:
    no module of the rewrite reads the process, the devices, the environment, the clock or a
    random source (`_collector.py` times nothing either; `nn.py` builds programs)."""
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        exempt: set[int] = set()
        for node in ast.walk(tree):
            if (path.name, getattr(node, "name", None)) == ERROR_POLICY:
                exempt |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in exempt:
                continue
            name = node.attr if isinstance(node, ast.Attribute) else \
                node.id if isinstance(node, ast.Name) else None
            if name in PROCESS_LOCAL:
                offenders.append(f"{path.name}:{node.lineno}: {name}")
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                allowed = {"os"} if path.name == ERROR_POLICY[0] else set()
                offenders += [f"{path.name}:{node.lineno}: import {m}" for m in mods
                              if m.split(".")[0] in ("random", "time", "os", "socket")
                              and m not in allowed]
    assert offenders == []


def test_the_same_program_rewrites_to_the_same_program():
    """Determinism, the other half of the many-hosts argument: two rewrites of one program, by
    fresh `nan_safe` objects with JAX's caches cleared in between, are structurally equal."""
    def f(x, m):
        y = jnp.where(m, jnp.sqrt(x), 0.)
        return jnp.max(jnp.log(jnp.abs(y) + 1.) * x, axis=-1), jnp.sort(y)[..., 2:]
    x = jnp.linspace(-1., 2., 12).reshape(3, 4)
    m = x > 0
    first = jaxsafe.make_jaxpr(f)(x, m)
    jax.clear_caches()
    assert structure(jaxsafe.make_jaxpr(f)(x, m)) == structure(first)


def _self_calls(path: pathlib.Path) -> list[str]:
    """Functions that call themselves by name (`f(...)` or `self.f(...)`)."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            direct = isinstance(f, ast.Name) and f.id == fn.name
            method = (isinstance(f, ast.Attribute) and f.attr == fn.name
                      and isinstance(f.value, ast.Name) and f.value.id == "self")
            if direct or method:
                found.append(f"{path.name}:{fn.name}")
    return found


def test_no_analysis_function_recurses_except_into_nested_bodies():
    """Recursion depth may grow with the nesting of bodies (a scan in a cond in a checkpoint),
    never with the length of a program: walks over producers go through `_walk.demand`."""
    recursive = sorted({hit for path in sorted(PACKAGE.glob("*.py")) for hit in _self_calls(path)})
    assert recursive == ["_rewrite.py:_rewrite_param"]


def test_every_row_is_consistent():
    for prim, rule in _rules.RULES.items():
        where = f"{prim}: {rule}"
        if rule.static is not None or rule.align is not None:
            assert rule.masks is not None, where  # a static rule has its run-time twin
        if rule.selection is not None:
            assert rule.drops(None) and rule.masks is not None and rule.linear, where
        if rule.masked_body is not None:  # a body, or a backward rule the masks seed
            assert rule.nested_params or rule.backward_param, where
        if rule.kinds is not None:
            assert rule.masks is not None and rule.align is None, where
        if rule.decreasing:
            assert rule.guard is not None and 0 in rule.guard.safe, where
        if rule.elementwise:
            assert rule.align is not None and rule.static is not None, where
        assert rule.known, where
        for k in rule.no_derivative:
            assert isinstance(k, int) and k >= 0, where


def test_a_primitive_without_a_row_takes_the_explicit_default():
    foreign = jax.extend.core.Primitive("jaxsafe_test_foreign")
    assert _rules.rule_for(foreign) is _rules.UNKNOWN
    assert not _rules.UNKNOWN.known and _rules.UNKNOWN.masks is None
    # JAX's own: known, no facts
    assert _rules.rule_for(P.reduce_window_p) is _rules.CONSERVATIVE
    assert _rules.CONSERVATIVE.known and _rules.CONSERVATIVE.guard is None


def _user_sqrt(name: str):
    prim = jax.extend.core.Primitive(name)
    prim.def_impl(lambda x: jnp.sqrt(x))
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(jnp.sqrt, multiple_results=False))
    ad.defjvp(prim, lambda t, x: t * 0.5 / prim.bind(x))
    return prim


@pytest.fixture
def table():
    """The rows as shipped, put back after the test."""
    saved = dict(_rules.RULES)
    yield _rules.RULES
    _rules.RULES.clear()
    _rules.RULES.update(saved)


def test_register_guard_describes_a_user_primitive_in_one_row(table):
    prim = _user_sqrt("jaxsafe_test_user_sqrt")
    f = lambda x: jnp.where(x > 0, prim.bind(x), 0.)
    assert "unknown primitive jaxsafe_test_user_sqrt" in str(jaxsafe.explain(f)(1.))
    jaxsafe.register_guard(prim, 1.0)
    row = table[prim]
    assert row.guard is not None and dict(row.guard.safe) == {0: 1.0}
    assert row.elementwise and row.known and not row.foldable  # not run on the host to plan
    assert "guarded jaxsafe_test_user_sqrt" in str(jaxsafe.explain(f)(1.))
    assert jax.grad(jaxsafe.nan_safe(f))(0.) == 0.


def test_register_guard_on_a_known_primitive_changes_its_guard_and_keeps_its_other_facts(table):
    before = table[P.sqrt_p]
    jaxsafe.register_guard(P.sqrt_p, {0: 4.0})
    after = table[P.sqrt_p]
    assert dict(after.guard.safe) == {0: 4.0}
    assert (after.masks, after.bound, after.decreasing, after.align) == (
        before.masks, before.bound, before.decreasing, before.align)


# --------------------------------------------------------------------------- failures

def test_a_failure_inside_a_pass_names_the_pass_the_equation_and_the_source_line(table):
    prim = _user_sqrt("jaxsafe_test_failing_rule")

    def broken_static_rule(eqn, out_syms, ctx):
        raise RuntimeError("a rule that fails")

    _rules.register(prim, masks=lambda *a: [None], static=broken_static_rule)
    f = lambda x: jnp.where(x > 0, prim.bind(x), 0.)  # the line the note must name
    with pytest.raises(RuntimeError, match="a rule that fails") as info:
        jaxsafe.make_jaxpr(f)(1.)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "liveness pass" in notes and "jaxsafe_test_failing_rule" in notes
    assert "test_architecture.py" in notes and "bug in jaxsafe" in notes


def test_outside_strict_mode_a_failed_analysis_runs_the_original_program_with_a_warning(
        table, monkeypatch):
    """A bug in the analysis must not stop a user's program: JAX's own program runs, values
    and derivatives bit for bit, and the warning carries what the strict mode raises."""
    prim = _user_sqrt("jaxsafe_test_failing_rule_fallback")

    def broken_static_rule(eqn, out_syms, ctx):
        raise RuntimeError("a rule that fails")

    _rules.register(prim, masks=lambda *a: [None], static=broken_static_rule)
    f = lambda x: jnp.sum(jnp.where(x > 0, prim.bind(x) * x, 0.))
    x = jnp.array([4.0, -1.0, 0.0])
    monkeypatch.setenv("JAXSAFE_STRICT", "0")
    safe = jaxsafe.nan_safe(f)
    with pytest.warns(jaxsafe.AnalysisFailedWarning, match="a rule that fails") as record:
        g = jax.grad(safe)(x)
    message = str(record[0].message)
    assert "liveness pass" in message and "JAXSAFE_STRICT=1" in message
    np.testing.assert_array_equal(g, jax.grad(f)(x))  # JAX's gradient, its NaN included
    assert np.isnan(g[1])
    np.testing.assert_array_equal(safe(x), jax.jit(f)(x))
    with pytest.warns(jaxsafe.AnalysisFailedWarning):
        report = jaxsafe.explain(f)(x)
    assert report.failure is not None and "a rule that fails" in report.failure
    assert str(report).startswith("the analysis failed") and not report.changed
    with pytest.warns(jaxsafe.AnalysisFailedWarning):
        assert str(jaxsafe.make_jaxpr(f)(x)) == str(jax.make_jaxpr(f)(x))
    monkeypatch.setenv("JAXSAFE_STRICT", "1")
    with pytest.raises(RuntimeError, match="a rule that fails"):
        jaxsafe.make_jaxpr(f)(x)


def test_a_rewritten_body_that_changed_its_signature_is_an_assertion_naming_the_equation():
    closed = jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, x: (c + x, x), 0., x))(
        jnp.ones(3))
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive is P.scan_p)
    body = eqn.params["jaxpr"]
    other = jax.make_jaxpr(lambda c, x: (c + x, x))(jnp.ones(2), 1.)
    assert_same_signature(eqn, body, body)
    with pytest.raises(AssertionError, match="scan .*changed its signature"):
        assert_same_signature(eqn, body, other)


# --------------------------------------------------------------------------- global state

def _guarded(x):
    return jnp.where(x > 0, jnp.sqrt(x), 0.)


def test_the_collector_stays_on_with_fewer_collections_and_the_user_thresholds_come_back(table):
    seen, fail = [], []
    prim = _user_sqrt("jaxsafe_test_collector_probe")

    def probe(eqn, out_syms, ctx):  # runs inside the rewrite's liveness pass
        seen.append((gc.isenabled(), gc.get_threshold()))
        if fail:
            raise RuntimeError("probe")
        return [out_syms[0]]

    _rules.register(prim, masks=lambda eqn, outs, invals, ctx: [outs[0]], static=probe,
                    align=lambda eqn, k: [])
    user = (555, 7, 9)
    saved = gc.get_threshold()
    gc.set_threshold(*user)
    try:
        closed = jax.make_jaxpr(lambda x: _guarded(prim.bind(x)))(1.)
        rewrite_with_report(closed)
        assert seen and all(enabled and threshold == _collector.THRESHOLDS
                            for enabled, threshold in seen)
        assert gc.get_threshold() == user and gc.isenabled()
        fail.append(True)
        with pytest.raises(RuntimeError, match="probe"):  # an error restores them too
            rewrite_with_report(closed)
        fail.clear()
        assert gc.get_threshold() == user
        gc.disable()  # a user who turned collection off is left alone
        seen.clear()
        rewrite_with_report(closed)
        assert seen and all(not enabled and threshold == user for enabled, threshold in seen)
    finally:
        gc.enable()
        gc.set_threshold(*saved)


def test_concurrent_rewrites_leave_the_user_thresholds():
    saved = gc.get_threshold()
    closed = jax.make_jaxpr(euler(200))(2.)
    errors = []

    def work():
        try:
            for _ in range(3):
                rewrite_with_report(closed)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and gc.get_threshold() == saved


def test_no_jaxpr_outlives_its_rewrite():
    """Nothing in jaxsafe keeps a rewritten program, its sweeps or its masks alive (no cache
    keyed by id() outlives the rewrite)."""
    closed = jax.make_jaxpr(lambda x: jnp.where(x > 0, jnp.sqrt(jnp.cos(x) * x), 0.))(
        jnp.ones(3))
    new, report = rewrite_with_report(closed)
    assert report.changed
    refs = [weakref.ref(closed.jaxpr), weakref.ref(new.jaxpr)]
    del closed, new, report
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_an_unchanged_program_is_returned_as_it_is():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.)(1.)
    new, report = rewrite_with_report(closed)
    assert new is closed and not report.changed
    assert isinstance(new, ClosedJaxpr)


def test_make_test_tables_runs_what_make_test_leaves_out():
    """`make test` leaves out what conftest marks `tables` (the later cases of the sweeps
    `_SAMPLED` names, half of the tables `_HALVED_TABLES` names) and `long` (the tests of
    tests/long_tests.txt): `make test-tables` must run the main session's whole folder with
    both markers, or those tests run nowhere."""
    makefile = (pathlib.Path(__file__).parent.parent / "Makefile").read_text()

    def target(name):
        text = makefile[makefile.index(f"\n{name}:"):]
        return text[:text.index("\n\n")]
    test, tables = target("test"), target("test-tables")
    assert '-m "not slow and not libs and not tables and not long"' in test
    assert '-m "(tables or long) and not slow and not libs"' in tables
    main_session = tables[:tables.index("JAX_ENABLE_X64")]
    assert main_session.rstrip().endswith(" tests"), main_session
    main_test = test[:test.index("JAX_ENABLE_X64")]
    ignored = [word.removeprefix("--ignore=") for word in main_test.split()
               if word.startswith("--ignore=")]
    assert all(f"--ignore={name}" in main_session for name in ignored), ignored


def test_long_tests_keeps_quickest_cases_and_module_openers_in_make_test(tmp_path):
    """tests/long_tests.py lists the tests of 1.5 s or more, less the quickest case of a
    parametrized test and the first test of a module (its time holds the module's fixtures)."""
    import long_tests

    report = tmp_path / "report.xml"
    report.write_text("""<testsuites><testsuite>
      <testcase classname="tests.test_a" name="test_opens" time="80"/>
      <testcase classname="tests.test_a" name="test_single" time="3"/>
      <testcase classname="tests.test_a" name="test_quick" time="1.4"/>
      <testcase classname="tests.test_a" name="test_sweep[one]" time="5"/>
      <testcase classname="tests.test_a" name="test_sweep[two]" time="4"/>
      <testcase classname="tests.test_b" name="test_sweep[one]" time="0.1"/>
      <testcase classname="tests.test_b" name="test_sweep[two]" time="2"/>
    </testsuite></testsuites>""")
    assert long_tests.long_tests(str(report), 1.5) == [
        "tests/test_a.py::test_single", "tests/test_a.py::test_sweep[one]",
        "tests/test_b.py::test_sweep[two]"]
    assert long_tests.long_tests(str(report), 6.0) == []
