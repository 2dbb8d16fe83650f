"""Hostile and unusual inputs: nan_safe never crashes on a program it does not understand."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise
from jax import lax

import jaxsafe
from jaxsafe import nan_safe

SAFE_SQRT = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.)


@pytest.mark.parametrize("thing", [3, "sqrt", [jnp.sqrt], (x for x in [1])])
def test_non_callables_are_rejected_by_name(thing):
    with pytest.raises(TypeError, match="`fun` must be callable"):
        nan_safe(thing)


def test_generator_function_is_rejected():
    def gen(x):
        yield x
    with pytest.raises(TypeError, match="generator"):
        nan_safe(gen)


def test_non_array_output_names_the_users_function():
    def returns_text(x):
        return "text"
    with pytest.raises(TypeError, match="returns_text"):
        nan_safe(returns_text)(1.)


def test_python_side_effects_run_once_per_signature_like_jit():
    log = []

    def f(x):
        log.append("traced")
        return SAFE_SQRT(x)
    g = nan_safe(f)
    g(1.), g(2.), jax.grad(g)(3.)
    assert log == ["traced"]


def test_debug_print_keeps_printing(capfd):
    def f(x):
        jax.debug.print("x is {}", x)
        return SAFE_SQRT(x)
    nan_safe(f)(4.)
    jax.block_until_ready(jax.grad(nan_safe(f))(0.))
    out = capfd.readouterr().out
    assert out.count("x is 4.0") == 1 and out.count("x is 0.0") == 1


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0, 2)])
def test_zero_size_arrays(shape):
    x = jnp.zeros(shape)
    assert nan_safe(SAFE_SQRT)(x).shape == shape
    g = jax.grad(lambda x: jnp.sum(nan_safe(SAFE_SQRT)(x)))(x)
    assert g.shape == shape


def test_integer_and_boolean_inputs():
    f = lambda n, b, x: jnp.where(b, jnp.log(x) * n, n.astype(jnp.float32))
    args = (jnp.array([1, 2, 3]), jnp.array([True, False, True]), jnp.array([1., 0., -1.]))
    assert_bitwise(nan_safe(f)(*args), jax.jit(f)(*args))
    g = jax.grad(lambda x: jnp.sum(nan_safe(f)(args[0], args[1], x)))(args[2])
    # lane 2 takes log(-1): the value is NaN, its derivative n / x = -3 is what JAX gives too
    np.testing.assert_array_equal(g, [1., 0., -3.])
    ints = nan_safe(lambda n: n * 2 + 1)(jnp.arange(3))
    assert ints.dtype == jnp.int32 and list(ints) == [1, 3, 5]


def test_complex_inputs():
    f = lambda z: jnp.where(z.real > 0, jnp.log(z), 0.)
    z = jnp.array([0. + 0.j, 1. + 1.j, -2. + 0.j])
    assert_bitwise(nan_safe(f)(z), jax.jit(f)(z))
    loss = lambda g: (lambda z: jnp.sum(jnp.abs(g(z)) ** 2))
    g = jax.grad(loss(nan_safe(f)))(z)
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g[1]), np.asarray(jax.grad(loss(f))(z)[1]), rtol=1e-6)


def test_prng_keys_and_none_leaves():
    def f(params, key):
        noise = jax.random.normal(key, (3,))
        return {"y": SAFE_SQRT(params["w"]) * noise, "nothing": None}
    params = {"w": jnp.array([-1., 0., 4.]), "unused": None}
    key = jax.random.key(0)
    out = nan_safe(f)(params, key)
    assert out["nothing"] is None
    assert_bitwise(out["y"], jax.jit(f)(params, key)["y"])
    g = jax.grad(lambda w: jnp.sum(nan_safe(f)({"w": w, "unused": None}, key)["y"]))(params["w"])
    assert np.all(np.isfinite(np.asarray(g))) and g[0] == 0 and g[1] == 0


def _nested_chain(depth):
    f = SAFE_SQRT
    for i in range(depth):
        if i % 2:
            f = (lambda g: jax.jit(lambda x: g(x) + 0.))(f)
        else:
            f = (lambda g: (lambda x: lax.scan(lambda c, _: (g(c), None), x, None,
                                               length=1)[0]))(f)
    return f


def test_nested_jits_and_scans_as_deep_as_jax_itself_goes():
    # jax 0.10.2 itself stops at about 50 levels of jit-inside-scan nesting under grad (it
    # raises RecursionError at 60 and crashes at 200 with the stack raised), so 40 is the depth
    # that plain JAX differentiates; nan_safe must not be the one to fail.
    f = _nested_chain(40)
    assert np.isnan(jax.grad(f)(0.))
    assert jax.grad(nan_safe(f))(0.) == 0.
    assert jax.grad(nan_safe(f))(4.) == 0.25


@pytest.mark.slow  # 25 s: `make fuzz` (make test stays under ten minutes)
def test_a_chain_of_100_jits_and_scans_in_sequence():
    # Each step's liveness is that of every later step (the scans compute lane by lane), and
    # XLA's compile time of the gradient grows with the square of such a chain of masks: 100
    # steps, not 200 (docs/how-it-works.md, "Limitations").
    def f(x):
        for i in range(100):
            if i % 2:
                x = jax.jit(SAFE_SQRT)(x) + 1.
            else:
                x = lax.scan(lambda c, _: (SAFE_SQRT(c) - 1., None), x, None, length=1)[0]
        return x
    x = jnp.array([-1., 0., 4.])
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    g = jax.jit(jax.grad(lambda x: jnp.sum(nan_safe(f)(x))))(x)
    assert np.all(np.isfinite(np.asarray(g)))


def _long_program(n_eqns):
    def f(x):
        for _ in range(n_eqns // 6):
            x = jnp.where(x > 0, jnp.sqrt(x), x * 0.5) + jnp.sin(x)
        return x
    return f


def test_a_program_of_2k_equations_runs_and_differentiates():
    x = jnp.array([-1., 0., 4.])
    f = _long_program(2_000)
    assert len(jax.make_jaxpr(f)(x).eqns) >= 1_500
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    # XLA's compile time of a linearized 1000-step chain grows fast on CPU (plain JAX's too):
    # differentiate a shorter one, under jit as a training step would be
    g = _long_program(300)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(nan_safe(g)(x))))(x)
    assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.slow
def test_a_program_of_50k_equations_is_rewritten():
    f = _long_program(50_000)
    x = jnp.array([-1., 0., 4.])
    orig = jax.make_jaxpr(f)(x)
    assert len(orig.eqns) >= 40_000
    new = jaxsafe.make_jaxpr(f)(x)
    P = jax.extend.core.primitives
    assert sum(e.primitive is P.sqrt_p for e in new.eqns) == \
        sum(e.primitive is P.sqrt_p for e in orig.eqns)


def test_donation_and_shardings_pass_through_an_outer_jit():
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    f = jax.jit(nan_safe(SAFE_SQRT), donate_argnums=0, in_shardings=sharding,
                out_shardings=sharding)
    x = jax.device_put(jnp.array([-1., 0., 4.]), sharding)
    out = f(x)
    assert out.sharding == sharding
    np.testing.assert_array_equal(out, [0., 0., 2.])
    g = jax.jit(jax.grad(lambda x: jnp.sum(nan_safe(SAFE_SQRT)(x))), in_shardings=sharding)
    np.testing.assert_array_equal(g(jnp.array([-1., 0., 4.])), [0., 0., 0.25])


@pytest.mark.parametrize("op, bad", [
    (jnp.sqrt, -1.), (jnp.log, 0.), (lambda x: 1. / x, 0.), (lambda x: x ** 0.5, -1.),
    (jnp.arcsin, 2.), (jnp.exp, 1e4), (jnp.arctanh, 1.), (jax.scipy.special.gammaln, -1.),
])
@pytest.mark.parametrize("use_jit", [True, False])
def test_debug_nans_raises_no_false_alarm_on_value_guarded_lanes(op, bad, use_jit):
    f = lambda x: jnp.where(x == bad, 0., op(x))
    x = jnp.array([bad, 0.5])
    with jax.debug_nans(True):
        g = jax.grad(lambda x: jnp.sum(nan_safe(f, jit=use_jit)(x)))(x)
    assert g[0] == 0. and np.isfinite(g[1])


@pytest.mark.parametrize("check, edge", [
    ("debug_infs", 1.2345), ("debug_nans", 1.3456), ("transfer_guard", 1.4567)])
def test_the_users_debugging_checks_do_not_stop_the_analysis(check, edge):
    """The analysis folds constants and probes derivatives at points where inf and NaN are
    the expected answers, and reads constants from the device: under the user's
    `jax_debug_infs`, `jax_debug_nans` or a disallowing transfer guard it used to fail, and
    the original program ran unguarded (hunt AT). The constants here are each case's own, so
    that no earlier probe answered them from the cache."""
    weights = np.array([-1.0, edge, 0.0], np.float32)  # NaN and -inf in the log's dropped lanes

    def f(x):
        return jnp.sum(jnp.sqrt(jnp.maximum(x, edge) - edge)) + jnp.sum(
            jnp.where(weights > 0, jnp.log(weights), 0.0) * jnp.where(x > 0, jnp.sqrt(x), 0.0))

    def hand(x):
        clamp = jnp.where(x > edge, jnp.sqrt(jnp.where(x > edge, x - edge, 1.0)), 0.0)
        return jnp.sum(clamp) + jnp.sum(
            jnp.where(weights > 0, jnp.log(jnp.where(weights > 0, weights, 1.0)), 0.0)
            * jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.0)), 0.0))

    x = jnp.array([-1.0, 0.5, 4.0])
    expected = jax.jit(jax.grad(hand))(x)
    checks = {"debug_infs": lambda: jax.debug_infs(True),
              "debug_nans": lambda: jax.debug_nans(True),
              "transfer_guard": lambda: jax.transfer_guard("disallow")}
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsafe.AnalysisFailedWarning)
        with checks[check]():
            got = jax.jit(jax.grad(nan_safe(f)))(x)
            if check != "transfer_guard":  # the user's own eager checks still stop a NaN
                # (JAX keeps an op compiled without them unchecked: they were never turned off)
                numerator = np.float32(edge if check == "debug_infs" else 0.0)
                with pytest.raises(FloatingPointError):
                    lax.div(numerator, np.float32(0.0))
    assert_bitwise(got, expected)


def test_a_nan_safe_function_is_copied_with_its_options():
    """A config or a model holding a `nan_safe` loss is deep-copied: the copy has the same
    options and caches of its own (the lock and the traced programs' tracebacks cannot be
    copied: a TypeError, before and after a call; hunt AT)."""
    import copy

    def loss(x, scale):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0)) * scale

    f = nan_safe(loss, static_argnums=1, finite_args=(True, False), jit=False, cache_size=3)
    x = jnp.array([4.0, -1.0])
    for g in (copy.deepcopy({"loss": f, "lr": 1e-3})["loss"], copy.copy(f)):
        assert g is not f and g.__wrapped__ is loss
        assert g.cache_info()["max_size"] == 3
        assert_bitwise(jax.grad(g)(x, 2.0), jax.grad(f)(x, 2.0))
    f(x, 2.0)  # a traced program with its traceback in the cache
    g = copy.deepcopy(f)
    assert g.cache_info()["size"] == 0
    assert_bitwise(g(x, 3.0), f(x, 3.0))
    for given in (0, (0,), [0], True):  # each form of `finite_args` (hunt AU)
        h = nan_safe(loss, static_argnums=1, finite_args=given)
        for copied in (copy.copy(h), copy.deepcopy(h)):
            assert_bitwise(jax.grad(copied)(x, 2.0), jax.grad(h)(x, 2.0))


def test_default_cache_size_is_documented_and_used():
    assert jaxsafe.DEFAULT_CACHE_SIZE == 256
    assert nan_safe(SAFE_SQRT).cache_info()["max_size"] == 256
    with pytest.raises(TypeError, match="cache_size"):
        nan_safe(SAFE_SQRT, cache_size=-1)
