"""The mask algebra on cores (jaxsafe/_masks.py): every helper against NumPy on the full arrays,
and the programs where a core crosses a transpose, a gather, a split and a concatenation."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite, structure
from jax import lax

import jaxsafe
from jaxsafe import _masks as M
from jaxsafe import nan_safe

# Numerics: conftest's leak checker is for the modules that exercise the API's tracing paths
# (test_api, test_composition, ...); here it would only turn JAX's caches off (2-3x slower).
pytestmark = pytest.mark.no_leak_check

P = jax.extend.core.primitives
Primitive = jax.extend.core.Primitive
SHAPE = (2, 3, 4)
RNG = np.random.default_rng(0)


def core_mask(axes, shape=SHAPE, p=0.5):
    """A random mask of `shape` that varies along `axes` only: (the broadcast mask, NumPy full)."""
    core = RNG.random([shape[a] for a in axes]) < p
    full = np.broadcast_to(np.expand_dims(core, [a for a in range(len(shape)) if a not in axes]),
                           shape)
    return M.broadcast_mask(jnp.asarray(core), shape, axes), full


AXES = [axes for r in range(4) for axes in itertools.combinations(range(3), r)]


@pytest.mark.parametrize("axes", AXES)
def test_a_broadcast_is_remembered_as_its_core(axes):
    with M.mask_scope():
        m, full = core_mask(axes)
        core, found = M.factor(m)
        assert found == axes and np.shape(core) == tuple(SHAPE[a] for a in axes)
        np.testing.assert_array_equal(m, full)


@pytest.mark.parametrize("a,b", [(a, b) for a in AXES for b in AXES][::3])
def test_and_or_combine_cores_at_the_union_of_their_axes(a, b):
    with M.mask_scope():
        (ma, fa), (mb, fb) = core_mask(a), core_mask(b)
        both, either = M.all_of([ma, mb]), M.any_of([ma, mb])
        np.testing.assert_array_equal(both, fa & fb)
        np.testing.assert_array_equal(either, fa | fb)
        assert M.factor(either)[1] == tuple(sorted(set(a) | set(b)))
        np.testing.assert_array_equal(M.not_mask(ma), ~fa)
    assert M.all_of([None, None]) is None and M.any_of([ma, None]) is None


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("reduced", [(0,), (1,), (2,), (0, 2), (0, 1, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reduce_any_on_a_core(axes, reduced, keepdims):
    with M.mask_scope():
        m, full = core_mask(axes, p=0.3)
        out = M.reduce_any(m, reduced, keepdims)
        np.testing.assert_array_equal(out, np.any(full, axis=reduced, keepdims=keepdims))
    np.testing.assert_array_equal(M.reduce_any(jnp.asarray(full), reduced, keepdims),
                                  np.any(full, axis=reduced, keepdims=keepdims))


def test_reduce_any_over_an_empty_axis_is_false():
    with M.mask_scope():
        m = M.broadcast_mask(jnp.ones((2,), bool), (2, 0), (0,))
        np.testing.assert_array_equal(M.reduce_any(m, (1,)), np.zeros(2, bool))


@pytest.mark.parametrize("perm", list(itertools.permutations(range(3))))
@pytest.mark.parametrize("axes", AXES)
def test_transpose_moves_the_core_to_the_operand_axes(perm, axes):
    out_shape = tuple(SHAPE[p] for p in perm)
    with M.mask_scope():
        m, full = core_mask(axes, out_shape)
        operand = M.move_axes(m, perm, SHAPE)
        np.testing.assert_array_equal(operand, np.transpose(full, np.argsort(perm)))


@pytest.mark.parametrize("axes", AXES)
def test_pad_and_slice_a_core(axes):
    config = [(1, 0, 0), (0, 2, 1), (0, 0, 0)]
    with M.mask_scope():
        m, full = core_mask(axes)
        padded = M.pad_mask(m, config, (3, 7, 4))
        ref = np.zeros((3, 7, 4), bool)
        ref[1:, 0:5:2, :] = full
        np.testing.assert_array_equal(padded, ref)
        for axis in range(3):
            np.testing.assert_array_equal(M.slice_mask(m, axis, 1, 2),
                                          np.take(full, [1], axis=axis))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_concatenated_masks_reduce_part_by_part(axis):
    shapes = [tuple(2 if a == axis else n for a, n in enumerate(SHAPE)), SHAPE]
    with M.mask_scope():
        (m1, f1), (m2, f2) = core_mask((0,), shapes[0]), core_mask((1, 2), shapes[1])
        cat = M.concat_masks([m1, m2], shapes, axis)
        full = np.concatenate([f1, f2], axis)
        np.testing.assert_array_equal(cat, full)
        for reduced in [(axis,), (0, 1, 2)]:
            np.testing.assert_array_equal(M.reduce_any(cat, reduced), np.any(full, reduced))
        same = M.concat_masks([None, None], shapes, axis)  # every lane live: one core, no concat
        np.testing.assert_array_equal(same, np.ones(full.shape, bool))


@pytest.mark.parametrize("new_shape", [(2, 1, 3, 4), (2, 3, 4, 1), (6, 4), (1, 2, 12)])
@pytest.mark.parametrize("axes", AXES)
def test_reshape_a_core(new_shape, axes):
    with M.mask_scope():
        m, full = core_mask(axes)
        np.testing.assert_array_equal(M.reshape_mask(m, new_shape), full.reshape(new_shape))


def test_a_mask_inside_another_member_adds_nothing_to_a_union():
    with M.mask_scope():
        row, full_row = core_mask((0, 1))
        inner = jnp.asarray(full_row & (RNG.random(SHAPE) < 0.5))
        M.within(inner, M.broadcast_mask(M.factor(row)[0], SHAPE, (0, 1)))
        assert M.any_of([row, inner]) is row
        other, full_other = core_mask((2,))
        np.testing.assert_array_equal(M.any_of([inner, other]), np.asarray(inner) | full_other)


def test_original_broadcasts_are_registered_through_a_chain():
    with M.mask_scope():
        src = jnp.asarray(RNG.random((2, 1, 4)) < 0.5)
        mid = lax.broadcast_in_dim(src, (2, 1, 4, 1), (0, 1, 2))
        out = lax.broadcast_in_dim(mid, (2, 3, 4, 5), (0, 1, 2, 3))
        M.register_broadcast(mid, src, (0, 1, 2))
        M.register_broadcast(out, mid, (0, 1, 2, 3))
        core, axes = M.factor(out)
        assert axes == (0, 2) and np.shape(core) == (2, 4)
        np.testing.assert_array_equal(M.reduce_any(out, (1, 3)), np.asarray(src)[:, 0, :])


# --------------------------------------------------------------------------- whole programs

def test_a_row_mask_crosses_a_three_cycle_transpose():
    """Output axis 0 of transpose(., (1, 2, 0)) is operand axis 1 (not argsort's 2)."""
    keep = np.array([True, False, True])

    def f(x):
        s = jnp.sum(jnp.transpose(jnp.sqrt(x), (1, 2, 0)), axis=(1, 2))
        return jnp.sum(jnp.where(keep, s, 0.))

    def hand(x):
        s = jnp.sum(jnp.transpose(jnp.sqrt(jnp.where(keep[None, :, None], x, 1.)), (1, 2, 0)),
                    axis=(1, 2))
        return jnp.sum(jnp.where(keep, s, 0.))
    x = jnp.linspace(0.5, 1.5, 27).reshape(3, 3, 3).at[:, 1, :].set(-1.)
    assert np.isnan(jax.grad(f)(x)).any()
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x), jax.grad(hand)(x))


def test_cross_entropy_of_a_log_with_zeros_in_unpicked_lanes():
    """take_along_axis(log(p), labels) in kept rows: the log's unpicked lanes are dropped (their
    zeros would give 0 * inf), although logsumexp-free rows keep the picked lane live."""
    p = jnp.array([[0.5, 0.5, 0.], [0., 1., 0.], [0.2, 0.3, 0.5]])
    labels = jnp.array([0, 1, 2])
    keep = np.array([True, True, False])

    def f(p):
        picked = jnp.take_along_axis(jnp.log(p), labels[:, None], axis=-1)[:, 0]
        return jnp.sum(jnp.where(keep, picked, 0.))

    def ref(p):  # analytic: d/dp log(p[i, label_i]) = 1 / p[i, label_i] in kept rows
        return jnp.zeros_like(p).at[jnp.arange(3), labels].set(
            jnp.where(keep, 1. / p[jnp.arange(3), labels], 0.))
    assert np.isnan(jax.grad(f)(p)).any()
    g = jax.grad(nan_safe(f))(p)
    assert_finite(g)
    assert_close(g, ref(p))


def test_split_columns_reduce_part_by_part():
    """q, k, v = split(x @ w): rows of x are live when any part's row is."""
    w = jnp.linspace(-1., 1., 18).reshape(3, 6)
    rows = np.array([True, False, True, False])

    def f(x, w):
        q, k, _ = jnp.split(jnp.log(x) @ w, 3, axis=-1)  # v: no lane live
        return jnp.sum(jnp.where(rows[:, None], q * k, 0.))

    def ref(x, w):
        q, k, _ = jnp.split(jnp.log(x[rows]) @ w, 3, axis=-1)
        return jnp.sum(q * k)
    x = jnp.linspace(0.5, 2., 12).reshape(4, 3).at[1].set(0.).at[3].set(-1.)
    assert np.isnan(jax.grad(f)(x, w)).any()
    g, g_ref = jax.grad(nan_safe(f), (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)
    assert_close(g, g_ref)
    np.testing.assert_array_equal(g[0][~rows], 0.)


def _bool_ops_of_shape(closed, shape) -> list[Primitive]:
    """Boolean equations at `shape` other than broadcasts (which XLA fuses into their select)."""
    return [e.primitive for e in closed.jaxpr.eqns for o in e.outvars
            if o.aval.dtype == jnp.bool_ and tuple(o.aval.shape) == shape
            and e.primitive is not P.broadcast_in_dim_p]


def test_row_masks_of_attention_stay_at_row_size():
    """Two masked attention layers, padded rows dropped after each and padded targets by the
    loss: the rewrite's masks run along (batch, query) and (batch, key), so no mask is computed at
    the logits' full shape (each op there is a fusion XLA compiles); the guards read broadcasts
    of the row masks, as the hand-written double where does."""
    b, h, t, d = 2, 4, 8, 16
    mask = (np.arange(t)[:, None] >= np.arange(t)[None, :])[None, None] & \
        (np.arange(t)[None, :] >= np.array([[3], [0]]))[:, None, None, :]
    row_valid = np.any(mask, axis=-1, keepdims=True)

    def attention(x, hand=False):
        s = jnp.where(mask, x @ jnp.swapaxes(x, -1, -2), -jnp.inf)
        if hand:
            s = jnp.where(row_valid, s, 0.)
        return jnp.where(row_valid, jax.nn.softmax(s, axis=-1) @ x, 0.)

    def loss(x, keep, hand=False):
        per_row = jnp.sum(attention(jnp.tanh(attention(x, hand)), hand) ** 2, axis=(1, 3))
        return jnp.sum(jnp.where(keep, per_row, 0.))
    x = jnp.linspace(-1., 1., b * h * t * d).reshape(b, h, t, d)
    keep = jnp.asarray(np.any(row_valid, axis=(1, 3)) & (np.arange(t) < t - 1))
    rewritten = jaxsafe.make_jaxpr(loss)(x, keep)
    assert _bool_ops_of_shape(rewritten, (b, h, t, t)) == []
    g = jax.grad(nan_safe(loss))(x, keep)
    assert_finite(g)
    assert_close(g, jax.grad(loss)(x, keep, hand=True), rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- masks at trace time

def _names(closed) -> list[str]:
    return [e.primitive.name for e in closed.jaxpr.eqns]


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1,), "VALID", dimension_numbers=("NCH", "OIH", "NCH"))


def test_a_crops_mask_is_a_constant_of_the_program():
    """A crop's mask depends on shapes only: computed at trace time, the program reads it as a
    small constant, with nothing left to compute it (before: a convolution over the mask at
    every run, a pad and reductions that XLA folded at compile time)."""
    x = jnp.array([[[1., 2., 3., 4., 5., np.nan, 7.]]])
    w = jnp.array([[[1., -1.]]])
    conv = lambda x, w: jnp.sum(jnp.sqrt(_conv(x, w)[..., :2] ** 2 + 1.))  # noqa: E731
    removed = lambda x, w: jnp.sum(jnp.sqrt(_conv(x[..., :3], w) ** 2 + 1.))  # noqa: E731
    rewritten = jaxsafe.make_jaxpr(conv)(x, w)
    assert _names(rewritten).count("conv_general_dilated") == 1
    assert "pad" not in _names(rewritten) and "reduce_or" not in _names(rewritten)
    assert [np.shape(c) for c in rewritten.consts] == [(7,)]  # the input lanes read
    np.testing.assert_array_equal(jax.grad(nan_safe(conv), 1)(x, w), jax.grad(removed, 1)(x, w))
    np.testing.assert_array_equal(nan_safe(conv)(x, w), jax.jit(conv)(x, w))

    a = jnp.array([[1., 2.], [3., 4.], [np.nan, 1.], [np.inf, 0.]])
    b = jnp.array([[1., -1., 0.5], [2., 0., 1.]])
    matmul = lambda a, b: jnp.sum(jnp.log((a @ b)[:2, 1:] ** 2 + 1.))  # noqa: E731
    rewritten = jaxsafe.make_jaxpr(matmul)(a, b)
    assert "pad" not in _names(rewritten) and "reduce_or" not in _names(rewritten)
    assert sorted(np.shape(c) for c in rewritten.consts) == [(3,), (4,)]  # one per side
    want = jnp.zeros_like(b).at[:, 1:].set(
        jax.grad(lambda a, b: jnp.sum(jnp.log((a[:2] @ b) ** 2 + 1.)), 1)(a, b[:, 1:]))
    np.testing.assert_array_equal(jax.grad(nan_safe(matmul), 1)(a, b), want)


def test_a_large_box_is_emitted_as_its_sides():
    """A crop of a large value: its mask's core is the whole value (over `STATIC_CORE_LIMIT`
    lanes), but a box is the AND of its sides, and those are emitted."""
    n = 300
    assert n * n > M.STATIC_CORE_LIMIT
    x = jnp.ones((n, n)).at[0, 0].set(-1.).at[5, n - 1].set(-2.)
    f = lambda x: jnp.sum(jnp.sqrt(x)[1:, :-1])  # noqa: E731
    rewritten = jaxsafe.make_jaxpr(f)(x)
    assert sorted(np.shape(c) for c in rewritten.consts) == [(n,), (n,)]
    assert "pad" not in _names(rewritten)
    want = jnp.zeros((n, n)).at[1:, :-1].set(0.5 / jnp.sqrt(x[1:, :-1]))
    np.testing.assert_array_equal(jax.jit(jax.grad(nan_safe(f)))(x), want)
    assert np.isnan(jax.grad(f)(x)[0, 0])  # plain JAX


def test_a_large_mask_that_is_no_box_is_staged():
    """Two blocks of a large value: over the limit and not a box, the mask is computed by the
    program, as XLA would (no large constant in the program)."""
    n = 400
    x = jnp.ones((n, n)).at[0, n - 1].set(-1.).at[n - 1, 0].set(-2.)
    h = n // 2

    def f(x):
        y = jnp.sqrt(x)
        return jnp.sum(y[:h, :h]) + jnp.sum(y[h:, h:])

    rewritten = jaxsafe.make_jaxpr(f)(x)
    assert all(np.size(c) <= M.STATIC_CORE_LIMIT for c in rewritten.consts)
    assert "pad" in _names(rewritten)
    blocks = np.zeros((n, n), bool)
    blocks[:h, :h] = blocks[h:, h:] = True
    want = jnp.where(blocks, 0.5 / jnp.sqrt(jnp.where(blocks, x, 1.)), 0.)
    np.testing.assert_array_equal(jax.jit(jax.grad(nan_safe(f)))(x), want)


def test_a_crop_and_a_predicate_on_the_programs_own_constant():
    """A mask made of a crop (at trace time) and of a predicate on a constant the program
    derives (`exp` of a grid, read as the program computes it, by XLA): the forward value is bit
    for bit `jax.jit`'s, the lanes either drops take no part."""
    def f(x):
        grid = jnp.exp(jnp.linspace(0., 1., x.shape[0]))
        return jnp.sum(jnp.where(grid > 1.5, jnp.sqrt(x), 0.)[:-1])

    x = jnp.linspace(-1., 1., 8)
    rewritten = jaxsafe.make_jaxpr(f)(x)
    assert "exp" in _names(rewritten)
    np.testing.assert_array_equal(nan_safe(f)(x), jax.jit(f)(x))
    live = (jnp.exp(jnp.linspace(0., 1., 8)) > 1.5) & (jnp.arange(8) < 7)
    want = jnp.where(live, 0.5 / jnp.sqrt(jnp.where(live, x, 1.)), 0.)
    assert_close(jax.grad(nan_safe(f))(x), want)
    assert np.isnan(jax.grad(f)(x)).any()  # plain JAX


def test_masks_at_trace_time_under_a_transfer_guard():
    """A user's `jax.transfer_guard("disallow")` does not reach the masks jaxsafe computes at
    trace time (they start from host scalars)."""
    x = jnp.ones((4, 4)).at[0, 0].set(-1.)
    f = lambda x: jnp.sum(jnp.sqrt(x)[1:, :-1])  # noqa: E731
    with jax.transfer_guard("disallow"):
        g = jax.jit(jax.grad(nan_safe(f)))(x)
    np.testing.assert_array_equal(g, jnp.zeros((4, 4)).at[1:, :-1].set(0.5))


@pytest.mark.parametrize("wrap", ["checkpoint", "jit", "cond", "scan"])
def test_a_crop_inside_a_body(wrap):
    """A crop inside a body: a `remat` body is an open jaxpr, which can hold no constant, so its
    masks stay staged (before that, the rewritten body was refused and the NaN stayed); the
    other bodies read theirs as constants."""
    x = jnp.array([0., 4., 9., 16.])
    crop = lambda x: jnp.sum(jnp.sqrt(x)[1:])  # noqa: E731
    f = {"checkpoint": jax.checkpoint(crop),
         "jit": jax.jit(crop),
         "cond": lambda x: lax.cond(x[1] > 0, crop, lambda x: 0. * x[0], x),
         "scan": lambda x: lax.scan(lambda c, _: (c + crop(x), None), 0., None, length=1)[0],
         }[wrap]
    want = jnp.array([0., 0.25, 1 / 6, 0.125])
    assert np.isnan(jax.grad(f)(x)[0])  # plain JAX
    assert_close(jax.grad(nan_safe(f))(x), want)
    assert jaxsafe.explain(f)(x).skipped == []


def test_a_mask_known_true_at_trace_time_adds_nothing():
    """A gather at constant indices that reads every lane drops none: the static pass reads
    the lanes it reads when jaxsafe plans (`_liveness_rules._lanes_read`), nothing is
    guarded, and the rewritten program is the original itself (contract 4), which `explain`
    says. The indices may be computed from literals or held in a program constant (a
    closed-over array: its integers are read at trace time, `_liveness.KnownOperands`)."""
    x = jnp.array([1., 4., 0., 9.])
    for f in (lambda x: jnp.sum(jnp.sqrt(x)[jnp.arange(4)[::-1]]),
              lambda x: jnp.sum(jnp.sqrt(x)[jnp.array([3, 2, 1, 0])])):
        for finite in (True, False):
            rewritten = jaxsafe.make_jaxpr(f, finite_args=finite)(x)
            assert structure(rewritten) == structure(jax.make_jaxpr(f)(x))
        report = jaxsafe.explain(f)(x)
        assert not report.sites and not report.changed
        assert "nothing to guard" in str(report)
        np.testing.assert_array_equal(jax.grad(nan_safe(f))(x), jax.grad(f)(x))


def test_an_overwrite_or_product_at_constant_indices_keeps_its_operand_live():
    """`x.at[i].mul(2.)` reads every operand lane where the output is live (as a scatter-add):
    the static pass says so, nothing to guard. `.at[i].min(5.)` chooses, as `jnp.minimum(x,
    5.)` does: an operand lane above 5 is dropped and guarded, and the forward value and the
    derivative are plain JAX's (`sqrt(0.)`, which wins, keeps its infinite derivative)."""
    x = jnp.array([1., 4., 0., 36.])
    f = lambda x: jnp.sum(jnp.sqrt(x).at[1].mul(2.))
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    assert not jaxsafe.explain(f)(x).changed
    g = lambda x: jnp.sum(jnp.sqrt(x).at[jnp.array([0, 2, 3])].min(5.))
    assert [guard.primitive for guard in jaxsafe.explain(g)(x).guards] == ["sqrt"]
    assert_bitwise(nan_safe(g)(x), jax.jit(g)(x))
    np.testing.assert_array_equal(jax.grad(nan_safe(g))(x), jax.grad(g)(x))


def test_a_gather_at_constant_indices_guards_with_a_constant_mask():
    """A closed-over index array that skips a lane: the mask is computed at trace time from
    its integers (before, ~11 staged mask equations that XLA folded); the skipped NaN lane
    contributes zero."""
    x = jnp.array([1., 4., 0., 9.])
    f = lambda x: jnp.sum(jnp.sqrt(x)[jnp.array([3, 1])])  # noqa: E731
    assert len(jaxsafe.make_jaxpr(f)(x).eqns) <= len(jax.make_jaxpr(f)(x).eqns) + 2
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x), jnp.array([0., .25, 0., 1 / 6]))


def test_a_mask_false_at_trace_time_still_guards():
    """`x.at[1].set(0.)` drops lane 1 of `sqrt(x)`: at `x[1] = 0` plain JAX's derivative there
    is `0 * inf`; its mask, false there at trace time, emits the guard (the hand fix's
    gradient)."""
    x = jnp.array([1., 0., 4.])

    def f(x):
        return jnp.sum(jnp.sqrt(x).at[1].set(0.) * 2.)

    def by_hand(x):
        return f(jnp.where(jnp.arange(3) == 1, 1., x))
    assert np.isnan(jax.grad(f)(x)).any()
    np.testing.assert_array_equal(jax.grad(nan_safe(f))(x), jax.grad(by_hand)(x))
    assert jaxsafe.explain(f)(x).sites
