"""Decisions that read guarded values (jaxsafe/_rewrite.py `ChangedLanes`, _symbolic.py).

A decision (a predicate, the `stop_gradient(max(x))` of a softmax, logsumexp's max) must see the
original values wherever its result is live. When a `where` drops whole rows, the rows a guard
changes are dropped as a whole, and a decision over a row reads the guarded values: the original
program is not computed a second time. When the dropped lanes do not make whole rows, it must
not. Checked against the hand-written double where, JAX on the valid rows alone, and the
number of matmuls in the rewritten program.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsafe import _symbolic as S
from jaxsafe import nan_safe
from jaxsafe._compat import Var

# Numerics: conftest's leak checker is for the modules that exercise the API's tracing paths
# (test_api, test_composition, ...); here it would only turn JAX's caches off (2-3x slower).
pytestmark = pytest.mark.no_leak_check

P = jax.extend.core.primitives
Primitive = jax.extend.core.Primitive


def _count(closed, primitive: Primitive) -> int:
    """Equations of `primitive`, in nested jits too."""
    jaxpr = getattr(closed, "jaxpr", closed)
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive is primitive
        for p in e.params.values():
            if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns"):
                n += _count(p, primitive)
    return n


# --------------------------------------------------------------------------- whole rows dropped

def attention_rows(q, k, v, key_valid):
    """Attention whose query rows with no valid key are dropped after the softmax; the
    queries are square roots, guarded in the dropped row (so its scores change there)."""
    s = jnp.sqrt(q) @ k.T
    s = jnp.where(key_valid[None, :] & (jnp.arange(4)[:, None] >= 1), s, -jnp.inf)
    row_valid = jnp.any(key_valid[None, :] & (jnp.arange(4)[:, None] >= 1), -1, keepdims=True)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.sum(jnp.where(row_valid, p @ v, 0.) ** 2)


def attention_rows_hand(q, k, v, key_valid):
    valid = key_valid[None, :] & (jnp.arange(4)[:, None] >= 1)
    row_valid = jnp.any(valid, -1, keepdims=True)
    q = jnp.where(row_valid, q, 1.)
    s = jnp.where(valid, jnp.sqrt(q) @ k.T, -jnp.inf)
    s = jnp.where(row_valid, s, 0.)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.sum(jnp.where(row_valid, p @ v, 0.) ** 2)


def _attention_args():
    q = jnp.linspace(-1., 1., 12).reshape(4, 3) + jnp.array([[0.], [1.], [1.], [1.]])
    k = jnp.linspace(0.5, -0.5, 15).reshape(5, 3)
    v = jnp.linspace(-2., 2., 10).reshape(5, 2)
    return q, k, v, jnp.array([True, False, True, True, False])


def test_softmax_over_dropped_rows_is_computed_once():
    args = _attention_args()
    grad = jax.grad(attention_rows, (0, 1, 2))
    plain = jax.make_jaxpr(grad)(*args)
    safe = jax.make_jaxpr(jax.grad(nan_safe(attention_rows), (0, 1, 2)))(*args)
    assert _count(safe, P.dot_general_p) == _count(plain, P.dot_general_p)
    assert any(np.isnan(g).any() for g in grad(*args))  # row 0 has no valid key: NaN in JAX
    got = jax.grad(nan_safe(attention_rows), (0, 1, 2))(*args)
    assert_finite(got)
    assert_close(got, jax.grad(attention_rows_hand, (0, 1, 2))(*args), rtol=1e-6)


def test_softmax_over_dropped_rows_forward_and_second_order():
    args = _attention_args()
    value, _ = jax.value_and_grad(nan_safe(attention_rows))(*args)
    assert_bitwise(value, jax.jit(attention_rows)(*args))
    h = jax.hessian(nan_safe(attention_rows))(*args)
    assert_close(h, jax.hessian(attention_rows_hand)(*args), rtol=1e-5, atol=1e-7)


def lm_head_loss(h, w, tokens, keep):
    """logsumexp minus the picked logit, over positions the mask keeps; a log guard drops
    the rows it does not keep."""
    logits = jnp.log(h) @ w
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(keep, logz - picked, 0.))


def lm_head_loss_hand(h, w, tokens, keep):
    h = jnp.where(keep[:, None], h, 1.)
    logits = jnp.log(h) @ w
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(keep, logz - picked, 0.))


def test_logsumexp_over_dropped_rows_reads_guarded_values():
    h = jnp.array([[1., 2., 3.], [-1., 0., 2.], [0.5, 0.25, 4.]])  # row 1: log of <= 0
    w = jnp.linspace(-1., 1., 12).reshape(3, 4)
    tokens, keep = jnp.array([0, 3, 2]), jnp.array([True, False, True])
    args = (h, w, tokens, keep)
    safe = jax.make_jaxpr(jax.grad(nan_safe(lm_head_loss), (0, 1)))(*args)
    plain = jax.make_jaxpr(jax.grad(lm_head_loss, (0, 1)))(*args)
    assert _count(safe, P.dot_general_p) == _count(plain, P.dot_general_p)
    assert _count(safe, P.log_p) == _count(plain, P.log_p)
    value, got = jax.value_and_grad(nan_safe(lm_head_loss), (0, 1))(*args)
    assert_bitwise(value, jax.jit(lm_head_loss)(*args))
    assert_finite(got)
    assert_close(got, jax.grad(lm_head_loss_hand, (0, 1))(*args), rtol=1e-6)


# --------------------------------------------------------------------------- lanes, not rows

def max_shift_over_lanes(x, keep):
    """The max is over a row whose dropped lanes are single lanes: it must read the original
    values there (log(100) here), or the live lanes would change."""
    s = jnp.log(x)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    return jnp.sum(jnp.where(keep, s - m, 0.))


def max_shift_over_lanes_hand(x, keep):
    m = jax.lax.stop_gradient(jnp.max(jnp.log(x), axis=-1, keepdims=True))
    s = jnp.log(jnp.where(keep, x, 1.))
    return jnp.sum(jnp.where(keep, s - m, 0.))


def test_decision_over_partly_dropped_rows_reads_the_original_values():
    x = jnp.array([[100., 2., 3.], [4., 0.5, 8.]])
    keep = jnp.array([[False, True, True], [True, True, False]])
    value, got = jax.value_and_grad(nan_safe(max_shift_over_lanes))(x, keep)
    assert_bitwise(value, jax.jit(max_shift_over_lanes)(x, keep))
    assert_close(got, jax.grad(max_shift_over_lanes_hand)(x, keep))


def test_predicate_of_a_guarded_value_still_reads_the_original():
    # The predicate reads r = sqrt(x), whose dropped lane 0 the guard changes (sqrt(1) = 1):
    # read as guarded, lane 0 would pick `out` (0) instead of 2 * x (-2).
    def f(x):
        r = jnp.sqrt(x)
        out = jnp.where(x > 0, r, 0.)
        return jnp.sum(jnp.where(r > 0.5, out, 2 * x))
    x = jnp.array([-1., 0.04, 4.])
    value, g = jax.value_and_grad(nan_safe(f))(x)
    assert_bitwise(value, jax.jit(f)(x))
    assert_close(g, jnp.array([2., 2., 0.25]))


# --------------------------------------------------------------------------- the algebra
# Brute force over every assignment of a few predicates on a small grid: `sym_not` is the
# complement, `disjoint` is sound, `move` is an OR over the axes it removes.

SHAPE = (2, 3)


def _keys():
    a = Var(jax.core.ShapedArray((2, 1), jnp.bool_))
    b = Var(jax.core.ShapedArray((1, 3), jnp.bool_))
    c = Var(jax.core.ShapedArray((2, 3), jnp.bool_))
    return [(a, (0, None)), (b, (None, 1)), (c, (0, 1))]


KEYS = _keys()


def _evaluate(sym, values, shape=SHAPE):
    out = np.zeros(shape, bool)
    for idx in itertools.product(*map(range, shape)):
        out[idx] = any(all(values[key][tuple(0 if e is None else idx[e] for e in embed)] == pos
                           for key, pos, embed in term) for term in sym)
    return out


_literal = st.builds(lambda k, pos: (KEYS[k][0], pos, KEYS[k][1]),
                     st.integers(0, 2), st.booleans())
_sym = st.frozensets(st.frozensets(_literal, max_size=3), max_size=3)
_values = st.tuples(*[st.lists(st.booleans(), min_size=n, max_size=n).map(
    lambda v, s=key.aval.shape: np.array(v).reshape(s)) for key, _ in KEYS
    for n in [int(np.prod(key.aval.shape))]])


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(_sym, _sym, _values)
def test_symbolic_not_and_disjoint_by_brute_force(a, b, vals):
    values = {key: v for (key, _), v in zip(KEYS, vals, strict=False)}
    a, b = S.sym_or(S.FALSE, a), S.sym_or(S.FALSE, b)
    not_a = S.sym_not(a)
    if not_a is not None:
        np.testing.assert_array_equal(_evaluate(not_a, values), ~_evaluate(a, values))
    if S.disjoint(a, b):
        assert not (_evaluate(a, values) & _evaluate(b, values)).any()


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(_sym, _values)
def test_symbolic_move_is_an_or_over_the_removed_axis(a, vals):
    values = {key: v for (key, _), v in zip(KEYS, vals, strict=False)}
    a = S.sym_or(S.FALSE, a)
    full = _evaluate(a, values)
    moved = S.move(a, {0: 0})  # keep axis 0, OR over axis 1
    # literals on axis 1 become unknowns: with each unknown true, the move is a superset of
    # the OR; literals that avoid axis 1 carry over exactly
    unknowns = {lit[0] for term in moved for lit in term if isinstance(lit[0], S.Unknown)}
    as_true = S.sym_or(S.FALSE, frozenset(frozenset(lit for lit in t if lit[0] not in unknowns)
                                          for t in moved))
    assert (_evaluate(as_true, values, (2, 1))[:, 0] >= full.any(axis=1)).all()
    if not unknowns:
        np.testing.assert_array_equal(_evaluate(moved, values, (2, 1))[:, 0], full.any(axis=1))


def test_a_transposed_or_of_a_literal_is_not_implied_by_the_literal():
    """A move that collapses an axis and swaps two others: at lane (i, j, k) the unknown is
    OR_k' c[j, i, k'], which c[i, j, k] does not imply; the OR of both keeps both terms."""
    c = Var(jax.core.ShapedArray((2, 2, 2), jnp.bool_))
    lit = (c, True, (0, 1, 2))
    moved = S.move(frozenset({frozenset({lit})}), {0: 1, 1: 0})  # onto a (2, 2, 2) value
    both = S.sym_or(moved, frozenset({frozenset({lit})}))
    assert frozenset({lit}) in both
    kept = S.move(frozenset({frozenset({lit})}), {0: 0, 1: 1})  # the same frame: absorbed
    assert S.sym_or(kept, frozenset({frozenset({lit})})) == kept


def test_not_any_of_a_literal_forces_its_negation_in_every_lane():
    c = Var(jax.core.ShapedArray((2, 3), jnp.bool_))
    lit = (c, True, (0, 1))
    none = S.sym_not(S.move(frozenset({frozenset({lit})}), {}))  # not any(c)
    assert S.implies(none, frozenset({frozenset({(c, False, (0, 1))})}))
    assert S.implies(none, frozenset({frozenset({(c, False, (1, 0))})}))  # any frame
    assert not S.implies(none, frozenset({frozenset({(c, True, (0, 1))})}))
    # not any(c and d) forces nothing about c alone
    d = Var(jax.core.ShapedArray((2, 3), jnp.bool_))
    both = S.sym_not(S.move(frozenset({frozenset({lit, (d, True, (0, 1))})}), {}))
    assert not S.implies(both, frozenset({frozenset({(c, False, (0, 1))})}))


# ----------------------------------------- a bound of the original program, after a guard

_KEEP_FIRST_TWO = jnp.array([True, True, False])


def _floored_unit(e, floor):
    """`e / sqrt(floor(e * e))`: a floored norm (optax's cosine similarity clips it)."""
    return e / jnp.sqrt(floor(e * e))


_FLOORS = {
    "maximum": lambda v: jnp.maximum(v, 1e-7),
    "clip below": lambda v: jnp.clip(v, 1e-7),
    "clip both": lambda v: jnp.clip(v, 1e-7, 1e7),
}


@pytest.mark.parametrize("floor", list(_FLOORS))
def test_a_bound_the_original_program_proves_does_not_hold_after_a_guard(floor):
    """`sqrt(max(x * x, eps))` is at least `sqrt(eps)` in the original program; but where a
    guard gives `x * x` its safe value 0 in a dropped lane and the original `max` took
    `x * x`, the re-decided `max` takes that 0: the `div` after it was left unguarded on the
    original bound and made `0 / 0` in the dropped lane, which reverse mode multiplied into
    the live scale's derivative (NaN). Reference: plain JAX, finite here, and the program
    with the dropped lane removed, at first and second order and in forward mode."""
    keep, floored = _KEEP_FIRST_TWO, _FLOORS[floor]
    f = lambda s, x: jnp.sum(jnp.where(keep, s * _floored_unit(x, floored), 0.))  # noqa: E731
    removed = lambda s, x: jnp.sum(s * _floored_unit(x[:2], floored))  # noqa: E731
    x = jnp.array([1., 2., 3.])
    for d in (jax.grad, jax.jacfwd, jax.hessian):
        want = d(removed, argnums=(0, 1))(2., x)
        got = d(nan_safe(f), argnums=(0, 1))(2., x)
        assert_finite(got)
        assert_close(got[0], want[0])
    assert_close(jax.grad(nan_safe(f))(2., x), jax.grad(f)(2., x))


def test_a_gram_matrix_of_floored_unit_vectors_whose_row_is_dropped():
    """The same through a product: `u @ u.T` reads the dropped row's `0 / 0` for the live rows'
    derivatives (optax's `ntxent` with a label that has no positive pair). Reference: the
    program with the dropped row and column removed."""
    e = jnp.array([[1., 0.], [0.6, 0.8], [0.3, 0.4]])
    keep = jnp.array([[False, True, False], [False, False, False], [False, False, False]])

    def gram(e, keep):
        u = _floored_unit(e, lambda v: jnp.maximum(jnp.sum(v, -1, keepdims=True), 1e-7))
        return jnp.sum(jnp.where(keep, u @ u.T, 0.))

    removed = lambda e: gram(e[:2], keep[:2, :2])  # noqa: E731
    f = lambda e: gram(e, keep)  # noqa: E731
    for d in (jax.grad, jax.jacfwd):
        want = d(removed)(e)
        got = d(nan_safe(f))(e)
        assert_close(got, want)  # `removed` slices `e` itself: its last row is 0
        assert_bitwise(got[2], jnp.zeros(2))
