"""Batched linear algebra: a batch element that a `where` drops contributes exactly zero.

`cholesky`, `triangular_solve`, `lu`, `qr`, `eigh`, `svd` work matrix by matrix along their
leading axes. A dropped batch element (a padding matrix of zeros, a covariance that is not
positive definite, a NaN) is cut from differentiation; the reference is the hand fix, which puts
a harmless matrix (the identity, or distinct eigenvalues) in the dropped elements before the
operation. Live elements keep their derivatives, real singularities included. A
`custom_linear_solve` (`jnp.linalg.solve`, `inv`) is cut matrix by matrix where its programs are
shown to work so, else as one whole, where the program drops all of it.
"""

import warnings

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite, structure

import jaxsafe
from jaxsafe import nan_safe

pytestmark = pytest.mark.no_leak_check

SPD = jnp.array([[2., .5], [.5, 1.]])
NOT_PD = jnp.array([[1., 2.], [2., 1.]])                 # Cholesky factor: NaN
NAN = jnp.array([[jnp.nan, 0.], [0., 1.]])
ZERO = jnp.zeros((2, 2))                                 # padding: repeated eigenvalues
MATS = jnp.stack([SPD, NOT_PD, NAN, ZERO, SPD + 1.])
VALID = jnp.array([True, False, False, False, True])
DISTINCT = jnp.diag(jnp.array([1., 2.]))                 # safe for eigh/svd/qr derivatives


def _fixed(a, safe):
    return jnp.where(VALID[:, None, None], a, safe)


def logdet(a):
    chol = jnp.linalg.cholesky(a)
    ld = 2. * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), -1)
    return jnp.where(VALID, ld, 0.)


def eigvec_energy(a):
    w, v = jnp.linalg.eigh(a)
    return jnp.where(VALID[:, None], w, 0.).sum() + \
        (jnp.where(VALID[:, None, None], v, 0.) ** 2 * jnp.arange(2.)[None, None]).sum()


def singular_values(a):
    return jnp.where(VALID[:, None], jnp.linalg.svd(a, compute_uv=False), 0.).sum()


def qr_r(a):
    q, r = jnp.linalg.qr(a)
    return (jnp.where(VALID[:, None, None], r, 0.) * jnp.array([[[1., 2.], [3., 4.]]])).sum()


def tri_solve(a):
    x = jsl.solve_triangular(jnp.tril(a), jnp.ones((5, 2, 1)), lower=True)
    return jnp.where(VALID[:, None, None], x, 0.).sum()


CASES = [
    ("cholesky", lambda a: logdet(a).sum(), jnp.eye(2)),
    ("eigh", eigvec_energy, DISTINCT),
    ("svd", singular_values, DISTINCT),
    ("qr", qr_r, DISTINCT),
    ("triangular_solve", tri_solve, jnp.eye(2)),
    ("slogdet", lambda a: jnp.where(VALID, jnp.linalg.slogdet(a)[1], 0.).sum(), jnp.eye(2)),
    ("det", lambda a: jnp.where(VALID, jnp.log(jnp.abs(jnp.linalg.det(a))), 0.).sum(),
     jnp.eye(2)),
]


@pytest.mark.parametrize("name,f,safe", CASES, ids=[c[0] for c in CASES])
def test_dropped_batch_elements_contribute_zero(name, f, safe):
    hand = lambda a: f(_fixed(a, safe))
    assert_bitwise(nan_safe(f)(MATS), jax.jit(f)(MATS))
    plain = jax.grad(f)(MATS)
    assert not np.all(np.isfinite(plain)), "plain JAX leaks here, or the test shows nothing"
    got = jax.grad(nan_safe(f))(MATS)
    assert_close(got, jax.grad(hand)(MATS), rtol=1e-5, atol=1e-6)
    assert_finite(got)
    np.testing.assert_array_equal(np.asarray(got)[~np.asarray(VALID)], 0.)
    assert_close(jax.jacfwd(nan_safe(f))(MATS), jax.jacfwd(hand)(MATS), rtol=1e-5, atol=1e-6)
    if name == "cholesky":  # second order (the others: first order, to keep make test short)
        assert_close(jax.hessian(nan_safe(f))(MATS), jax.hessian(hand)(MATS),
                     rtol=1e-4, atol=1e-5)



RHS = jnp.arange(10.).reshape(5, 2, 1) / 10. + 1.


def _batched_cho_solve(a, b):
    """`jsl.solve(a, b, assume_a="pos")` of a batch: its right-hand side laid out as (1, 5, 2),
    the batch along axis 1 (JAX 0.10 warns of its own batched call of `cho_solve`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return jsl.solve(a, b, assume_a="pos")


def _kept(y):
    return jnp.where(VALID.reshape((5,) + (1,) * (y.ndim - 1)), y, 0.)


# `custom_linear_solve`s of a batch: each program (matvec, solve, their transposes) works
# matrix by matrix along the batch axes, wherever they lie (`cho_solve` lays its right-hand
# side out as (1, 5, 2))
SOLVES = {
    "inv": lambda a: jnp.linalg.inv(a),
    "solve": lambda a: jnp.linalg.solve(a, RHS),
    "solve, a matrix right-hand side": lambda a: jnp.linalg.solve(a, a + 3.),
    "scipy solve": lambda a: jsl.solve(a, RHS),
    "scipy solve, positive definite": lambda a: _batched_cho_solve(a, RHS),
    "vmap of scipy solve, positive definite": lambda a: jax.vmap(
        lambda m, r: jsl.solve(m, r, assume_a="pos"))(a, RHS),
    "lu_solve": lambda a: jsl.lu_solve(jsl.lu_factor(a), RHS),
    "cho_solve": lambda a: jsl.cho_solve(jsl.cho_factor(a), RHS),
    "vmap of solve": lambda a: jax.vmap(jnp.linalg.solve)(a, RHS[..., 0]),
    "two batch axes": lambda a: jnp.linalg.inv(jnp.stack([a, a + 1.], 1)),
    # a `custom_jvp` over `svd`: its body's static rules drop the matrix (`custom_rule_syms`)
    "pinv": lambda a: jnp.linalg.pinv(a),
    # its `svd` through `eigh` and a `sort` whose permutation, reversed, feeds a gather: the
    # integer lanes move as float ones do (`_moved_as_float`), the index by its batch
    "pinv, hermitian": lambda a: jnp.linalg.pinv(a, hermitian=True),
    "batch along axis 1": lambda a: jnp.moveaxis(
        jax.vmap(jnp.linalg.inv, 1, 1)(jnp.moveaxis(a, 0, 1)), 1, 0),
}


@pytest.mark.parametrize("name", SOLVES)
def test_one_dropped_singular_matrix_of_a_batched_solve_is_cut(name):
    """A batched `jnp.linalg.solve` or `inv` with one singular, NaN or zero matrix that a
    `where` drops: the solve's programs are shown to work matrix by matrix
    (`_liveness_rules.solve_batch`), so the dropped matrices alone are cut from
    differentiation, as the hand fix's identity gives. Before, a `custom_linear_solve` was one
    whole and the dropped matrices' gradient was NaN (the FAQ's "Not yet"); `lu_solve` and
    `cho_solve`, triangular solves, were cut matrix by matrix already."""
    solve = SOLVES[name]

    def f(a):
        return jnp.sum(_kept(solve(a)) ** 2)

    def hand(a):
        return f(_fixed(a, jnp.eye(2)))

    assert_bitwise(nan_safe(f)(MATS), jax.jit(f)(MATS))
    assert np.isnan(jax.grad(f)(MATS)).any()  # the bug
    got = jax.grad(nan_safe(f))(MATS)
    assert_close(got, jax.grad(hand)(MATS), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[~np.asarray(VALID)], 0.)
    assert_close(jax.jacfwd(nan_safe(f))(MATS), jax.jacfwd(hand)(MATS), rtol=1e-5, atol=1e-6)
    assert_close(jax.hessian(nan_safe(f))(MATS), jax.hessian(hand)(MATS), rtol=1e-4, atol=1e-5)


def test_a_solve_that_mixes_the_matrices_of_a_batch_stays_one_whole():
    """`custom_linear_solve` with an operator that mixes batch elements (a sum over the
    batch): nothing is cut per matrix (each dropped matrix's lanes reach the live ones'
    results), and the derivatives are plain JAX's."""
    def f(a, b):
        def matvec(x):
            return a @ x + 0.1 * jnp.sum(x, 0, keepdims=True)
        x = jax.lax.custom_linear_solve(
            matvec, b, lambda _, r: jnp.linalg.solve(a, r),
            lambda _, r: jnp.linalg.solve(jnp.swapaxes(a, 1, 2), r))
        return jnp.sum(_kept(x) ** 2)

    a, b = MATS[jnp.array([0, 4, 0, 4, 0])] + jnp.eye(2)[None], RHS
    assert_bitwise(nan_safe(f)(a, b), jax.jit(f)(a, b))
    for argnums in (0, 1):
        assert_close(jax.grad(nan_safe(f), argnums)(a, b), jax.grad(f, argnums)(a, b))
    assert not jaxsafe.explain(f)(a, b).guards


SINGULAR_3 = jnp.stack([2. * jnp.eye(3) + .1, jnp.zeros((3, 3)), jnp.ones((3, 3))])
VALID_3 = jnp.array([True, False, False])


def _custom_log_det(body):
    """A custom derivative rule over a non-lane-to-lane body, as `jnp.linalg.slogdet` is from
    3 x 3 on: its rule solves with the matrix, singular in the dropped ones."""
    @jax.custom_jvp
    def f(a):
        return body(a)

    @f.defjvp
    def f_jvp(primals, tangents):
        (a,), (ta,) = primals, tangents
        return f(a), jnp.trace(jnp.linalg.solve(a, ta), axis1=-2, axis2=-1)
    return f


CUSTOM_BODIES = {
    "jnp.linalg.slogdet": lambda a: jnp.linalg.slogdet(a)[1],
    "lu, diagonal": _custom_log_det(lambda a: jnp.sum(jnp.log(jnp.abs(jnp.diagonal(
        jax.lax.linalg.lu(a)[0], axis1=-2, axis2=-1))), -1)),
    "qr, diagonal": _custom_log_det(lambda a: jnp.sum(jnp.log(jnp.abs(jnp.diagonal(
        jnp.linalg.qr(a)[1], axis1=-2, axis2=-1))), -1)),
}


@pytest.mark.parametrize("name", CUSTOM_BODIES)
def test_a_dropped_singular_matrix_of_a_custom_rule_over_a_decomposition_is_cut(name):
    """From 3 x 3 on, `slogdet` is a `custom_jvp` whose body is `lu`, a diagonal gather, a pivot
    test (`any(diag == 0)`, a `reduce_or`) and a `log`, and whose rule solves with the matrix.
    Seen from inside, the body's output mask is one the static pass cannot name, along every
    axis: a batch element may still be dropped whole, so it is decided at run time
    (`batched_syms`), and the pivot test reduces row by row (a `reduce_or` row): a singular
    matrix the `where` drops is cut before the call. Before, its gradient was NaN (2 x 2 took
    the closed form and was fixed). Batched, one matrix under a scalar predicate, and vmapped."""
    logdet = CUSTOM_BODIES[name]

    def f(a):
        return jnp.where(VALID_3, logdet(a), 0.).sum()

    def by_hand(a):
        return f(jnp.where(VALID_3[:, None, None], a, jnp.eye(3)))

    assert_bitwise(nan_safe(f)(SINGULAR_3), jax.jit(f)(SINGULAR_3))
    assert np.isnan(jax.grad(f)(SINGULAR_3)[1]).all()  # the bug
    assert_close(jax.grad(nan_safe(f))(SINGULAR_3), jax.grad(by_hand)(SINGULAR_3), rtol=1e-5)

    def one(a, ok):
        return jnp.where(ok, logdet(a[None])[0], 0.)

    zero = jnp.zeros((3, 3))
    np.testing.assert_array_equal(jax.grad(nan_safe(one))(zero, False), 0.)
    assert_close(jax.grad(nan_safe(one))(SINGULAR_3[0], True),
                 jax.grad(one)(SINGULAR_3[0], True), rtol=1e-5)
    batched = jax.grad(lambda a: jax.vmap(nan_safe(one))(a, VALID_3).sum())(SINGULAR_3)
    assert_close(batched, jax.grad(by_hand)(SINGULAR_3), rtol=1e-5)


# The output read through a slice of the matrix axes before the `where` (one entry, one
# eigenvector, a reversed or padded matrix): a dropped matrix is still dropped whole.
SLICED = [
    ("chol[:, 1, 1]", lambda a: jnp.where(VALID, jnp.log(jnp.linalg.cholesky(a)[:, 1, 1]),
                                          0.).sum(), jnp.eye(2)),
    ("eigh v[..., 0]", lambda a: jnp.where(VALID[:, None], jnp.linalg.eigh(a)[1][..., 0] ** 2
                                           * jnp.arange(1., 3.)[None], 0.).sum(), DISTINCT),
    ("svd u[..., 0]", lambda a: jnp.where(VALID[:, None], jnp.linalg.svd(a)[0][..., 0] ** 2
                                          * jnp.arange(1., 3.)[None], 0.).sum(), DISTINCT),
    ("qr q[:, :, 0] by dynamic_slice", lambda a: jnp.where(VALID[:, None], jax.lax.dynamic_slice(
        jnp.linalg.qr(a)[0], (0, 0, 0), (5, 2, 1))[..., 0] * jnp.arange(1., 3.)[None], 0.).sum(),
     DISTINCT),
    ("rev and negative pad of cholesky", lambda a: jnp.where(VALID[:, None, None], jax.lax.pad(
        jnp.flip(jnp.linalg.cholesky(a), -1), 0., ((0, 0, 0), (0, 0, 0), (0, -1, 0))),
        0.).sum(), jnp.eye(2)),
    ("vmapped eigh v[:, -1]", jax.vmap(lambda a, ok: jnp.where(
        ok, jnp.linalg.eigh(a)[1][:, -1] ** 2 * jnp.arange(1., 3.), 0.).sum()), DISTINCT),
]


@pytest.mark.parametrize("name,f,safe", SLICED, ids=[c[0] for c in SLICED])
def test_a_slice_of_the_matrix_axes_before_the_where_still_drops_whole_matrices(name, f, safe):
    if name.startswith("vmapped"):
        f = (lambda g: lambda a: g(a, VALID).sum())(f)
    hand = lambda a: f(_fixed(a, safe))
    assert_bitwise(nan_safe(f)(MATS), jax.jit(f)(MATS))
    assert not np.all(np.isfinite(jax.grad(f)(MATS))), "plain JAX leaks here"
    got = jax.grad(nan_safe(f))(MATS)
    assert_finite(got)
    np.testing.assert_array_equal(np.asarray(got)[~np.asarray(VALID)], 0.)
    assert_close(got, jax.grad(hand)(MATS), rtol=1e-5, atol=1e-6)


def test_a_nan_from_cholesky_times_a_weight_is_guarded():
    """cholesky makes NaN from a finite matrix that is not positive definite: a product with a
    differentiated weight in the dropped lanes is a leak (0 * NaN in the weight's gradient)."""
    def f(w):
        chol = jnp.linalg.cholesky(MATS[:2])
        return jnp.where(VALID[:2, None, None], chol * w, 0.).sum()

    def hand(w):
        chol = jnp.linalg.cholesky(jnp.where(VALID[:2, None, None], MATS[:2], jnp.eye(2)))
        return jnp.where(VALID[:2, None, None], chol * w, 0.).sum()
    w = jnp.float32(2.)
    assert np.isnan(jax.grad(f)(w))
    assert_close(jax.grad(nan_safe(f))(w), jax.grad(hand)(w))


def test_a_live_matrix_that_is_not_positive_definite_stays_nan():
    valid = jnp.array([True, True, False])
    mats = jnp.stack([SPD, NOT_PD, ZERO])

    def f(a):
        chol = jnp.linalg.cholesky(a)
        return jnp.where(valid, jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)).sum(-1), 0.).sum()
    plain, got = jax.grad(f)(mats), jax.grad(nan_safe(f))(mats)
    np.testing.assert_array_equal(np.isnan(got[1]), np.isnan(plain[1]))
    assert np.all(np.isnan(got[1]))                       # the taken branch's own NaN
    assert_close(got[0], plain[0])                         # live elements unchanged
    np.testing.assert_array_equal(got[2], 0.)


def test_vmap_of_a_per_matrix_where():
    """`nan_safe` of a one-matrix function under `vmap`: the `where` on a scalar drops the whole
    matrix. (Its diagonal by indexing: `jnp.diagonal` of one matrix is a cond on the platform,
    and liveness crosses a cond's branches as a whole, so that form keeps the matrix live.)"""
    idx = jnp.arange(2)

    def one(a, ok):
        chol = jnp.linalg.cholesky(a)
        return jnp.where(ok, jnp.log(chol[idx, idx]).sum(), 0.)

    def hand(a, ok):
        return one(jnp.where(ok, a, jnp.eye(2)), ok)
    loss = lambda g: lambda a: jax.vmap(g)(a, VALID).sum()
    assert_close(jax.grad(loss(nan_safe(one)))(MATS), jax.grad(loss(hand))(MATS),
                 rtol=1e-5, atol=1e-6)


def test_nothing_dropped_nothing_changed():
    """Every batch element live: the rewritten program is the original."""
    def f(a):
        return jnp.log(jnp.diagonal(jnp.linalg.cholesky(a), axis1=-2, axis2=-1)).sum()
    a = jnp.stack([SPD, SPD + 1.])
    report = jaxsafe.explain(f)(a)
    assert not report.changed
    assert structure(jaxsafe.make_jaxpr(f)(a)) == structure(jax.make_jaxpr(f)(a))


def test_explain_names_the_cut_and_no_unknown_primitive():
    report = jaxsafe.explain(lambda a: logdet(a).sum())(MATS)
    text = str(report)
    assert "cholesky" in text and "singular derivative" in text, text
    assert "unknown" not in text and "unguarded" not in text, text
    # one matrix: jnp.diagonal's platform-dependent branch index is known (no derivative)
    one = str(jaxsafe.explain(lambda a: jnp.log(jnp.diagonal(jnp.linalg.cholesky(a))))(SPD))
    assert "unknown" not in one, one
    # `lu_solve`'s pivots become a permutation by a primitive of their own
    solved = jaxsafe.explain(lambda a: _kept(jsl.lu_solve(jsl.lu_factor(a), RHS)).sum())(MATS)
    assert solved.guards and not solved.unknown, str(solved)


def _newton_step(x, done, fixed=False):
    """One Newton step on f(x) = x0^2 |x|^2 / 2, skipped where `done`: its Hessian is singular
    at x0 = 0, where the step is not taken."""
    h = jnp.eye(2) * x[0] ** 2
    if fixed:
        h = jnp.where(done, jnp.eye(2), h)
    return jnp.where(done, x, x - jnp.linalg.solve(h, 2. * x))


@pytest.mark.parametrize("done", [True, "traced"])
def test_a_solve_the_program_drops_whole_is_cut(done):
    x = jnp.array([0., 1.])
    if done == "traced":
        f = lambda x, d: _newton_step(x, d).sum()
        hand = lambda x, d: _newton_step(x, d, fixed=True).sum()
        args = (x, jnp.bool_(True))
    else:  # a Python constant: the where drops the solve in every lane
        f = lambda x: _newton_step(x, True).sum()
        hand = lambda x: _newton_step(x, True, fixed=True).sum()
        args = (x,)
    assert np.all(np.isnan(jax.grad(f)(*args)))
    assert_close(jax.grad(nan_safe(f))(*args), jax.grad(hand)(*args))
    assert_close(jax.jacfwd(nan_safe(f))(*args), jax.jacfwd(hand)(*args))
    if done == "traced":  # second order once
        assert_close(jax.hessian(nan_safe(f))(*args), jax.hessian(hand)(*args))


def test_vmap_of_nan_safe_newton_steps():
    xs = jnp.array([[0., 1.], [2., 1.]])
    done = jnp.array([True, False])
    loss = lambda step: lambda xs: jax.vmap(step)(xs, done).sum()
    got = jax.grad(loss(nan_safe(_newton_step)))(xs)
    assert_close(got, jax.grad(loss(lambda x, d: _newton_step(x, d, fixed=True)))(xs))
    assert_finite(got)


def test_a_matrix_that_a_slice_of_the_batch_never_reads_is_cut():
    """`chol[1:, 0, 0]`: the slice cuts off matrix 0 along the batch axis and the other lanes
    along the matrix axes; matrix 0 (not positive definite: NaN) is dropped whole."""
    mats = jnp.stack([NOT_PD, SPD, SPD + 1.])
    for read in (lambda c: jnp.sum(c[1:, 0, 0]), lambda c: jnp.sum(c[1:, :, :1])):
        f = lambda a, read=read: read(jnp.linalg.cholesky(a))
        hand = lambda a, read=read: read(jnp.linalg.cholesky(a.at[0].set(jnp.eye(2))))
        assert np.isnan(jax.grad(f)(mats)).any()
        got = jax.grad(nan_safe(f))(mats)
        np.testing.assert_array_equal(got, jax.grad(hand)(mats))
        assert_bitwise(nan_safe(f)(mats), jax.jit(f)(mats))
