"""Non-finite data: inf and NaN that arrive in arguments, constants and literals, not from a
NaN-prone primitive (issue 12).

Each case is compared with the hand-written double where (the reference), first and second
order, eager, under jit and under vmap; forward values bitwise equal to `jax.jit(f)`.
"""

import functools

import jax
import jax.numpy as jnp
import jax.scipy.special as sp
import jax.scipy.stats as stats
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite, structure
from jax import lax

import jaxsafe

nan, inf = np.nan, np.inf

# library functions and many small compiled programs: run without jax.checking_leaks,
# which turns JAX's caches off and doubles the time (the modules of the rewrite itself check
# for leaks on every test).
pytestmark = pytest.mark.no_leak_check
DATA = jnp.array([1., nan, 2., inf])
VALID = jnp.array([True, False, True, False])
VALID_NP = np.array([True, False, True, False])


def _clean(data, valid):
    return jnp.where(valid, data, 0.)


# (name, f(b, data), hand(b, data)): the mask is an argument-independent constant of f, or
# passed through a closure over an argument below.
CONSTANT_MASKS = [
    ("closed-over numpy mask",
     lambda b, d: jnp.where(VALID_NP, b * d, 0.).sum(),
     lambda b, d: jnp.where(VALID_NP, b * _clean(d, VALID_NP), 0.).sum()),
    ("tril mask",
     lambda b, d: jnp.where(jnp.tril(jnp.ones((2, 2), bool)).ravel(), b * d, 0.).sum(),
     lambda b, d: jnp.where(jnp.tril(jnp.ones((2, 2), bool)).ravel(),
                            b * _clean(d, jnp.tril(jnp.ones((2, 2), bool)).ravel()), 0.).sum()),
    ("iota mask",
     lambda b, d: jnp.where(jnp.arange(4) % 2 == 0, b * d, 0.).sum(),
     lambda b, d: jnp.where(jnp.arange(4) % 2 == 0,
                            b * _clean(d, jnp.arange(4) % 2 == 0), 0.).sum()),
    ("literal predicate",
     lambda b, d: lax.select(False, b * d, jnp.ones_like(d)).sum() * b,
     lambda b, d: lax.select(False, b * jnp.zeros_like(d), jnp.ones_like(d)).sum() * b),
]


def _check_all_orders(f, hand, args, argnums=0):
    """Forward bitwise; grad, grad of grad, under jit; hand fix as the reference."""
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(*args), jax.jit(f)(*args))
    # the hand fix compiled once per order: nan_safe's eager and jitted derivatives against it
    g, want = jax.grad(safe, argnums)(*args), jax.jit(jax.grad(hand, argnums))(*args)
    assert_close(g, want)
    assert_close(jax.jit(jax.grad(safe, argnums))(*args), want)
    gg = jax.grad(jax.grad(safe, argnums), argnums)
    hh = jax.grad(jax.grad(hand, argnums), argnums)
    assert_close(gg(*args), jax.jit(hh)(*args))
    return g


def _matches_the_hand_fix(loss, by_hand, args, argnums=(0,), tol=(1e-6, 0.),
                          hessian_tol=(1e-6, 0.)):
    """Forward bitwise `jax.jit(loss)`'s; each gradient in `argnums` and the Hessian in the
    first argument the hand fix's (`tol`, `hessian_tol`: rtol and atol)."""
    safe = jaxsafe.nan_safe(loss)
    assert_bitwise(safe(*args), jax.jit(loss)(*args))
    for k in argnums:
        assert_close(jax.grad(safe, k)(*args), jax.grad(by_hand, k)(*args), rtol=tol[0],
                     atol=tol[1])
    assert_close(jax.hessian(safe)(*args), jax.hessian(by_hand)(*args), rtol=hessian_tol[0],
                 atol=hessian_tol[1])


def test_a_padded_batch_with_its_validity_mask_as_an_argument():
    def loss(b, data, valid):
        return jnp.where(valid, b * data, 0.).sum()

    def hand(b, data, valid):
        return jnp.where(valid, b * _clean(data, valid), 0.).sum()

    args = (2., DATA, VALID)
    assert np.isnan(jax.grad(loss)(*args))  # the bug
    g = _check_all_orders(loss, hand, args)
    assert g == 3.0
    # the data's own gradient: b where valid, 0 in the padding
    assert_close(jax.grad(jaxsafe.nan_safe(loss), 1)(*args), jnp.array([2., 0., 2., 0.]))
    # a batch of such rows under vmap
    datas = jnp.stack([DATA, DATA[::-1]])
    valids = jnp.stack([VALID, VALID[::-1]])
    vg = jax.vmap(jax.grad(jaxsafe.nan_safe(loss)), (None, 0, 0))(2., datas, valids)
    assert_close(vg, jax.vmap(jax.grad(hand), (None, 0, 0))(2., datas, valids))
    assert_close(vg, jnp.array([3., 3.]))


@pytest.mark.parametrize("name, f, hand", CONSTANT_MASKS, ids=[c[0] for c in CONSTANT_MASKS])
def test_a_constant_mask_over_non_finite_data(name, f, hand):
    args = (2., DATA)
    assert not np.isfinite(jax.grad(f)(*args))  # the bug
    _check_all_orders(f, hand, args)  # the tril mask keeps the inf lane: a real inf
    vg = jax.vmap(jax.grad(jaxsafe.nan_safe(f)))(jnp.array([1., 2.]), jnp.stack([DATA, DATA]))
    assert_close(vg, jax.vmap(jax.grad(hand))(jnp.array([1., 2.]), jnp.stack([DATA, DATA])))


UNARY = [
    ("x * x", lambda x: x * x),
    ("x ** 3", lambda x: x ** 3),
    ("square", jnp.square),
    ("sin", jnp.sin),
    ("tanh", jnp.tanh),
    ("cos", jnp.cos),
    ("sinc", jnp.sinc),
    ("x * exp(x)", lambda x: x * jnp.exp(x)),
]


@pytest.mark.parametrize("name, op", UNARY, ids=[c[0] for c in UNARY])
def test_non_finite_inputs_in_the_dropped_lanes_of_ops_safe_for_finite_inputs(name, op):
    def f(x):
        return jnp.where(x > 0, op(x), 0.)

    def hand(x):
        return jnp.where(x > 0, op(jnp.where(x > 0, x, 0.5)), 0.)

    xs = jnp.array([-inf, nan, -1., 0.5, 2.])
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(xs), jax.jit(f)(xs))
    for fn, ref in [(jax.grad(lambda x: safe(x).sum()), jax.grad(lambda x: hand(x).sum())),
                    (jax.vmap(jax.grad(safe)), jax.vmap(jax.grad(hand))),
                    (jax.vmap(jax.grad(jax.grad(safe))), jax.vmap(jax.grad(jax.grad(hand)))),
                    (jax.jacfwd(safe), jax.jacfwd(hand))]:
        want = jax.jit(ref)(xs)  # the hand fix compiled once: nan_safe eager and jitted
        assert_close(fn(xs), want, rtol=1e-5)
        assert_close(jax.jit(fn)(xs), want, rtol=1e-5)


def test_live_lanes_keep_their_derivative_within_the_hand_fix_rounding():
    """Where `jax.grad(f)` is finite, nan_safe's gradient differs from it by no more than the
    hand fix's does, plus one rounding: the guards touch dropped lanes only, but XLA may fuse
    (and so round) the guarded program differently, as it does the hand-fixed one."""
    def f(w, x, valid):
        return jnp.where(valid, jnp.tanh(w * x) * x, 0.).sum()

    def hand(w, x, valid):
        return f(w, jnp.where(valid, x, 0.), valid)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=64).astype(np.float32))
    valid = jnp.asarray(rng.random(64) > .3)
    for w in [0.3, 1.7, -2.1]:
        plain = jax.jit(jax.grad(f, (0, 1)))(w, x, valid)
        safe = jax.jit(jax.grad(jaxsafe.nan_safe(f), (0, 1)))(w, x, valid)
        by_hand = jax.jit(jax.grad(hand, (0, 1)))(w, x, valid)
        for p, s, h in zip(plain, safe, by_hand, strict=True):
            p, s, h = (np.asarray(a, np.float64) for a in (p, s, h))
            ulp = np.spacing(np.abs(p).astype(np.float32)).astype(np.float64)
            assert np.all(np.abs(s - p) <= np.abs(h - p) + ulp), (s - p, h - p)


def test_key_padding_in_attention_is_guarded_by_column():
    """NaN in the padded keys and values: q @ k.T drops the padded columns for every query, so
    k's padded rows are guarded with the key mask alone (no reduction over queries)."""
    def attention(q, k, v, key_valid):
        s = q @ k.T
        s = jnp.where(key_valid[None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.sum(jnp.sin(p @ jnp.where(key_valid[:, None], v, 0.)))

    def hand(q, k, v, key_valid):
        return attention(q, jnp.where(key_valid[:, None], k, 0.), v, key_valid)

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(5, 4)).astype(np.float32)) for _ in range(3))
    key_valid = jnp.array([True, True, False, True, False])
    k = k.at[2].set(nan).at[4].set(inf)
    v = v.at[2].set(nan)
    assert np.isnan(jax.grad(attention)(q, k, v, key_valid)).any()  # the bug
    for argnum in (0, 1, 2):
        got = jax.grad(jaxsafe.nan_safe(attention), argnum)(q, k, v, key_valid)
        assert_close(got, jax.grad(hand, argnum)(q, k, v, key_valid), rtol=1e-5)


def test_a_relu_mlp_with_no_padding_pays_no_reduction():
    """A weight that only ReLU drops, row by row, would need a run-time reduction per layer:
    left unguarded and reported. What changes is elementwise: each ReLU is selected on its
    decision, since its cotangent (a weight that may hold inf) may be non-finite
    (test_cotangents.py); promised finite weights leave the program the original."""
    def mlp(params, x):
        for w in params[:-1]:
            x = jnp.maximum(x @ w, 0.)
        return (x @ params[-1]).sum()

    rng = np.random.default_rng(2)
    params = [jnp.asarray(rng.normal(size=s).astype(np.float32))
              for s in [(8, 16), (16, 16), (16, 1)]]
    x = jnp.asarray(rng.normal(size=(4, 8)).astype(np.float32))
    closed, report = jaxsafe.nan_safe(mlp).trace(params, x)
    plain = jax.make_jaxpr(mlp)(params, x)

    def heavy(c):
        return [e.primitive for e in c.eqns if e.primitive.name.startswith(("reduce", "dot"))]
    assert heavy(closed) == heavy(plain)
    assert report.skipped and report.selections and not report.sites
    assert structure(jaxsafe.make_jaxpr(mlp, finite_args=True)(params, x)) == structure(plain)


def test_finite_args_drops_the_data_guards():
    def loss(b, data, valid):
        return jnp.where(valid, b * data, 0.).sum()

    args = (2., DATA, VALID)
    plain = jax.make_jaxpr(loss)(*args)
    assert structure(jaxsafe.make_jaxpr(loss)(*args)) != structure(plain)
    for finite in (True, (1,), 1, (True, True, False), (False, True)):
        traced = jaxsafe.make_jaxpr(loss, finite_args=finite)(*args)
        assert structure(traced) == structure(plain), finite
    # a broken promise: NaN in the dropped lanes' derivative, never a wrong live value
    g = jax.grad(jaxsafe.nan_safe(loss, finite_args=True))(*args)
    assert np.isnan(g)
    clean = jnp.array([1., 5., 2., 7.])
    assert_close(jax.grad(jaxsafe.nan_safe(loss, finite_args=True))(2., clean, VALID), 3.)


def test_finite_args_as_a_pytree_prefix():
    def loss(p, valid):
        return jnp.where(valid, p["w"] * p["data"], 0.).sum()

    p = {"w": 2., "data": DATA}
    g = jax.grad(jaxsafe.nan_safe(loss, finite_args=({"w": True, "data": False}, False)))(
        p, VALID)
    assert g["w"] == 3.0
    g = jax.grad(jaxsafe.nan_safe(loss, finite_args=({"w": False, "data": True},)))(p, VALID)
    assert np.isnan(g["w"])  # the promise about data is broken


@pytest.mark.parametrize("bad", ["yes", 1.5, [0.5], ({"w": "x"},), None])
def test_finite_args_rejects_what_it_cannot_read(bad):
    with pytest.raises(TypeError, match="finite_args"):
        jaxsafe.nan_safe(lambda x: x, finite_args=bad)


def test_finite_args_prefix_mismatch_names_the_argument():
    f = jaxsafe.nan_safe(lambda p: p["a"] * 2., finite_args=({"b": True},))
    with pytest.raises(ValueError, match=r"finite_args\[0\]"):
        f({"a": 1.})


def test_a_literal_predicate_makes_the_unselected_side_dead():
    """jax-ml/jax#20601: `lax.select(False, beta * x, 1.)` with x NaN."""
    def f(beta, x):
        return lax.select(False, beta * x, 1.)

    assert np.isnan(jax.grad(f)(2., nan))
    assert jax.grad(jaxsafe.nan_safe(f))(2., nan) == 0.
    assert jax.grad(jaxsafe.nan_safe(f), 1)(2., nan) == 0.
    # and a NaN-prone primitive on the dead side is guarded the same way
    g = jax.grad(jaxsafe.nan_safe(lambda x: lax.select(False, jnp.sqrt(x), 1.)))(-1.)
    assert g == 0.


def test_a_non_finite_constant_is_checked_not_assumed():
    table = np.array([1., nan, 3., inf], np.float32)

    def f(b):
        return jnp.where(VALID_NP, b * table, 0.).sum()

    assert np.isnan(jax.grad(f)(2.))
    assert jax.grad(jaxsafe.nan_safe(f))(2.) == 4.0
    finite_table = np.array([1., 2., 3., 4.], np.float32)
    g = lambda b: jnp.where(VALID_NP, b * finite_table, 0.).sum()  # noqa: E731
    closed = jaxsafe.make_jaxpr(g, finite_args=True)(2.)
    assert structure(closed) == structure(jax.make_jaxpr(g)(2.))


def test_a_real_singularity_of_the_taken_branch_stays():
    def f(b, data, valid):
        return jnp.where(valid, b * data, 0.).sum()

    data = jnp.array([1., nan, 2., inf])
    valid = jnp.array([True, True, True, False])  # the NaN is in a live lane
    assert np.isnan(jax.grad(jaxsafe.nan_safe(f))(2., data, valid))
    assert np.isnan(jaxsafe.nan_safe(f)(2., data, valid))


def _scan_program(guard_by_hand: bool):
    def f(x):
        def body(c, _):
            safe_c = jnp.where(c >= 0, 0., c) if guard_by_hand else c
            return c + jnp.where(c >= 0, c, jnp.sin(safe_c)), c
        return lax.scan(body, x, None, length=3)[1].sum()
    return f


def test_a_body_input_that_may_be_non_finite_is_guarded_inside_the_body():
    """+inf in a scan's carry: the body's `where` drops `sin(c)`, whose derivative at inf is NaN."""
    f, hand = _scan_program(False), _scan_program(True)
    xs = jnp.array([inf, -1., 2.])
    assert np.isnan(jax.vmap(jax.grad(f))(xs)).any()
    got = jax.vmap(jax.grad(jaxsafe.nan_safe(f)))(xs)
    assert_close(got, jax.vmap(jax.grad(hand))(xs))
    assert np.isfinite(got).all()
    assert_bitwise(jaxsafe.nan_safe(f)(xs[0]), jax.jit(f)(xs[0]))


def test_a_body_input_computed_from_finite_arguments_is_finite():
    """What a body receives is judged from the program around it: promised-finite arguments
    through finite-preserving primitives leave the body unchanged, in a scan (carry fixpoint),
    a cond and a while loop."""
    def cond_program(x, s):
        return lax.cond(s > 0, lambda u: u, lambda u: jnp.where(u >= 0, u, jnp.sin(u)), x * 2.)

    def while_program(x):
        def body(c):
            i, v = c
            return i + 1, v + jnp.where(v >= 0, v, jnp.sin(v))
        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    for f, args in [(_scan_program(False), (1.,)), (cond_program, (1., 1.)),
                    (while_program, (1.,))]:
        closed = jaxsafe.make_jaxpr(f, finite_args=True)(*args)
        assert structure(closed) == structure(jax.make_jaxpr(f)(*args))
        assert structure(jaxsafe.make_jaxpr(f)(*args)) != structure(closed)


def test_a_hazard_before_a_body_makes_its_input_possibly_non_finite():
    """log(x) of a promised-finite x is NaN at x < 0 in a lane the scan's body then drops."""
    def f(x):
        def body(c, _):
            return jnp.where(c >= 0, c, jnp.sin(c)) + 1., c
        return lax.scan(body, jnp.log(x), None, length=2)[0]

    closed = jaxsafe.make_jaxpr(f, finite_args=True)(1.)
    assert structure(closed) != structure(jax.make_jaxpr(f)(1.))


def test_an_operand_read_twice_is_guarded_once():
    """`d * d` (a squared distance): one select for both reads. Two identical selects are not
    merged by XLA once differentiated (each has its own transpose), which cost 16% of a
    Lennard-Jones step."""
    def f(x):
        return jnp.where(x > 0, x * x, 0.)

    closed = jaxsafe.make_jaxpr(f)(jnp.ones(3))
    selects = [e for e in closed.jaxpr.eqns if e.primitive is lax.select_n_p]
    assert len(selects) == 2  # the guard and the program's own where
    (mul,) = [e for e in closed.jaxpr.eqns if e.primitive is lax.mul_p]
    assert mul.invars[0] is mul.invars[1] is selects[0].outvars[0]
    xs = jnp.array([-inf, nan, 2.])
    assert_close(jax.vmap(jax.grad(jaxsafe.nan_safe(f)))(xs), jnp.array([0., 0., 4.]))


@functools.cache
def _edge_ops():
    from transparency_cases import STATS, WRAPPED, inputs
    x = np.asarray(inputs("unary", jnp.float32)[0])
    ops = [w for w in WRAPPED + STATS if "float32" in w.dtypes]
    return x, ops


# "none" drops every lane (each edge value, dropped); "even" and "odd" (taken lanes beside
# dropped ones) run in `make fuzz`: `make test` stays under ten minutes
@pytest.mark.parametrize("pattern", [pytest.param("even", marks=pytest.mark.slow),
                                     pytest.param("odd", marks=pytest.mark.slow), "none"])
def test_library_functions_with_edge_values_in_lanes_a_constant_mask_drops(pattern):
    """Every wrapped jax.numpy / jax.nn / jax.scipy.special function of the transparency suite,
    behind a closed-over NumPy mask that drops +-inf, NaN, +-max, 0, -0 and subnormals in turn
    (or every lane): a dropped lane's derivative is exactly the other side's (1), a taken lane's
    is plain JAX's on the same program where that is finite."""
    x, ops = _edge_ops()
    n = x.shape[0]
    keep = {"even": np.arange(n) % 2 == 0, "odd": np.arange(n) % 2 == 1,
            "none": np.zeros(n, bool)}[pattern]

    for start in range(0, len(ops), _EDGE_CHUNK):
        _check_edge_chunk(x, keep, ops[start:start + _EDGE_CHUNK])


# Functions per program: one program of all 166 takes XLA about 15 times as long to compile as
# chunks of 24 do (compile time grows faster than the program).
_EDGE_CHUNK = 24


def _check_edge_chunk(x, keep, ops):
    def f(xs):
        return [jnp.where(keep, w.op(v), v) for w, v in zip(ops, xs, strict=True)]

    xs = [jnp.asarray(x)] * len(ops)
    loss = lambda fn: lambda xs: sum(jnp.sum(y) for y in fn(xs))  # noqa: E731
    grads = jax.jit(jax.grad(loss(jaxsafe.nan_safe(f))))(xs)
    for w, g in zip(ops, grads, strict=True):
        np.testing.assert_array_equal(np.asarray(g)[~keep], 1.0, err_msg=w.id)
    if not keep.any():
        return  # every lane dropped: no taken lane to compare with plain JAX
    # the reference for taken lanes: the same program without nan_safe, under jit (a program
    # of another shape, such as vmap of grad of the function alone, fuses differently: at
    # x = -max, 2 * x overflows in one and not the other)
    plain = jax.jit(jax.grad(loss(f)))(xs)
    for w, g, branch in zip(ops, grads, plain, strict=True):
        # taken lanes: where plain JAX's derivative is finite, the same (where it is not, it may
        # be JAX's own where-bug inside the function: sp.entr at x < 0)
        g, branch = np.asarray(g)[keep], np.asarray(branch)[keep]
        finite = np.isfinite(branch)
        # (atol: XLA flushes a subnormal derivative to 0 in one fusion and not in another)
        np.testing.assert_allclose(g[finite], branch[finite], rtol=1e-5,
                                   atol=float(np.finfo(np.float32).tiny), err_msg=w.id)



# ----------------------------------------------------------------- what a NaN test taints

def _root_or_zero(x, w):
    """`nan_to_num` drops the lanes where `sqrt` made NaN (x * w < 0): the program's own test."""
    return jnp.sum(jnp.nan_to_num(jnp.sqrt(x * w)))


def _root_or_zero_by_hand(x, w):
    h = x * w
    return jnp.sum(jnp.where(h >= 0, jnp.sqrt(jnp.where(h >= 0, h, 1.)), 0.))


def test_a_nan_test_taints_only_ancestors_that_may_be_non_finite():
    x = jnp.array([1., -2., 3., -0.5])
    w = jnp.array([2., 1., -1., -4.])
    _, report = jaxsafe.nan_safe(_root_or_zero, finite_args=True).trace(x, w)
    # x * w is finite wherever x and w are: only sqrt, whose NaN the test catches, is guarded
    assert [site.eqn.primitive.name for site in report.sites if site.replace] == ["sqrt"]
    for order in (jax.grad, jax.hessian):
        safe = order(jaxsafe.nan_safe(_root_or_zero, finite_args=True), (0, 1))(x, w)
        assert_close(safe, order(_root_or_zero_by_hand, (0, 1))(x, w))
    assert np.isnan(jax.grad(_root_or_zero)(x, w)).any()  # what plain JAX gives


def test_a_nan_test_still_taints_an_argument_that_may_be_nan():
    x = jnp.array([1., nan, 3.])
    w = jnp.array([2., 1., -1.])
    grads = jax.grad(jaxsafe.nan_safe(_root_or_zero), (0, 1))(x, w)
    # the reference: JAX on the program without the dropped lanes (1 and 2)
    live = jnp.array([0])
    expected = jax.grad(lambda a, b: _root_or_zero(a[live], b[live]), (0, 1))(x, w)
    assert_close(grads, expected)


C = jnp.array([2., 4., -8.])


def _scaled(x, c):
    return jnp.sum(jnp.where(jnp.abs(x) < 1, x / c, 0.))


def _scaled_by_hand(x, c):
    keep = jnp.abs(x) < 1
    return jnp.sum(jnp.where(keep, jnp.where(keep, x, 0.) / c, 0.))


def test_a_known_constant_takes_no_tangent_so_nothing_guards_its_derivative():
    f = lambda x: _scaled(x, C)  # noqa: E731
    x = jnp.array([0.5, inf, nan])
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    assert_close(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(f)(x))


def test_a_closed_over_tracer_is_differentiated_so_its_derivative_is_guarded():
    x = jnp.array([0.5, inf, nan])

    def through(c, g):
        return g(lambda x: _scaled(x, c))(x)

    safe = jax.grad(through)(C, jaxsafe.nan_safe)
    assert_close(safe, jax.grad(lambda c: _scaled_by_hand(x, c))(C))
    assert np.isnan(jax.grad(through)(C, lambda f: f)).any()  # plain JAX: -inf / c ** 2 * 0


# ------------------------------------------------------- a padded batch through a classifier

def _cross_entropy(w, x, labels, valid):
    logp = jax.nn.log_softmax(x @ w)
    nll = -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
    return jnp.sum(jnp.where(valid, nll, 0.))


def _cross_entropy_by_hand(w, x, labels, valid):
    return _cross_entropy(w, jnp.where(valid[:, None], x, 0.), labels, valid)


def test_nan_padding_rows_through_a_linear_layer_and_cross_entropy():
    """The row liveness of the logits is the OR over the row of the lanes the label gather
    picks (and of logsumexp's row): proven the same along the row, so the NaN rows of `x` get
    a guard without a run-time reduction (`_symbolic._implied_by_reduction`)."""
    x = jnp.concatenate([jnp.arange(6.).reshape(2, 3) / 5, jnp.full((2, 3), nan)])
    w = jnp.arange(9.).reshape(3, 3) / 10 - 0.3
    labels, valid = jnp.array([0, 2, 1, 0]), jnp.array([True, True, False, False])
    assert np.isnan(jax.grad(_cross_entropy)(w, x, labels, valid)).all()
    _, report = jaxsafe.nan_safe(_cross_entropy).trace(w, x, labels, valid)
    assert any(site.eqn.primitive.name == "dot_general" and 0 in site.replace
               for site in report.sites)
    for order in (jax.grad, jax.hessian):
        assert_close(order(jaxsafe.nan_safe(_cross_entropy))(w, x, labels, valid),
                     order(_cross_entropy_by_hand)(w, x, labels, valid), rtol=1e-5)


def _log_softmax_by_lax_reduce(z):
    """A log-softmax whose row max is a generic `lax.reduce` with `lax.max` from a finite start
    (as `jaxsafe.nn` takes it): the reduction is read row by row."""
    lowest = np.array(np.finfo(z.dtype).min, z.dtype)
    row_max = lax.reduce(lax.stop_gradient(z), lowest, lax.max, (1,))[:, None]
    shifted = z - row_max
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=1, keepdims=True))


CLASSES = np.array([[True, True, False]] * 2 + [[True, False, True]] * 2)
NORMALIZERS = {
    "jaxsafe.nn.log_softmax": lambda z: jaxsafe.nn.log_softmax(z, axis=-1),
    "log of jaxsafe.nn.softmax": lambda z: jnp.log(jaxsafe.nn.softmax(z, axis=-1)),
    "jaxsafe.nn.logsumexp": lambda z: z - jaxsafe.nn.logsumexp(z, axis=-1, keepdims=True),
    "lax.reduce max": _log_softmax_by_lax_reduce,
    # a constant mask along the row: the rows' liveness runs along the class axis too, and the
    # guard of `x` takes the coarser mask the row predicate names (`Site.coarse`)
    "jax.nn.log_softmax where=constant": lambda z: jax.nn.log_softmax(z, axis=-1, where=CLASSES),
    "jaxsafe.nn.log_softmax where=constant":
        lambda z: jaxsafe.nn.log_softmax(z, axis=-1, where=CLASSES),
}


@pytest.mark.parametrize("name", NORMALIZERS)
def test_padded_rows_through_jaxsafe_nn_are_guarded_as_through_jax_nn(name):
    """`jaxsafe.nn`'s functions inside `nan_safe` (contract 2): their custom rules have lane-to-
    lane bodies (`_liveness_rules.custom_rule_syms`) and their row max is a generic reduction
    (its row), so the NaN rows of `x` are guarded in `x` itself, as after `jax.nn.log_softmax`,
    and every derivative is the hand fix's. Before, every entry of the gradient was NaN."""
    normalize = NORMALIZERS[name]

    def loss(w, x, labels, valid):
        logp = normalize(x @ w)
        nll = -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
        return jnp.sum(jnp.where(valid, nll, 0.))

    def by_hand(w, x, labels, valid):
        return loss(w, jnp.where(valid[:, None], x, 0.), labels, valid)

    x = jnp.concatenate([jnp.arange(6.).reshape(2, 3) / 5, jnp.full((2, 3), nan)])
    w = jnp.arange(9.).reshape(3, 3) / 10 - 0.3
    labels, valid = jnp.array([0, 2, 1, 0]), jnp.array([True, True, False, False])
    args = (w, x, labels, valid)
    assert np.isnan(jax.grad(loss)(*args)).all()  # the bug
    safe = jaxsafe.nan_safe(loss)
    assert not safe.trace(*args)[1].conservative  # every primitive has its row
    assert_bitwise(safe(*args), jax.jit(loss)(*args))
    for order in (jax.grad, jax.hessian):
        assert_close(order(safe)(*args), order(by_hand)(*args), rtol=1e-5)
    assert_close(jax.grad(safe, 1)(*args), jax.grad(by_hand, 1)(*args), rtol=1e-5)


@pytest.mark.parametrize("activation", [
    jax.nn.relu, jax.nn.relu6, jax.nn.softplus, jax.nn.celu, jax.nn.elu, jnp.tanh,
    lambda z: jnp.maximum(z, 0.)], ids=["relu", "relu6", "softplus", "celu", "elu", "tanh",
                                        "maximum"])
def test_an_activation_between_padded_rows_and_a_row_where(activation):
    """`jax.nn.relu`, `relu6` and `softplus` are `custom_jvp` calls: their bodies are lane to
    lane, so the rows a `where` drops after them are dropped before them. The lanes a `max` or
    `min` keeps (ReLU as `jnp.maximum`, `celu`, `elu`) are decided at run time, so `x`'s exact
    mask would need a reduction: its guard takes the coarser mask the row predicate names
    (`Site.coarse`). Either way the NaN and inf rows of `x` are guarded in `x` itself (before,
    `w1`'s gradient was NaN)."""
    def loss(w1, w2, x):
        h = activation(x @ w1)
        return jnp.sum(jnp.where(VALID, (h @ w2)[:, 0] ** 2, 0.))

    def by_hand(w1, w2, x):
        return loss(w1, w2, jnp.where(VALID[:, None], x, 0.))

    x = jnp.array([[1., 2.], [nan, nan], [.5, -1.], [inf, 0.]])
    w1 = jnp.array([[.1, -.2, .3], [-.4, .5, .6]])
    w2 = jnp.array([[.2, .1], [-.3, .4], [.5, -.6]])
    assert np.isnan(jax.grad(loss)(w1, w2, x)).any()  # the bug
    safe = jaxsafe.nan_safe(loss)
    assert_bitwise(safe(w1, w2, x), jax.jit(loss)(w1, w2, x))
    for argnums in (0, 1):
        assert_close(jax.grad(safe, argnums)(w1, w2, x), jax.grad(by_hand, argnums)(w1, w2, x),
                     rtol=1e-5)
    assert_close(jax.hessian(safe)(w1, w2, x), jax.hessian(by_hand)(w1, w2, x), rtol=1e-5)


def test_a_coarse_guard_reads_the_row_predicate_and_no_reduction():
    """The guard of `x` before `maximum(x @ w1, 0)` takes the row predicate `valid` (its exact
    mask, an OR over the ReLU's decisions along the row, would be a run-time reduction): the
    rewritten program reduces nothing the original does not, and `explain` says which mask."""
    def loss(w1, x, valid):
        h = jnp.maximum(x @ w1, 0.)
        return jnp.sum(jnp.where(valid, h.sum(axis=1) ** 2, 0.))

    x = jnp.array([[1., 2.], [nan, nan], [.5, -1.]])
    w1 = jnp.array([[.1, -.2, .3], [-.4, .5, .6]])
    valid = jnp.array([True, False, True])
    closed, report = jaxsafe.nan_safe(loss).trace(w1, x, valid)

    def reductions(c):
        return sorted(e.primitive.name for e in c.eqns if e.primitive.name.startswith("reduce"))
    assert reductions(closed) == reductions(jax.make_jaxpr(loss)(w1, x, valid))
    site, = [s for s in report.sites if s.eqn.primitive.name == "dot_general"]
    assert list(site.coarse) == [0] and "predicates drop it" in site.reasons[0]
    by_hand = jax.grad(lambda w, x, v: loss(w, jnp.where(v[:, None], x, 0.), v))
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(w1, x, valid), by_hand(w1, x, valid))


PAIR_MASKS = {
    "and": lambda qv, kv: qv[:, None] & kv[None, :],
    "not or": lambda qv, kv: ~(~qv[:, None] | ~kv[None, :]),
    "logical_and of a not": lambda qv, kv: jnp.logical_and(qv[:, None], ~jnp.logical_not(kv)[None]),
}


@pytest.mark.parametrize("pairs", PAIR_MASKS)
def test_padded_queries_and_keys_of_a_pair_mask_are_guarded_before_the_scores(pairs):
    """Attention whose mask is `q_valid[:, None] & k_valid[None, :]`, with NaN padded rows of
    `q` and `k`: the mask of `q`'s rows is an OR over the keys (a run-time reduction), and the
    predicate runs along both axes, so it names no coarser mask either, unless read through its
    `and` (`_symbolic.expand_connectives`): then `q_valid` along the query axis, `k_valid`
    along the key axis. Before, `q`'s gradient was NaN in every entry."""
    pair = PAIR_MASKS[pairs]

    def loss(q, k, v, qv, kv):
        s = jnp.where(pair(qv, kv), q @ k.T / 2., -jnp.inf)
        p = jnp.where(qv[:, None], jax.nn.softmax(s, axis=-1), 0.)
        return jnp.sum(jnp.where(qv[:, None], (p @ v) ** 2, 0.))

    def by_hand(q, k, v, qv, kv):
        return loss(jnp.where(qv[:, None], q, 0.), jnp.where(kv[:, None], k, 0.), v, qv, kv)

    rng = np.random.RandomState(0)
    q, k, v = (rng.randn(*shape).astype(np.float32) for shape in ((4, 2), (5, 2), (5, 3)))
    q[3], k[4] = nan, inf
    qv, kv = jnp.array([True, True, True, False]), jnp.array([True] * 4 + [False])
    args = (q, k, v, qv, kv)
    assert np.isnan(jax.grad(loss)(*args)).all()  # the bug
    safe = jaxsafe.nan_safe(loss)
    assert_bitwise(safe(*args), jax.jit(loss)(*args))
    for argnums in (0, 1, 2):
        assert_close(jax.grad(safe, argnums)(*args), jax.grad(by_hand, argnums)(*args),
                     rtol=1e-5)
    assert_close(jax.hessian(safe)(*args), jax.hessian(by_hand)(*args), rtol=1e-4, atol=1e-6)


def test_a_gram_matrix_of_padded_rows_is_guarded_once_for_both_operands():
    """`h @ h.T` under a pair mask: both operands of the matmul are `h`, with the same coarse
    mask, so one `select_n` guards both (`_emit`'s guard cache compares the coarse formulas,
    not mask objects); gradients and Hessian are the hand fix's."""
    def loss(x, valid):
        h = jnp.maximum(x, 0.)
        gram = jnp.einsum("ik,jk->ij", h, h)
        pairs = valid[:, None] & valid[None, :]
        return jnp.sum(jnp.where(pairs, jnp.maximum(gram, .1) ** 2, 0.))

    def by_hand(x, valid):
        return loss(jnp.where(valid[:, None], x, 0.), valid)

    x = jnp.array([[1., 2.], [nan, nan], [.5, -1.]])
    valid = jnp.array([True, False, True])
    assert np.isnan(jax.grad(loss)(x, valid)).any()  # the bug
    safe = jaxsafe.nan_safe(loss)
    assert_bitwise(safe(x, valid), jax.jit(loss)(x, valid))
    assert_close(jax.grad(safe)(x, valid), jax.grad(by_hand)(x, valid))
    assert_close(jax.hessian(safe)(x, valid), jax.hessian(by_hand)(x, valid))
    closed, _ = safe.trace(x, valid)
    dots = [e.invars for e in closed.eqns if e.primitive.name == "dot_general"]
    assert dots and all(a is b for a, b in dots)  # one guarded `h` for both operands


FEATURE_OPS = {
    "concatenate": lambda z: jnp.concatenate([z, z ** 2], -1).sum(-1),
    "stack, reshape": lambda z: jnp.stack([z, jnp.tanh(z)], -1).reshape(3, 8).sum(-1),
    "split": lambda z: (jnp.split(z, 2, axis=1)[1] * jnp.split(z, 2, axis=1)[0]).sum(-1),
    "reshape into heads": lambda z: z.reshape(3, 2, 2).max(-1).sum(-1),
    "cumsum": lambda z: jnp.cumsum(z, axis=1)[:, -1],
    "cumlogsumexp": lambda z: lax.cumlogsumexp(z, axis=1)[:, -1],
    "cummax": lambda z: lax.cummax(z, axis=1)[:, -1],
    "sort": lambda z: jnp.sort(z, axis=1)[:, -1],
    "top_k": lambda z: lax.top_k(z, 2)[0].sum(-1),
    "roll": lambda z: jnp.roll(z, 1, axis=1)[:, 0],
    "tile": lambda z: (jnp.tile(z, (1, 2)) * jnp.arange(8.)[None]).sum(-1),
    "average pool": lambda z: lax.reduce_window(z, 0., lax.add, (1, 2), (1, 2), "VALID").sum(-1),
    "max pool": lambda z: lax.reduce_window(z, -jnp.inf, lax.max, (1, 2), (1, 1), "SAME").sum(-1),
    "convolve": lambda z: jax.vmap(lambda r: jnp.convolve(r, jnp.array([1., -2.]),
                                                          mode="same"))(z).sum(-1),
    "segment_sum": lambda z: jax.vmap(lambda r: jax.ops.segment_sum(
        r, jnp.array([0, 0, 1, 1]), 2))(z).sum(-1),
}


@pytest.mark.parametrize("name", FEATURE_OPS)
def test_a_padded_row_reaches_through_an_op_along_the_feature_axis(name):
    """A padded NaN or inf row of `x` and a `where` on rows after an op that works along the
    feature axis only (concatenated or stacked features, heads, a cumulative op, a sort, a
    pooling window, a convolution, a segment sum): the row's formula crosses the op (its static
    rule carries formulas along the axes it keeps in place), so the matmul's operand is guarded
    by the row predicate (`Site.coarse`). Before, `w`'s gradient was NaN (optax's
    `sigmoid_focal_loss` stacks its two log terms)."""
    op = FEATURE_OPS[name]
    valid = jnp.array([True, False, True])

    def loss(w, x):
        return jnp.sum(jnp.where(valid, op(x @ w) ** 2, 0.))

    def by_hand(w, x):
        return loss(w, jnp.where(valid[:, None], x, 0.))

    w = jnp.array([[.5, -1., .2, .3], [2., .3, 1., -.2]])
    x = jnp.array([[1., 2.], [nan, inf], [.3, -.7]])
    assert np.isnan(jax.grad(loss)(w, x)).any()  # the bug
    safe = jaxsafe.nan_safe(loss)
    assert_bitwise(safe(w, x), jax.jit(loss)(w, x))
    assert_close(jax.grad(safe)(w, x), jax.grad(by_hand)(w, x), rtol=1e-5)
    assert_close(jax.hessian(safe)(w, x), jax.hessian(by_hand)(w, x), rtol=1e-4, atol=1e-5)



def _graph_attention(w, a, x, senders, receivers, edge_mask, node_mask):
    """One GAT layer on a padded graph: attention logits from gathered sender and receiver
    rows, a softmax over each node's incoming edges, messages `alpha[:, None] * h[senders]`
    whose factor a `where` zeroes on padded edges, and a segment sum."""
    n = x.shape[0]
    h = x @ w
    e = jax.nn.leaky_relu(jnp.concatenate([h[senders], h[receivers]], -1) @ a)
    e = jnp.where(edge_mask, e, -jnp.inf)
    top = lax.stop_gradient(jax.ops.segment_max(e, receivers, n))
    alpha = jnp.exp(e - top[receivers])
    alpha = jnp.where(edge_mask, alpha / jax.ops.segment_sum(alpha, receivers, n)[receivers], 0.)
    out = jax.ops.segment_sum(alpha[:, None] * h[senders], receivers, n)
    return jnp.sum(jnp.where(node_mask[:, None], jnp.tanh(out) ** 2, 0.))


def test_graph_attention_over_a_nan_padded_node():
    """A padded node with NaN features, and padded edges from it to it: the messages'
    factor `alpha` is `where(edge_mask, ..., 0.)`, which drops `h[senders]`'s padded rows at
    run time (`product_syms`). That factor is broadcast along the feature axis
    (`alpha[:, None]`), so the mask it makes runs along rows only, crosses the gathers and
    guards `x`'s row before `x @ w` with no reduction. Before, the mask ran along both axes
    and `w`'s gradient was NaN (hunt C)."""
    rng = np.random.RandomState(0)
    x = rng.randn(4, 3).astype(np.float32)
    x[3] = nan
    w, a = rng.randn(3, 2).astype(np.float32), rng.randn(4).astype(np.float32)
    graph = (jnp.array([0, 1, 2, 1, 3, 3]), jnp.array([1, 2, 0, 0, 3, 3]),
             jnp.array([True] * 4 + [False] * 2), jnp.array([True] * 3 + [False]))

    def loss(w, a, x):
        return _graph_attention(w, a, x, *graph)

    def by_hand(w, a, x):
        return loss(w, a, jnp.where(graph[3][:, None], x, 0.))

    assert np.isnan(jax.grad(loss)(w, a, x)).all()  # the bug
    _matches_the_hand_fix(loss, by_hand, (w, a, x), argnums=(0, 1), tol=(1e-5, 1e-7),
                          hessian_tol=(1e-4, 1e-6))




# (move the rows, the inverse move: which rows of `x @ w` reach the `where`'s rows)
ROW_MOVES = {
    "rev twice": (lambda h: h[::-1][::-1], lambda v: v),
    "constant gather": (lambda h: h[jnp.array([1, 0, 2])], lambda v: v[jnp.array([1, 0, 2])]),
    "roll": (lambda h: jnp.roll(h, 1, axis=0), lambda v: jnp.roll(v, -1, axis=0)),
    "dynamic_slice": (lambda h: lax.dynamic_slice(h, (0, 0), (3, 2)), lambda v: v),
}


@pytest.mark.parametrize("move", ROW_MOVES)
def test_a_product_of_row_masked_factors_drops_rows_before_the_matmul(move):
    """`a * a` with `a = where(v[:, None], move(x @ w), 0.)`: each factor is the other's
    mask, zero where `v` takes the literal and carrying a derivative where it takes `x @ w`,
    so it keeps exactly the lanes where `v` holds (`_choosers._selected_literal`): a row
    mask, which crosses the move and the matmul with no reduction. Before, each factor's mask
    was decided at run time along both axes, and `w`'s gradient was NaN (`a ** 2` was
    guarded)."""
    moved, back = ROW_MOVES[move]
    v = jnp.array([True, False, True])

    def loss(w, x):
        a = jnp.where(v[:, None], moved(x @ w), 0.)
        return jnp.sum(a * a)

    def by_hand(w, x):
        return loss(w, jnp.where(back(v)[:, None], x, 0.))

    w = jnp.array([[.3, -.2], [.1, .4]])
    x = jnp.where(back(v)[:, None], jnp.array([[1., 2.], [.5, -1.], [.7, .2]]),
                  jnp.array([nan, inf]))  # NaN and inf in the row the `where` drops
    assert np.isnan(jax.grad(loss)(w, x)).any()  # the bug
    _matches_the_hand_fix(loss, by_hand, (w, x))


def test_multi_head_attention_messages_with_exp_of_a_masked_logit():
    """Graph attention with heads: `exp(where(edge_ok, logit, -inf))[..., None] *
    where(edge_ok, h[s], 0.)`: the exponential makes the `-inf` lanes 0, carrying nothing,
    so the factor drops the edges `edge_ok` drops, along edges only, through the reshape into
    heads and the gathers, down to `x @ w`'s padded row (a lane-to-lane chain to the
    `where`'s constant, folded at trace time)."""
    n, heads = 4, 2
    x = jnp.array([[1., 2.], [.5, -1.], [2., .3], [nan, nan]])
    node_ok = jnp.array([True, True, True, False])
    s, r = jnp.array([0, 1, 2, 0, 3, 3]), jnp.array([1, 2, 0, 2, 3, 1])
    edge_ok = jnp.array([True] * 4 + [False] * 2)
    w = jnp.arange(8.).reshape(2, 4) / 10 - .3

    def loss(w, x):
        h = (x @ w).reshape(n, heads, 2)
        logit = jnp.where(edge_ok[:, None], jnp.einsum("ehf,ehf->eh", h[s], h[r]), -jnp.inf)
        msg = jnp.exp(logit)[..., None] * jnp.where(edge_ok[:, None, None], h[s], 0.)
        out = jax.ops.segment_sum(msg, r, n)
        return jnp.sum(jnp.where(node_ok[:, None, None], out, 0.))

    def by_hand(w, x):
        return loss(w, jnp.where(node_ok[:, None], x, 0.))

    assert np.isnan(jax.grad(loss)(w, x)).all()  # the bug
    _matches_the_hand_fix(loss, by_hand, (w, x), tol=(1e-5, 0.), hessian_tol=(1e-4, 1e-5))


@pytest.mark.parametrize("readout", ["segment_max", "segment_min", "segment_sum"])
def test_a_padded_graph_readout_drops_the_padding_graph_rows_before_the_matmul(readout):
    """A readout per graph (`segment_max`, as jraph pads a batch with a graph of NaN nodes)
    whose padding graph a `where` drops: the segment's rows are dropped as a row mask (the
    scatter read as its scatter-add twin while some result is dropped), so `x`'s NaN row is
    guarded before `x @ w`. A segment maximum whose every result is live drops its losers
    instead (`test_choosers`); that must not turn the readout's row mask into one that needs
    a run-time reduction."""
    pool = getattr(jax.ops, readout)
    x = jnp.array([[1., 2.], [.5, -1.], [nan, nan]])
    graph_id, graph_ok = jnp.array([0, 0, 1]), jnp.array([True, False])
    w = jnp.array([[.3, -.2], [.1, .4]])

    def loss(w, x):
        return jnp.sum(jnp.where(graph_ok[:, None], jnp.tanh(pool(x @ w, graph_id, 2)), 0.))

    def by_hand(w, x):
        return loss(w, jnp.where(jnp.array([True, True, False])[:, None], x, 0.))

    assert np.isnan(jax.grad(loss)(w, x)).all()  # the bug
    _matches_the_hand_fix(loss, by_hand, (w, x))


def test_a_readout_under_an_empty_segment_test_per_feature_at_constant_ids():
    """jraph's `segment_max_or_constant`: `where(count > 0, segment_max(h), 0.)` with the count
    taken per feature, so the test runs along both axes, at segment ids computed from a
    closed-over `n_node` (a padded batch), then a `where` on a closed-over graph mask. At ids
    known when jaxsafe traces, the formula of `h`'s rows is known then too (a static mask:
    `scatter-add` folds, boolean constants are read), so `x`'s NaN padded row is guarded
    before `x @ w` without a run-time reduction. Before, `w`'s gradient was NaN."""
    n_node, graph_ok = np.array([3, 2]), np.array([True, False])
    node_ok = np.array([True, True, True, False, False])
    x = jnp.where(node_ok[:, None], jnp.arange(10.).reshape(5, 2) / 10., nan)
    w = jnp.array([[.3, -.2], [.1, .4]])

    def loss(w, x):
        h = x @ w
        ids = jnp.repeat(jnp.arange(2), n_node, total_repeat_length=5)
        count = jax.ops.segment_sum(jnp.ones_like(h, dtype=jnp.int32), ids, 2)
        pooled = jnp.where(count > 0, jax.ops.segment_max(h, ids, 2), 0.)
        return jnp.sum(jnp.where(graph_ok[:, None], jnp.tanh(pooled), 0.))

    def by_hand(w, x):
        return loss(w, jnp.where(node_ok[:, None], x, 0.))

    assert np.isnan(jax.grad(loss)(w, x)).all()  # the bug
    _matches_the_hand_fix(loss, by_hand, (w, x))

SLICED_MAXIMA = {
    # a per-graph maximum over hand-made row slices, then a constant graph mask
    "stack_of_slices": lambda h: jnp.stack([jnp.max(h[:2], 0), jnp.max(h[2:], 0)]),
    "concatenate_of_slices": lambda h: jnp.concatenate([jnp.max(h[:2], 0, keepdims=True),
                                                        jnp.max(h[2:], 0, keepdims=True)]),
    # the rows a negative pad cuts off, the rest kept by a constant mask
    "negative_pad": lambda h: jnp.stack([jnp.max(lax.pad(h, 0., ((0, -1, 0), (0, 0, 0))), 0),
                                         jnp.min(h[2:], 0)]),
    "strided_slice": lambda h: jnp.stack([jnp.max(h[::2][:1], 0), jnp.max(h[1:], 0)]),
}


@pytest.mark.parametrize("pool", list(SLICED_MAXIMA.values()), ids=list(SLICED_MAXIMA))
def test_a_maximum_over_rows_a_slice_keeps_guards_the_rows_it_cuts_before_the_matmul(pool):
    """`jnp.max(h[:2], 0)` keeps its winners, decided at run time along both axes, so `x`'s
    exact row mask before `h = x @ w` would need a run-time reduction. The rows the slices
    cut off and the part of a closed-over graph mask each maximum lands in are known when
    jaxsafe plans: the coarser mask they name (the rows no live maximum reads) guards the
    NaN padded row, as the hand fix does. Before, `w`'s gradient was NaN."""
    graph_ok = jnp.array([True, False])
    x = jnp.array([[1., 2.], [.5, -1.], [nan, nan]])
    w = jnp.array([[.3, -.2], [.1, .4]])
    keep = np.zeros(3, bool)
    for row in range(3):  # the rows the live maximum reads, found by poking them
        poked = x.at[row].set(7.)
        keep[row] = not np.array_equal(pool(jnp.where(jnp.isnan(poked), 0., poked))[0],
                                       pool(jnp.where(jnp.isnan(x), 0., x))[0])

    def loss(w, x):
        return jnp.sum(jnp.where(graph_ok[:, None], jnp.tanh(pool(x @ w)), 0.))

    def by_hand(w, x):
        return loss(w, jnp.where(jnp.asarray(keep)[:, None], x, 0.))

    assert not keep[2]
    assert np.isnan(jax.grad(loss)(w, x)).all()  # the bug
    _matches_the_hand_fix(loss, by_hand, (w, x))


def test_a_row_factor_zeroed_by_a_where_drops_rows_of_a_gathered_matmul():
    """The smallest form of the graph-attention case: `s[:, None] * h[idx]` with
    `s = where(m, f(h[idx]), 0.)`, `h = x @ w` and a NaN row of `x`."""
    m, idx = jnp.array([True, True, False]), jnp.array([0, 1, 2])

    def loss(w, x):
        h = x @ w
        s = jnp.where(m, jnp.tanh(h[idx].sum(-1)), 0.)
        return jnp.sum(jnp.where(m[:, None], s[:, None] * h[idx], 0.))

    def by_hand(w, x):
        return loss(w, jnp.where(m[:, None], x, 0.))

    w, x = jnp.array([[.5, -1.], [.3, .2]]), jnp.array([[1., 2.], [3., 4.], [nan, nan]])
    assert np.isnan(jax.grad(loss)(w, x)).all()  # the bug
    _matches_the_hand_fix(loss, by_hand, (w, x))
    assert_close(jax.jit(jax.grad(jaxsafe.nan_safe(loss)))(w, x), jax.grad(by_hand)(w, x))


def _first_row_zeroed(x):
    return jnp.where(jnp.arange(x.shape[0])[:, None] == 0, 0., x)


OVERWRITES = {
    "at[0].set": lambda z: z.at[0].set(0.),
    "dynamic_update_slice": lambda z: lax.dynamic_update_slice(z, jnp.zeros((1, 3)), (0, 0)),
    "dynamic_slice": lambda z: lax.dynamic_slice(z, (1, 0), (2, 3)),
    "gather": lambda z: z[jnp.array([1, 2])],
}


@pytest.mark.parametrize("name", OVERWRITES)
def test_a_row_overwritten_at_a_constant_index_is_guarded_before_a_matmul(name):
    """`(x @ w).at[0].set(0.)` and `dynamic_update_slice` at starts the program computes from
    literals overwrite lanes known from shapes alone, as a `slice` crops them: the mask of `x`'s
    rows (an OR over the matmul's output row) is computed from constants, and XLA folds it, so
    `x`'s NaN row is guarded (before, `w`'s gradient was NaN for the overwrites)."""
    cut = OVERWRITES[name]

    def loss(x, w):
        return jnp.sum(cut(x @ w) ** 2)

    def by_hand(x, w):
        return loss(_first_row_zeroed(x), w)

    x = jnp.array([[nan, nan], [1., 2.], [.5, -1.]])
    w = jnp.array([[.1, .2, .3], [-.4, .5, .6]])
    safe = jaxsafe.nan_safe(loss)
    assert_bitwise(safe(x, w), jax.jit(loss)(x, w))
    assert_close(jax.grad(safe, 1)(x, w), jax.grad(by_hand, 1)(x, w))
    assert_close(jax.hessian(safe, 1)(x, w), jax.hessian(by_hand, 1)(x, w))


def test_a_value_taken_only_below_a_finite_bound_is_finite_where_taken():
    """`jnp.where(t < 1., t, 0.)` of a value bounded below (`|x|`, a distance): NaN and +inf
    fail `t < 1.`, and -inf is below the bound, so what it takes is finite even from a NaN
    argument: the NaN test of `nan_to_num` after it does not make the product before it
    suspect (jax-md's soft sphere with NaN positions). `t > -1.` lets +inf through, and the
    product keeps its guard (plain JAX's derivative in `w` is NaN there)."""
    def energy(keep):
        def f(x, w):
            t = jnp.abs(x)
            s = jnp.where(keep(t), t, 0.0)
            return jnp.sum(jnp.nan_to_num(jnp.where(s < 0.9, s * w, 0.0)))
        return f

    f, g = energy(lambda t: t < 1.0), energy(lambda t: t > -1.0)
    x, w = jnp.array([nan, inf, 0.95, 0.5, -0.2]), jnp.ones(5)  # w: promised finite
    expected = jnp.array([0.0, 0.0, 0.0, 0.5, 0.2])
    assert [gd.primitive for gd in jaxsafe.explain(f, finite_args=1)(x, w).guards] == ["abs"]
    assert_close(jax.grad(jaxsafe.nan_safe(f, finite_args=1), 1)(x, w), expected)
    assert np.isnan(np.asarray(jax.grad(g, 1)(x, w))).any()
    assert "guarded mul" in str(jaxsafe.explain(g, finite_args=1)(x, w))
    assert_close(jax.grad(jaxsafe.nan_safe(g, finite_args=1), 1)(x, w), expected)


def test_a_constant_mask_gives_a_guard_whatever_its_shape():
    """A mask that is a constant array (not a broadcast row: XLA sees a 2-D constant) drops the
    NaN rows of `x @ w`: the liveness of `x` is an OR over the mask's rows, computed from
    constants alone, which XLA folds, so the guard costs one `select_n`, as the hand fix's."""
    keep = jnp.asarray(np.array([[True, True], [False, False], [True, True]]))
    x = jnp.array([[1., 2., 0.5], [nan, inf, 1.], [0.25, -1., 2.]])
    w = jnp.array([[1., 0.5], [-0.5, 1.], [2., 0.]])

    def make(clean):
        return lambda x, w: jnp.sum(jnp.where(keep, clean(x) @ w, 0.) ** 2)
    f, hand = make(lambda v: v), make(lambda v: jnp.where(keep[:, :1], v, 0.))
    assert np.isnan(np.asarray(jax.grad(f, 1)(x, w))).any()
    assert "unguarded" not in str(jaxsafe.explain(f)(x, w))
    for order in (jax.grad, jax.hessian):
        got = jax.jit(order(jaxsafe.nan_safe(f), 1))(x, w)
        assert_finite(got)
        assert_close(got, jax.jit(order(hand, 1))(x, w))


def test_integer_bits_cast_to_floats_may_be_non_finite():
    """`bitcast_convert_type` of integers makes any float (here inf): a value guard, as for
    the same floats passed as an argument, not the finiteness of the integers."""
    bits = jnp.array([0x3f800000, 0x7f800000, 0x7fc00000], jnp.uint32)  # 1., inf, NaN
    valid = jnp.array([True, False, False])

    def f(w, b):
        return jnp.where(valid, w * lax.bitcast_convert_type(b, jnp.float32), 0.).sum()

    def hand(w, b):
        d = lax.bitcast_convert_type(b, jnp.float32)
        return jnp.where(valid, w * jnp.where(valid, d, 0.), 0.).sum()

    assert np.isnan(jax.grad(f)(2., bits))  # the leak is real
    assert_bitwise(jaxsafe.nan_safe(f)(2., bits), jax.jit(f)(2., bits))
    for order in (jax.grad, jax.hessian):
        assert_close(order(jaxsafe.nan_safe(f))(2., bits), order(hand)(2., bits))
    assert_close(jax.grad(jaxsafe.nan_safe(f))(2., bits), 1.)


@pytest.mark.parametrize("finite_args", [False, True])
def test_a_constant_base_raised_to_a_large_exponent_overflows_in_the_dropped_lanes(finite_args):
    """`10. ** n` is finite at n = 1, the point a guard check looks at, and inf at n = 100: the
    exponent is not a literal, so the power is NaN-prone (its base takes 1 in dropped lanes),
    as `exp(n * log(10))` is."""
    def f(w, n):
        return jnp.where(n < 10, w * 10. ** n, 0.).sum()

    def hand(w, n):
        return jnp.where(n < 10, w * 10. ** jnp.where(n < 10, n, 0.), 0.).sum()

    w, n = 1.5, jnp.array([1., 2., 100., -100.])
    safe = jaxsafe.nan_safe(f, finite_args=finite_args)
    assert np.isnan(jax.grad(f, argnums=(0, 1))(w, n)[0])  # the leak is real
    assert_bitwise(safe(w, n), jax.jit(f)(w, n))
    for argnums in (0, 1):
        got = jax.grad(safe, argnums)(w, n)
        assert_finite(got)
        assert_close(got, jax.grad(hand, argnums)(w, n))
    assert_close(jax.hessian(safe, 1)(w, n), jax.hessian(hand, 1)(w, n))
    assert_close(jax.grad(jaxsafe.nan_safe(f), 0)(w, n.astype(jnp.int32)),
                 jax.grad(hand, 0)(w, n.astype(jnp.int32)))


_LL = jnp.array([[-1., nan, -3.], [-0.5, -2., inf]])
_LIVE = jnp.array([[True, False, True], [True, True, False]])
_K = jnp.array([[2., nan, 0.], [5., 1., -1.]])  # counts; NaN (missing) and -1 masked out
_U = jnp.array([[0., .3, .7], [1., .5, .2]])  # beta's boundary lanes masked out
_OK = (_U > 0) & (_U < 1)


@pytest.mark.parametrize("name,f,mask,data,param", [
    ("logaddexp", jnp.logaddexp, _LIVE, _LL, -1.2),
    ("xlogy", lambda a, x: sp.xlogy(a, x), _OK, _U, 0.7),
    ("poisson.logpmf", lambda mu, k: stats.poisson.logpmf(k, mu), _LIVE, _K, 1.5),
    ("beta.logpdf", lambda a, u: stats.beta.logpdf(u, a, 3.), _OK, _U, 2.5),
])
@pytest.mark.parametrize("param_shape", [(), (2, 1)])
def test_a_shared_parameter_of_a_custom_rule_over_masked_data(name, f, mask, data, param,
                                                              param_shape):
    """A custom_jvp function that broadcasts its parameter over the data (`logaddexp(lw, ll)`,
    `poisson.logpmf(k, mu)`, `xlogy(a, x)`): the parameter feeds live lanes, so it cannot be
    cut, and takes the rule's derivative from every lane. The dropped lanes of the data are
    evaluated at a live lane's values instead of their own (a NaN, a 0 under a `log`).
    Reference: the double where on the data, at a live lane's value (any point where the rule's
    derivative is finite gives the dropped lanes' zero share)."""
    p0 = jnp.full(param_shape, param) + (0. if param_shape != (2, 1) else jnp.array([[0.], [.3]]))
    safe_data = jnp.where(mask, data, data.reshape(-1)[jnp.argmax(mask.reshape(-1))])

    def loss(p, d):
        return jnp.sum(jnp.where(mask, f(p, d), 0.))

    assert not np.isfinite(np.asarray(jax.grad(loss)(p0, data))).all()  # the leak is real
    assert_bitwise(jaxsafe.nan_safe(loss)(p0, data), jax.jit(loss)(p0, data))
    for order in (jax.grad, jax.hessian):
        got = order(jaxsafe.nan_safe(loss))(p0, data)
        assert_finite(got)
        assert_close(got, order(loss)(p0, safe_data), rtol=1e-5)


def test_a_raw_key_argument_is_no_unknown_primitive():
    """`jax.random.*` on a raw uint32 key wraps it into a typed key (`random_wrap`, a JAX
    primitive that jax.extend does not list): a row of its own, not reported unknown."""
    def noisy(x, key):
        return jnp.where(x > 1, x * jax.random.uniform(key, x.shape), 0.).sum()

    x, key = jnp.array([1., 2., 3.]), jax.random.PRNGKey(0)
    assert "random_wrap" in str(jax.make_jaxpr(noisy)(x, key))
    text = str(jaxsafe.explain(noisy)(x, key))
    assert "unknown primitive" not in text, text
    text = str(jaxsafe.explain(lambda k: jax.random.key_data(jax.random.wrap_key_data(k)))(key))
    assert "unknown primitive" not in text, text


def test_uniform_random_bits_are_finite_and_other_set_exponents_are_checked():
    """`jax.random.uniform` bitcasts `(bits >> 9) | 0x3F800000`: the constant sets the exponent
    (floats in [1, 2)), so noise under a `where` needs no guard with finite arguments; a constant
    whose exponent field is all ones (inf and NaN) does."""
    key = jax.random.PRNGKey(0)
    x = jnp.array([1., 2., 3.])

    def noisy(x, key):
        return jnp.where(x > 1, x * jax.random.uniform(key, x.shape), 0.).sum()

    assert structure(jaxsafe.make_jaxpr(noisy, finite_args=True)(x, key)) == \
        structure(jax.make_jaxpr(noisy)(x, key))

    def set_to_inf(w, bits):
        d = lax.bitcast_convert_type(lax.shift_right_logical(bits, jnp.uint32(9))
                                     | jnp.uint32(0x7F800000), jnp.float32)
        return jnp.where(jnp.array([True, False, False]), w * d, 0.).sum()

    bits = jnp.array([0, 0, 1 << 20], jnp.uint32)  # 1 << 20 >> 9 = 2048: a NaN's mantissa
    assert np.isnan(jax.grad(set_to_inf)(2., bits))  # inf and NaN in the dropped lanes
    assert_close(jax.grad(jaxsafe.nan_safe(set_to_inf))(2., bits), np.inf)  # the live lane's inf


CONV_DN = ("NCH", "OIH", "NCH")


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1,), "VALID", dimension_numbers=CONV_DN)


def test_an_image_a_where_drops_after_a_convolution_takes_no_part():
    """A NaN image that a `where` per image drops after a convolution: its lanes run along the
    output's batch axis (no reduction), so they are guarded; the kernel's gradient is that of
    the batch without the image."""
    x = jnp.stack([jnp.arange(1., 8.)[None], jnp.full((1, 7), nan)])
    w = jnp.array([[[1., -1.]]])
    valid = jnp.array([True, False])

    def loss(x, w):
        return jnp.sum(jnp.where(valid[:, None, None], _conv(x, w), 0.) ** 2)

    assert np.isnan(np.asarray(jax.grad(loss, 1)(x, w))).all()  # plain JAX
    got = jax.grad(jaxsafe.nan_safe(loss), 1)(x, w)
    np.testing.assert_array_equal(got, jax.grad(lambda x, w: jnp.sum(_conv(x, w) ** 2), 1)(
        x[:1], w))
    np.testing.assert_array_equal(jaxsafe.nan_safe(loss)(x, w), jax.jit(loss)(x, w))


@pytest.mark.parametrize("drop", ["slice", "arange"])
def test_lanes_a_static_crop_drops_after_a_lane_mixing_op_take_no_part(drop):
    """A crop (a slice, or a `where` on `jnp.arange(n) < k`) after a convolution or a matmul:
    its mask is computed from shapes and constants (XLA folds it), so the non-finite padding
    the dropped outputs read is guarded at the cost of a `select_n`."""
    keep = {"slice": lambda y, k: y[..., :k],
            "arange": lambda y, k: jnp.where(jnp.arange(y.shape[-1]) < k, y, 0.)}[drop]
    x = jnp.array([[[1., 2., 3., 4., 5., nan, 7.]]])
    w = jnp.array([[[1., -1.]]])
    conv = lambda x, w: jnp.sum(keep(_conv(x, w), 2) ** 2)
    removed = lambda x, w: jnp.sum(_conv(x[..., :3], w) ** 2)
    assert np.isnan(np.asarray(jax.grad(conv, 1)(x, w))).all()  # plain JAX
    np.testing.assert_array_equal(jax.grad(jaxsafe.nan_safe(conv), 1)(x, w),
                                  jax.grad(removed, 1)(x, w))

    a = jnp.array([[1., 2.], [3., 4.], [nan, 1.], [inf, 0.]])  # rows 2, 3: padding
    b = jnp.array([[1., -1., 0.5], [2., 0., 1.]])
    matmul = lambda a, b: jnp.sum(keep((a @ b).T, 2).T[:, 1:] ** 2)
    assert np.isnan(np.asarray(jax.grad(matmul, 1)(a, b))).any()
    want = jnp.zeros_like(b).at[:, 1:].set(
        jax.grad(lambda a, b: jnp.sum((a[:2] @ b) ** 2), 1)(a, b[:, 1:]))
    np.testing.assert_array_equal(jax.grad(jaxsafe.nan_safe(matmul), 1)(a, b), want)
    np.testing.assert_array_equal(jaxsafe.nan_safe(matmul)(a, b), jax.jit(matmul)(a, b))


def test_causal_linear_attention_shifted_by_a_slice_ignores_the_padded_key():
    """`(tril(q @ k.T) @ v)[:-1]` with a NaN key in the last position: no kept output reads it."""
    q = jax.random.normal(jax.random.PRNGKey(0), (4, 2))
    k = jax.random.normal(jax.random.PRNGKey(1), (4, 2)).at[3].set(nan)
    v = jax.random.normal(jax.random.PRNGKey(2), (4, 2))
    attn = lambda q, k, v: jnp.sum((jnp.tril(q @ k.T) @ v)[:-1] ** 2)
    removed = lambda q, k, v: jnp.sum((jnp.tril(q[:-1] @ k[:-1].T) @ v[:-1]) ** 2)
    assert np.isnan(np.asarray(jax.grad(attn)(q, k, v))).all()  # plain JAX
    got = jax.grad(jaxsafe.nan_safe(attn))(q, k, v)
    assert_close(got, jax.grad(removed)(q, k, v), rtol=1e-6)  # row 3 reads nothing: 0
