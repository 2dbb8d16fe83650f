"""Windows and transforms: average pooling (`reduce_window_sum`), convolutions and FFTs.

A drop after them reaches the lanes before them that only dropped outputs read; lanes that
no window reads at all (a stride longer than the window) are dropped by the window itself
(`test_drop_table.py` has a row for each in one dimension). Here: images. Each program takes
`log` or `sqrt` of an argument with zeros in the lanes the drop leaves, so plain JAX's gradient
is NaN there; the reference is the hand-written double where, its `live` mask built in NumPy
from the window geometry (which input pixels a live output's window covers), independently
of the library's rule.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite, structure
from jax import lax

import jaxsafe
from jaxsafe import nan_safe

pytestmark = pytest.mark.no_leak_check  # numerics: compiled with JAX's caches


def _covered(out_live: np.ndarray, in_size: int, window: int, stride: int, pad_lo: int,
             lhs_dilation: int = 1) -> np.ndarray:
    """Along one axis: the input lanes a live output position's window reads (by loops)."""
    read = np.zeros(in_size, bool)
    for o in np.flatnonzero(out_live):
        for j in range(window):
            at = o * stride + j - pad_lo
            if at >= 0 and at % lhs_dilation == 0 and at // lhs_dilation < in_size:
                read[at // lhs_dilation] = True
    return read


def _check(f, hand, *args):
    """Plain JAX's gradient is NaN; nan_safe's forward is jit's bit for bit, and its gradient
    and Hessian (under jit) are finite and the hand fix's."""
    assert np.isnan(np.asarray(jax.jit(jax.grad(f))(*args))).any()
    assert_bitwise(nan_safe(f)(*args), jax.jit(f)(*args))
    for order in (jax.grad, jax.hessian):
        got = jax.jit(order(nan_safe(f)))(*args)
        assert_finite(got)
        assert_close(got, jax.jit(order(hand))(*args), rtol=1e-5, atol=1e-6)


def _images(zero_where):
    """Two 1-channel 6x6 images (NHWC), positive but for zeros where `zero_where` holds."""
    x = 0.5 + jnp.arange(72, dtype=jnp.float32).reshape(2, 6, 6, 1) / 50.
    return jnp.where(zero_where, 0., x)


KEEP = jnp.array([True, False])  # the second image is dropped


def test_average_pooling_of_a_dropped_image():
    """`where(keep[n], avg_pool(log(x)), 0)`: the dropped image's pixels are dead."""
    x = _images(jnp.arange(2)[:, None, None, None] == 1)

    def make(clean):
        def f(x):
            pooled = lax.reduce_window(jnp.log(clean(x)), 0., lax.add, (1, 2, 2, 1),
                                       (1, 2, 2, 1), "VALID") / 4.
            return jnp.sum(jnp.where(KEEP[:, None, None, None], pooled, 0.) ** 2)
        return f
    _check(make(lambda v: v),
           make(lambda v: jnp.where(KEEP[:, None, None, None], v, 1.)), x)


def test_average_pooling_then_a_crop():
    """A 3x3 pooling with stride 2 and SAME padding (none before, one after), then a crop of
    the top-left 2x2 outputs: pixels only the cropped-away windows read are dead (row and
    column 5)."""
    live_axis = _covered(np.arange(3) < 2, 6, 3, 2, 0)
    live = jnp.asarray(live_axis[:, None] & live_axis[None, :])[None, :, :, None]
    x = _images(~live & (jnp.arange(6)[:, None] % 2 == 1)[None, :, :, None])

    def make(clean):
        def f(x):
            pooled = lax.reduce_window(jnp.sqrt(clean(x)), 0., lax.add, (1, 3, 3, 1),
                                       (1, 2, 2, 1), "SAME")
            return jnp.sum(pooled[:, :2, :2] ** 2)
        return f
    _check(make(lambda v: v), make(lambda v: jnp.where(live, v, 1.)), x)


@pytest.mark.parametrize("groups,stride,padding", [(1, 1, "SAME"), (2, 1, "SAME"),
                                                   (1, 2, "VALID")])
def test_convolution_of_a_dropped_image(groups, stride, padding):
    """NCHW, a 3x3 kernel with negative weights, feature groups 1 or 2: a per-image `where`
    after the convolution kills the dropped image's pixels. With stride 2, VALID, no window
    reads the last row or column (of the kept image too)."""
    read = jnp.asarray(_covered(np.ones(6 // stride - (stride - 1), bool), 6, 3, stride, 0))
    live = KEEP[:, None, None, None] & read[None, None, :, None] & read[None, None, None, :]
    x = jnp.transpose(_images(False), (0, 3, 1, 2))
    x = jnp.where(live, jnp.concatenate([x, x + 1.], axis=1), 0.)  # two features
    k = jnp.linspace(-1., 1., 2 * 2 // groups * 9).reshape(2, 2 // groups, 3, 3)

    def make(clean):
        def f(x):
            y = lax.conv_general_dilated(jnp.log(clean(x)), k, (stride, stride), padding,
                                         feature_group_count=groups)
            return jnp.sum(jnp.where(KEEP[:, None, None, None], y, 0.) ** 2)
        return f
    _check(make(lambda v: v), make(lambda v: jnp.where(live, v, 1.)), x)


def test_convolution_under_a_pixel_mask():
    """A `where` with a run-time mask over output pixels (an argument): the pixels no live
    output's window reads are dead (a stride-2 3x3 convolution, VALID)."""
    out_live = np.zeros((2, 2, 2), bool)
    out_live[0, 0, 0] = True
    out_live[1, 1, 1] = True
    live = np.zeros((2, 6, 6), bool)
    for n, i, j in zip(*np.nonzero(out_live), strict=True):
        rows = _covered(np.arange(2) == i, 6, 3, 2, 0)
        cols = _covered(np.arange(2) == j, 6, 3, 2, 0)
        live[n] |= rows[:, None] & cols[None, :]
    live = jnp.asarray(live)[..., None]
    x = _images(~live & (jnp.arange(6) % 3 == 0)[None, None, :, None])
    mask = jnp.asarray(out_live)[:, None]
    k = jnp.array([[1., -2., 1.], [0., 1., 0.], [-1., 0., 2.]]).reshape(1, 1, 3, 3)

    def make(clean):
        def f(x, mask):
            y = lax.conv_general_dilated(jnp.sqrt(clean(x)), k, (2, 2), "VALID",
                                         dimension_numbers=("NHWC", "OIHW", "NCHW"))
            return jnp.sum(jnp.where(mask, y, 0.) ** 2)
        return f
    f, hand = make(lambda v: v), make(lambda v: jnp.where(live, v, 1.))
    _check(lambda x: f(x, mask), lambda x: hand(x, mask), x)


def test_pointwise_convolution_under_a_pixel_mask():
    """A 1x1 convolution keeps each pixel where it is: a per-pixel `where` after it kills the
    pixels it drops, in every feature."""
    live = (jnp.arange(6)[:, None] + jnp.arange(6)[None, :]) % 3 != 0
    x = _images(~live[None, :, :, None])
    k = jnp.array([[[[1.5, -0.5]]]])  # HWIO: one feature in, two out

    def make(clean):
        def f(x):
            y = lax.conv_general_dilated(jnp.log(clean(x)), k, (1, 1), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jnp.sum(jnp.where(live[None, :, :, None], y, 0.) ** 2)
        return f
    _check(make(lambda v: v), make(lambda v: jnp.where(live[None, :, :, None], v, 1.)), x)


def test_transposed_convolution_then_a_crop():
    """`conv_transpose` (a convolution of the input dilated by its stride) upsamples 1-D rows;
    a crop of its first outputs leaves the last inputs unread."""
    live = np.zeros(6, bool)
    # outputs 0..3 of a stride-2, size-3 transposed convolution read inputs 0 and 1
    live[:2] = True
    x = jnp.where(jnp.asarray(live), jnp.arange(1., 7.), 0.).reshape(1, 6, 1)
    k = jnp.array([1., -1., 0.5]).reshape(3, 1, 1)

    def make(clean):
        def f(x):
            y = lax.conv_transpose(jnp.sqrt(clean(x)), k, (2,), "SAME",
                                   dimension_numbers=("NWC", "WIO", "NWC"))
            return jnp.sum(y[:, :4] ** 2)
        return f
    keep = jnp.asarray(live).reshape(1, 6, 1)
    _check(make(lambda v: v), make(lambda v: jnp.where(keep, v, 1.)), x)


TRANSFORMS = {
    "rfft": lambda v: jnp.fft.rfft(v, axis=-1),
    # jnp pads the spectrum (a no-op pad) between the two: the drop crosses it at run time
    "rfft-irfft": lambda v: jnp.fft.irfft(jnp.fft.rfft(v, axis=-1), n=4, axis=-1),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_fft_of_dropped_rows(transform):
    """An FFT transforms each row as one: a per-row `where` after it kills the dropped rows."""
    keep = jnp.array([True, False, True])
    x = jnp.where(keep[:, None], jnp.arange(1., 13.).reshape(3, 4), 0.)

    def make(clean):
        def f(x):
            spectrum = TRANSFORMS[transform](jnp.log(clean(x)))
            return jnp.sum(jnp.abs(jnp.where(keep[:, None], spectrum, 0.)) ** 2)
        return f
    _check(make(lambda v: v), make(lambda v: jnp.where(keep[:, None], v, 1.)), x)


def test_a_network_that_drops_nothing_is_unchanged():
    """Convolutions with SAME padding, a stride-2 pooling that tiles its input and an FFT, with
    `log` and `sqrt` before them: nothing is dropped, so the program is the original."""
    def net(x, k):
        y = lax.conv_general_dilated(jnp.log(x), k, (1, 1), "SAME")
        y = lax.reduce_window(jnp.sqrt(y * y), 0., lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        y = lax.conv_general_dilated(jnp.log1p(y), k, (2, 2), "SAME")
        return jnp.sum(jnp.abs(jnp.fft.fft2(y)))
    x = jnp.ones((2, 1, 8, 8))
    k = jnp.ones((1, 1, 3, 3))
    assert structure(jaxsafe.make_jaxpr(net)(x, k)) == structure(jax.make_jaxpr(net)(x, k))
    assert "nothing to guard" in str(jaxsafe.explain(net)(x, k))


@pytest.mark.parametrize("size,window,stride,pad",
                         [(n, k, s, p) for n, k, s, p in itertools.product(
                             (5,), (1, 2, 3), (1, 2, 3), (0, 1))])
def test_a_strided_window_sum_drops_exactly_the_lanes_no_window_reads(size, window, stride,
                                                                      pad):
    """One row of sqrt, pooled: nan_safe's gradient is the hand fix's, whose live lanes are
    the loops' (`_covered`), for every small geometry."""
    windows = (size + 2 * pad - window) // stride + 1
    live = _covered(np.ones(windows, bool), size, window, stride, pad)
    x = jnp.where(jnp.asarray(live), jnp.arange(1., size + 1.), 0.)

    def make(clean):
        def f(x):
            return jnp.sum(lax.reduce_window(jnp.sqrt(clean(x)), 0., lax.add, (window,),
                                             (stride,), [(pad, pad)]) ** 2)
        return f
    f, hand = make(lambda v: v), make(lambda v: jnp.where(jnp.asarray(live), v, 1.))
    got = jax.jit(jax.grad(nan_safe(f)))(x)
    assert_finite(got)
    assert_close(got, jax.jit(jax.grad(hand))(x))
    if live.all():  # nothing to drop: nothing changed
        assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))


def test_a_drop_that_stops_at_a_primitive_without_a_rule_is_reported():
    """The generic `reduce_window` (a product of windows) has no liveness rule: a crop after it
    does not reach the `sqrt` before it (conservative), and `explain` says so; without the crop
    nothing is reported."""
    def make(crop):
        def f(x):
            y = lax.reduce_window(jnp.sqrt(x), 1., lax.mul, (2,), (1,), "VALID")
            return jnp.sum(y[:2] if crop else y)
        return f
    x = jnp.array([1., 2., 3., 0., 0.])
    _, report = nan_safe(make(True)).trace(x)
    assert [e.primitive.name for e in report.conservative] == ["reduce_window"]
    assert "liveness not followed through reduce_window (no rule)" in str(report)
    _, report = nan_safe(make(False)).trace(x)
    assert report.conservative == [] and "nothing to guard" in str(report)


def _max_pool(h):
    return lax.reduce_window(h, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID")


def test_a_pooled_window_that_only_dropped_lanes_make_holds_its_value_for_a_product():
    """A max pooling re-decided on the original values, whose first row of windows is dropped
    by a `where` after a matmul: the weight's gradient reads the pooled values (`h.T @ ct`),
    where plain JAX's is finite. The pooling's dropped lanes used to take -inf, so a window of
    dropped lanes gave -inf, and `0 * -inf` made the weight's gradient NaN."""
    def make(clean):
        def f(w, x, m):
            h = _max_pool(jnp.sqrt(clean(jnp.maximum(x, 0.))))
            return jnp.sum(jnp.where(m, h @ w, 0.))
        return f
    x = jnp.array([[0., 0., 0., 0.], [1., 2., 3., 4.]])
    w = jnp.ones((2, 3))
    m = jnp.array([[False, False, False], [True, False, True]])
    f = make(lambda v: v)
    hand = make(lambda v: jnp.where(m[:, :1], v, 1.))
    plain = jax.jit(jax.grad(f))(w, x, m)
    assert_finite(plain)
    assert_close(jax.jit(jax.grad(nan_safe(f)))(w, x, m), plain)
    got = jax.jit(jax.grad(nan_safe(f), argnums=1))(w, x, m)
    assert_finite(got)
    assert_close(got, jax.jit(jax.grad(hand, argnums=1))(w, x, m))
    assert_bitwise(nan_safe(f)(w, x, m), jax.jit(f)(w, x, m))


def test_a_pooled_nan_that_a_convolution_reads_only_in_dropped_pixels():
    """`conv(max_pool(sqrt(x)), k)` under a pixel mask: a window of negative pixels that no
    live output reads pools to NaN, and the kernel's gradient reads the pooled map
    (`0 * NaN`). The pooling holds its original values there (it is re-decided on them), so
    the convolution's operand takes 0 in its dropped lanes, with the mask the `sqrt`'s cut
    computes anyway; the kernel's gradient and Hessian are the hand fix's."""
    def pool(v):
        return lax.reduce_window(v, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

    out_live = jnp.array([[True, False], [False, False]])
    live = np.zeros((1, 1, 8, 8), bool)
    live[..., :6, :6] = True  # the pixels the live output's 3x3 window of pooled pixels reads

    def make(clean):
        def f(k, x):
            y = lax.conv_general_dilated(pool(jnp.sqrt(clean(x))), k, (1, 1), "VALID")
            return jnp.sum(jnp.where(out_live, y, 0.) ** 2)
        return f
    x = (jnp.arange(1., 65.) / 8.).reshape(1, 1, 8, 8).at[..., 6:, 6:].set(-1.)
    k = jnp.linspace(-1., 1., 9).reshape(1, 1, 3, 3)
    f, hand = make(lambda v: v), make(lambda v: jnp.where(live, v, 1.))
    assert np.isnan(np.asarray(jax.grad(f)(k, x))).any()
    assert_bitwise(nan_safe(f)(k, x), jax.jit(f)(k, x))
    for order in (jax.grad, jax.hessian):
        for argnums in (0, 1):
            got = jax.jit(order(nan_safe(f), argnums=argnums))(k, x)
            assert_finite(got)
            assert_close(got, jax.jit(order(hand, argnums=argnums))(k, x), rtol=1e-5, atol=1e-6)


def test_two_layers_where_the_second_convolution_drops_every_pixel():
    """sqrt(max(conv, 0)) and a max pooling, twice; the second layer's clamp drops every
    pixel, so the first pooling's windows are all dropped. Plain JAX: NaN for both kernels (the
    first layer's clamp ties at 0 on zero input, sqrt meets 0); nan_safe: both exactly 0."""
    def conv(x, w):
        return lax.conv_general_dilated(x, w, (1,), "VALID",
                                        dimension_numbers=("NWC", "WIO", "NWC"))

    def pool(h):
        return lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 1), (1, 2, 1), "VALID")

    def f(w1, w2, x):
        h = pool(jnp.sqrt(jnp.maximum(conv(x, w1), 0.)))
        return jnp.sum(pool(jnp.sqrt(jnp.maximum(conv(h, w2), 0.))))
    x = jnp.array([0., 0., 0., 0., 1., 2., 3., 4., 5., 6.]).reshape(1, 10, 1)
    w1, w2 = jnp.ones((2, 1, 1)), -jnp.ones((2, 1, 1))
    assert all(np.isnan(np.asarray(g)).all() for g in jax.grad(f, argnums=(0, 1))(w1, w2, x))
    assert_bitwise(nan_safe(f)(w1, w2, x), jax.jit(f)(w1, w2, x))
    # reverse and forward mode (a dropped window picks a lane whose tangent is 0 * inf), and
    # the Hessian: the loss is locally constant, so each is exactly 0
    for order in (jax.grad, jax.jacfwd, jax.hessian):
        got = jax.jit(order(nan_safe(f), argnums=(0, 1)))(w1, w2, x)
        for g in jax.tree.leaves(got):
            np.testing.assert_array_equal(np.asarray(g), 0.)


@pytest.mark.parametrize("case", ["depthwise-channel", "grouped-pixel"])
def test_a_grouped_convolution_keeps_only_the_groups_it_reads(case):
    """Feature groups: an output feature reads its group's operand features only. A depthwise
    convolution under a per-channel `where`, and two groups of two features under a mask of one
    output feature at one pixel: the other group's features (and the pixels no live window
    reads) are dead."""
    n, width = 4, 6
    x = 1. + jnp.arange(n * width, dtype=jnp.float32).reshape(1, n, width) / 7.
    if case == "depthwise-channel":
        groups, out_mask = n, jnp.array([True, False, True, False])[None, :, None]
        live = jnp.broadcast_to(out_mask, x.shape)
    else:
        groups = 2
        out_mask = jnp.zeros((1, n, width - 2), bool).at[0, 1, 0].set(True)
        live = jnp.zeros(x.shape, bool).at[0, :2, :3].set(True)  # group 0, window of pixel 0
    x = jnp.where(live, x, 0.)
    k = jnp.linspace(-1., 1., n * (n // groups) * 3).reshape(n, n // groups, 3)

    def make(clean):
        def f(x):
            y = lax.conv_general_dilated(jnp.sqrt(clean(x)), k, (1,), "VALID",
                                         feature_group_count=groups)
            return jnp.sum(jnp.where(out_mask, y, 0.) ** 2)
        return f
    _check(make(lambda v: v), make(lambda v: jnp.where(live, v, 1.)), x)


def test_batch_groups_keep_only_the_batch_each_output_feature_reads():
    """`batch_group_count=2`: output feature 0 reads batch 0 only, feature 1 batch 1. With
    feature 1 dropped, batch 1's `sqrt(0)` and `sqrt(-1)` are dead (found by a bug hunt: the
    output features were taken to read every batch)."""
    w = jnp.linspace(0.5, 1.5, 2 * 1 * 2).reshape(2, 1, 2)
    x = jnp.array([[[1., 4., 9.]], [[-1., 0., 1.]]])

    def make(clean):
        def f(x):
            y = lax.conv_general_dilated(jnp.sqrt(clean(x)), w, (1,), "VALID",
                                         batch_group_count=2)
            return jnp.sum(y[:, 0] ** 2)
        return f
    keep = jnp.array([True, False])[:, None, None]
    _check(make(lambda v: v), make(lambda v: jnp.where(keep, v, 1.)), x)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_dropped_output_feature_drops_its_kernel_slice(groups):
    """Output feature o is computed with kernel[o] alone: with feature 1 (of 2 per group)
    dropped, its kernel slice's `sqrt` of a negative weight is dead, as for `x @ sqrt(w)`."""
    x = 1. + jnp.arange(1 * 2 * 5, dtype=jnp.float32).reshape(1, 2, 5) / 7.
    w = jnp.linspace(0.25, 2., 4 * (2 // groups) * 2).reshape(4, 2 // groups, 2)
    w = w.at[1].set(jnp.array([0., -1.])[None, :]).at[3, 0, 0].set(0.)
    out_mask = jnp.array([True, False, True, False])[None, :, None]

    def make(clean):
        def f(w):
            y = lax.conv_general_dilated(x, jnp.sqrt(clean(w)), (1,), "VALID",
                                         feature_group_count=groups)
            return jnp.sum(jnp.where(out_mask, y, 0.) ** 2)
        return f
    keep = out_mask[0, :, :, None]  # kernel's output features
    _check(make(lambda v: v), make(lambda v: jnp.where(keep, v, 1.)), w)
