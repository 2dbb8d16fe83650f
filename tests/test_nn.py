"""jaxsafe.nn: a row with no valid entry is 0 (or -inf), zero derivatives; others are jax.nn's.

Oracles: jax.nn on the valid rows (bit for bit), a float64 NumPy attention computed row by row,
finite differences (`check_grads`), and `jax.debug_nans` for the absence of NaN anywhere inside.
Derivative checks run under `jax.jit`: one compilation each instead of one per operation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, assert_finite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import jaxsafe
import jaxsafe.nn as jsnn

# jaxsafe.nn's numerics, many small compiled programs: run without jax.checking_leaks,
# which turns JAX's caches off and doubles the time (the modules of the rewrite itself check
# for leaks on every test).
pytestmark = pytest.mark.no_leak_check

RNG = np.random.default_rng(0)


def normal(*shape, dtype=np.float32):
    return jnp.asarray(RNG.normal(size=shape).astype(dtype))


def all_zero(tree) -> bool:
    return all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(tree))


# -- softmax, log_softmax, logsumexp ---------------------------------------------------------

# Row [1, 2] is all -inf, row [3, 1] is all masked by W, row [2, 3] is half -inf.
X = normal(4, 6, 7).at[1, 2].set(-jnp.inf).at[2, 3, :3].set(-jnp.inf)
W = jnp.asarray(RNG.random((4, 6, 7)) > 0.3).at[3, 1].set(False).at[1, 2].set(True)
EMPTY_INF = np.zeros((4, 6), bool)
EMPTY_INF[1, 2] = True
EMPTY_WHERE = EMPTY_INF.copy()
EMPTY_WHERE[3, 1] = True
CT = normal(4, 6, 7)


def _lse(module):
    def lse(x, axis=-1, where=None):
        return module.logsumexp(x, axis, keepdims=True, where=where)
    return lse


FNS = {  # name: (ours, jax's, the value of a row with no valid entry)
    "softmax": (jsnn.softmax, jax.nn.softmax, 0.),
    "log_softmax": (jsnn.log_softmax, jax.nn.log_softmax, -jnp.inf),
    "logsumexp": (_lse(jsnn), _lse(jax.nn), -jnp.inf),
}


def finite_loss(f, ct):
    """sum(ct * f(x)) over the finite outputs (log_softmax is -inf on masked entries)."""
    def loss(x):
        y = f(x)
        ok = jnp.isfinite(y)
        return jnp.sum(jnp.where(ok, jnp.where(ok, y, 0.) * ct, 0.))
    return loss


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(FNS))
def test_rows_with_a_valid_entry_equal_jax_nn_bit_for_bit(name, jit):
    ours, theirs, _ = FNS[name]
    if jit:
        ours, theirs = jax.jit(ours), jax.jit(theirs)
    # without where: jax.nn is NaN on the all -inf row only
    assert_bitwise(ours(X)[~EMPTY_INF], theirs(X)[~EMPTY_INF])
    # with where and no all -inf row: jax.nn is right everywhere, and so are we
    x = X.at[1, 2].set(1.)
    assert_bitwise(ours(x, where=W), theirs(x, where=W))


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("axis", [pytest.param(1, marks=pytest.mark.slow), (0, 2),
                                  pytest.param(None, marks=pytest.mark.slow)])  # time budget
def test_other_axes_equal_jax_nn(name, axis):
    ours, theirs, _ = FNS[name]
    x = X.at[1, 2].set(1.)
    assert_bitwise(ours(x, axis=axis, where=W), theirs(x, axis=axis, where=W))
    assert_bitwise(ours(x, axis=axis), theirs(x, axis=axis))


@pytest.mark.parametrize("name", list(FNS))
def test_gradients_of_valid_rows_equal_jax_nn_on_those_rows_alone(name):
    ours, theirs, _ = FNS[name]
    keep = ~EMPTY_WHERE
    ct = CT if name != "logsumexp" else CT[..., :1]
    g_ours = np.asarray(jax.jit(jax.grad(finite_loss(lambda x: ours(x, where=W)[keep],
                                                     ct[keep])))(X))
    g_theirs = jax.jit(jax.grad(finite_loss(lambda x: theirs(x, where=W[keep]), ct[keep])))(
        X[keep])
    assert_bitwise(g_ours[keep], g_theirs)
    assert all_zero(g_ours[~keep])


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("masked_by", ["where", "inf"])
def test_empty_rows_give_the_neutral_value_and_zero_derivatives(name, masked_by):
    ours, _, neutral = FNS[name]
    where = W if masked_by == "where" else None
    empty = EMPTY_WHERE if masked_by == "where" else EMPTY_INF
    f = lambda x: ours(x, where=where)
    ct = jnp.where(empty[..., None], CT, 0.)  # the cotangent of the empty rows only
    loss = finite_loss(f, ct if name != "logsumexp" else ct[..., :1])
    full = finite_loss(f, CT if name != "logsumexp" else CT[..., :1])
    t = normal(*X.shape)  # nonzero on -inf entries too

    @jax.jit
    def derivatives(x):
        return {
            "tangent_out": jax.jvp(f, (x,), (t,))[1][empty],  # the output itself, not a loss
            "grad": jax.grad(loss)(x),
            "jvp": jax.jvp(loss, (x,), (t,))[1],
            "hvp_fwd": jax.jvp(jax.grad(loss), (x,), (t,))[1],  # forward over reverse
            "hvp_rev": jax.grad(lambda x: jnp.vdot(jax.grad(loss)(x), t))(x),  # rev over rev
        }

    assert np.all(np.asarray(f(X))[empty] == neutral)
    assert all_zero(derivatives(X))
    # with every row in the loss, all derivatives stay finite; the Hessian of rows 1 to 3
    assert_finite(jax.jit(jax.grad(full))(X))
    assert_finite(jax.jit(jax.hessian(lambda r: full(X.at[1:].set(r))))(X[1:]))


TRANSFORMS = {
    "jit": lambda f: f,
    "vmap": lambda f: jax.vmap(f),
    "grad": lambda f: jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))),
    "jacfwd": lambda f: jax.vmap(jax.jacfwd(f)),
    "jacrev": lambda f: jax.vmap(jax.jacrev(f)),
    "hessian": lambda f: jax.vmap(jax.hessian(lambda x: jnp.sum(jnp.sin(f(x))))),
    "grad_grad_grad": lambda f: jax.vmap(lambda x: jax.grad(jax.grad(jax.grad(  # in x[-1]
        lambda s: jnp.sum(jnp.sin(f(x.at[-1].set(s)))))))(x[-1])),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_softmax_under_every_transformation_is_finite_and_zero_on_empty_rows(transform):
    x = jnp.array([[1., 2., 3.], [-jnp.inf] * 3, [0.5, -jnp.inf, -1.]])
    t = TRANSFORMS[transform]
    out = jax.jit(t(jsnn.softmax))(x)
    assert_finite(out)
    assert all_zero(out[1])
    want = jax.jit(t(jax.nn.softmax))(x[jnp.array([0, 2])])  # jax.nn on the valid rows
    assert_close(np.asarray(out)[[0, 2]], want, rtol=1e-6, atol=1e-7)


def test_nan_and_inf_in_a_valid_entry_are_not_hidden():
    x = jnp.array([[1., jnp.nan, 3.], [1., jnp.inf, 2.], [-jnp.inf, -jnp.inf, -jnp.inf]])
    for name, (ours, theirs, neutral) in FNS.items():
        y, want = ours(x), theirs(x)
        assert_bitwise(y[:2], want[:2])
        assert np.all(np.isnan(np.asarray(y)[0])), name
        assert np.all(np.asarray(y)[2] == neutral), name
    g = jax.grad(lambda x: jnp.sum(jsnn.softmax(x)[0]))(x)
    assert np.all(np.isnan(np.asarray(g)[0]))


def test_masked_out_nan_is_ignored():
    x = jnp.array([[1., jnp.nan, 3.], [jnp.nan] * 3])
    w = jnp.array([[True, False, True], [False] * 3])
    for name, (ours, theirs, neutral) in FNS.items():
        y = ours(x, where=w)
        assert_bitwise(y[0], theirs(x[:1], where=w[:1])[0])
        assert np.all(np.asarray(y)[1] == neutral), name
        assert_finite(jax.jit(jax.grad(finite_loss(functools.partial(ours, where=w), 1.)))(x))


def test_softmax_custom_jvp_flag_is_mirrored():
    x, keep = X.at[1, 2].set(1.), ~EMPTY_WHERE
    before = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", True)
    try:
        assert_bitwise(jsnn.softmax(x, where=W), jax.nn.softmax(x, where=W))
        # (jit caches do not key on this flag: fresh functions, traced under it)
        g = np.asarray(jax.jit(jax.grad(finite_loss(lambda x: jsnn.softmax(x, where=W)[keep],
                                                    CT[keep])))(x))
        # same shapes on both sides: XLA may round a [22, 7] program unlike a [4, 6, 7] one
        want = jax.jit(jax.grad(finite_loss(lambda x: jax.nn.softmax(x, where=W)[keep],
                                            CT[keep])))(x)
        assert_bitwise(g[keep], np.asarray(want)[keep])
        assert all_zero(g[~keep])
        loss = finite_loss(jsnn.softmax, jnp.where(EMPTY_INF[..., None], CT, 0.))
        assert all_zero(jax.jit(jax.grad(loss))(X))
        sin_sum = lambda r: jnp.sum(jnp.sin(jsnn.softmax(r)))
        assert_finite(jax.jit(jax.hessian(sin_sum))(X[1, 2]))
    finally:
        jax.config.update("jax_softmax_custom_jvp", before)


def test_logsumexp_b_and_return_sign():
    b = normal(4, 6, 7).at[0, 0].set(0.)  # row [0, 0]: every weight is 0, no valid entry
    keep = ~EMPTY_INF
    keep[0, 0] = False
    def both(module):
        return jax.jit(lambda a, b: (*module.logsumexp(a, -1, b=b, return_sign=True),
                                     module.logsumexp(a, -1, b=b)))(X, b)
    out, sign, plain = (np.asarray(r) for r in both(jsnn))
    assert_bitwise([r[keep] for r in (out, sign, plain)],
                   [np.asarray(r)[keep] for r in both(jax.nn)])
    assert out[0, 0] == -jnp.inf and sign[0, 0] == 0 and out[1, 2] == -jnp.inf
    ct = jnp.zeros((4, 6)).at[0, 0].set(1.).at[1, 2].set(1.)  # the empty rows only
    grads = jax.jit(jax.grad(
        lambda a, b: jnp.sum(ct * jnp.where(ct > 0, jsnn.logsumexp(a, -1, b=b), 0.)), (0, 1)))(X, b)
    assert all_zero(grads)


def test_logsumexp_of_empty_rows_has_zero_gradient_with_b():
    a = jnp.array([[1., 2.], [3., 4.], [-jnp.inf, 0.]])
    b = jnp.array([[1., 2.], [0., 0.], [1., 0.]])  # rows 1 and 2 have no valid entry
    f = jax.jit(lambda a, b: jsnn.logsumexp(a, axis=-1, b=b))
    assert np.array_equal(np.asarray(f(a, b))[1:], [-np.inf, -np.inf])
    ga, gb = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.where(jnp.isfinite(f(a, b)), f(a, b), 0.)),
                              (0, 1)))(a, b)
    assert all_zero((ga[1:], gb[1:]))
    assert_bitwise(f(a, b)[0], jax.nn.logsumexp(a[:1], axis=-1, b=b[:1])[0])


def test_no_nan_anywhere_inside_under_debug_nans():
    with jax.debug_nans(True):
        for ours, _, _ in FNS.values():
            for where in (None, W):
                f = functools.partial(ours, where=where)
                jax.block_until_ready(jax.jit(jax.grad(finite_loss(f, 1.)))(X))


def test_python_scalars_and_sequences_are_taken_as_jax_nn_takes_them():
    """Hunt BC 1: softmax read `x.dtype` before converting `x` (AttributeError on a float), and
    a list or tuple was stacked into an array where jax.nn refuses it. (Under jit, one
    compilation each: the function itself still gets the Python scalar.)"""
    def both(name, x, **kwargs):
        return [jax.jit(functools.partial(getattr(module, name), x, **kwargs))()
                for module in (jsnn, jax.nn)]

    for name in ("log_softmax", "logsumexp"):
        assert_bitwise(*both(name, 2.0, axis=None))
    before = jax.config.jax_softmax_custom_jvp
    try:
        for custom_jvp in (True, False):  # softmax converts before either path
            jax.config.update("jax_softmax_custom_jvp", custom_jvp)
            for x in (2.0, np.float32(-1.5)):
                assert_bitwise(*both("softmax", x, axis=None))
            for f in (jsnn.softmax, jax.nn.softmax):  # the default axis -1 of a scalar
                with pytest.raises(ValueError, match="axis -1 is out of bounds"):
                    f(3.0)
    finally:
        jax.config.update("jax_softmax_custom_jvp", before)
    with pytest.raises(ValueError, match="axis -1 is out of bounds"):
        jsnn.log_softmax(3.0)
    for name in ("softmax", "log_softmax", "logsumexp"):
        for x in ([1., 2.], (1., 2.)):
            with pytest.raises(TypeError):
                getattr(jax.nn, name)(x)
            with pytest.raises(TypeError, match=rf"{name}: `[xa]` must be an array or a scalar, "
                                                rf".*jnp.asarray"):
                getattr(jsnn, name)(x)


@jax.jit
def _softmax_and_grad(x, w):
    loss = lambda x: jnp.sum(jnp.sin(jsnn.softmax(x, where=w)))
    return jsnn.softmax(x, where=w), jax.grad(loss)(x)


_jax_softmax = jax.jit(lambda x, w: jax.nn.softmax(x, where=w))


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), p_mask=st.floats(0., 1.), p_inf=st.floats(0., 1.))
def test_random_masks_and_infs(seed, p_mask, p_inf):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(5, 4)).astype(np.float32)
    x[rng.random(x.shape) < p_inf] = -np.inf
    w = rng.random(x.shape) >= p_mask
    valid = w & np.isfinite(x)
    rows = valid.any(-1)
    y, g = (np.asarray(a) for a in _softmax_and_grad(x, w))
    want = np.asarray(_jax_softmax(x, w))
    assert all_zero(y[~rows])
    assert_bitwise(y[rows], want[rows])
    assert_finite(g)
    assert all_zero(g[~valid])


# -- dot-product attention -------------------------------------------------------------------

def reference_attention(q, k, v, bias=None, mask=None, scale=None, is_causal=False,
                        query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None):
    """Float64 NumPy, one query row at a time: softmax over the attendable keys, else 0.

    Returns the output and a [B, T, N] boolean array of the rows with an attendable key.
    """
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(H) if scale is None else scale
    bias = np.zeros((1, 1, 1, 1)) if bias is None else np.asarray(bias, np.float64)
    mask = np.ones((1, 1, 1, 1), bool) if mask is None else np.asarray(mask)
    bias, mask = np.broadcast_to(bias, (B, N, T, S)), np.broadcast_to(mask, (B, N, T, S))
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    q_len = None if query_seq_lengths is None else np.asarray(query_seq_lengths)
    kv_len = None if key_value_seq_lengths is None else np.asarray(key_value_seq_lengths)
    out, rows = np.zeros((B, T, N, H)), np.zeros((B, T, N), bool)
    keys = np.arange(S)
    for b in range(B):
        for t in range(T):
            for n in range(N):
                kh = n // (N // K)
                logits = k[b, :, kh] @ q[b, t, n] * scale + bias[b, n, t]
                ok = mask[b, n, t] & (logits > -np.inf)
                if is_causal:
                    ok &= keys <= t
                if local_window_size is not None:
                    left, right = local_window_size
                    ok &= (t <= keys + left) & (t >= keys - right)
                if q_len is not None and t >= q_len[b]:
                    ok[:] = False
                if kv_len is not None:
                    ok &= keys < kv_len[b]
                if not ok.any():
                    continue
                p = np.exp(logits[ok] - logits[ok].max())
                out[b, t, n] = (p / p.sum()) @ v[b, ok, kh]
                rows[b, t, n] = True
    return out, rows


B, T, S, N, K, H = 2, 5, 6, 4, 2, 8
Q, KEY, VAL = normal(B, T, N, H), normal(B, S, K, H), normal(B, S, K, H)
MASK = jnp.asarray(RNG.random((B, N, T, S)) > 0.3).at[0, 1, 2].set(False).at[1, :, 4].set(False)
BIAS = normal(B, 1, T, S)
BIAS_INF = BIAS.at[0, 0, 3].set(-jnp.inf).at[1, 0, 1, :4].set(-jnp.inf)  # [0, 3]: no key
LENS = {"query_seq_lengths": jnp.array([3, 0], jnp.int32),
            "key_value_seq_lengths": jnp.array([0, 4], jnp.int32)}

CONFIGS = {
    "plain": {},
    "mask": {"mask": MASK},
    "mask_broadcast": {"mask": MASK[:, :1, :, :]},
    "bias": {"bias": BIAS, "mask": MASK},
    "bias_minus_inf": {"bias": BIAS_INF},
    "bias_per_head": {"bias": normal(B, N, T, S).at[1, 2, 0].set(-jnp.inf)},
    "causal": {"is_causal": True},
    "causal_kv_len_0": {"is_causal": True, "key_value_seq_lengths": LENS["key_value_seq_lengths"]},
    "q_len_0": {"query_seq_lengths": LENS["query_seq_lengths"]},
    "both_lens": dict(LENS),
    "window": {"local_window_size": (1, 0), "mask": MASK},
    "window_int_scale": {"local_window_size": 1, "scale": 0.3, "is_causal": True},
}
WITH_EMPTY_ROWS = ["mask", "bias_minus_inf", "causal_kv_len_0", "both_lens", "window"]

JAX_XLA = functools.partial(jax.nn.dot_product_attention, implementation="xla")


def jitted(attention, config):
    """`attention(q, k, v, **config)` under jit, the arrays of `config` passed as arguments
    (not captured as constants, which XLA would fold at length)."""
    arrays = {k: v for k, v in config.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in config.items() if k not in arrays}
    run = jax.jit(lambda q, k, v, arrays: attention(q, k, v, **arrays, **static))
    return lambda q, k, v: run(q, k, v, arrays)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_attention_against_numpy_and_jax_nn(name):
    config = CONFIGS[name]
    out = np.asarray(jitted(jsnn.dot_product_attention, config)(Q, KEY, VAL))
    want, rows = reference_attention(Q, KEY, VAL, **config)
    assert_close(out, want.astype(np.float32), rtol=2e-5, atol=2e-6)
    assert all_zero(out[~rows])
    assert_bitwise(out[rows], np.asarray(jitted(JAX_XLA, config)(Q, KEY, VAL))[rows])
    assert (name not in WITH_EMPTY_ROWS) or not rows.all()  # the case is exercised


def test_attention_eager_equals_jax_nn_eager():
    config = {"mask": MASK, "bias": BIAS, "is_causal": True}
    out = np.asarray(jsnn.dot_product_attention(Q, KEY, VAL, **config))
    _, rows = reference_attention(Q, KEY, VAL, **config)
    assert_bitwise(out[rows], np.asarray(jax.nn.dot_product_attention(Q, KEY, VAL, **config))[rows])


@pytest.mark.parametrize("name", [n for n in CONFIGS if "bias" not in n])
def test_attention_gradients_of_valid_rows_equal_jax_nn(name):
    # (a bias of -inf makes jax.nn NaN on the row, hence on the gradients: no oracle there)
    config = CONFIGS[name]
    _, rows = reference_attention(Q, KEY, VAL, **config)
    ct = normal(B, T, N, H) * rows[..., None]  # zero on the rows with no key

    def grads(attention):
        f = lambda q, k, v, **kw: jnp.sum(attention(q, k, v, **kw) * ct)
        return jitted(jax.grad(f, (0, 1, 2)), config)(Q, KEY, VAL)
    assert_bitwise(grads(jsnn.dot_product_attention), grads(JAX_XLA))


def only(f, args, argnums):
    """`f` as a function of `args[i] for i in argnums`, the other arguments fixed."""
    def g(*a):
        full = list(args)
        for i, x in zip(argnums, a, strict=True):
            full[i] = x
        return f(*full)
    return g


@pytest.mark.parametrize("name", [n if n in ("mask", "bias_minus_inf", "causal_kv_len_0")
                                  else pytest.param(n, marks=pytest.mark.slow)  # time budget
                                  for n in WITH_EMPTY_ROWS + ["bias"]])
def test_attention_rows_with_no_key_give_zero_derivatives_of_every_order(name):
    config = dict(CONFIGS[name])
    bias = config.pop("bias", None)
    arrays = {k: v for k, v in config.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in config.items() if k not in arrays}
    _, rows = reference_attention(Q, KEY, VAL, bias=bias, **config)
    assert not rows.all()
    args = (Q, KEY, VAL) + ((bias,) if bias is not None else ())
    tangents = tuple(normal(*a.shape) for a in args)
    ct_empty = normal(B, T, N, H) * ~rows[..., None]  # the cotangent of the rows with no key
    ct_all = normal(B, T, N, H)

    @jax.jit
    def derivatives(args, tangents, arrays):
        def loss(ct):
            return lambda *a: jnp.sum(jnp.sin(
                jsnn.dot_product_attention(*a, **arrays, **static)) * ct)
        argnums = range(len(args))
        empty, full = loss(ct_empty), loss(ct_all)
        return {
            "zero": {"grad": jax.grad(empty, argnums)(*args),
                      "jvp": jax.jvp(empty, args, tangents)[1],
                      "hvp": jax.jvp(jax.grad(empty, argnums), args, tangents)[1]},
            "finite": {"grad": jax.grad(full, argnums)(*args),
                        "hvp": jax.jvp(jax.grad(full, argnums), args, tangents)[1]}}

    d = derivatives(args, tangents, arrays)
    assert all_zero(d["zero"])
    assert_finite(d["finite"])


@pytest.mark.parametrize("name", ["bias_minus_inf",  # the other two in `make fuzz` (time)
                                  pytest.param("both_lens", marks=pytest.mark.slow),
                                  pytest.param("window_int_scale", marks=pytest.mark.slow)])
def test_attention_gradients_against_finite_differences(name):
    config = dict(CONFIGS[name])
    bias = config.pop("bias", None)
    q, k, v = Q[:1, :4, :2, :4], KEY[:1, :, :1, :4], VAL[:1, :, :1, :4]
    if "mask" in config:
        config["mask"] = config["mask"][:1, :2, :4]
    for lens in ("query_seq_lengths", "key_value_seq_lengths"):
        if lens in config:
            config[lens] = config[lens][1:]
    if bias is not None:
        bias = bias[:1, :, :4]
        finite = jnp.isfinite(bias)
        # the finite entries of the bias are a variable too; a step from -inf is no direction
        f = jax.jit(lambda q, k, v, b: jnp.sin(jsnn.dot_product_attention(
            q, k, v, jnp.where(finite, b, -jnp.inf), **config)))
        args = (q, k, v, jnp.where(finite, bias, 0.))
    else:
        f = jax.jit(lambda q, k, v: jnp.sin(jsnn.dot_product_attention(q, k, v, **config)))
        args = (q, k, v)
    check_grads(f, args, order=2, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-2)
    check_grads(f, args, order=1, modes=("fwd",), atol=1e-2, rtol=1e-2, eps=1e-2)


@pytest.mark.parametrize("heads", [pytest.param((4, 4), marks=pytest.mark.slow), (4, 2), (4, 1)],
                         ids=["mha", "gqa", "mqa"])  # mha is the plain case, tested above
def test_grouped_query_heads_and_unbatched_inputs(heads):
    n, kh = heads
    q, k, v = normal(B, T, n, H), normal(B, S, kh, H), normal(B, S, kh, H)
    config = {"mask": MASK, "bias": BIAS_INF}
    out = np.asarray(jitted(jsnn.dot_product_attention, config)(q, k, v))
    want, rows = reference_attention(q, k, v, **config)
    assert_close(out, want.astype(np.float32), rtol=2e-5, atol=2e-6)
    assert_bitwise(out[rows], np.asarray(jitted(JAX_XLA, config)(q, k, v))[rows])
    one = {"mask": MASK[:1], "bias": BIAS_INF[:1]}
    unbatched = jitted(jsnn.dot_product_attention, one)(q[0], k[0], v[0])
    assert unbatched.shape == (T, n, H)
    assert_bitwise(unbatched, jitted(jsnn.dot_product_attention, one)(q[:1], k[:1], v[:1])[0])


def test_attention_under_vmap_and_jacfwd():
    config = {"mask": MASK[:1], "bias": BIAS_INF[:1]}
    f = lambda q, k, v: jsnn.dot_product_attention(q, k, v, **config)
    qs, ks, vs = normal(3, 1, T, N, H), normal(3, 1, S, K, H), normal(3, 1, S, K, H)
    batched = jax.jit(jax.vmap(f))(qs, ks, vs)
    single = jax.jit(f)
    for i in range(3):
        assert_close(batched[i], single(qs[i], ks[i], vs[i]), rtol=1e-6, atol=1e-7)
    small = lambda q: f(q, ks[0], vs[0])
    jf, jr = jax.jit(jax.jacfwd(small))(qs[0]), jax.jit(jax.jacrev(small))(qs[0])
    assert_finite(jf)
    assert_close(jf, jr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_accumulates_in_float32(dtype):
    q, k, v = (x.astype(dtype) for x in (Q, KEY, VAL))
    config = {"mask": MASK, "is_causal": True}
    if dtype == jnp.float16:  # F16_F16_F32 does not compile on CPU: eager, as jax.nn needs
        ours = functools.partial(jsnn.dot_product_attention, **config)
        theirs = functools.partial(jax.nn.dot_product_attention, **config)
    else:
        ours, theirs = jitted(jsnn.dot_product_attention, config), jitted(JAX_XLA, config)
    out = np.asarray(ours(q, k, v))
    assert out.dtype == dtype
    want, rows = reference_attention(q, k, v, **config)
    tol = 1e-2 if dtype == jnp.float16 else 4e-2
    assert_close(out, want, rtol=tol, atol=tol)
    assert all_zero(out[~rows])
    assert_bitwise(out[rows], np.asarray(theirs(q, k, v))[rows])
    if dtype == jnp.bfloat16:
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ours(q, k, v).astype(jnp.float32)),
                                 (0, 1, 2)))(q, k, v)
        assert_finite(grads)


@pytest.mark.parametrize("name", ["mask", "bias_minus_inf", "both_lens"])
def test_attention_takes_jax_nn_s_implementation_and_return_residual(name):
    """Hunt BC 2: `implementation=` and `return_residual=`, jax.nn's keywords, were refused.
    The residual is jax.nn's on the rows with a key, -inf on the others; no gradient."""
    config = CONFIGS[name]
    _, rows = reference_attention(Q, KEY, VAL, **config)
    assert not rows.all()

    def ours(q, k, v, **config):
        out, residual = jsnn.dot_product_attention(q, k, v, return_residual=True, **config)
        no_residual_grad = jax.grad(lambda q: jnp.sum(jnp.where(rows, jsnn.dot_product_attention(
            q, k, v, return_residual=True, **config)[1], 0.)))(q)
        return (jsnn.dot_product_attention(q, k, v, **config),
                [jsnn.dot_product_attention(q, k, v, implementation=i, **config)
                 for i in (None, "xla")], out, residual, no_residual_grad)

    plain, implementations, out, residual, grad = jitted(ours, config)(Q, KEY, VAL)
    _, want = jitted(functools.partial(JAX_XLA, return_residual=True), config)(Q, KEY, VAL)
    assert_bitwise(implementations, [plain, plain])
    assert_bitwise(out, plain)
    residual = np.asarray(residual)
    assert residual.shape == (B, T, N) == want.shape
    assert_bitwise(residual[rows], np.asarray(want)[rows])
    assert np.all(residual[~rows] == -np.inf)
    assert all_zero(grad)  # as jax.nn's, the residual has no gradient


def test_attention_residual_unbatched_and_on_flax_s_path():
    """The residual of unbatched inputs is `[q_len, heads]`, as jax.nn's; Flax's path
    (`precision=`, as many key/value heads as query heads) gives the same residual."""
    k, v = normal(1, S, N, H), normal(1, S, N, H)
    q, mask = Q[:1], MASK[:1]
    _, rows = reference_attention(q, k, v, mask=mask)
    assert not rows.all()

    @jax.jit
    def both(q, k, v, mask):
        attend = functools.partial(jsnn.dot_product_attention, return_residual=True)
        return (attend(q[0], k[0], v[0], mask=mask[0]), attend(q, k, v, mask=mask),
                attend(q, k, v, mask=mask, precision=jax.lax.Precision.DEFAULT),
                JAX_XLA(q[0], k[0], v[0], mask=mask[0], return_residual=True))

    unbatched, batched, flax_path, want = both(q, k, v, mask)
    assert (unbatched[0].shape, unbatched[1].shape) == ((T, N, H), (T, N))
    assert_bitwise(np.asarray(unbatched[1])[rows[0]], np.asarray(want[1])[rows[0]])
    assert np.all(np.asarray(unbatched[1])[~rows[0]] == -np.inf)
    assert_bitwise(flax_path, batched)


def test_attention_refuses_the_cudnn_implementation_saying_what_to_do():
    with pytest.raises(ValueError, match=r"jaxsafe.nn implements the XLA path only, got "
                                         r"implementation='cudnn'. Pass implementation='xla'"):
        jsnn.dot_product_attention(Q, KEY, VAL, implementation="cudnn")  # pyright: ignore
    with pytest.raises(ValueError, match=r"`implementation` must be None or 'xla'"):
        jsnn.dot_product_attention(Q, KEY, VAL, implementation="flash")  # pyright: ignore
    with pytest.raises(ValueError, match="Unsupported implementation"):
        jax.nn.dot_product_attention(Q, KEY, VAL, implementation="flash")  # pyright: ignore


def test_attention_validates_like_jax_nn():
    with pytest.raises(ValueError, match="value shape"):
        jsnn.dot_product_attention(Q, KEY, VAL[:, :3])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        jsnn.dot_product_attention(normal(B, T, 3, H), KEY, VAL)
    with pytest.raises(ValueError, match="key_value_seq_lengths dtype"):
        jsnn.dot_product_attention(Q, KEY, VAL, key_value_seq_lengths=jnp.array([1., 2.]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_a_numeric_mask_attends_where_it_is_nonzero_as_flax_reads_it(dtype):
    """Flax's `make_attention_mask` is float32 by default, and Linen's and NNX's attention read
    a mask as `where(mask, ...)`: as an `attention_fn` there, a numeric mask attends where it is
    nonzero (it used to raise "mask dtype should be bool"). Bits and gradients are the boolean
    mask's."""
    def attend(mask):
        return lambda q: jsnn.dot_product_attention(q, KEY, VAL, mask=mask)

    numeric = MASK.astype(dtype) * 3
    assert_bitwise(attend(numeric)(Q), attend(MASK)(Q))
    assert_bitwise(jax.grad(lambda q: attend(numeric)(q).sum())(Q),
                   jax.grad(lambda q: attend(MASK)(q).sum())(Q))


def test_attention_has_no_nan_inside_under_debug_nans():
    config = dict(CONFIGS["causal_kv_len_0"], bias=BIAS_INF)
    with jax.debug_nans(True):
        loss = lambda q, k, v: jnp.sum(jsnn.dot_product_attention(q, k, v, **config))
        jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2)))(Q, KEY, VAL))


def test_nan_safe_fixes_a_hand_written_attention_the_same_way():
    """The user's own -inf mask + jax.nn.softmax, rows dropped afterwards, under nan_safe."""
    mask = MASK[:, :1]  # [B, 1, T, S]: query 4 of batch 1 has no key
    rows = np.asarray(mask).any(-1)[:, 0]  # [B, T]
    assert not rows.all()

    def hand_written(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H).astype(np.float32)
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)   # NaN on rows with no key
        out = jnp.einsum("bnts,bsnh->btnh", p, v)
        return jnp.where(rows[:, :, None, None], out, 0.)           # the rows dropped

    q, k, v = Q, normal(B, S, N, H), normal(B, S, N, H)
    ours = lambda q, k, v: jsnn.dot_product_attention(q, k, v, mask=mask)
    loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2)))
    assert np.isnan(np.asarray(loss(hand_written)(q, k, v)[2])).any()  # the bug, in d/dv
    fixed = loss(jaxsafe.nan_safe(hand_written))(q, k, v)
    assert_finite(fixed)
    assert_close(fixed, loss(ours)(q, k, v), rtol=2e-5, atol=1e-6)
    assert_close(jaxsafe.nan_safe(hand_written)(q, k, v), jax.jit(ours)(q, k, v),
                 rtol=2e-6, atol=1e-6)
