"""Programs that bug hunts on library functions and on JAX's bug reports found wrong, each
checked against an independent reference: the hand-written double where, or JAX on the
program with the dropped lanes removed."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite
from jax import lax
from jax.custom_derivatives import SymbolicZero

import jaxsafe

# a numerics sweep: the modules of nan_safe's tracing paths check for tracer leaks (conftest)
pytestmark = pytest.mark.no_leak_check

nan = jnp.nan
VALID = jnp.array([True, False])


def _same_forward(f, *args):
    assert_bitwise(jaxsafe.nan_safe(f)(*args), jax.jit(f)(*args))


# --------------------------------------------------------------------------- a body's row max

def _rowwise(body):
    """`body(x, w)` as a `custom_jvp` whose rule is the analytic derivative of `w * log(.)`."""
    @jax.custom_jvp
    def g(x, w):
        return body(x, w)

    @g.defjvp
    def g_jvp(primals, tangents):
        (x, w), (dx, dw) = primals, tangents
        return g(x, w), w * dx / x + dw * jnp.log(x)
    return g


ROW_BODIES = {
    "max": lambda x, w: w * jnp.log(x + jnp.max(x, -1, keepdims=True)),
    "min": lambda x, w: w * jnp.log(x - jnp.min(x, -1, keepdims=True) + 1.),
    "cummax": lambda x, w: w * jnp.log(x + lax.cummax(x, axis=1)),
    "top_k": lambda x, w: w * jnp.log(x + lax.top_k(x, 1)[0]),
    "sort": lambda x, w: w * jnp.log(x + jnp.sort(x, -1)),
}


@pytest.mark.parametrize("body", list(ROW_BODIES.values()), ids=list(ROW_BODIES))
def test_a_custom_rule_whose_body_chooses_along_rows_cuts_a_dropped_row(body):
    """A `custom_jvp` whose primal body takes a row maximum (optax's
    `safe_softmax_cross_entropy`, through `log_softmax`): the body re-runs as one unit, so a
    row reads every lane of itself and no other row. A row the program drops after the call
    is cut from differentiation, as the hand fix replaces it. Before, the maximum kept every
    row live and the dropped row's NaN derivative reached `x`'s gradient."""
    g = _rowwise(body)
    w = jnp.array([[2., 3.], [1., 1.]])
    x = jnp.array([[1., 2.], [0., -1.]])

    def loss(x):
        return jnp.sum(jnp.where(VALID, g(x, w).sum(-1), 0.))

    def by_hand(x):
        return loss(jnp.where(VALID[:, None], x, 1.))

    def live_row_only(x):  # the reference with the dropped row removed
        return g(x[:1], w[:1]).sum()

    assert np.isnan(jax.grad(loss)(x)).any()  # the bug
    _same_forward(loss, x)
    grad = jax.grad(jaxsafe.nan_safe(loss))(x)
    assert_close(grad, jax.grad(by_hand)(x))
    assert_close(grad[:1], jax.grad(live_row_only)(x[:1]))
    np.testing.assert_array_equal(grad[1], [0., 0.])
    assert_close(jax.hessian(jaxsafe.nan_safe(loss))(x), jax.hessian(by_hand)(x))


def test_a_masked_softmax_cross_entropy_as_a_custom_rule_over_padded_rows():
    """The optax shape: a `custom_jvp` log-softmax with `-inf` masked classes, its rows
    dropped by a validity mask, a NaN padded row of logits from `x @ w`."""
    @jax.custom_jvp
    def log_softmax(z):
        return z - jnp.max(z, -1, keepdims=True) - jnp.log(
            jnp.sum(jnp.exp(z - jnp.max(z, -1, keepdims=True)), -1, keepdims=True))

    @log_softmax.defjvp
    def log_softmax_jvp(primals, tangents):
        (z,), (dz,) = primals, tangents
        out = log_softmax(z)
        return out, dz - jnp.sum(jnp.exp(out) * dz, -1, keepdims=True)

    labels = jnp.array([[0., 1., 0.], [1., 0., 0.]])
    allowed = jnp.array([True, True, False])
    x = jnp.array([[.5, -1.], [nan, nan]])
    w = jnp.array([[.3, -.2, .1], [.1, .4, -.3]])

    def loss(w, x):
        z = jnp.where(allowed, x @ w, -jnp.inf)
        ce = -jnp.sum(jnp.where(allowed, labels * log_softmax(z), 0.), -1)
        return jnp.sum(jnp.where(VALID, ce, 0.))

    def by_hand(w, x):
        return loss(w, jnp.where(VALID[:, None], x, 0.))

    assert np.isnan(jax.grad(loss)(w, x)).all()  # the bug
    _same_forward(loss, w, x)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(w, x), jax.grad(by_hand)(w, x))


# --------------------------------------------------------------------------- free lanes

def test_a_lane_without_derivative_that_is_dropped_keeps_its_guarded_value():
    """`g = mask01 * w` carries no derivative of `w` where the mask is 0, so `sqrt(g * g + 1)`
    takes its original value back there (`_free.py`). In a lane that is also dropped, the
    original is NaN (`0 * nan`); it must be the value the guards made safe, or `lr`'s
    derivative, which reads it through `lr * sqrt(...)`, is NaN. The shape of a
    meta-gradient through an Adam update of a masked gradient."""
    w = jnp.array([.5, nan])

    def loss(lr, w):
        g = jnp.where(VALID, 1., 0.) * w
        return jnp.sum(jnp.where(VALID, lr * jnp.sqrt(g * g + 1.), 0.))

    def by_hand(lr, w):
        return loss(lr, jnp.where(VALID, w, 0.))

    def live_lane_only(lr, w):
        return lr * jnp.sqrt(w[0] ** 2 + 1.)

    assert np.isnan(jax.grad(loss)(.1, w))  # the bug
    _same_forward(loss, .1, w)
    grads = jax.grad(jaxsafe.nan_safe(loss), (0, 1))(.1, w)
    assert_close(grads, jax.grad(by_hand, (0, 1))(.1, w))
    assert_close(grads[0], jax.grad(live_lane_only)(.1, w))
    assert_close(jax.jit(jax.grad(jaxsafe.nan_safe(loss)))(.1, w), grads[0])
    assert_close(jax.jvp(lambda lr: jaxsafe.nan_safe(loss)(lr, w), (.1,), (1.,))[1], grads[0])
    assert_close(jax.hessian(jaxsafe.nan_safe(loss))(.1, w), jax.hessian(by_hand)(.1, w))


# --------------------------------------------------------------------------- empty values

EMPTY_SLICES = {
    "x[1:] of one lane": (lambda v: v[1:], (1,)),
    "x[0:0]": (lambda v: v[0:0], (1,)),
    "rows[1:] of one row": (lambda v: v[1:], (1, 3)),
    "columns[:, 1:] of one column": (lambda v: v[:, 1:], (3, 1)),
}


@pytest.mark.parametrize("cut,shape", list(EMPTY_SLICES.values()), ids=list(EMPTY_SLICES))
def test_a_slice_that_keeps_no_lane_drops_every_lane(cut, shape):
    """A value with no lanes reads nothing: `jnp.sqrt(a)[1:]` of one lane drops it (a size-1
    axis sliced away). Before, the lane stayed live and `sqrt(-1)`'s NaN derivative reached
    `a`'s gradient, and through a product, `b`'s."""
    a, b = -jnp.ones(shape), jnp.ones(shape)

    def loss(a, b):
        return b.sum() + jnp.sum(cut(jnp.sqrt(a) * b))

    assert np.isnan(jax.grad(loss, (0, 1))(a, b)[1]).all()  # the bug
    _same_forward(loss, a, b)
    grads = jax.grad(jaxsafe.nan_safe(loss), (0, 1))(a, b)
    np.testing.assert_array_equal(grads[0], np.zeros(shape))
    np.testing.assert_array_equal(grads[1], np.ones(shape))  # the program without the slice


def test_an_associative_scan_of_a_power_of_two_length_keeps_only_its_live_prefix():
    """`lax.associative_scan` slices a size-1 axis away at power-of-two lengths: a linear
    recurrence (S5, LRU) whose padded tail is sliced off gets the gradient of the same
    program run on the live prefix."""
    def combine(e1, e2):
        return e1[0] * e2[0], e2[0] * e1[1] + e2[1]

    def loss(a, b, k=2):
        return jnp.sum(lax.associative_scan(combine, (jnp.sqrt(a), b))[1][:k] ** 2)

    def live_prefix(a, b, k=2):
        return jnp.sum(lax.associative_scan(combine, (jnp.sqrt(a[:k]), b[:k]))[1] ** 2)

    a, b = jnp.array([.25, .5, 4., -1.]), jnp.array([1., 2., 3., 4.])
    assert np.isnan(jax.grad(loss, (0, 1))(a, b)[0]).any()  # the bug
    _same_forward(loss, a, b)
    grads = jax.grad(jaxsafe.nan_safe(loss), (0, 1))(a, b)
    assert_close(grads, jax.grad(live_prefix, (0, 1))(a, b))  # 0 past the prefix


# --------------------------------------------------------------------------- one-part splits

def test_a_split_into_one_part_is_not_a_part_of_itself():
    """`lax.split(x, (n,))`, as `jax.flatten_util.ravel_pytree` emits it (optax's
    `projection_simplex`): its operand's mask is the one output's. Before, the mask was
    remembered as a concatenation of itself, and reducing it raised "cycle through"."""
    x = jnp.arange(1., 10.).reshape(3, 3)
    valid = jnp.array([True, True, False])

    def loss(x, by_hand=False):
        y = x.ravel() * jnp.sum(x.ravel())
        y = lax.split(y, (9,))[0].reshape(3, 3)
        if by_hand:
            y = jnp.where(valid[:, None], y, 1.)
        return jnp.sum(jnp.where(valid, jnp.sum(jnp.sqrt(y), -1), 0.))

    _same_forward(loss, x)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(x), jax.grad(loss)(x))  # finite: the same
    bad = x.at[2].set(-1.)  # the dropped row's sqrt is NaN; the sum reads every row
    assert np.isnan(jax.grad(loss)(bad)).all()
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(bad), jax.grad(loss, 0)(bad, True))


# --------------------------------------------------------------------------- a body's own index

def _with_cos_rule(body):
    g = jax.custom_jvp(body)
    g.defjvp(lambda primals, tangents: (g(*primals), tangents[0] * jnp.cos(primals[0])))
    return g


def _rows_of(one_row):
    return lambda x: jax.vmap(one_row)(x)


INDEXED_BODIES = {
    "take_along_axis(argmax)": lambda x: jnp.sin(x) + jnp.take_along_axis(
        x, jnp.argmax(x, -1)[:, None], -1),
    "x[arange, argmin]": lambda x: jnp.sin(x) + x[jnp.arange(len(x)), jnp.argmin(x, -1)][:, None],
    "argsort gather": lambda x: jnp.sin(x) + jnp.take_along_axis(x, jnp.argsort(x, -1), -1),
    "vmap of r[argmax(r)]": _rows_of(lambda r: jnp.sin(r) + r[jnp.argmax(r)]),
    "dynamic_update_slice at argmax": lambda x: jnp.sin(lax.dynamic_update_slice(
        x, x[:, :1] * 2., (0, jnp.argmax(x[0])))),
    # batched: scatters whose index writes into its own row only
    "vmap of at[argmax].set": _rows_of(lambda r: jnp.sin(r.at[jnp.argmax(r)].set(r[0] * 2.))),
    "vmap of at[argmax].add": _rows_of(lambda r: jnp.sin(r.at[jnp.argmax(r)].add(r[0]))),
    "vmap of dynamic_update_slice at argmax": _rows_of(
        lambda r: jnp.sin(lax.dynamic_update_slice(r, r[:1] * 2., (jnp.argmax(r),)))),
}


@pytest.mark.parametrize("body", list(INDEXED_BODIES.values()), ids=list(INDEXED_BODIES))
@pytest.mark.parametrize("mapped", [False, True], ids=["whole", "lax.map"])
def test_a_custom_rule_whose_body_indexes_by_its_own_values_cuts_a_dropped_row(body, mapped):
    """A custom rule's body that picks lanes by an index it computes from its input (`argmax`
    then a gather, a `dynamic_slice`, a `dynamic_update_slice` or a scatter): where every read
    counts, an index is read by the output lanes it places (its batch coordinates, across the
    offset axes; a scatter's, every lane of its batch element), not by every lane, so a row
    dropped after the call is cut. Also per row under `lax.map`. Before, the index kept every
    row live."""
    g = _with_cos_rule(body)
    run = (lambda x: lax.map(lambda r: g(r[None])[0], x)) if mapped else g
    x = jnp.array([[1., 2.], [nan, -1.]])

    def loss(x):
        return jnp.sum(jnp.where(VALID[:, None], run(x), 0.))

    def by_hand(x):
        return loss(jnp.where(VALID[:, None], x, 1.))

    assert np.isnan(jax.grad(loss)(x)).any()  # the bug
    _same_forward(loss, x)
    grad = jax.grad(jaxsafe.nan_safe(loss))(x)
    assert_close(grad, jax.grad(by_hand)(x))
    assert_close(grad[0], jnp.cos(x[0]))  # the rule's derivative, the dropped row removed
    np.testing.assert_array_equal(grad[1], [0., 0.])


# --------------------------------------------------------------------------- NaN made from finite

def test_a_gather_that_fills_out_of_range_lanes_with_nan_is_not_finite():
    """`take_along_axis` (or `.at[i].get(mode="fill")`) gives NaN for an out-of-range index,
    an ignore-index label of -100, from finite operands: a lane the program then drops must
    not reach `w`'s gradient through `picked * w`. Before, a gather counted as finite where
    its operand was (a constant, `finite_args`, soft-capped logits)."""
    logits = jnp.array([[1., 2., .5], [.3, .1, 2.]])  # a constant: finite
    labels = jnp.array([1, -100])
    valid = labels >= 0

    def loss(w):
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1)[:, 0]
        return jnp.sum(jnp.where(valid, picked * w, 0.))

    def by_hand(w):
        safe = jnp.where(valid, labels, 0)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), safe[:, None], -1)[:, 0]
        return jnp.sum(jnp.where(valid, picked * w, 0.))

    w = jnp.array([2., 3.])
    assert np.isnan(jax.grad(loss)(w)).any()  # the bug
    _same_forward(loss, w)
    grad = jax.grad(jaxsafe.nan_safe(loss))(w)
    assert_close(grad, jax.grad(by_hand)(w))
    assert grad[1] == 0.
    # promised finite arguments do not make the fill finite
    def loss_of(w, logits):
        picked = jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
        return jnp.sum(jnp.where(valid, picked * w, 0.))
    assert_close(jax.grad(jaxsafe.nan_safe(loss_of, finite_args=True))(w, logits),
                 jnp.array([logits[0, 1], 0.]))


def test_a_max_pooling_window_in_the_padding_alone_gives_minus_inf():
    """A max pooling whose padding is as wide as its window gives its start, `-inf`, from
    finite operands: the windows a `where` drops must not reach `w`'s gradient through
    `w * pooled`. Before, the pooling counted as finite where its operand was."""
    x = jnp.array([1., 3., 2., .5])
    valid = jnp.arange(6) >= 2

    def pool(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (2,), (1,), ((3, 0),))

    def loss(w, x):
        return jnp.sum(jnp.where(valid, w * pool(x), 0.))

    def without_dropped_windows(w, x):
        return jnp.sum(w[2:] * pool(x)[2:])

    w = jnp.arange(6.) + 1.
    assert np.isnan(jax.grad(loss)(w, x)).any()  # the bug
    _same_forward(loss, w, x)
    expected = jax.grad(without_dropped_windows)(w, x)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(w, x), expected)
    assert_close(jax.grad(jaxsafe.nan_safe(loss, finite_args=True))(w, x), expected)
    assert_close(jax.grad(jaxsafe.nan_safe(lambda w: loss(w, x)))(w), expected)  # a constant


# --------------------------------------------------------------------------- masks into bodies

_MASK = jnp.array([0., 1., 0., 1., 1.])
_X = jnp.array([0., 2., 0., .5, 3.])

BODIES_OF_A_MASKED_PRODUCT = {
    "checkpoint": lambda m, x: jnp.sum(jax.checkpoint(lambda y: m * jnp.sqrt(y) * y)(x)),
    "scan over xs": lambda m, x: lax.scan(
        lambda c, a: (c + a[1] * jnp.sqrt(a[0]) * a[0], None), 0., (x, m))[0],
    "scan constant": lambda m, x: lax.scan(
        lambda c, a: (c + jnp.sum(m * jnp.sqrt(a) * a), None), 0., x[None])[0],
    "lax.map": lambda m, x: jnp.sum(lax.map(lambda a: a[1] * jnp.sqrt(a[0]) * a[0], (x, m))),
    "switch": lambda m, x: lax.switch(1, [lambda y: jnp.sum(y), lambda y: jnp.sum(
        m * jnp.sqrt(y) * y)], x),
}


@pytest.mark.parametrize("made_outside", [False, True], ids=["constant", "from a predicate"])
@pytest.mark.parametrize("body", list(BODIES_OF_A_MASKED_PRODUCT.values()),
                         ids=list(BODIES_OF_A_MASKED_PRODUCT))
def test_a_zero_one_mask_from_outside_a_body_masks_the_product_inside(body, made_outside):
    """`m * sqrt(x) * x` with a 0/1 mask `m` that carries no derivative, inside a
    `jax.checkpoint`, a `scan` (as a constant or sliced from `xs`), `lax.map` or a `switch`
    branch: the lanes where `m` is 0 are dropped there as at the top level (the body is told
    what its inputs carry and hold outside). Before, the body took `m` as differentiable and
    `sqrt(0)`'s infinite derivative gave NaN."""
    def loss(x):
        m = (x > .1).astype(x.dtype) if made_outside else _MASK
        return body(m, x)

    def live_lanes_only(x):  # the program without the masked lanes
        keep = np.array([1, 3, 4])
        return jnp.sum(jnp.sqrt(x[keep]) * x[keep])

    assert np.isnan(jax.grad(loss)(_X)).any()  # the bug
    _same_forward(loss, _X)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(_X), jax.grad(live_lanes_only)(_X),
                 rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("made_outside", [False, True], ids=["constant", "from a predicate"])
def test_a_zero_one_mask_from_outside_a_while_loop_masks_the_product_inside(made_outside):
    """The same in a `while_loop` (`fori_loop` with a traced trip count), which only forward
    mode differentiates: the body's constants are the same in every iteration, so a 0/1 mask
    closed over outside masks the product inside. Before, `jacfwd` was NaN in every lane."""
    def loss(x, n):
        m = (x > .1).astype(x.dtype) if made_outside else _MASK
        return jnp.sum(lax.fori_loop(0, n, lambda i, c: c + m * jnp.sqrt(x) * x,
                                     jnp.zeros_like(x)))

    def live_lanes_only(x, n):
        keep = np.array([1, 3, 4])
        return n * jnp.sum(jnp.sqrt(x[keep]) * x[keep])

    n = jnp.int32(3)
    assert np.isnan(jax.jacfwd(loss)(_X, n)).any()  # the bug
    _same_forward(loss, _X, n)
    assert_close(jax.jacfwd(jaxsafe.nan_safe(loss))(_X, n), jax.jacfwd(live_lanes_only)(_X, n),
                 rtol=1e-6, atol=1e-6)


CHECKPOINTED = {
    "checkpoint": lambda h, w: jax.checkpoint(lambda h, w: h @ w)(h, w),
    "checkpoint, tanh": lambda h, w: jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w),
    "checkpoint, residual": lambda h, w: jax.checkpoint(lambda h, w: h + h @ w)(h, w),
    "cond branch": lambda h, w: lax.cond(True, lambda h, w: h @ w, lambda h, w: h - h @ w, h, w),
}


@pytest.mark.parametrize("block", list(CHECKPOINTED.values()), ids=list(CHECKPOINTED))
def test_a_row_dropped_after_a_checkpoint_is_guarded_before_the_matmul_inside(block):
    """`where(m[:, None], checkpoint(h @ w), 0.)` with a NaN padded row of `h`: the row mask
    outside runs along the rows of the body's output, so the body knows its formula (an
    unknown on the same axis) and guards `h`'s row before the matmul without a run-time
    reduction, as without the checkpoint. Before, it was left and `w`'s gradient was NaN."""
    h = jnp.array([[.5, 1.], [nan, 2.]])
    w = jnp.array([[.3, -.1], [.2, .5]])
    m = jnp.array([True, False])

    def loss(w, h):
        return jnp.sum(jnp.where(m[:, None], block(h, w), 0.))

    def by_hand(w, h):
        return loss(w, jnp.where(m[:, None], h, 0.))

    assert np.isnan(jax.grad(loss)(w, h)).any()  # the bug
    _same_forward(loss, w, h)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(w, h), jax.grad(by_hand)(w, h))
    assert_close(jax.hessian(jaxsafe.nan_safe(loss))(w, h), jax.hessian(by_hand)(w, h))


# ---------------------------------------------------------------- scans with bodies inside

CARRY_STEPS = {
    "cond on the step": lambda i, s: lax.cond(i % 2 == 0, lambda s: s * 2., lambda s: s, s),
    "switch on the step": lambda i, s: lax.switch(i % 3, [lambda s: s, lambda s: s * .5,
                                                          lambda s: -s], s),
    "checkpoint": lambda i, s: jax.checkpoint(lambda s: s * .5 + 1.)(s),
    "optimization_barrier": lambda i, s: lax.optimization_barrier(s) * .5,
    "custom_jvp (softplus)": lambda i, s: jax.nn.softplus(s),
}


@pytest.mark.parametrize("step", list(CARRY_STEPS.values()), ids=list(CARRY_STEPS))
def test_a_drop_after_a_loop_reaches_a_carry_through_a_body_inside_the_loop(step):
    """A `fori_loop` whose body is lane by lane but runs a `cond` or `switch` on the step, a
    `jax.checkpoint`, an `optimization_barrier` or a custom rule (`jax.scipy.special.bessel_jn`
    is a scan with a `cond` inside): a `where` after the loop drops the same lanes of the
    carries, at every step. Before, such a body kept every carry lane live and the dropped
    lane's `log(0)` gave a NaN gradient."""
    def loss(a):
        def body(i, s):
            return step(i, s) + jnp.log(a)
        return jnp.sum(jnp.where(a > 0, lax.fori_loop(0, 3, body, jnp.zeros_like(a)), 0.))

    def by_hand(a):
        safe = jnp.where(a > 0, a, 1.)
        return jnp.sum(jnp.where(a > 0, lax.fori_loop(
            0, 3, lambda i, s: step(i, s) + jnp.log(safe), jnp.zeros_like(a)), 0.))

    a = jnp.array([2., 0., 3.])
    assert np.isnan(jax.grad(loss)(a)).any()  # the bug
    _same_forward(loss, a)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(a), jax.grad(by_hand)(a))
    assert_close(jax.hessian(jaxsafe.nan_safe(loss))(a), jax.hessian(by_hand)(a))


def test_bessel_jn_under_a_where_has_the_hand_fixs_gradient():
    """The library function behind the class above: `bessel_jn` of `sqrt(a)`, dropped where
    `a <= 0`."""
    from jax.scipy.special import bessel_jn

    def loss(a):
        return jnp.sum(jnp.where(a > 0, bessel_jn(jnp.sqrt(a), v=0, n_iter=15)[0], 0.))

    def by_hand(a):
        return loss(jnp.where(a > 0, a, 1.))

    a = jnp.array([2., -1., 3.])
    assert np.isnan(jax.grad(loss)(a)).any()  # the bug
    _same_forward(loss, a)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(a), jax.grad(by_hand)(a), rtol=1e-5)


# --------------------------------------------------------------------------- nothing to guard

_MASSES = jnp.array([1., 2., 3.])

UNGUARDED = {
    "outer product of a closed-over array": (
        lambda x: jnp.sum(_MASSES[:, None] * _MASSES[None] * x[None]), jnp.ones(3)),
    "softened pair potential": (
        lambda p: -.5 * jnp.sum(_MASSES[:, None] * _MASSES[None] / jnp.sqrt(
            jnp.sum((p[:, None] - p[None]) ** 2, -1) + .01)),
        jnp.array([[0., 0.], [.5, 0.], [0., 2.]])),
    "jnp.diag": (lambda a: jnp.sum(jnp.diag(a)), 2. * jnp.eye(3)),
}


@pytest.mark.parametrize("case", list(UNGUARDED.values()), ids=list(UNGUARDED))
def test_a_product_that_nothing_differentiates_is_not_re_decided(case):
    """A product of constants (the masses of an N-body potential, closed over as a jax.Array)
    and `jnp.diag`'s Mosaic branch (a 0/1 mask times the matrix, in a `cond` whose cotangent is
    finite) need nothing: the program is the original. Before, the product was re-decided on
    a `select_n` because an argument may be non-finite, with "0 guards" in `explain`."""
    f, x = case
    assert str(jaxsafe.make_jaxpr(f)(x)) == str(jax.make_jaxpr(f)(x))
    assert "nothing to guard" in str(jaxsafe.explain(f)(x))


# ------------------------------------------------------ forward mode beside a custom_vjp

@jax.custom_vjp
def _double(w):
    return 2. * w


_double.defvjp(lambda w: (2. * w, None), lambda _, ct: (2. * ct,))


def test_forward_mode_in_an_argument_that_reaches_no_custom_vjp_call():
    """`jacfwd` and `jvp` of `nan_safe(f)` in an argument that never reaches `f`'s custom_vjp
    call work, as for `f`. Before, any custom_vjp call in `f` made every forward-mode
    derivative raise. Forward mode in the argument that reaches it raises as it does for `f`,
    and reverse mode, under `vmap` too, is unchanged."""
    def f(x, w):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.) * _double(w))

    def by_hand(x, w):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.)), 0.) * _double(w))

    x, w = jnp.array([-1., 0., 4.]), jnp.float32(3.)
    safe = jaxsafe.nan_safe(f)
    assert_close(jax.jacfwd(safe)(x, w), jax.jacfwd(by_hand)(x, w))
    assert_close(jax.jit(jax.jacfwd(safe))(x, w), jax.jacfwd(by_hand)(x, w))
    t = jnp.array([1., 1., 1.])
    assert_close(jax.jvp(lambda x: safe(x, w), (x,), (t,)),
                 jax.jvp(lambda x: by_hand(x, w), (x,), (t,)))
    assert_close(jax.linearize(lambda x: safe(x, w), x)[1](t),
                 jax.linearize(lambda x: by_hand(x, w), x)[1](t))
    assert_close(jax.hessian(safe)(x, w), jax.hessian(by_hand)(x, w))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jacfwd(f, 1)(x, w)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jacfwd(safe, 1)(x, w)
    xs = jnp.stack([x, x + 1.])

    def batched(loss):
        return lambda xs, w: jnp.sum(jax.vmap(loss, (0, None))(xs, w))
    assert_close(jax.grad(batched(safe), (0, 1))(xs, w), jax.grad(batched(by_hand), (0, 1))(xs, w))
    assert_close(jax.vmap(jax.grad(safe, (0, 1)), (0, None))(xs, w),
                 jax.vmap(jax.grad(by_hand, (0, 1)), (0, None))(xs, w))


# ------------------------------------------------------------------ relu's losers

_RELU_X = jnp.array([0., 2., -1., .5, 3., .64])


def _root_then(act):
    """`act(sqrt|x| - .8)` squared: relu's 0 wins where `sqrt|x| < .8`, `x = 0` among them."""
    return lambda x: jnp.sum(act(jnp.sqrt(jnp.abs(x)) - .8) ** 2)


def _root_then_by_hand(act):
    def f(x):
        keep = jnp.sqrt(jnp.abs(x)) > .8
        root = jnp.sqrt(jnp.where(keep, jnp.abs(x), 1.))
        return jnp.sum(act(jnp.where(keep, root - .8, -1.)) ** 2)
    return f


@jax.custom_jvp
def _masked_rule_relu(x):
    return jnp.maximum(x, 0.)


# a rule that weighs the tangent by a 0/1 factor instead of selecting it
_masked_rule_relu.defjvp(lambda p, t: (_masked_rule_relu(p[0]),
                                       t[0] * (p[0] > 0).astype(p[0].dtype)))

ACTIVATIONS = {"relu": jax.nn.relu, "relu6": jax.nn.relu6,
               "a rule weighing by a 0/1 factor": _masked_rule_relu}


@pytest.mark.parametrize("act", list(ACTIVATIONS.values()), ids=list(ACTIVATIONS))
def test_relu_losers_are_dropped_lanes(act):
    """`jax.nn.relu` is a `custom_jvp`: its 0 winning over a `sqrt` at 0 dropped nothing (the
    rule was read structurally), and the gradient was NaN where `jnp.maximum(., 0.)` gave 0.
    Its rule's tangent follows the body's selection, so its losers are dropped lanes now."""
    loss, by_hand = _root_then(act), _root_then_by_hand(act)
    assert np.isnan(jax.grad(loss)(_RELU_X)).any()  # the bug
    _same_forward(loss, _RELU_X)
    safe = jaxsafe.nan_safe(loss)
    assert_close(jax.grad(safe)(_RELU_X), jax.grad(by_hand)(_RELU_X))
    assert_close(jax.jacfwd(safe)(_RELU_X), jax.jacfwd(by_hand)(_RELU_X))
    assert_close(jax.hessian(safe)(_RELU_X), jax.hessian(by_hand)(_RELU_X))


def test_a_relu_whose_guarded_operand_would_win_keeps_its_value():
    """`relu(log|x| + 5)` at 0: the guard puts `log(1) + 5 = 5` there, which relu would pass;
    the call reads the original `-inf` there (no derivative), so the value stays 0."""
    def loss(x):
        return jnp.sum(jax.nn.relu(jnp.log(jnp.abs(x)) + 5.) * jnp.arange(1., 5.))

    def by_hand(x):
        keep = jnp.abs(x) > jnp.exp(-5.)
        inner = jnp.where(keep, jnp.log(jnp.where(keep, jnp.abs(x), 1.)) + 5., -1.)
        return jnp.sum(jax.nn.relu(inner) * jnp.arange(1., 5.))

    x = jnp.array([0., 2., -1e-3, 1e-4])
    assert np.isnan(jax.grad(loss)(x)).any()  # the bug
    _same_forward(loss, x)
    assert_bitwise(jax.value_and_grad(jaxsafe.nan_safe(loss))(x)[0], loss(x))
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(x), jax.grad(by_hand)(x))


def test_a_hinge_on_a_distance_at_a_coincident_pair():
    """A contrastive hinge `relu(|a - b| - margin)`: at `a == b` the norm's `sqrt` is singular
    and relu drops it; its gradient is 0 there, as with `jnp.maximum`."""
    b = jnp.array([[0., 0.], [0., 1.], [0., 0.]])

    def loss(a):
        return jnp.sum(jax.nn.relu(jnp.linalg.norm(a - b, axis=-1) - .5))

    def by_hand(a):
        d2 = jnp.sum((a - b) ** 2, -1)
        far = d2 > .25
        return jnp.sum(jnp.where(far, jnp.sqrt(jnp.where(far, d2, 1.)) - .5, 0.))

    a = jnp.array([[0., 0.], [1., 1.], [2., 0.]])
    assert np.isnan(jax.grad(loss)(a)).any()  # the bug
    _same_forward(loss, a)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(a), jax.grad(by_hand)(a))
    assert_close(jax.hessian(jaxsafe.nan_safe(loss))(a), jax.hessian(by_hand)(a))


@jax.custom_jvp
def _straight_through(x):
    return jnp.maximum(x, 0.)


_straight_through.defjvp(lambda p, t: (_straight_through(p[0]), t[0]))


def test_a_straight_through_rule_keeps_every_lane():
    """A rule that passes the tangent where its body's `max` drops the lane (a straight-through
    estimator) does not follow the body: the lane is live, the program is the original, and
    the rule's derivative (inf at the `sqrt` of 0) stays."""
    def loss(x):
        return jnp.sum(_straight_through(jnp.sqrt(jnp.abs(x)) - .8))

    assert str(jaxsafe.make_jaxpr(loss)(_RELU_X)) == str(jax.make_jaxpr(loss)(_RELU_X))
    assert_bitwise(jax.grad(jaxsafe.nan_safe(loss))(_RELU_X), jax.grad(loss)(_RELU_X))
    assert np.isinf(jax.grad(loss)(_RELU_X)[0])


@jax.custom_jvp
def _hard_forward_soft_backward(soft, hard):
    return hard


_hard_forward_soft_backward.defjvp(lambda p, t: (p[1], t[0]))


def test_a_rule_s_operand_its_primal_never_reads_is_dropped_lane_by_lane():
    """Hunt Y: a straight-through estimator whose primal returns `hard` and whose rule passes
    `soft`'s tangent lane by lane. The primal's structure says nothing of `soft`; the rule's
    tangent program does, so `soft`'s dropped lanes are those the `where` drops (it was guarded
    only where every lane was dropped, and `sqrt(0)`'s `0 * inf` reached the gradient)."""
    def f(x):
        return jnp.sum(jnp.where(x > 0, _hard_forward_soft_backward(jnp.sqrt(x), jnp.round(x)),
                                 0.))

    def by_hand(x):
        soft = jnp.sqrt(jnp.where(x > 0, x, 1.))
        return jnp.sum(jnp.where(x > 0, _hard_forward_soft_backward(soft, jnp.round(x)), 0.))

    x = jnp.array([-1., 0., 4., 2.3])
    assert np.isnan(jax.grad(f)(x)).any()
    assert_bitwise(jaxsafe.nan_safe(f)(x), jax.jit(f)(x))
    assert_close(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(by_hand)(x))
    assert_close(jax.jacfwd(jaxsafe.nan_safe(f))(x), jax.jacfwd(by_hand)(x))
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x)[2:], jax.grad(f)(x)[2:])  # live: JAX's


@jax.custom_vjp
def _hard_forward_soft_backward_vjp(soft, hard):
    return hard


_hard_forward_soft_backward_vjp.defvjp(lambda soft, hard: (hard, None),
                                       lambda _, g: (g, jnp.zeros_like(g)))


def test_a_backward_rule_s_unread_operand_is_cut_where_every_lane_is_dropped_and_says_so():
    """The same estimator as a `custom_vjp` (documented, Limitations): its backward rule is
    Python jaxsafe does not see before JAX calls it, so `soft` is cut only where every output
    lane is dropped, and `explain` says that. With one lane live, plain JAX's NaN stays; with
    every lane dropped, the gradient is 0."""
    def f(x):
        soft = jnp.sqrt(x)
        return jnp.sum(jnp.where(x > 0, _hard_forward_soft_backward_vjp(soft, jnp.round(x)), 0.))

    text = str(jaxsafe.explain(f)(jnp.array([-1., 4.])))
    assert "its primal never reads this operand and its backward rule is not seen: cut only " \
           "where every output lane is dropped" in text
    some = jnp.array([-1., 0., 4.])
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(some), jax.grad(f)(some))
    none = jnp.array([-1., 0.])
    assert np.isnan(jax.grad(f)(none)).all()
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(none), jnp.zeros(2))


def test_a_relu_network_with_nothing_to_guard_is_the_original_program():
    """relu's rule selects its tangent (`select_n(x > 0, 0, t)`): an infinite cotangent is
    written as 0 in a loser's lane, never weighed by it, so a relu network with nothing to
    guard is not re-decided (a `jnp.maximum(., 0.)` is: JAX weighs its cotangent by 0)."""
    def mlp(w1, w2, x):
        return jnp.sum(jax.nn.relu(x @ w1) @ w2)

    args = (jnp.ones((3, 5)), jnp.ones((5, 2)), jnp.ones((4, 3)))
    assert str(jaxsafe.make_jaxpr(mlp)(*args)) == str(jax.make_jaxpr(mlp)(*args))
    assert not jaxsafe.explain(mlp)(*args).selections


@jax.custom_jvp
def _safe_root(x):
    return jnp.where(x > 0, jnp.sqrt(x), 0.)


# the rule drops what the body drops, and its untaken branch is NaN there
_safe_root.defjvp(lambda p, t: (_safe_root(p[0]),
                                jnp.where(p[0] > 0, t[0] * .5 / jnp.sqrt(p[0]), 0.)))


def test_a_rule_whose_untaken_branch_is_nan_in_a_lane_it_drops():
    """`where(x > 0, t * .5 / sqrt(x), 0.)` as a rule: body and rule drop `x <= 0`, so those
    lanes are dropped; the rule's transpose weighs its zero cotangent by the untaken `NaN`
    there, so the call's operand is cut in them (before it was read by structure, the
    documented leak; read by value, it came out NaN with "nothing to guard")."""
    def loss(x):
        return jnp.sum(_safe_root(x - 1.))

    x = jnp.array([.5, 4.])
    assert np.isnan(jax.grad(loss)(x)).any()  # the rule's own leak
    _same_forward(loss, x)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(x), jnp.array([0., .5 / jnp.sqrt(3.)]))
    assert_close(jax.jacfwd(jaxsafe.nan_safe(loss))(x), jnp.array([0., .5 / jnp.sqrt(3.)]))


@jax.custom_jvp
def _maximum_or_straight(x, y):
    return jnp.maximum(x, y)


def _maximum_or_straight_rule(p, t):
    """A rule handed symbolic zeros: it passes `x`'s tangent straight through where `y` has
    none, and selects like a maximum otherwise."""
    (x, y), (tx, ty) = p, t
    if isinstance(tx, SymbolicZero):
        tx = jnp.zeros_like(x)
    if isinstance(ty, SymbolicZero):
        return _maximum_or_straight(x, y), tx
    return _maximum_or_straight(x, y), lax.select(x > y, tx, ty)


_maximum_or_straight.defjvp(_maximum_or_straight_rule, symbolic_zeros=True)


def test_a_rule_handed_symbolic_zeros_is_read_by_structure():
    """A rule with `symbolic_zeros=True` may compute other tangents than a trace with every
    tangent given shows (here it passes `x`'s tangent through where `y` is a constant): its
    call is read by structure, and the live derivative stays JAX's. Before, the losers of the
    traced `select` were dropped and `jax.grad` lost the rule's derivative (1. became 0.)."""
    zero = jnp.zeros(2)

    def loss(x):
        return jnp.sum(_maximum_or_straight(jnp.sqrt(x) - .8, zero))

    x = jnp.array([0., .25])
    _same_forward(loss, x)
    assert_bitwise(jax.grad(jaxsafe.nan_safe(loss))(x), jax.grad(loss)(x))


RELU_STACKS = {
    "relu(relu(x) - 1)": lambda x: jnp.sum(jax.nn.relu(jax.nn.relu(x) - 1.)),
    "relu6(2 relu6(x))": lambda x: jnp.sum(jax.nn.relu6(jax.nn.relu6(x) * 2.)),
    "hard_sigmoid stack": lambda x: jnp.sum(jax.nn.hard_sigmoid(jax.nn.hard_sigmoid(x) * 4.)),
}


@pytest.mark.parametrize("f", list(RELU_STACKS.values()), ids=list(RELU_STACKS))
def test_stacked_relus_with_nothing_to_guard_are_the_original_program(f):
    """relu's rule only selects its tangent and makes no NaN: a zero cotangent is never
    weighed by an operand's value, inf or NaN included, so the inner relu's dropped lanes need
    no cut (`PrimitiveRule.cut_needless`), and the program is the original."""
    x = jnp.array([-jnp.inf, -1., -0., 0., .5, 2., jnp.inf, jnp.nan])
    assert str(jaxsafe.make_jaxpr(f)(x)) == str(jax.make_jaxpr(f)(x))
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(f)(x))


# ------------------------------------------------- integer and low-precision data movement
# Hunt O: a movement's liveness rule evaluated its transpose on float32 zeros, so a scatter whose
# combiner is typed in the operand's dtype (float16, bfloat16, float64) did not lower, and an
# integer movement inside a body that re-runs as one unit (a checkpoint, a cond's branch, a
# custom rule's primal) did not bind on a float32 operand 0 beside integer updates. The
# analysis failed, and the original program ran with its NaN.

SENDERS = jnp.array([0, 1, 2])  # closed over; segment 2 is padding


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("combine", ["sum", "max", "min"])
def test_a_segment_reduction_of_constant_ids_in_a_narrow_dtype(dtype, combine):
    segment = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max,
               "min": jax.ops.segment_min}[combine]
    f = lambda r2: jnp.sum(segment(jnp.sqrt(r2), SENDERS, num_segments=2))
    kept = lambda r2: jnp.sum(jnp.sqrt(r2[:2]))  # the padding pair removed
    r2 = jnp.array([4., 9., -1.], dtype)
    _same_forward(f, r2)
    got = jax.grad(jaxsafe.nan_safe(f))(r2)
    want = jnp.concatenate([jax.grad(kept)(r2)[:2], jnp.zeros(1, dtype)])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not jaxsafe.explain(f)(r2).failure


INTEGER_MOVEMENTS = {
    "scatter": lambda: jnp.array([1, 2, 3]).at[1].set(5),
    "scatter-add": lambda: jnp.zeros(3, jnp.int32).at[jnp.array([0, 1, 1])].add(1),
    "bincount": lambda: jnp.bincount(jnp.array([0, 1, 1]), length=3),
    "pad": lambda: jnp.pad(jnp.array([1, 2]), (1, 0)),
    "dynamic_update_slice": lambda: lax.dynamic_update_slice(jnp.array([1, 2, 3]),
                                                             jnp.array([7]), (1,)),
    "cummax": lambda: lax.cummax(jnp.array([1, 3, 2])),
    "gather": lambda: jnp.array([1, 2, 3])[jnp.array([2, 1, 0])],
}


def _in_custom_jvp(fn):
    @jax.custom_jvp
    def g(v):
        return fn(v)

    @g.defjvp
    def g_jvp(primals, tangents):
        return g(primals[0]), tangents[0] * 2.
    return g


WRAPPERS = {
    "checkpoint": jax.checkpoint,
    "cond": lambda fn: (lambda v: lax.cond(True, fn, lambda u: u * 0., v)),
    "custom_jvp": _in_custom_jvp,
}


@pytest.mark.parametrize("wrap", list(WRAPPERS))
@pytest.mark.parametrize("movement", list(INTEGER_MOVEMENTS))
def test_an_integer_constant_moved_inside_a_body(movement, wrap):
    """`where(x > 0, body(sqrt(x)), 0.)`, the body scaling by an integer array it builds: the
    where's dropped lane is guarded (the hand fix's 0), not left NaN by a failed analysis."""
    block = WRAPPERS[wrap](lambda v: v * INTEGER_MOVEMENTS[movement]())
    f = lambda x: jnp.sum(jnp.where(x > 0, block(jnp.sqrt(x)), 0.))
    hand = lambda x: f(jnp.where(x > 0, x, 1.))
    x = jnp.array([4., 9., -1.])
    _same_forward(f, x)
    assert not jaxsafe.explain(f)(x).failure
    assert_close(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(hand)(x))


# ------------------------------------------------- a vmap's named axis, staged by a jit
# Hunt P: `jax.grad(jax.jit(jax.vmap(nan_safe(f), axis_name="b")))` with a `psum` over "b" in
# `f` raised NameError: JAX traces the call's derivative rule after the vmap, where "b" is
# unbound, and the rewrite traced there too; and JAX cannot differentiate a jit of a
# custom_jvp that names the axis (the jit front is left out under a named vmap).

NAMED = {
    "nothing to guard": (lambda r: r * lax.psum(r, "b"),
                         lambda r: r * lax.psum(r, "b")),
    "guarded": (lambda r: jnp.where(r > 0, jnp.sqrt(r), 0.) * lax.psum(r, "b"),
                lambda r: jnp.where(r > 0, jnp.sqrt(jnp.where(r > 0, r, 1.)), 0.)
                * lax.psum(r, "b")),
    "mean": (lambda r: jnp.where(r > lax.pmean(r, "b"), jnp.log(r), 0.),
             lambda r: jnp.where(r > lax.pmean(r, "b"),
                                 jnp.log(jnp.where(r > lax.pmean(r, "b"), r, 1.)), 0.)),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_a_collective_over_a_named_vmap_axis_under_jit(name):
    f, hand = NAMED[name]
    x = jnp.array([[-1., 0.5, 4.], [1., 2., -3.]])

    def loss(g):
        return lambda x: jnp.sum(jax.jit(jax.vmap(g, axis_name="b"))(x))
    assert_bitwise(jax.jit(jax.vmap(jaxsafe.nan_safe(f), axis_name="b"))(x),
                   jax.jit(jax.vmap(f, axis_name="b"))(x))
    assert_close(jax.grad(loss(jaxsafe.nan_safe(f)))(x), jax.grad(loss(hand))(x))
    t = jnp.ones_like(x)
    assert_close(jax.jvp(loss(jaxsafe.nan_safe(f)), (x,), (t,))[1],
                 jax.jvp(loss(hand), (x,), (t,))[1])


# Hunt Q: relu's 0 carries nothing in forward mode (`_custom_carries.py`), but as a factor of a
# product it masks nothing: `g` below reads relu's own 0 where relu is 0, and guarding it there
# put up to 31 equations into a ReLU followed by a norm or a gate (contract 4).
RELU_THEN = {
    "a gate": lambda h: jax.nn.relu(h) * jax.nn.sigmoid(jax.nn.relu(h)),
    "a layer norm": lambda h: (lambda r: (r - r.mean()) * lax.rsqrt(r.var() + 1e-5))(
        jax.nn.relu(h)),
    "an RMS norm": lambda h: jax.nn.relu(h) / jnp.sqrt(jnp.mean(jax.nn.relu(h) ** 2) + 1e-6),
    "exp of minus itself": lambda h: jax.nn.relu(h) * jnp.exp(-jax.nn.relu(h)),
    "a tanh of its sum": lambda h: jax.nn.relu(h) * jnp.tanh(jnp.sum(jax.nn.relu(h))),
}


@pytest.mark.parametrize("name", list(RELU_THEN))
def test_a_relu_then_a_norm_or_gate_is_the_original_program(name):
    f = lambda h: jnp.sum(RELU_THEN[name](h))
    h = jnp.array([0.5, -1.0, 2.0])
    assert str(jaxsafe.make_jaxpr(f)(h)) == str(jax.make_jaxpr(f)(h))
    edge = jnp.array([jnp.inf, -jnp.inf, nan, -1., 0.5])
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(edge), jax.jit(jax.grad(f))(edge))


# ------------------------------------------------------------- a contraction with zero weights
# Hunts O and R: `w * v` summed drops `v`'s lanes where the constant `w` is 0, but the same sum
# spelled as a `dot_general` (`w @ v`, `einsum`, a 0/1 selection matrix, a one-hot matmul)
# kept every lane live: NaN in every derivative of a padded row's `sqrt(0)`.

PADDED = jnp.array([[1., 2.], [0., 0.], [3., 4.]])  # row 1 is padding: its norm is sqrt(0)
WEIGHTS = jnp.array([0.5, 0., 0.5])
SELECTION = jnp.array([[1., 0., 0.], [0., 0., 1.]])
_norms = lambda x: jnp.linalg.norm(x, axis=-1)  # noqa: E731

CONTRACTIONS = {
    "matmul": lambda x: WEIGHTS @ _norms(x),
    "einsum": lambda x: jnp.einsum("i,i->", WEIGHTS, _norms(x)),
    "vdot": lambda x: jnp.vdot(_norms(x), WEIGHTS),
    "selection matrix": lambda x: jnp.sum(SELECTION @ _norms(x)),
    "one-hot": lambda x: jnp.sum(jax.nn.one_hot(jnp.array([0, 2]), 3) @ _norms(x)),
    "a where's zeros": lambda x: jnp.sum(jnp.where(jnp.array([True, False, True]), 1., 0.)
                                         @ _norms(x)),
}


@pytest.mark.parametrize("name", list(CONTRACTIONS))
def test_a_contraction_with_zero_weights_drops_the_lanes_they_meet(name):
    f = CONTRACTIONS[name]
    kept = lambda x: jnp.sum(_norms(x[jnp.array([0, 2])]) * (0.5 if name in (
        "matmul", "einsum", "vdot") else 1.))  # the padded row removed
    _same_forward(f, PADDED)
    safe = jaxsafe.nan_safe(f)
    want = jax.grad(kept)(PADDED)  # 0 in the padded row, which `kept` does not read
    assert np.isnan(np.asarray(jax.grad(f)(PADDED))).any()
    assert_close(jax.grad(safe)(PADDED), want)
    assert_close(jax.jacfwd(safe)(PADDED), want)
    assert np.isfinite(np.asarray(jax.hessian(safe)(PADDED))).all()


# Hunt AI: the lanes a zero weight drops still reach the contraction's value (`0 * nan` is
# NaN), but the rewritten `dot_general` read the guarded operand (`sqrt(1.)` there): under a
# derivative the value became finite (a hidden NaN: contracts 1 and 3). And an inf cotangent
# met the zero weight in the transpose (`0 * inf`): NaN in the dropped lane (contract 2).
_ONE_HOT = jax.nn.one_hot(jnp.array([0, 2]), 3)
_ROWS = jnp.array([[1., 4.], [-1., -2.], [9., 16.]])
NAN_MEETS_ZERO = {  # (f, x, the program with the dropped lanes removed)
    "dot": (lambda x: jnp.dot(jnp.array([0., 1.]), jnp.sqrt(x)), jnp.array([-1., 4.]),
            lambda x: jnp.sqrt(x[1])),
    "matmul, a zero column": (
        lambda x: jnp.sum(jnp.array([[1., 0., 2.], [3., 0., -1.]]) @ jnp.log(x)),
        jnp.array([2., 0., 3.]), lambda x: 4. * jnp.log(x[0]) + jnp.log(x[2])),
    "einsum": (lambda x: jnp.einsum("i,i->", jnp.array([0., 1., 1.]), jnp.log(x)),
               jnp.array([0., 2., 3.]), lambda x: jnp.log(x[1]) + jnp.log(x[2])),
    "one-hot rows": (lambda x: jax.nn.one_hot(jnp.array([0, 2]), 3) @ jnp.sqrt(x),
                     jnp.array([[1., 4.], [-1., -2.], [9., 16.]]),
                     lambda x: jnp.sqrt(x[jnp.array([0, 2])])),
    # hunt AJ: a one-hot the program transposes or casts (a value computed from a constant)
    "one-hot transposed twice": (lambda x: _ONE_HOT.T.T @ jnp.sqrt(x), _ROWS,
                                 lambda x: jnp.sqrt(x[jnp.array([0, 2])])),
    "one-hot as its transpose, contracted": (
        lambda x: jnp.einsum("ij,ik->jk", _ONE_HOT.T, jnp.sqrt(x)), _ROWS,
        lambda x: jnp.sqrt(x[jnp.array([0, 2])])),
    "one-hot cast to bfloat16": (
        lambda x: _ONE_HOT.astype(jnp.bfloat16).astype(jnp.float32) @ jnp.sqrt(x), _ROWS,
        lambda x: jnp.sqrt(x[jnp.array([0, 2])])),
    "complex one-hot": (
        lambda x: jnp.real(_ONE_HOT.astype(jnp.complex64) @ jnp.sqrt(x).astype(jnp.complex64)),
        _ROWS, lambda x: jnp.sqrt(x[jnp.array([0, 2])])),
}


@pytest.mark.parametrize("name", list(NAN_MEETS_ZERO))
def test_a_contraction_keeps_the_nan_its_zero_weights_meet(name):
    f, x, kept = NAN_MEETS_ZERO[name]
    safe = jaxsafe.nan_safe(f)
    want = jax.jit(f)(x)
    assert np.isnan(np.asarray(want)).any()
    loss = lambda x: jnp.sum(safe(x))  # noqa: E731
    value, grad = jax.value_and_grad(loss)(x)
    assert_bitwise(value, jnp.sum(want))
    assert_bitwise(jax.vjp(safe, x)[0], want)
    assert_bitwise(jax.jvp(safe, (x,), (jnp.ones_like(x),))[0], want)
    assert_bitwise(jax.linearize(safe, x)[0], want)
    assert_bitwise(jaxsafe.nan_safe(f, jit=False)(x), f(x))
    reference = jax.grad(lambda x: jnp.sum(kept(x)))(x)  # 0 in the lanes it does not read
    assert_close(grad, reference)
    assert_close(jax.jacfwd(loss)(x), reference)
    assert_close(jax.hessian(loss)(x), jax.hessian(lambda x: jnp.sum(kept(x)))(x))


def test_an_inf_cotangent_meets_a_zero_weight_as_a_product_s_does():
    """`sqrt(w @ x)` at 0: the cotangent is inf, and a zero weight's lane of `x` takes 0 from
    it, as in `sqrt(w * x)` (plain JAX: `0 * inf`); the live lane's inf stays."""
    w = jnp.array([0., 1.])
    x = jnp.array([3., 0.])
    for f in (lambda x: jnp.sqrt(jnp.dot(w, x)), lambda x: jnp.sum(jnp.sqrt(w * x))):
        assert np.isnan(np.asarray(jax.grad(f)(x))[0])
        got = jax.grad(jaxsafe.nan_safe(f))(x)
        np.testing.assert_array_equal(np.asarray(got), np.array([0., np.inf], np.float32))


def test_a_contraction_whose_weights_meet_every_lane_is_the_original_program():
    """A constant weight matrix with zeros but no all-zero row masks no lane: nothing to guard,
    and the padded row's `sqrt(0)` is a live singularity (plain JAX's NaN stays)."""
    w = jnp.array([[1., 0.], [0., 2.], [1., 1.]])
    f = lambda x: jnp.sum(_norms(x) @ w)
    assert str(jaxsafe.make_jaxpr(f)(PADDED)) == str(jax.make_jaxpr(f)(PADDED))
    assert np.isnan(np.asarray(jax.grad(jaxsafe.nan_safe(f))(PADDED))[1]).all()


def test_a_network_with_closed_over_weights_and_nothing_to_guard_is_the_original_program():
    """Closed-over float weights carry no derivative, and a contraction with them masks only
    the lanes their zeros meet whole: weights with no zero row mask nothing, and nothing is
    guarded (the first version of the contraction rule guarded the `tanh` here)."""
    w = jnp.arange(1., 7.).reshape(3, 2)
    f = lambda x: jnp.sum(jnp.tanh(jax.nn.relu(x @ w.T @ w)) @ w.T)
    x = jnp.ones(2)
    assert str(jaxsafe.make_jaxpr(f)(x)) == str(jax.make_jaxpr(f)(x))


def test_a_weakly_typed_literal_stays_weakly_typed_under_differentiation():
    """Hunt U: a Python float argument and the `0.` of a `where` are weakly typed, and so are
    plain JAX's value and gradient; the guarded program bound the literal strongly typed, so a
    float16 update `p - g * p` promoted to float32 (contract 1)."""
    f = lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.)  # noqa: E731
    safe = jaxsafe.nan_safe(f)
    for got, want in zip(jax.value_and_grad(safe)(2.), jax.value_and_grad(f)(2.), strict=True):
        assert jax.typeof(got) == jax.typeof(want) and jax.typeof(got).weak_type
    assert jax.typeof(jax.jit(jax.grad(safe))(2.)).weak_type
    p16 = jnp.ones(2, jnp.float16)
    assert (p16 - jax.grad(safe)(2.) * p16).dtype == jnp.float16
    assert jaxsafe.make_jaxpr(f)(2.).out_avals == jax.make_jaxpr(f)(2.).out_avals


def test_a_dense_constant_mask_that_drops_whole_rows_guards_the_matmul_before_a_relu():
    """Hunt V: a (B, W) padding mask closed over as a full array, not `live[:, None]`: the
    matmul's operand is guarded where the mask, ORed over the features when jaxsafe plans,
    drops the row (before, the row's NaN reached the weights' gradient through the ReLU)."""
    live = np.array([True, True, False, True])
    mask = np.broadcast_to(live[:, None], (4, 3)).copy()
    w = jax.random.normal(jax.random.PRNGKey(0), (2, 3))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 2)).at[2].set(jnp.nan)

    def f(w, x):
        return jnp.sum(jnp.where(mask, jax.nn.relu(x @ w), 0.) ** 2)

    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(w, x), jax.jit(f)(w, x))
    assert np.isnan(np.asarray(jax.grad(f)(w, x))).all()
    hand = jax.grad(f)(w, jnp.where(live[:, None], x, 0.))
    assert_close(jax.grad(safe)(w, x), hand)
    assert_close(jax.jit(jax.grad(safe))(w, x), hand)
    # a mask that keeps one lane of the padded row keeps the row live: its NaN is the taken
    # branch's (contract 3)
    partial = mask.copy()
    partial[2, 0] = True
    g = lambda w, x: jnp.sum(jnp.where(partial, jax.nn.relu(x @ w), 0.))  # noqa: E731
    assert np.isnan(np.asarray(jax.grad(jaxsafe.nan_safe(g))(w, x))).any()


@pytest.mark.parametrize("sampler", ["gamma", "beta", "dirichlet"])
def test_a_gamma_sample_s_shape_in_a_dropped_lane_is_guarded(sampler):
    """Hunt X: `jax.random.gamma` (and `beta`, `dirichlet`) had a row saying it is finite for
    finite operands, which a shape of 0 or below breaks (NaN), and no liveness: a masked
    sample's shape kept plain JAX's NaN gradient. Each lane is sampled from its own key, so
    the guard (shape 1 in a dropped lane) leaves the live lanes' samples bit for bit. (The
    samplers compile a loop each: `make test` runs gamma, `make test-tables` the others.)"""
    key = jax.random.PRNGKey(0)
    if sampler == "dirichlet":
        # padded components: their samples are 0 and still in every sample's normalizer
        # (live), but the log of a padded sample is dropped (plain JAX: 0 * inf there, NaN in
        # every used lane)
        concentration = jnp.array([[1., 2., 0., 0.], [0.5, 0.5, 3., 0.]])
        used = concentration > 0

        def dirichlet_log(c):
            sample = jax.random.dirichlet(key, jnp.where(used, c, 0.))
            return jnp.sum(jnp.where(used, jnp.log(sample), 0.))

        assert np.isnan(jax.grad(dirichlet_log)(concentration)[np.asarray(used)]).all()
        value, g = jax.jit(jax.value_and_grad(jaxsafe.nan_safe(dirichlet_log)))(concentration)
        assert_bitwise(value, jax.jit(dirichlet_log)(concentration))
        assert np.isfinite(g).all() and (np.asarray(g)[~np.asarray(used)] == 0).all()
        return
    a = jnp.array([0., -1., 2., np.nan, 0.7])
    live = jnp.array([False, False, True, False, True])
    sample = {"gamma": lambda a: jax.random.gamma(key, a),
              "beta": lambda a: jax.random.beta(key, a, 2.)}[sampler]
    f = lambda a: jnp.sum(jnp.where(live, sample(a), 0.))  # noqa: E731
    by_hand = lambda a: jnp.sum(jnp.where(live, sample(jnp.where(live, a, 1.)), 0.))  # noqa: E731
    assert np.isnan(jax.grad(f)(a)).any()
    value, g = jax.jit(jax.value_and_grad(jaxsafe.nan_safe(f)))(a)
    assert_bitwise(value, jax.jit(f)(a))
    assert_close(g, jax.grad(by_hand)(a), rtol=1e-5)
    assert_close(jax.jacfwd(jaxsafe.nan_safe(f))(a), jax.jacfwd(by_hand)(a), rtol=1e-5)


# ------------------------------------------- rows picked at known indices after a value's choice
# Hunt AH: `relu(x @ w)[jnp.array([0, 2])]` with a NaN padding row 1 of `x`: the rows a gather,
# a `dynamic_slice` at literal starts or `x.at[rows].set(0.)` keep were an unknown (a slice's are
# known lane by lane), so the relu's run-time part left the matmul's operand unguarded ("would
# need a run-time reduction"): NaN in every entry of `w`'s gradient (contract 2).
_ROWS_W = jnp.array([[1., .5], [-.5, 1.]])
_ROWS_X = jnp.array([[1., 2.], [nan, nan], [3., -1.]])
ROW_PICKS = {
    "gather": lambda h: h[jnp.array([0, 2])],
    "take": lambda h: jnp.take(h, jnp.array([0, 2]), axis=0),
    "take_along_axis": lambda h: jnp.take_along_axis(h, jnp.array([[0], [2]]), axis=0),
    "dynamic_slice": lambda h: lax.dynamic_slice(h, (2, 0), (1, 2)),
    "overwritten": lambda h: h.at[jnp.array([1])].set(0.),
}
VALUE_CHOICES = {
    "relu": jax.nn.relu,
    "where": lambda h: jnp.where(h > 0, h, 0.),
    "clip": lambda h: jnp.clip(h, 0., 10.),
    "sort": lambda h: jnp.sort(h, axis=1),
}


@pytest.mark.parametrize("pick, choice", [(p, "relu") for p in ROW_PICKS]
                         + [("gather", c) for c in VALUE_CHOICES if c != "relu"])
def test_rows_picked_at_known_indices_after_a_choice_by_value_drop_the_padding_row(pick, choice):
    f = lambda w, x: jnp.sum(ROW_PICKS[pick](VALUE_CHOICES[choice](x @ w)))  # noqa: E731
    _same_forward(f, _ROWS_W, _ROWS_X)
    padding_removed = _ROWS_X.at[1].set(0.)  # row 1 reaches no output: its values do not count
    for argnum in (0, 1):
        got = jax.grad(jaxsafe.nan_safe(f), argnum)(_ROWS_W, _ROWS_X)
        want = jax.grad(f, argnum)(_ROWS_W, padding_removed)
        assert_close(got, want)
    assert np.isnan(np.asarray(jax.grad(f)(_ROWS_W, _ROWS_X))).all()  # plain JAX


# Hunt AJ: `k * k` of integers was taken as at least 0 (as `y * y` of floats is), but an
# integer square wraps (`int8(12) ** 2` is -112): the `sqrt` after it lost its guard, NaN in a
# dropped lane (contract 2). `jnp.square` and `k ** 2` of integers had the same bound.
@pytest.mark.parametrize("square", [lambda k: k * k, jnp.square, lambda k: k ** 2],
                         ids=["k * k", "square", "k ** 2"])
def test_an_integer_square_may_be_negative(square):
    def f(a):
        s = square(a.astype(jnp.int8)).astype(jnp.float32)
        return jnp.sum(jnp.where(a < 10, jnp.sqrt(s) * a, 0.))

    def hand(a):
        s = square(a.astype(jnp.int8)).astype(jnp.float32)
        return jnp.sum(jnp.where(a < 10, jnp.sqrt(jnp.where(a < 10, s, 1.)) * a, 0.))
    a = jnp.array([12., 3.])
    assert np.isnan(np.asarray(jax.grad(f)(a))[0])
    assert_close(jax.grad(jaxsafe.nan_safe(f))(a), jax.grad(hand)(a))


def test_an_index_out_of_bounds_reads_the_lane_xla_clamps_it_to():
    """Hunt AJ: `x[jnp.array([0, 5])]` of 5 lanes reads lane 4 (XLA clamps an index out of
    bounds under `promise_in_bounds`), but its mask, the gather's transpose, dropped the index:
    lane 4 was guarded, and the value under a derivative changed (contract 1)."""
    f = lambda x: jnp.sum(jnp.sqrt(x)[jnp.array([0, 5])])  # noqa: E731
    x = jnp.array([4., -1., 9., -4., 16.])
    value, grad = jax.value_and_grad(jaxsafe.nan_safe(f))(x)
    assert_bitwise(value, jax.jit(f)(x))
    assert_close(grad, jnp.array([.25, 0., 0., 0., 0.]))  # JAX's own derivative: lane 4 gets 0
    g = lambda x, i: jnp.sum(jnp.sqrt(x)[i])  # noqa: E731
    assert_bitwise(jax.value_and_grad(jaxsafe.nan_safe(g))(x, jnp.array([0, 5]))[0],
                   jax.jit(f)(x))


# Hunt AN: a user's `custom_jvp` whose tangent divides by its input (`t / x`), in a lane a
# 0/1 mask drops: the cut operand's zero tangent met `x = 0` in the rule
# (`0 / 0`), and forward mode weighed that NaN by the mask's 0. The output's dropped lanes are
# cut too.
@jax.custom_jvp
def _log_with_rule(x):
    return jnp.log(x)


@_log_with_rule.defjvp
def _log_with_rule_jvp(primals, tangents):
    return _log_with_rule(primals[0]), tangents[0] / primals[0]


_MASK01 = jnp.array([0., 1., 1., 1.])
CUSTOM_RULE_DROPS = {
    "a constant mask": lambda x: jnp.sum(_log_with_rule(x) * _MASK01),
    "a mask from a predicate": lambda x: jnp.sum(_log_with_rule(x)
                                                 * (x > 0).astype(jnp.float32)),
}


@pytest.mark.parametrize("name", list(CUSTOM_RULE_DROPS))
def test_a_custom_rule_dividing_by_its_input_in_a_dropped_lane_in_forward_mode(name):
    f = CUSTOM_RULE_DROPS[name]
    hand = lambda x: f(jnp.where(_MASK01 > 0, x, 1.))
    x = jnp.array([0., 1., 2., 4.])
    assert np.isnan(np.asarray(jax.jacfwd(f)(x))).any()
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    for order in (jax.grad, jax.jacfwd, jax.hessian, lambda g: jax.jacfwd(jax.jacrev(g))):
        assert_close(order(safe)(x), order(hand)(x))


# --------------------------------------------------------------------------- hunt AQ

def _relu(hand):
    """A ReLU, or the hand fix's where that keeps a NaN as `maximum` does."""
    return (lambda x: jnp.where(x < 0, jnp.zeros_like(x), x)) if hand else \
        (lambda x: jnp.maximum(x, jnp.zeros_like(x)))


CONSTANT_OPERANDS = {
    # a NaN-prone equation of constants alone: its own derivative is never taken, but the
    # product's derivative in `x` reads its value (-inf, NaN in the dropped lanes)
    "log of arange": lambda x, hand: jnp.sum(jnp.where(
        jnp.arange(3.0) > 0,
        x * jnp.log(jnp.where(jnp.arange(3.0) > 0, jnp.arange(3.0), 1.0) if hand
                    else jnp.arange(3.0)), 0.0)),
    "sqrt of a closed-over array": lambda x, hand: jnp.sum(jnp.where(
        jnp.array([4.0, -1.0, 2.0]) > 0,
        x * jnp.sqrt(jnp.array([4.0, 1.0, 2.0]) if hand else jnp.array([4.0, -1.0, 2.0])),
        0.0)),
}


@pytest.mark.parametrize("name", sorted(CONSTANT_OPERANDS))
def test_a_nan_prone_value_of_constants_that_a_derivative_reads_is_guarded(name):
    """Hunt AQ: a value computed from constants alone takes no guard of its own (no derivative
    reads its operands), but a product whose derivative in an argument reads it in dropped
    lanes guards it there: `x * log(k)` at `k = 0` gives 0, not `0 * -inf`."""
    f = CONSTANT_OPERANDS[name]
    x = jnp.array([1.5, 3.0, 2.0])
    _same_forward(lambda x: f(x, False), x)
    got = jax.grad(jaxsafe.nan_safe(lambda x: f(x, False)))(x)
    assert_bitwise(got, jax.grad(lambda x: f(x, True))(x))
    assert_bitwise(jax.jacrev(jaxsafe.nan_safe(lambda x: f(x, False)))(x), got)


INTEGER_DIVISORS = {
    # an integer product: its bound was computed with float rounding slack (it raised)
    "a count times 2": (lambda x, m: jnp.maximum(jnp.sum(m) * 2, 1),
                        jnp.array([True, False, True])),
    # 255 + 1 wraps to 0 in uint8: a bound of 2 was claimed
    "a uint8 that wraps": (lambda x, k: jnp.maximum(k, jnp.uint8(1)) + jnp.uint8(1),
                           jnp.uint8(255)),
    # 255 booleans summed in int8 are -1, plus 1 is 0
    "an int8 count that wraps": (lambda x, m: jnp.sum(m.astype(jnp.int8), dtype=jnp.int8)
                                 + jnp.int8(1), jnp.ones(255, bool)),
}


@pytest.mark.parametrize("name", sorted(INTEGER_DIVISORS))
def test_a_divisor_computed_by_integer_arithmetic_keeps_no_bound_that_wrapping_breaks(name):
    """Hunt AQ: integer arithmetic wraps, so only choices (`maximum`, a select), moves and
    widening conversions keep an integer bound; a divisor that wraps to 0 leaves the ReLU
    before the quotient re-decided, and the dropped lane's derivative is the hand fix's 0."""
    divisor, arg = INTEGER_DIVISORS[name]

    def f(x, a, hand=False):
        return jnp.sum(_relu(hand)(x) / divisor(x, a).astype(jnp.float32))

    x = jnp.array([-1.0, 2.0, 3.0])
    _same_forward(f, x, arg)
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x, arg),
                   jax.grad(lambda x, a: f(x, a, hand=True))(x, arg))


def test_a_float16_divisor_bounded_by_a_tiny_number_still_re_decides_the_relu():
    """Hunt AQ: `8 * relu(x) / maximum(s, 1e-4)` in float16 with `s = 0`: the numerator's
    derivative `8 / 1e-4` overflows float16, so the ReLU's dropped lane would get `0 * inf`."""
    h = jnp.float16

    def f(x, s, hand=False):
        return jnp.sum(8 * (_relu(hand)(x) / jnp.maximum(s, h(1e-4))))

    x, s = jnp.array([-1.0, 2.0], h), h(0.0)
    got = jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x, s)
    assert_bitwise(got, jax.grad(lambda x, s: f(x, s, hand=True))(x, s))


def test_a_closed_over_typed_prng_key_does_not_stop_the_analysis():
    """Hunt AQ: a `jax.random.key` closed over made the analysis fail (NumPy cannot hold a
    typed key), and the original program ran unguarded; now it is an unknown constant."""
    m, key = VALID, jax.random.key(0)

    def f(x, hand=False):
        inner = jnp.where(m, x, 1.0) if hand else x
        return jnp.sum(jnp.where(m, jnp.log(inner) * jax.random.uniform(key, (2,)), 0.0))

    x = jnp.array([1.5, 0.0])
    _same_forward(f, x)
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(lambda x: f(x, hand=True))(x))


# --------------------------------------------------------------------------- hunt AT
_ROUTES = np.array([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
SLICED_CONTRACTIONS = {  # rows 0, 1 meet only a zero weight in the column the program keeps
    "sliced": lambda v: (v @ _ROUTES)[0],
    "a where after it": lambda v: jnp.sum(jnp.where(jnp.array([True, False]), v @ _ROUTES, 0.0)),
    "a matrix product, sliced": lambda v: (v[None] @ _ROUTES)[0, 0],
    "an einsum, sliced": lambda v: jnp.einsum("i,ij->j", v, _ROUTES)[0],
}


@pytest.mark.parametrize("name", list(SLICED_CONTRACTIONS))
def test_a_contraction_s_zero_weights_in_the_output_lanes_kept(name):
    """Hunt AT: `(sqrt(x) @ w)[0]` where `w`'s rows 0 and 1 are zero in column 0 only: those
    lanes reach the output through zero weights alone, yet a weight matrix with a nonzero in
    each row was read as masking nothing, whatever the output kept ("nothing to guard", NaN).
    A known weight is now read against the output lanes the program keeps (known when it is
    planned, or decided at run time). The same sum written as a product was already right."""
    contract = SLICED_CONTRACTIONS[name]

    def f(x):
        return contract(jnp.sqrt(x))

    def hand(x):
        return contract(jnp.sqrt(jnp.where(_ROUTES[:, 0] != 0, x, 1.0)))

    x = jnp.array([1.0, 0.0, 4.0, 2.0])
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()
    _same_forward(f, x)
    for derivative in (jax.grad, jax.jacfwd, jax.hessian):
        assert_bitwise(derivative(jaxsafe.nan_safe(f))(x), jax.jit(derivative(hand))(x))


def test_a_contraction_whose_weights_are_nonzero_where_kept_is_left_as_it_is():
    """The other side: with the output sliced and a weight matrix nonzero in the kept column,
    nothing is dropped by the weights, and nothing is added."""
    w = np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 5.0], [4.0, 0.0]], np.float32)

    def f(x):
        return (jnp.sqrt(x) @ w + 1.0)[0]

    x = jnp.array([1.0, 4.0, 4.0, 2.0])
    assert str(jaxsafe.explain(f)(x)) == "nothing to guard: the program runs unchanged"


# --------------------------------------------------------------------------- hunt AS
def test_a_scalar_weight_of_a_contraction_does_not_stop_the_analysis():
    """Hunt AS: `jnp.dot(2., x)` stages a `dot_general` of a 0-d literal, whose zero test gave
    a NumPy scalar, not an array: the analysis raised under `jit(grad)` (an eager call retried
    at concrete values hid it) and the original program ran, NaN in the dropped lane."""
    def f(x, hand=False):
        inner = jnp.where(x > 0, x, 1.0) if hand else x
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(jnp.dot(2.0, inner)), 0.0))

    x = jnp.array([-1.0, 4.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsafe.AnalysisFailedWarning)
        got = jax.jit(jax.grad(jaxsafe.nan_safe(f)))(x)
    assert_bitwise(got, jax.jit(jax.grad(lambda x: f(x, hand=True)))(x))


@pytest.mark.parametrize("constant", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("left", [True, False])
def test_a_product_with_a_non_finite_python_scalar_is_guarded(constant, left):
    """Hunt AS: `jnp.exp(-jnp.inf * v)` under a `where`: the scalar literal's derivative in `v`
    is the literal, and a dropped lane's zero cotangent met it (`0 * inf`). Its guard was
    skipped as needing a reduction of the liveness; a literal is guarded at the output's
    shape, as `v / 0.` was. Forward values unchanged; derivatives the hand fix's."""
    def op(v):
        return constant * v if left else v * constant

    def f(v, hand=False):
        inner = jnp.where(v > 0, v, 1.0) if hand else v
        return jnp.sum(jnp.where(v > 0, jnp.exp(op(inner)) * jnp.log(inner), 0.0))

    x = jnp.array([-1.0, 4.0, 0.5])
    _same_forward(f, x)
    for derivative in (jax.grad, jax.jacfwd, jax.hessian):
        assert_bitwise(derivative(jaxsafe.nan_safe(f))(x),
                       jax.jit(derivative(lambda v: f(v, hand=True)))(x))


# --------------------------------------------------------------------------- hunt AR
def _safe_mask(mask, fn, operand, placeholder=0.0):
    """jax-md's `util.safe_mask`: 0, a singular point of `sqrt`, under the inner where."""
    return jnp.where(mask, fn(jnp.where(mask, operand, 0.0)), placeholder)


def test_a_hand_guard_at_the_pole_times_a_differentiated_factor_second_order():
    """Hunt AR: `safe_mask(r2 > 0, lambda v: eps * sqrt(v), r2)` with `eps` differentiated
    (force matching): the first derivatives are right as written, but a second reverse pass
    weighs the zero cotangent of `eps * sqrt'(0)`'s NaN tangent into `eps` (`0 * inf`): the
    mixed derivative and the Hessian were NaN, "nothing to guard". A product whose other
    factor carries a derivative there now keeps the guard; the reference is the hand fix with
    its safe value inside the domain."""
    def energy(eps, r2, safe=0.0):
        ok = r2 > 0
        return jnp.sum(jnp.where(ok, eps * jnp.sqrt(jnp.where(ok, r2, safe)), 0.0))

    def hand(eps, r2):
        return energy(eps, r2, safe=1.0)

    def mixed(e):
        return jax.grad(lambda eps, r2: jnp.sum(jax.grad(e, 1)(eps, r2)), 0)

    r2, eps = jnp.array([0.0, 4.0]), 2.0
    safe = jaxsafe.nan_safe(energy)
    assert np.isnan(np.asarray(mixed(energy)(eps, r2)))
    assert_bitwise(safe(eps, r2), jax.jit(energy)(eps, r2))
    assert_bitwise(mixed(safe)(eps, r2), jax.jit(mixed(hand))(eps, r2))
    for argnums in (0, 1, (0, 1)):
        assert_bitwise(jax.hessian(safe, argnums)(eps, r2),
                       jax.jit(jax.hessian(hand, argnums))(eps, r2))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_a_hand_guard_times_its_own_argument_second_order(dtype):
    """The one-argument form, `x * sqrt(where(x > 0, x, 0.))` under `where(x > 0, ., 0.)`, and
    in float16 `x * log(where(x > 0, x, 1e-5))`, whose safe value is inside the domain but
    whose `log'` there overflows float16: Hessians are the hand fix's, 0 in dropped lanes."""
    inner_fn, safe_value = (jnp.sqrt, 0.0) if dtype == jnp.float32 else (jnp.log, 1e-5)

    def f(x, safe=safe_value):
        return jnp.sum(jnp.where(x > 0, x * inner_fn(jnp.where(x > 0, x, dtype(safe))),
                                 dtype(0.0)))

    x = jnp.array([-1.0, 0.5, 2.0], dtype)
    safe = jaxsafe.nan_safe(f)
    assert np.isnan(np.asarray(jax.hessian(f)(x))).any()
    assert_bitwise(safe(x), jax.jit(f)(x))
    assert_bitwise(jax.hessian(safe)(x), jax.jit(jax.hessian(lambda x: f(x, 1.0)))(x))


def test_a_row_maximum_over_an_empty_axis_may_be_infinite():
    """Hunt AR: `jnp.max(x, axis=1, initial=-inf)` of a batch with no entries is -inf from
    finite operands (the reduction's identity), and was taken as finite: with `finite_args`, or
    over a constant, a product with it in a dropped row was left unguarded (`0 * -inf`)."""
    keep = jnp.array([True, False])

    def f(x, s, hand=False):
        weight = jnp.where(keep, s, 0.0) if hand else s
        return jnp.sum(jnp.where(keep, jnp.max(x, axis=1, initial=-jnp.inf) * weight, 0.0))

    x, s = jnp.ones((2, 0)), jnp.array([2.0, 3.0])
    assert np.isnan(np.asarray(jax.grad(f, 1)(x, s))).any()
    safe = jaxsafe.nan_safe(f, finite_args=True)
    assert_bitwise(jax.grad(safe, 1)(x, s), jax.grad(lambda x, s: f(x, s, hand=True), 1)(x, s))

    def g(s, hand=False):
        weight = jnp.where(keep, s, 0.0) if hand else s
        return jnp.sum(jnp.where(keep, lax.reduce_max(jnp.ones((2, 0)), (1,)) * weight, 0.0))

    assert_bitwise(jax.grad(jaxsafe.nan_safe(g))(s), jax.grad(lambda s: g(s, hand=True))(s))


# --------------------------------------------------------------------------- hunt AW


@pytest.mark.parametrize(("approx", "exact"), [
    (lambda v: jax.lax.approx_max_k(v, 2)[0], lambda v: jax.lax.top_k(v, 2)[0]),
    (lambda v: jax.lax.approx_min_k(-v, 1, reduction_dimension=0)[0],
     lambda v: -jax.lax.top_k(v.T, 1)[0].T),
], ids=["max_k", "min_k along axis 0"])
def test_approx_top_k_drops_the_lanes_it_does_not_return(approx, exact):
    """Hunt AW: `approx_max_k`/`approx_min_k` kept every input lane live (no liveness row), so
    `sqrt`'s infinite derivative at a 0 it did not return stayed NaN. Its derivative reads the
    lanes it returns, as `top_k`'s does: jaxsafe's gradient is now the exact `top_k`'s under
    nan_safe (CPU computes it exactly), and 0 in every lane not returned."""
    def f(x):
        return jnp.sum(approx(jnp.sqrt(x)))

    def g(x):
        return jnp.sum(exact(jnp.sqrt(x)))

    x = jnp.array([[4.0, 9.0, 0.0, 1.0, 0.25], [1.0, 0.0, 2.0, 0.0, 3.0]])
    assert np.isnan(np.asarray(jax.grad(f)(x))).any() or \
        np.isinf(np.asarray(jax.grad(f)(x))).any()
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    for derivative in (jax.grad, jax.jacfwd):
        got = derivative(safe)(x)  # up to a NaN's sign (`-top_k(v)` for the minimum)
        assert_close(got, derivative(jaxsafe.nan_safe(g))(x))
    returned = np.asarray(jax.grad(lambda x: jnp.sum(approx(x)))(x + 1.0)) != 0
    assert returned.sum() == np.asarray(approx(x)).size
    assert not np.asarray(jax.grad(safe)(x))[~returned].any()


# --------------------------------------------------------------------------- hunt AX


@pytest.mark.parametrize("form", ["scalar", "constant"])
def test_atan2_with_one_operand_left_as_it_is_is_not_guarded_onto_its_origin(form):
    """Hunt AX: `where(y > 0, arctan2(y, x), 0.)` with a scalar `x` (read by live lanes too, so
    it keeps its value): the guard put 0 into `y`'s dropped lanes, and with `x == 0` made
    `atan2(0, 0)` there, whose derivative is 0 / 0: `x`'s gradient was NaN where JAX's is
    finite. Each safe value alone is now off the origin. With an `x` that carries no derivative
    (a constant, also left as it is) every order is the hand fix's too."""
    y = jnp.array([-1.0, 2.0, -3.0])
    if form == "scalar":
        def f(y, x):
            return jnp.sum(jnp.where(y > 0, jnp.arctan2(y, x), 0.0))

        def hand(y, x):
            ok = y > 0
            xb = jnp.broadcast_to(x, y.shape)
            return jnp.sum(jnp.where(ok, jnp.arctan2(jnp.where(ok, y, 1.0),
                                                     jnp.where(ok, xb, 1.0)), 0.0))
        args = (y, jnp.float32(0.0))
        argnums = (0, 1)
    else:
        xs = jnp.array([0.0, 0.0, 1.0])

        def f(y):
            return jnp.sum(jnp.where(y > 0, jnp.arctan2(y, xs), 0.0))

        def hand(y):
            ok = y > 0
            return jnp.sum(jnp.where(ok, jnp.arctan2(jnp.where(ok, y, 1.0), xs), 0.0))
        args, argnums = (y,), 0
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(*args), jax.jit(f)(*args))
    for derivative in (jax.grad, jax.jacfwd, jax.hessian):
        got = derivative(safe, argnums)(*args)
        assert_finite(got)
        assert_close(got, derivative(hand, argnums)(*args))


# --------------------------------------------------------------------------- hunt AZ


def test_an_empty_broadcast_shows_nothing_finite():
    """Hunt AZ: a sum over an empty broadcast of `x ** 2` is 0 whatever `x` holds, yet the walk
    back from `s < 1` (`_finite_lanes.py`) took it to show `x` finite, and left `x ** 2`
    unguarded where `s < 1` drops it: `inf`'s gradient was NaN. An empty value reads no lane
    of its operands."""
    def f(x, hand=False):
        y = x ** 2
        s = jnp.sum(jnp.broadcast_to(y, (0, 3)))
        inner = jnp.where(s < 1.0, 0.0, x) ** 2 if hand else y
        return jnp.sum(jnp.where(s < 1.0, 0.0, inner))

    x = jnp.array([jnp.inf, 1.0, 2.0])
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    assert_bitwise(jax.grad(safe)(x), jax.grad(lambda x: f(x, hand=True))(x))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e5m2"])
def test_the_analysis_reads_dtypes_numpy_has_no_finfo_for(dtype):
    """Hunt AZ: a domain bound in bfloat16 or float8 (`where(x > 2, 0., log(x))`) asked
    NumPy's `finfo`, which refuses `ml_dtypes` types: the analysis failed and the whole program
    ran unguarded, so an unrelated leak beside it stayed (`sqrt(0.5 - x)` where `x > 0.5`)."""
    dt = jnp.dtype(dtype)

    def f(x, hand=False):
        a = jnp.where(x > 2, 0.0, jnp.log(x))
        b = jnp.where(x > 0.5, 0.0, jnp.sqrt(0.5 - jnp.where(hand & (x > 0.5), 0.0, x)))
        return jnp.sum(a + b)

    x = jnp.array([0.25, 1.5, 3.0], dt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no AnalysisFailedWarning
        got = jax.grad(jaxsafe.nan_safe(f))(x)
    assert_bitwise(got, jax.grad(lambda x: f(x, hand=True))(x))
    assert_finite(got.astype(jnp.float32))


# --------------------------------------------------------------------------- hunt BA


def test_a_clamp_in_float8_has_float16_s_narrow_range():
    """Hunt BA: `2e4 * sqrt(maximum(x, .01))` in float8_e5m2: a loss scale times `sqrt`'s finite
    derivative at the clamp overflows the narrow range, as in float16, but NumPy does not count
    the `ml_dtypes` floats as floats, and the clamp was left: NaN in the lanes it drops."""
    h = jnp.float8_e5m2

    def f(x, hand=False):
        m = jnp.where(x > h(0.01), x, h(0.01)) if hand else jnp.maximum(x, h(0.01))
        return jnp.sum((h(2e4) * jnp.sqrt(m)).astype(jnp.float32))

    x = jnp.array([-1.0, 0.0, 2.0], h)
    assert np.isnan(np.asarray(jax.grad(f)(x).astype(jnp.float32))).any()
    got = jax.grad(jaxsafe.nan_safe(f))(x)
    assert_bitwise(got, jax.grad(lambda x: f(x, hand=True))(x))


def test_one_byte_dtypes_do_not_share_folded_constants():
    """Hunt BA: folded constants were remembered by `dtype.str`, which is `<V1` for every
    1-byte `ml_dtypes` type: the same program in float8_e4m3fnuz, then in float8_e4m3fn, read
    the first one's constants, the analysis failed and the program ran unguarded."""
    grads = []
    for dt in (jnp.float8_e4m3fnuz, jnp.float8_e4m3fn):
        def f(x, dt=dt):
            y = jnp.where(x > 0, jnp.log(x) + jnp.sqrt(jnp.sum(x * x) + dt(1.0)), dt(0.0))
            return jnp.sum(y.astype(jnp.float32))

        x = jnp.array([-1.0, 0.0, 2.0], dt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no AnalysisFailedWarning
            grads.append(np.asarray(jax.grad(jaxsafe.nan_safe(f))(x).astype(jnp.float32)))
    for g in grads:
        assert np.isfinite(g).all() and g[1] == 0.0, grads


@pytest.mark.parametrize("dt", ["float8_e4m3fn", "float8_e4m3fnuz"])
@pytest.mark.parametrize("op", ["cummax", "cummin"])
def test_a_running_extreme_in_a_float8_without_inf_keeps_its_live_derivative(op, dt):
    """Hunt BA: the choice of `cummax` filled the lanes no live output reads with `inf`, which
    is NaN in a float8 without inf: the running minimum of the fill spread it, no lane was
    chosen, and a live lane's derivative was 0 (contract point 3)."""
    dtype = jnp.dtype(dt)
    running = getattr(lax, op)
    f = lambda x: jnp.sum(running(x, axis=1)[:, 1].astype(jnp.float32))  # noqa: E731
    x = jnp.array([[1., 3., -3., 2.], [0.5, 0.25, 1., 4.]], dtype)
    want = jax.grad(f)(x)
    assert np.asarray(want.astype(jnp.float32)).sum() == 2.0  # one chosen lane per row
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f))(x), want)


@pytest.mark.parametrize("dt", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_jaxsafe_nn_in_a_float8_without_inf(dt):
    """Hunt BA: `-inf` is NaN in these dtypes. `jaxsafe.nn.logsumexp` added the NaN row max
    that JAX replaces with 0 (NaN where JAX gives the value), and a masked `softmax` filled
    its masked entries with it (every entry NaN)."""
    dtype = jnp.dtype(dt)
    x = jnp.array([[1., 2., -3.], [0.5, 0.25, 1.]], dtype)
    for axis in (0, 1):
        assert_bitwise(jaxsafe.nn.logsumexp(x, axis=axis),
                       jax.scipy.special.logsumexp(x, axis=axis))
    mask = jnp.array([[True, False, True], [False, False, False]])
    got = np.asarray(jaxsafe.nn.softmax(x, where=mask).astype(jnp.float32))
    want = np.asarray(jaxsafe.nn.softmax(x.astype(jnp.float32), where=mask)
                      .astype(dtype).astype(jnp.float32))
    np.testing.assert_allclose(got, want, atol=0.07)  # float8's rounding of float32's
    assert got[1].tolist() == [0., 0., 0.] and np.isfinite(got).all()
    lse = np.asarray(jaxsafe.nn.logsumexp(x, axis=1, where=mask).astype(jnp.float32))
    assert np.isfinite(lse[0])
    row0 = jax.grad(lambda x: jaxsafe.nn.softmax(x, where=mask)[0, 2].astype(jnp.float32))(x)
    assert np.isfinite(np.asarray(row0.astype(jnp.float32))).all()


# --------------------------------------------------------------------------- hunt BC


def test_jaxsafe_nn_log_softmax_needs_no_guard_under_finite_args():
    """Hunt BC: `jaxsafe.nn.log_softmax` shifts by a row max that is a generic `lax.reduce`
    with a finite start (for XLA's fusion), which the analysis did not read as a maximum: the
    `exp` of the shift took an overflow guard that `jax.nn.log_softmax`'s does not, and
    `assert_no_leaks` flagged the function."""
    f = lambda x: -jnp.mean(jaxsafe.nn.log_softmax(x)[:, 0])  # noqa: E731
    x = jnp.array([[1., 2., 3., 4.], [0., -1., 5., 2.], [3., 3., 3., 3.]])
    report = jaxsafe.explain(f, finite_args=True)(x)
    assert not [s for s in report.sites if s.replace or s.cut], str(report)
    jaxsafe.testing.assert_no_leaks(f, x)
    assert_bitwise(jaxsafe.nan_safe(f, finite_args=True)(x), jax.jit(f)(x))
    assert_bitwise(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(x), jax.grad(f)(x))


# --------------------------------------------------------------------------- hunt BB

_PADDED_PARTICLES = jnp.array([True, False, True, True])  # particle 1 is padding
_DIAGONAL = jnp.arange(4)


@pytest.mark.parametrize("clamp", [
    lambda s: jnp.maximum(s, 1e-12), lambda s: jnp.clip(s, 1e-12, 1e6), jax.nn.relu,
], ids=["maximum", "clip", "relu"])
def test_a_padded_row_dropped_through_a_clamped_gram_diagonal(clamp):
    """Hunt BB: squared norms read off a Gram matrix's diagonal (`(x @ x.T)[i, i]`), clamped,
    under a constant padding mask: the gather lost the mask's predicate, the clamp's run-time
    choice joined it, and the matmul's operands were left unguarded ("a guard would need a
    run-time reduction"): the padded NaN row reached every live gradient. The lanes a gather
    with known indices reads are now read only from the output lanes that may be live."""
    x = jnp.array([[1., 2.], [jnp.nan, 0.], [3., 5.], [0.5, -1.]])

    def f(x):
        sq = (x @ x.T)[_DIAGONAL, _DIAGONAL]
        return jnp.sum(jnp.where(_PADDED_PARTICLES, jnp.sqrt(clamp(sq) + 1.), 0.))

    def without_padding(x):
        live = x[np.array([0, 2, 3])]
        return jnp.sum(jnp.sqrt(clamp(jnp.sum(live * live, -1)) + 1.))

    assert np.isnan(np.asarray(jax.grad(f)(x))).any()  # plain JAX: the leak
    assert_bitwise(jaxsafe.nan_safe(f)(x), jax.jit(f)(x))
    got = jax.grad(jaxsafe.nan_safe(f))(x)
    want = jax.grad(without_padding)(x)
    assert_close(got[np.array([0, 2, 3])], want[np.array([0, 2, 3])], rtol=1e-6)
    assert got[1].tolist() == [0., 0.]


# --------------------------------------------------------------------------- hunt BE

_PAIRS = np.triu_indices(4, 1)
_LIVE_PAIRS = np.asarray(_PADDED_PARTICLES)[_PAIRS[0]] & np.asarray(_PADDED_PARTICLES)[_PAIRS[1]]


@pytest.mark.parametrize("padding", [[jnp.inf, 1e30], [30., 40.]], ids=["inf", "finite"])
@pytest.mark.parametrize("clamp", [
    lambda s: jnp.maximum(s, 1e-6), lambda s: jnp.clip(s, 1e-6, 1e30),
], ids=["maximum", "clip"])
def test_a_re_decided_clamp_keeps_its_bound_in_dropped_lanes(padding, clamp):
    """Hunt BE: a clamp whose operand a row guard changed was re-decided on the original values
    alone, so in a dropped lane it took the guarded 0 where the original had won, below the
    bound that let the `sqrt` after it go unguarded: `0 * inf` reached the live rows through the
    Gram matrix, even with a finite padded row (plain JAX finite). It now takes an operand where
    it wins on the original and on the guarded values both."""
    x = jnp.array([[1., 2.], padding, [0.5, 1.5], [2., -1.]])
    ts = jnp.array([1., 2.])

    def energy(pairs, keep):
        def f(x, ts):
            def body(c, t):
                y = x * t
                s = (y @ y.T)[pairs]
                e = jnp.where(s > 1., jnp.sqrt(clamp(s)), 0.)
                return c + jnp.sum(jnp.where(keep, e, 0.)), None
            return lax.scan(body, 0., ts)[0]
        return f

    f = energy(_PAIRS, _LIVE_PAIRS)
    live = np.array([0, 2, 3])
    without_padding = energy(np.triu_indices(3, 1), True)
    _same_forward(f, x, ts)
    gx, gt = jax.grad(jaxsafe.nan_safe(f), (0, 1))(x, ts)
    wx, wt = jax.grad(without_padding, (0, 1))(x[live], ts)
    assert_close(gx[live], wx, rtol=1e-6)
    assert gx[1].tolist() == [0., 0.]
    assert_close(gt, wt, rtol=1e-6)


def test_a_re_decided_max_keeps_the_original_choice_in_its_live_lanes():
    """The other side of the fix above: `log(x)` guarded where it loses to `b` (its lane is
    dropped there, the result's is live): the guarded `log(1) = 0` would beat `b = -5` on the
    guarded values, so the result's live lanes must keep the original choice, `b`."""
    def f(x, b):
        return jnp.sum(jnp.where(b > -10., jnp.maximum(jnp.log(x), b), 0.))

    x, b = jnp.array([0., 2., 0.]), jnp.array([-5., -5., -20.])
    _same_forward(f, x, b)
    gx, gb = jax.grad(jaxsafe.nan_safe(f), (0, 1))(x, b)
    assert gx.tolist() == [0., 0.5, 0.]
    assert gb.tolist() == [1., 0., 0.]


def _clamped_norm(sq):
    return jnp.sqrt(jnp.maximum(sq, 1e-12) + 1.)


_WEIGHTS = jnp.array([1., 0., 1., 2.])  # particle 1 is padding, stored as a zero weight


def _diagonal_gather(x):
    return (x @ x.T)[_DIAGONAL, _DIAGONAL]


_PADDED_FORMS = {
    "float mask": lambda x: jnp.where(_WEIGHTS > 0, _clamped_norm(_diagonal_gather(x)), 0.),
    "concatenate": lambda x: jnp.where(
        jnp.concatenate([_PADDED_PARTICLES, _PADDED_PARTICLES]),
        _clamped_norm(jnp.concatenate([_diagonal_gather(x), _diagonal_gather(x)])), 0.),
    "reshape": lambda x: jnp.where(
        _PADDED_PARTICLES.reshape(2, 2),
        _clamped_norm(_diagonal_gather(x).reshape(2, 2)), 0.),
    "mask and predicate": lambda x: jnp.where(
        _PADDED_PARTICLES & (_diagonal_gather(x) < 100.), _clamped_norm(_diagonal_gather(x)), 0.),
    "jnp.diagonal": lambda x: jnp.where(
        _PADDED_PARTICLES, _clamped_norm(jnp.diagonal(x @ x.T)), 0.),
}


@pytest.mark.parametrize("form", list(_PADDED_FORMS))
def test_a_padded_row_dropped_after_the_gram_gather_in_other_forms(form):
    """Hunt BE: the forms the BB fix did not reach. The padding mask stored as floats
    (`W > 0`: a predicate computed from a float constant is now known when jaxsafe plans), a
    `concatenate` or `reshape` between the gather and the `where` (a known mask moves with the
    lanes), one `where` on the mask and a run-time predicate (the connective is expanded) and
    `jnp.diagonal` (its `platform_dependent` cond is its default case: the Mosaic case runs in
    Pallas kernels only). Each reads the padded NaN row only from dropped lanes."""
    x = jnp.array([[1., 2.], [jnp.nan, 0.], [3., 5.], [0.5, -1.]])
    live = np.array([0, 2, 3])
    body = _PADDED_FORMS[form]

    def f(x):
        return jnp.sum(body(x))

    def without_padding(x):  # every form sums each live particle's clamped norm once or twice
        return jnp.sum(_clamped_norm(jnp.sum(x * x, -1)))

    assert np.isnan(np.asarray(jax.grad(f)(x))).any()  # plain JAX: the leak
    _same_forward(f, x)
    got = jax.grad(jaxsafe.nan_safe(f))(x)
    times = 2. if form == "concatenate" else 1.
    assert_close(got[live], times * jax.grad(without_padding)(x[live]), rtol=1e-6)
    assert got[1].tolist() == [0., 0.]
    hess = jax.hessian(jaxsafe.nan_safe(f))(x)
    assert_close(hess[live][:, :, live], times * jax.hessian(without_padding)(x[live]),
                 rtol=1e-5, atol=1e-6)
    assert not np.asarray(hess[1]).any() and not np.asarray(hess[:, :, 1]).any()


def test_a_platform_dependent_choice_between_xla_platforms_is_not_taken_when_planning():
    """Only Pallas kernel platforms are known never to run: a `platform_dependent` choosing
    between `cpu` and a default stays a run-time choice (both cases' reads count)."""
    def f(x):
        y = lax.platform_dependent(x, cpu=lambda v: v[:2], default=lambda v: v[1:])
        return jnp.sum(jnp.where(jnp.array([True, False]), jnp.sqrt(y), 0.))

    x = jnp.array([4., -1., 9.])
    closed = jaxsafe.make_jaxpr(f)(x)
    assert "cond" in [str(e.primitive) for e in closed.jaxpr.eqns]
    _same_forward(f, x)
    assert jax.grad(jaxsafe.nan_safe(f))(x).tolist() == [0.25, 0., 0.]


# --------------------------------------------------------------------------- hunt BF

_VALID_POINTS = jnp.array([True, True, False, False, False])
_EPS = 1e-6

_HAND_CLAMPS = {  # each keeps the squared distance at or above _EPS, in a `where` taking it
    "s > eps": lambda s: jnp.sqrt(jnp.where(s > _EPS, s, _EPS)),
    "s <= eps": lambda s: jnp.sqrt(jnp.where(s <= _EPS, _EPS, s)),
    "power": lambda s: jnp.where(s >= _EPS, s, _EPS) ** 0.5,
    "log of a where": lambda s: jnp.log(jnp.where(s > 0., s, 1.)),
}


@pytest.mark.parametrize("distances", ["outer difference", "gram"])
@pytest.mark.parametrize("clamp", list(_HAND_CLAMPS))
def test_a_hand_clamp_by_where_after_a_guarded_value_decides_its_dropped_lanes_again(
        clamp, distances):
    """Hunt BF: `sqrt(where(s > eps, s, eps))` is at least sqrt(eps), so its `sqrt` goes
    unguarded. But `s` is computed from a guarded `sqrt(x)`: in a dropped pair the guarded `s`
    may be 0 where the original passed the comparison, and the `select_n` emitted again took it
    on the original predicate (`0 * inf` reached the live points through `s`). Its dropped lanes
    are now decided on the guarded values, its live lanes on the original ones."""
    hand_clamp = _HAND_CLAMPS[clamp]

    def pairwise(y):
        if distances == "gram":
            n2 = jnp.sum(y * y, -1)
            return n2[:, None] + n2[None, :] - 2 * y @ y.T
        return jnp.sum((y[:, None] - y[None, :]) ** 2, -1)

    def f(x, valid):
        s = pairwise(jnp.sqrt(x))
        pair = valid[:, None] & valid[None, :]
        return jnp.sum(jnp.where(pair, hand_clamp(s), 0.))

    def double_where(x, valid):  # the hand fix: the invalid points and pairs replaced first
        pair = valid[:, None] & valid[None, :]
        s = jnp.where(pair, pairwise(jnp.sqrt(jnp.where(valid[:, None], x, 1.))), 1.)
        return jnp.sum(jnp.where(pair, hand_clamp(s), 0.))

    # valid points 0, 1; the invalid ones sit at other distances, one outside sqrt's domain.
    # Point 0 sits where a guarded invalid point does (sqrt's guard puts 1 there): their
    # guarded distance is 0, their original one passes the comparison.
    x = jnp.array([[1., 1.], [4., 1.], [9., 3.], [16., 2.], [-1., 5.]])
    assert np.isnan(np.asarray(jax.grad(f)(x, _VALID_POINTS))).any()  # plain JAX
    _same_forward(f, x, _VALID_POINTS)
    got = jax.grad(jaxsafe.nan_safe(f))(x, _VALID_POINTS)
    assert_close(got, jax.grad(double_where)(x, _VALID_POINTS), rtol=1e-6)
    assert not np.asarray(got[2:]).any()
    hess = jax.hessian(jaxsafe.nan_safe(f))(x, _VALID_POINTS)
    assert_close(hess, jax.hessian(double_where)(x, _VALID_POINTS), rtol=1e-5, atol=1e-6)


def test_a_where_clamp_in_a_live_lane_keeps_the_original_decision():
    """The other side: where the result is live, the predicate is the original one. In lane 0
    `s = sqrt(x) + w` fails `s > eps`, so `sqrt(x)` is dropped there and guarded (x = 0 makes
    `0 * inf`), while the clamp's result is live; the guarded `s = sqrt(1) - 0.5` passes the
    comparison, so deciding that lane on the guarded values would give `w` a derivative there
    (the original takes the constant eps). Lane 2 is dropped: decided on the guarded values."""
    mask = jnp.array([True, True, False, False])

    def f(x, w):
        s = jnp.sqrt(x) + w
        return jnp.sum(jnp.where(mask, jnp.sqrt(jnp.where(s > _EPS, s, _EPS)), 0.))

    x, w = jnp.array([0., 4., 0., 9.]), jnp.array([-.5, 0., -.5, 0.])
    closed = jaxsafe.make_jaxpr(f)(x, w)
    assert sum(str(e.primitive) == "gt" for e in closed.jaxpr.eqns) == 2  # both decisions
    _same_forward(f, x, w)
    gx, gw = jax.grad(jaxsafe.nan_safe(f), (0, 1))(x, w)
    assert gx[0] == 0. and gx[2:].tolist() == [0., 0.]
    assert_close(gx[1], 0.5 / np.sqrt(2.) * 0.25, rtol=1e-6)
    assert gw[0] == 0. and gw[2:].tolist() == [0., 0.]
    assert_close(gw[1], 0.5 / np.sqrt(2.), rtol=1e-6)
