"""The public surface: decorator forms, caching and tracing, bad input, unknown primitives."""

import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise
from jax.interpreters import ad, mlir

import jaxsafe
from jaxsafe import nan_safe


def test_decorator_forms_keep_name_and_docstring():
    @nan_safe
    def plain(x):
        """Docstring."""
        return jnp.where(x > 0, jnp.log(x), 0.)

    @nan_safe(static_argnums=1)
    def with_static(x, n):
        return jnp.where(x > 0, jnp.log(x), 0.) * n

    assert plain.__name__ == "plain" and plain.__doc__ == "Docstring."
    assert jax.grad(plain)(0.) == 0.
    assert jax.grad(with_static)(0., 3) == 0.
    assert with_static(jnp.e, 3) == 3.


def test_same_signature_traces_once_new_shape_traces_again():
    count = []

    @nan_safe
    def f(x):
        count.append(1)
        return jnp.where(x > 0, jnp.sqrt(x), 0.)

    f(jnp.ones(3))
    f(jnp.zeros(3))
    jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3))
    assert len(count) == 1
    f(jnp.ones(4))
    assert len(count) == 2
    f(jnp.ones(3, jnp.int32))
    assert len(count) == 3
    f(1.)  # weak-typed Python scalar: its own signature
    f(2.)
    assert len(count) == 4


def test_static_values_are_part_of_the_signature():
    count = []

    @nan_safe(static_argnames="mode")
    def f(x, mode):
        count.append(mode)
        return jnp.where(x > 0, jnp.log(x), 0.) if mode == "log" else jnp.sqrt(jnp.abs(x))

    assert f(0., mode="log") == 0. and f(0., mode="log") == 0.
    assert f(4., mode="sqrt") == 2.
    assert count == ["log", "sqrt"]


@pytest.mark.parametrize("order", [(1, True, 1.), (True, 1., 1), (1., 1, True)])
def test_equal_static_values_of_other_types_are_other_signatures(order):
    """`1`, `True` and `1.0` are equal and hash alike; `f` may read the type, and jax.jit keeps
    them apart: so must nan_safe's cache, in values and derivatives, positional, by name and
    beside a leaf that is not an array (the second jit front)."""
    def f(x, k, act=jnp.sin):
        scale = 100. if isinstance(k, bool) else 10. if isinstance(k, float) else 1.
        return act(jnp.where(x > 0, jnp.sqrt(x), 0.)) * scale

    by_position = nan_safe(f, static_argnums=1)
    by_name = nan_safe(f, static_argnames="k")
    for k in order:
        want = jax.jit(f, static_argnums=1)(4., k)
        want_grad = jax.grad(jax.jit(f, static_argnums=1))(4., k)
        assert by_position(4., k) == want and by_name(4., k=k) == want
        assert by_position(4., k, jnp.cos) == jax.jit(f, static_argnums=(1, 2))(4., k, jnp.cos)
        assert jax.grad(by_position)(4., k) == want_grad
        assert jax.grad(by_name)(4., k=k) == want_grad
        assert jax.grad(by_position)(-1., k) == 0.


def test_cache_is_bounded():
    f = nan_safe(lambda x: jnp.where(x > 0, jnp.log(x), 0.), cache_size=2)
    for n in range(1, 6):
        f(jnp.ones(n))
    assert f.cache_info() == {"size": 2, "max_size": 2}


def test_calls_from_threads_with_mixed_shapes():
    f = nan_safe(lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.)))
    results, errors = {}, []

    def work(i):
        try:
            x = jnp.arange(float(i % 3 + 2)) - 1.
            results[i] = (float(f(x)), np.asarray(jax.grad(f)(x)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, (value, grad) in results.items():
        x = np.arange(float(i % 3 + 2)) - 1.
        assert value == pytest.approx(np.sum(np.sqrt(np.maximum(x, 0))))
        assert np.all(np.isfinite(grad))


def test_non_callable_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="`fun` must be callable"):
        nan_safe(3)
    with pytest.raises(TypeError, match="`fun` must be callable"):
        jaxsafe.make_jaxpr("sqrt")


def test_non_array_arguments_are_static_without_being_marked():
    f = nan_safe(lambda x, s: x * len(s))
    assert f(1., "text") == 4. and f(1., "text!") == 5.
    assert f.cache_info()["size"] == 2  # one trace per string, as for a static argument
    g = nan_safe(lambda n, x, opts: x * n if opts["mode"] == "fast" else x, static_argnums=0)
    assert g(2, 1., opts={"mode": "fast"}) == 2. and g(2, 1., opts={"mode": "slow"}) == 1.


def test_unhashable_static_argument_is_a_type_error():
    f = nan_safe(lambda x, opts: x * len(opts), static_argnums=1)
    with pytest.raises(TypeError, match="not hashable"):
        f(1., [1, 2])


def _user_primitive():
    prim = jax.extend.core.Primitive("user_sqrt")
    prim.def_impl(lambda x: jnp.sqrt(x))
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(jnp.sqrt, multiple_results=False))
    ad.defjvp(prim, lambda t, x: t * 0.5 / prim.bind(x))
    return prim


USER_SQRT = _user_primitive()


def test_primitive_without_a_rule_passes_through_and_is_reported():
    f = lambda x: jnp.where(x > 0, USER_SQRT.bind(x), 0.)
    x = jnp.array([0., 4.])
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    assert jnp.array_equal(nan_safe(f)(x), jnp.array([0., 2.]))
    jax.grad(lambda x: jnp.sum(nan_safe(f)(x)))(x)  # runs; unguarded, so it may be NaN
    assert "unknown primitive user_sqrt" in str(jaxsafe.explain(f)(x))


def test_register_guard_makes_a_user_primitive_safe():
    prim = _user_primitive()
    f = lambda x: jnp.where(x > 0, prim.bind(x), 0.)
    assert np.isnan(jax.grad(nan_safe(f))(0.))
    jaxsafe.register_guard(prim, 1.0)
    try:
        assert jax.grad(nan_safe(f))(0.) == 0.
    finally:
        del jaxsafe._rules.RULES[prim]  # keep the table as shipped for the other tests


def test_explain_names_the_source_line():
    f = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.)
    text = str(jaxsafe.explain(f)(1.))
    assert "guarded sqrt" in text and "test_api.py" in text
    assert "nothing to guard" in str(jaxsafe.explain(lambda x: x * 2.)(1.))


def test_make_jaxpr_accepts_static_arguments():
    closed = jaxsafe.make_jaxpr(lambda x, n: jnp.where(x > 0, jnp.log(x), 0.) * n,
                                static_argnums=1)(1., 2)
    assert isinstance(closed, jax.extend.core.ClosedJaxpr)


# --------------------------------------------------------------------------- data-dependent shapes

def test_nonzero_without_size_under_jit_raises_nan_safes_error_and_control_flow_keeps_jaxs():
    with pytest.raises(jaxsafe.DataDependentShapeError, match="jnp.nonzero") as info:
        jax.jit(nan_safe(lambda x: jnp.nonzero(x)[0].sum()))(jnp.ones(3))
    assert isinstance(info.value.__cause__, jax.errors.ConcretizationTypeError)
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(nan_safe(lambda x: x if x > 0 else -x))(1.)


def test_the_where_form_of_issue_19089_gives_the_hand_fix_gradient():
    def f(x):
        delta = jnp.array((0., 1.)) * x
        return jnp.sum(jnp.where(delta > 0, delta ** 0.5, 0.))
    assert np.isnan(jax.grad(f)(1.))
    assert jax.grad(nan_safe(f))(1.) == 0.5
    assert jax.grad(jax.grad(nan_safe(f)))(1.) == -0.25


def test_a_call_that_is_not_differentiated_never_pays_for_the_rewrite(monkeypatch):
    """The rewrite runs when the JVP rule is first traced (or asked for), once per signature."""
    from jaxsafe import _api
    calls = []
    real = _api.rewrite_with_report

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_api, "rewrite_with_report", counting)
    f = jaxsafe.nan_safe(lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.)))
    x = jnp.array([-1.0, 4.0])
    np.testing.assert_array_equal(f(x), 2.0)
    np.testing.assert_array_equal(jax.jit(f)(x), 2.0)
    assert calls == []
    np.testing.assert_array_equal(jax.grad(f)(x), [0.0, 0.25])
    np.testing.assert_array_equal(jax.grad(f)(x), [0.0, 0.25])
    assert calls == [1]
    assert f.trace(x)[1].sites  # the report asks for it: the same rewrite, not a new one
    assert calls == [1]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(static_argnums=5), ValueError, r"`static_argnums` \[5\] out of range: `two` takes 2 "
                                         r"positional arguments \(x, n\)"),
    (dict(static_argnums=-3), ValueError, r"`static_argnums` \[-3\] out of range"),
    (dict(static_argnames="m"), ValueError, r"`static_argnames` \['m'\] name no argument of "
                                            r"`two`; its arguments are: n, x"),
    (dict(static_argnums="n"), TypeError, r"`static_argnums` must be an int or a sequence of "
                                          r"ints .*got 'n'; name arguments with `static_argnames`"),
    (dict(static_argnums=True), TypeError, r"`static_argnums` must be an int"),
    (dict(static_argnames=3), TypeError, r"`static_argnames` must be a str"),
    (dict(jit="no"), TypeError, r"`jit` must be True or False, got 'no'"),
    (dict(cache_size=True), TypeError, r"`cache_size` must be an int >= 0, got True"),
])
def test_bad_options_are_errors_naming_them(kwargs, error, message):
    def two(x, n):
        return x * n
    with pytest.raises(error, match=message):
        nan_safe(two, **kwargs)
    if "jit" not in kwargs and "cache_size" not in kwargs:
        with pytest.raises(error, match=message):
            jaxsafe.explain(two, **kwargs)


def test_finite_args_naming_a_position_the_call_lacks_and_diagnose_argnums_are_errors():
    f = lambda x, n=1: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.)) * n
    x = jnp.array([-1., 4.])
    with pytest.raises(ValueError, match=r"`finite_args` names argument position\(s\) \[7\], "
                                         r"but the function was called with 1 positional"):
        nan_safe(f, finite_args=7)(x)
    assert nan_safe(f, finite_args=-1)(x) == 2.
    def g(x, n=1, *, scale=1.):
        return f(x, n) * scale
    with pytest.raises(ValueError, match=r"`finite_args` gives 3 flags, but `g` takes 2 "
                                         r"positional argument\(s\) \(x, n\)"):
        nan_safe(g, finite_args=(True, False, True))
    with pytest.raises(ValueError, match=r"`finite_args` gives 3 flags"):
        jaxsafe.explain(g, finite_args=(True, False, True))
    assert nan_safe(lambda *a: f(*a), finite_args=(True, False, True))(x, 2) == 4.
    assert nan_safe(f, finite_args=(True, False))(x, 2) == 4.
    assert nan_safe(f, finite_args=(True, False))(x) == 2.
    with pytest.raises(TypeError, match=r"diagnose: `argnums` must be an int or a sequence of "
                                        r"ints .*got 'x'"):
        jaxsafe.diagnose(f, argnums="x")


def test_options_a_signature_with_star_args_can_take():
    def anything(*args, **kwargs):
        return args[0] * len(kwargs)
    f = nan_safe(anything, static_argnums=3, static_argnames="mode")
    assert f(2., mode="a") == 2.
    assert nan_safe(lambda x, n: x * n, static_argnums=None, static_argnames=None)(2., 3.) == 6.
    assert nan_safe(lambda x, n: x * n, static_argnums=-1)(2., 3) == 6.


def test_the_public_names_are_listed_once_and_documented():
    assert sorted(jaxsafe.__all__) == sorted(set(jaxsafe.__all__))
    api = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    for name in jaxsafe.__all__:
        assert hasattr(jaxsafe, name), name
        assert name in api, f"docs/api.md does not mention {name}"
    for fun in (jaxsafe.nan_safe, jaxsafe.register_guard, jaxsafe.register_rule,
                jaxsafe.nn.dot_product_attention):
        assert "!!!" not in fun.__doc__ and "```" not in fun.__doc__  # help() reads it raw


def test_python_control_flow_under_jit_keeps_jax_s_error_and_adds_one_line():
    import traceback

    def branchy(x):
        if x > 0:  # a Python branch on a traced value
            return jnp.sqrt(x)
        return x

    with pytest.raises(jax.errors.TracerBoolConversionError) as plain:
        jax.jit(jax.grad(jax.jit(branchy)))(1.)
    with pytest.raises(jax.errors.TracerBoolConversionError) as ours:
        jax.jit(jax.grad(nan_safe(branchy)))(1.)
    assert str(ours.value) == str(plain.value)  # JAX's own message
    notes = [n for n in getattr(ours.value, "__notes__", []) if n.startswith("nan_safe:")]
    assert len(notes) == 1 and "jnp.where or lax.cond" in notes[0] and "static_argnums" in notes[0]
    assert "\n" not in notes[0]  # one line
    frames = [f.filename for f in traceback.extract_tb(ours.value.__traceback__)]
    assert not any("/jaxsafe/" in f for f in frames), frames
    assert jax.grad(nan_safe(branchy))(4.) == 0.25  # eager: traced at the values


def test_cache_size_zero_traces_every_plain_call_again():
    """`cache_size=0`: every call traces `f` again, so a value and a derivative come from the
    same `f` (jax.jit's own trace cache is not kept either)."""
    scale = [1.0]
    f = lambda x: jnp.where(x > 0, jnp.log(x), 0.) * scale[0]
    h = nan_safe(f, cache_size=0)
    x = jnp.array([0., 2.])
    assert_bitwise(h(x), jax.jit(f)(x))
    scale[0] = 3.0
    assert_bitwise(h(x), jnp.array([0., 3. * jnp.log(2.)]))
    value, grad = jax.value_and_grad(lambda x: h(x).sum())(x)
    assert_bitwise(value, h(x).sum())
    assert_bitwise(grad, jnp.array([0., 1.5]))


def test_make_jaxpr_and_explain_take_shape_dtype_structs_as_jax_make_jaxpr_does():
    g = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.)
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    assert str(jaxsafe.make_jaxpr(g)(spec)) == str(jaxsafe.make_jaxpr(g)(jnp.ones(4)))
    assert "1 guard" in str(jaxsafe.explain(g)(spec))


def test_a_program_over_symbolic_shapes_runs_as_it_is_with_a_warning_that_says_so():
    """jax.export's shape polymorphism: the analysis needs concrete shapes. The program runs
    as `jax.jit(f)` does, and the warning says what to do (not "a bug in jaxsafe")."""
    from jax import export
    f = lambda x: jnp.sqrt(x)[1:]
    gf = jax.jit(jax.grad(lambda x: nan_safe(f)(x).sum()))
    spec = jax.ShapeDtypeStruct(export.symbolic_shape("n"), jnp.float32)
    with pytest.warns(jaxsafe.AnalysisFailedWarning, match="symbolic shapes.*concrete shapes"):
        exported = export.export(gf)(spec)
    x = jnp.array([0., 1., 4.])
    assert_bitwise(exported.call(x), jax.grad(lambda x: f(x).sum())(x))
    assert_bitwise(jax.jit(gf)(x), jnp.array([0., .5, .25]))  # concrete shapes: guarded


@pytest.mark.no_leak_check  # diagnose compiles several programs
def test_diagnose_reports_a_complex_gradient_s_entries_as_complex_numbers(recwarn):
    f = lambda z: jnp.sum(jnp.abs(jnp.where(jnp.abs(z) > 0, jnp.sqrt(z), 0.)))
    z = jnp.array([0j, 1 + 1j])
    diagnosis = jaxsafe.diagnose(f)(z)
    entries = [v for finding in diagnosis.leaks for v in finding.values]
    assert entries and all(isinstance(v, complex) for v in entries)
    assert not [w for w in recwarn if issubclass(w.category, np.exceptions.ComplexWarning)]


def test_assert_no_leaks_names_itself_for_a_function_that_is_not_callable():
    with pytest.raises(TypeError, match="assert_no_leaks: `fun` must be callable"):
        jaxsafe.testing.assert_no_leaks(3, 1.)


def test_a_signature_traced_under_another_configuration_is_traced_again():
    """Hunt AI: the cache keyed by shapes alone reused a program traced under
    `jax.enable_x64(True)` outside it (float64 results where `jax.jit` gives float32), and one
    traced with rank promotion allowed where it raises. The key holds JAX's trace context,
    as `jax.jit`'s does."""
    f = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.) + 0.1 * jnp.arange(2.)  # noqa: E731
    safe = jaxsafe.nan_safe(f)
    x = jnp.array([-1., 2.], jnp.float32)
    with jax.enable_x64(True):
        wide = safe(x)
        assert_bitwise(wide, jax.jit(f)(x))
    assert wide.dtype == jnp.float64
    narrow = safe(x)
    assert narrow.dtype == jnp.float32
    assert_bitwise(narrow, jax.jit(f)(x))
    add = jaxsafe.nan_safe(lambda a, b: a + b)
    with jax.numpy_rank_promotion("allow"):
        assert add(jnp.ones(2), jnp.ones((3, 1))).shape == (3, 2)
    with jax.numpy_rank_promotion("raise"), pytest.raises(ValueError, match="rank_promotion"):
        add(jnp.ones(2), jnp.ones((3, 1)))


def test_a_bad_argument_s_error_names_the_function_and_the_argument():
    """Hunt AI: JAX's error named `functools.partial(<function NanSafeFunction._staged ...>)`
    and the path `args[0]` (`kwargs['y']`), where `jax.jit` names `f` and `x` (`y`)."""
    def energy(x, y=1.):
        return jnp.sqrt(x) * y

    safe = jaxsafe.nan_safe(energy)
    with pytest.raises(TypeError) as error:
        safe(np.array([1, "a"], dtype=object))
    assert "energy" in str(error.value) and "path x" in str(error.value)
    assert "_staged" not in str(error.value)
    with pytest.raises(OverflowError, match="argument path is y"):
        safe(jnp.ones(2), y=2 ** 40)


def test_a_positional_only_static_argument():
    """Hunt AJ: with the jit front carrying the user's signature, the name of a positional-only
    static parameter went to `jax.jit` as a static name, which it rejects."""
    def f(x, k, /):
        return jnp.where(x > 0, jnp.sqrt(x), 0.).sum() * k

    x = jnp.array([1., -1.])
    assert nan_safe(f, static_argnums=1)(x, 3) == jax.jit(f, static_argnums=1)(x, 3)
    assert_bitwise(jax.grad(nan_safe(f, static_argnums=1))(x, 3), jnp.array([1.5, 0.]))
    import operator
    assert_bitwise(nan_safe(operator.mul, static_argnums=1)(x, 3), x * 3)


def test_finite_args_takes_numpy_integer_positions_as_static_argnums_does():
    """Hunt BC 7: `np.int64(1)` and `tuple(np.arange(2))` were refused with a message that said
    positions are accepted. They mean what the Python ints mean."""
    def masked_product(w, data, valid):
        return jnp.sum(jnp.where(valid, w * data, 0.0))
    args = (2.0, jnp.ones(3), jnp.array([True, False, True]))

    def program(finite_args):
        return str(jaxsafe.make_jaxpr(masked_product, finite_args=finite_args)(*args))
    assert program(1) != program(False)  # a finite `data` leaves the product unguarded
    for numpy_form, python_form in [(np.int64(1), 1), (np.int32(-2), -2),
                                    (tuple(np.arange(2)), (0, 1)), ([np.uint8(1)], [1])]:
        assert program(numpy_form) == program(python_form), numpy_form
        assert nan_safe(masked_product, finite_args=numpy_form)(*args) == 4.
    for not_a_position in (1.0, np.float32(1), [np.True_]):
        with pytest.raises(TypeError, match=r"`finite_args` must be True, False, an argument "
                                            r"position"):
            nan_safe(masked_product, finite_args=not_a_position)


def test_static_argnames_naming_a_positional_only_parameter_says_so():
    """Hunt BC 8: the error said `f` has no arguments ("its arguments are: none"); jax.jit says
    the name is positional-only. nan_safe says so too, and gives the position to use."""
    def f(x, n, /):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.)) * n

    x = jnp.array([4., -1.])
    with pytest.raises(ValueError, match="positional-only"):
        jax.jit(f, static_argnames="n")(x, 2)
    with pytest.raises(ValueError, match=r"`static_argnames` \['n'\] names a positional-only "
                                         r"parameter of `f`, which cannot be passed by name; "
                                         r"mark it static by position: static_argnums=1\.$"):
        nan_safe(f, static_argnames="n")
    assert nan_safe(f, static_argnums=1)(x, 2) == jax.jit(f, static_argnums=1)(x, 2)

    def g(x, n, m, /, k=1):
        return x * n * m * k
    with pytest.raises(ValueError, match=r"name positional-only parameters of `g`.*"
                                         r"static_argnums=\(1, 2\)\."):
        jaxsafe.explain(g, static_argnames=("n", "m"))
    with pytest.raises(ValueError, match=r"\['j'\] name no argument of `g`; the arguments it "
                                         r"takes by name are: k\."):
        nan_safe(g, static_argnames="j")


def test_an_eager_call_reads_control_flow_at_the_values_but_not_float_of_an_argument():
    """Hunt BC 6: docs/api.md said an eager call is traced at the values, as an eager jax.grad;
    `if n > 1` is read so (`test_python_control_flow_under_jit_...`), `float(n)` is not: JAX's
    error, now with a line that says to mark `n` static. The gradient is then the hand fix's."""
    x = jnp.array([-1., 0., 4.])

    def hand_fixed(x):
        ok = x > 0
        return jnp.where(ok, jnp.sqrt(jnp.where(ok, x, 1.)), 0.)

    def scaled(x, n):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.) * float(n))

    want = jax.grad(lambda x: jnp.sum(hand_fixed(x)) * 2)(x)
    with pytest.raises(jax.errors.ConcretizationTypeError) as error:
        jax.grad(nan_safe(scaled))(x, 2)
    notes = [n for n in getattr(error.value, "__notes__", []) if n.startswith("nan_safe:")]
    assert len(notes) == 1 and "\n" not in notes[0]
    assert "float()" in notes[0] and "static_argnums=/static_argnames=" in notes[0]
    assert_bitwise(jax.grad(nan_safe(scaled, static_argnums=1))(x, 2), want)
    with pytest.raises(jax.errors.ConcretizationTypeError) as under_jit:
        jax.jit(nan_safe(scaled))(x, 2)
    assert any("but not float()" in n for n in under_jit.value.__notes__)
