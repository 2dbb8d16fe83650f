"""`jax.nn` functions whose fully masked rows are 0 (or `-inf`) with zero gradient, not NaN.

A softmax row with no valid entry (every entry masked by `where`, or `-inf`) has max `-inf`, and
`exp(x - max)` is `exp(-inf - -inf) = exp(nan)`. Even when that row is sliced away afterwards,
its NaN reaches the gradient (`0 * nan`). `jax.nn.dot_product_attention` avoids the NaN with a
large negative fill instead of `-inf`, and so attends uniformly over a fully masked row.

The fix works on row-sized values (one per row): the row max starts from the lowest finite
number instead of -inf, so an empty row computes `exp(-inf - finite) = 0`, and the row sum goes
through `maximum(sum, 1/2)`, so it divides `0` by `1/2`. A valid row's max and sum are unchanged
(its sum is at least 1), so it runs jax.nn's operations on jax.nn's values and gives jax.nn's
bits. No select, unlike the usual double `where`: XLA:CPU fuses these into the same kernels as
jax.nn's (a select or compare splits them at some shapes), so the compiled programs cost the same
(see `benchmarks/bench_nn.py`). NaN in a valid entry stays NaN.

Derivatives are autodiff of this code, plus small custom rules: the sum's `maximum` has
derivative 1 (`_denominator`), logsumexp's `log` of an empty sum has derivative 0
(`_log_of_sum`), and log_softmax cuts the `x_i` term of an empty row (`_scale_tangent`);
`softmax` under `jax_softmax_custom_jvp` mirrors `jax.nn`'s rule. `grad`, `jacfwd`, `vmap`,
`jit` and higher orders all compose. Inside `jaxsafe.nan_safe` these functions are read lane by
lane like `jax.nn`'s (their custom rules have lane-to-lane bodies), so padded rows dropped after
them are guarded as they are after `jax.nn`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, cast, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.random import bernoulli
from jax.typing import ArrayLike, DTypeLike

from ._atoms import farthest

Array = jax.Array
Axis = int | Sequence[int] | None

__all__ = ["dot_product_attention", "log_softmax", "logsumexp", "softmax"]


def _array(x: ArrayLike, fun: str, arg: str) -> Array:
    """`x` as an array (a Python scalar has no dtype), refusing a list or tuple as `jax.nn`
    does: JAX reads no Python sequence as an array, so that none is traced element by element."""
    if not (isinstance(x, np.ndarray | jax.Array) or hasattr(x, "__jax_array__")
            or np.isscalar(x)):
        raise TypeError(f"{fun}: `{arg}` must be an array or a scalar, as in jax.nn, got "
                        f"{type(x)}; convert it first: jnp.asarray({arg}).")
    return jnp.asarray(x)


def _masked(x: ArrayLike, where: ArrayLike | None) -> Array:
    """`x` with its masked-out entries `-inf`, or the lowest finite number in a float8 without
    inf (where `-inf` is NaN, which a row max would spread to the valid entries)."""
    x = jnp.asarray(x)
    if where is None:
        return x
    fill = farthest(x.dtype, -1) if jnp.issubdtype(x.dtype, jnp.floating) else -jnp.inf
    return jnp.where(where, x, fill)


def _shift(x_safe: Array, axis: Axis, where: ArrayLike | None) -> Array:
    """The row max to subtract, at least the lowest finite number; `keepdims`, no gradient.

    A row with no valid entry (masked entries are `_masked`'s fill) gets the lowest finite
    number, so `exp(x - shift)` is `exp(-inf) = 0` there. A valid row's max is at least that
    number (or NaN), so it is jax.nn's max. The floor is the reduction's initial value, not an
    operation after it: XLA:CPU then fuses max, exp, sum and divide as it does for `jax.nn`
    (a select or a `maximum` on the row max splits its kernel at some shapes).
    """
    if not jnp.issubdtype(x_safe.dtype, jnp.floating):  # no -inf: jax.nn's max as is
        return lax.stop_gradient(jnp.max(x_safe, axis, where=where, initial=-jnp.inf,
                                         keepdims=True))
    dims = _axes(x_safe.ndim, axis)
    lowest = np.array(jnp.finfo(x_safe.dtype).min, x_safe.dtype)
    row_max = lax.reduce(lax.stop_gradient(x_safe), lowest, lax.max, dims)
    return lax.expand_dims(row_max, dims)


def _axis_tuple(axis: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(axis) if isinstance(axis, tuple | list) else (cast(int, axis),)


def _axes(ndim: int, axis: Axis) -> tuple[int, ...]:
    axes = tuple(range(ndim)) if axis is None else _axis_tuple(axis)
    if any(not -ndim <= a < ndim for a in axes):
        raise ValueError(f"axis {axis} is out of bounds for an array of dimension {ndim}")
    axes = tuple(sorted(int(a) % ndim for a in axes))
    if len(set(axes)) != len(axes):
        raise ValueError(f"duplicate value in 'axis': {axis}")
    return axes


@jax.custom_jvp
def _denominator(total: Array) -> Array:
    """`total`, or 1/2 where it is 0 (a row with no valid entry: then `0 / (1/2) = 0`).

    A valid row sums to at least 1 (its max contributes `exp(0) = 1`) or to NaN, so the value is
    `total` there. The derivative is 1 everywhere (an empty row's `total` has tangent 0 anyway):
    `maximum`'s own rule would add compares and selects that split XLA:CPU's fused backward.
    """
    return jnp.maximum(total, 0.5)


@_denominator.defjvp
def _denominator_jvp(primals, tangents):
    return _denominator(*primals), tangents[0]


@jax.custom_jvp
def _scale_tangent(x: Array, scale: Array) -> Array:
    """The identity, with derivative `scale` (x's shape, treated as a constant).

    A multiply, not a select on the row: XLA:CPU fuses it into jax.nn's backward (a select there
    costs a fifth more memory traffic). The body reads `scale` in a select that never picks it,
    which XLA removes: it shows `nan_safe`'s liveness analysis that the rule reads `scale` lane
    by lane, as it does, so a row dropped after `log_softmax` stays dropped before it.
    """
    return lax.select(lax.full_like(x, False, dtype=bool), scale, x)


@_scale_tangent.defjvp
def _scale_tangent_jvp(primals, tangents):
    x, scale = primals
    return x, tangents[0] * lax.stop_gradient(scale)


@jax.custom_jvp
def _log_of_sum(total: Array) -> Array:
    """`log(total)`, whose derivative is 0 (not `0 / 0`) where `total` is 0: an empty sum."""
    return lax.log(total)


@_log_of_sum.defjvp
def _log_of_sum_jvp(primals, tangents):
    total, = primals
    safe = lax.select(total == 0, lax.full_like(total, 1), total)
    return _log_of_sum(total), lax.div(tangents[0], safe)


# -- softmax, log_softmax, logsumexp ---------------------------------------------------------

def softmax(x: ArrayLike, axis: Axis = -1, where: ArrayLike | None = None) -> Array:
    """Softmax, as `jax.nn.softmax`, with 0 (not NaN) on a row that has no valid entry.

    A row has no valid entry when `where` masks all of it or all of it is `-inf`. Such a row
    gives 0 and a zero gradient; every other row is `jax.nn.softmax`'s, bit for bit. A row with
    a NaN (or `+inf`) valid entry is NaN, as in `jax.nn`.

    **Arguments:**

    - `x`: input array.
    - `axis`: axis or axes (or `None`, all) along which the softmax sums to 1.
    - `where`: elements to include; masked-out elements give 0.

    **Returns:** an array shaped like `x`.

    Example:

        jaxsafe.nn.softmax(jnp.array([[1., 2.], [-jnp.inf, -jnp.inf]]))  # row 1: [0., 0.]
    """
    x = _array(x, "softmax", "x")  # before either path: a Python scalar has no dtype
    # the same switch as jax.nn.softmax (a config flag the type stubs do not declare)
    if jax.config.jax_softmax_custom_jvp:  # pyright: ignore[reportAttributeAccessIssue]
        return _softmax_custom_jvp(x, axis, where)
    return _softmax(x, axis, where)


def _softmax(x, axis, where):
    x_safe = _masked(x, where)
    unnormalized = jnp.exp(x_safe - _shift(x_safe, axis, where))  # 0 on an empty row
    result = unnormalized / _denominator(jnp.sum(unnormalized, axis, where=where, keepdims=True))
    if where is not None:
        result = jnp.where(where, result, 0)
    return result


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _softmax_custom_jvp(x, axis, where):
    return _softmax(x, axis, where)


@_softmax_custom_jvp.defjvp
def _softmax_custom_jvp_rule(axis, primals, tangents):
    (x, where), (x_dot, _) = primals, tangents
    y = _softmax_custom_jvp(x, axis, where)  # 0 on empty rows, so the tangent is 0 there
    return y, y * (x_dot - (y * x_dot).sum(axis, where=where, keepdims=True))


@functools.partial(jax.jit, static_argnames=("axis",))
def log_softmax(x: ArrayLike, axis: Axis = -1, where: ArrayLike | None = None) -> Array:
    """Log-softmax, as `jax.nn.log_softmax`, with `-inf` (not NaN) on a row with no valid entry.

    Such a row (all masked by `where`, or all `-inf`) gives `-inf` and a zero gradient; every
    other row is `jax.nn.log_softmax`'s, bit for bit.

    **Arguments:**

    - `x`: input array.
    - `axis`: axis or axes (or `None`, all) to normalise over.
    - `where`: elements to include; masked-out elements give `-inf`.

    **Returns:** an array shaped like `x`.

    Example:

        jaxsafe.nn.log_softmax(jnp.array([-jnp.inf, -jnp.inf]))  # [-inf, -inf], gradient 0
    """
    x_safe = _masked(_array(x, "log_softmax", "x"), where)
    shift = _shift(x_safe, axis, where)
    if jnp.issubdtype(x_safe.dtype, jnp.floating):
        # A row with no valid entry is -inf already; cut the derivative of its `x_i` term. The
        # factor min(total, 1) is 1 on a valid row (total >= 1) and 0 on an empty one. It scales
        # the whole derivative of `x` (after jax.nn's fused multiply-adds, whose bits it keeps);
        # the sum it needs is the one below, computed twice in the program and merged by XLA.
        total = jnp.sum(jnp.exp(x_safe - shift), axis, where=where, keepdims=True)
        x_safe = _scale_tangent(x_safe, jnp.broadcast_to(jnp.minimum(total, 1), x_safe.shape))
    shifted = x_safe - shift
    total = jnp.sum(jnp.exp(shifted), axis, where=where, keepdims=True)
    result = shifted - jnp.log(_denominator(total))
    if where is not None:
        return jnp.where(where, result, -jnp.inf)
    return result


def _promote_inexact(*args: ArrayLike) -> list[Array]:
    # jax's `promote_args_inexact`, from public API (the weak-type flag is not kept).
    dtype = jax.dtypes.result_type(*args)
    if not jnp.issubdtype(dtype, jnp.inexact):  # jax's to_inexact_dtype table
        dtype = np.dtype(np.float64 if np.dtype(dtype).itemsize == 8 else np.float32)
    return [jnp.asarray(a, dtype) for a in args]


def logsumexp(a: ArrayLike, axis: Axis = None, b: ArrayLike | None = None,
              keepdims: bool = False, return_sign: bool = False,
              where: ArrayLike | None = None) -> Array | tuple[Array, Array]:
    """Log-sum-exp, as `jax.nn.logsumexp`, with a zero gradient on an empty reduction.

    A reduction with no valid entry (all masked by `where`, all `b == 0`, or all `-inf`) gives
    `-inf`, as in JAX, but its gradient is 0 instead of NaN. Other results are JAX's, bit for bit.

    **Arguments:**

    - `a`: input array.
    - `axis`: axis or axes to reduce (`None`: all).
    - `b`: scaling factors for `exp(a)`, broadcastable to `a`.
    - `keepdims`: keep the reduced axes with size 1.
    - `return_sign`: also return the sign of the sum (and take the log of its absolute value).
    - `where`: elements to include in the reduction.

    **Returns:** the result, or `(result, sign)` with `return_sign=True`.

    Example:

        jax.grad(lambda x: jaxsafe.nn.logsumexp(x))(jnp.full(3, -jnp.inf))  # [0., 0., 0.]
    """
    a = _array(a, "logsumexp", "a")
    if where is not None:
        a = jnp.where(where, a, 0)
    b_arr = None
    if b is not None:
        a_arr, b_arr = _promote_inexact(a, b)
        a_arr = jnp.where(b_arr != 0, a_arr, -jnp.inf)
    else:
        a_arr, = _promote_inexact(a)
    dims = tuple(range(a_arr.ndim)) if axis is None else _axis_tuple(axis)
    amax = lax.stop_gradient(
        jnp.max(a_arr.real, axis=dims, keepdims=keepdims, where=where, initial=-jnp.inf))
    amax_raw = amax  # -inf on an empty reduction
    amax = lax.select(jnp.isfinite(amax), amax, lax.full_like(amax, 0))
    if not np.isinf(farthest(a_arr.real.dtype, -1)):
        amax_raw = amax  # a float8 without inf: JAX's max is NaN (its initial -inf), then 0
    pos_dims = tuple(d % a_arr.ndim for d in dims)  # valid: jnp.max has checked them
    amax_with_dims = amax if keepdims else lax.expand_dims(amax, pos_dims)

    exp_a = lax.exp(lax.sub(a_arr, amax_with_dims.astype(a_arr.dtype)))
    if b_arr is not None:
        exp_a = jnp.multiply(exp_a, b_arr)
    sumexp = exp_a.sum(axis=dims, keepdims=keepdims, where=where)
    sign = lax.sign(sumexp)
    if return_sign or not jnp.issubdtype(a_arr.dtype, jnp.complexfloating):
        sumexp = abs(sumexp)
    # An empty reduction sums to 0: log(0) + -inf is -inf, and `_log_of_sum` gives it a zero
    # derivative. Elsewhere `amax_raw` is `amax` or a non-finite max that makes `out` what JAX's
    # `log(sumexp) + 0` makes (inf, NaN). No select on the result: the liveness analysis of
    # `nan_safe` follows the rows through it (a select on `empty` would hide them).
    out = lax.add(_log_of_sum(sumexp), amax_raw.astype(sumexp.dtype))

    if return_sign:
        return out, sign
    if b is not None and not jnp.issubdtype(out.dtype, jnp.complexfloating):
        with jax.debug_nans(False):
            out = jnp.where(sign < 0, jnp.array(np.nan, dtype=out.dtype), out)
    return out


# -- dot-product attention -------------------------------------------------------------------
# The layout, masks and grouping follow jax.nn's `_dot_product_attention_xla`, so that rows with
# an attendable key give the same bits; the masks fill with -inf instead of a large negative.

def _causal_mask(T: int, S: int) -> Array:
    return jnp.tril(jnp.ones((T, S), dtype=bool))[None, None, :, :]


def _window_mask(T: int, S: int, local_window_size: tuple[int, int]) -> Array:
    query_pos, key_pos = jnp.arange(T), jnp.arange(S)
    left_window, right_window = local_window_size
    left_mask = query_pos[..., None] <= key_pos[..., None, :] + left_window
    right_mask = query_pos[..., None] >= key_pos[..., None, :] - right_window
    return jnp.logical_and(right_mask, left_mask)[None, None, :, :]


def _padding_mask(T: int, S: int, q_seqlen, kv_seqlen) -> Array:
    q_mask = kv_mask = True
    if q_seqlen is not None:
        q_mask = jnp.arange(0, T)[None, :, None] < q_seqlen[:, None, None]
    if kv_seqlen is not None:
        kv_mask = jnp.arange(0, S)[None, None, :] < kv_seqlen[:, None, None]
    return jnp.logical_and(q_mask, kv_mask)[:, None, :, :]


def _apply_masks(logits, mask, is_causal, q_seqlen, kv_seqlen, local_window_size):
    T, S = logits.shape[2], logits.shape[3]
    masks = []
    if mask is not None:
        masks.append(mask)
    if is_causal:
        masks.append(_causal_mask(T, S))
    if local_window_size is not None:
        masks.append(_window_mask(T, S, local_window_size))
    if q_seqlen is not None or kv_seqlen is not None:
        masks.append(_padding_mask(T, S, q_seqlen, kv_seqlen))
    if not masks:
        return logits
    combined = jnp.ones_like(logits, dtype=bool)
    for m in masks:
        combined = jnp.logical_and(combined, m)
    return jnp.where(combined, logits, -jnp.inf)


def _attention_core(query, key, value, bias, mask, is_causal, scale, q_seqlen, kv_seqlen,
                    local_window_size, given_precision=None, finish=None, residual=False):
    """`given_precision`: the caller's (Flax's `precision=`), for both einsums; `finish`: what
    is done to the probabilities before they weigh the values (Flax's sow and dropout).
    Returns the output and, with `residual`, jax.nn's `return_residual` output (else None)."""
    logits_dtype = jnp.promote_types(query.dtype, np.float32)
    precision = {np.dtype(jnp.bfloat16): lax.DotAlgorithmPreset.BF16_BF16_F32,
                 np.dtype(np.float16): lax.DotAlgorithmPreset.F16_F16_F32}.get(query.dtype)
    if given_precision is not None:
        precision = given_precision
    try:  # as jax.nn: explicit precision fails on platforms without it, so fall back
        logits = jnp.einsum("BTNH,BSNH->BNTS", query, key, precision=precision,
                            preferred_element_type=logits_dtype)
    except Exception:  # noqa: BLE001  (jax.nn catches everything here too)
        logits = jnp.einsum("BTNH,BSNH->BNTS", query, key, precision=None,
                            preferred_element_type=logits_dtype)
    logits *= jnp.array(scale, dtype=logits.dtype)
    if bias is not None:
        logits = (logits + bias).astype(logits.dtype)
    logits = _apply_masks(logits, mask, is_causal, q_seqlen, kv_seqlen, local_window_size)
    # Always float32, as jax.nn; a row with no attendable key gives probabilities 0, hence
    # output 0 (query rows past `q_seqlen` are such rows, so no output mask is needed).
    logits = logits.astype(np.float32)
    probs = _softmax(logits, -1, None).astype(key.dtype)
    if finish is not None:
        probs = finish(probs)
    encoded = jnp.einsum("BNTS,BSNH->BTNH", probs, value, precision=given_precision)
    if not residual:
        return encoded, None
    # jax.nn's residual: each query row's logsumexp (-inf on a row with no key), B N T -> B T N
    lse = cast(Array, logsumexp(logits, axis=-1)).astype(key.dtype)
    return encoded, lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)))


def _flax_finish(module, dropout_rate: float, dropout_rng, broadcast_dropout: bool,
                 deterministic: bool):
    """Flax's attention weights, then: sown on `module` (as `attention_weights`), then dropout
    (broadcast over batch and heads, or one mask per lane), scaled by `1 / keep`."""
    def finish(probs):
        if module is not None:
            _sow(module, probs)
        if deterministic or dropout_rate <= 0.0:
            return probs
        keep_prob = 1.0 - dropout_rate
        shape = (1, 1) + probs.shape[-2:] if broadcast_dropout else probs.shape
        keep = bernoulli(dropout_rng, keep_prob, shape)  # keyed: the same on every host
        return probs * (keep.astype(probs.dtype) / jnp.asarray(keep_prob, probs.dtype))
    return finish


def _sow(module, weights) -> None:
    """Record the weights as Flax's own attention does, for Linen or NNX modules."""
    from flax import linen, nnx  # pyright: ignore[reportMissingImports]  (a Flax module: Flax is there)
    if isinstance(module, linen.Module):
        module.sow("intermediates", "attention_weights", weights)
    else:
        module.sow(nnx.Intermediate, "attention_weights", weights)


def _attention_grouped(query, key, value, bias, mask, is_causal, scale, q_seqlen, kv_seqlen,
                       local_window_size, residual):
    B, T, N, H = query.shape
    K = key.shape[2]
    G = N // K
    query = jnp.reshape(query, (B, T, K, G, H))

    def to_grouped(t):
        if t is None:
            return t
        tB, tN, tT, tS = t.shape
        if tN == 1:
            return jnp.broadcast_to(t[:, :, None, :, :], (tB, tN, G, tT, tS))
        assert tN == N
        return jnp.reshape(t, (tB, K, G, tT, tS))

    core = jax.vmap(functools.partial(_attention_core, residual=residual),
                    in_axes=(3, None, None, 2, 2) + (None,) * 5, out_axes=3)
    out, lse = core(query, key, value, to_grouped(bias), to_grouped(mask), is_causal, scale,
                    q_seqlen, kv_seqlen, local_window_size)
    return jnp.reshape(out, (B, T, N, H)), None if lse is None else jnp.reshape(lse, (B, T, N))


def _ensure_4d(t) -> Array:
    t = jnp.asarray(t)
    if t.ndim < 4:
        return jnp.expand_dims(t, axis=tuple(range(4 - t.ndim)))
    return t


def _check(t, shape: Sequence[int], dtype, name: str) -> None:
    if t is None:
        return
    if t.ndim != len(shape):
        raise ValueError(f"{name} ndim should be {len(shape)}, but got {t.ndim}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} dtype should be {dtype}, but got {t.dtype}")
    if any(s != -1 and ts != s for s, ts in zip(shape, t.shape, strict=True)):
        raise ValueError(f"{name} shape should be {shape}: but got {t.shape}")


def _check_implementation(implementation: object) -> None:
    """jaxsafe.nn has the XLA path of jax.nn's attention only: say so for cuDNN's."""
    if implementation is None or implementation == "xla":
        return
    if implementation == "cudnn":
        raise ValueError(
            "dot_product_attention: jaxsafe.nn implements the XLA path only, got "
            "implementation='cudnn'. Pass implementation='xla' (or leave it out) for "
            "jaxsafe.nn's rows with no key (0, zero gradient), or call "
            "jax.nn.dot_product_attention(implementation='cudnn') for cuDNN's kernel.")
    raise ValueError(f"dot_product_attention: `implementation` must be None or 'xla' (the "
                     f"path jaxsafe.nn implements), got {implementation!r}.")


def _prepare(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
             dtype):
    """The arrays as jax.nn prepares and checks them (4D, lengths as arrays), in `dtype` when
    given (Flax's), with a numeric mask read as Flax reads it: nonzero attends."""
    if dtype is not None:
        query, key, value = (jnp.asarray(t, dtype) for t in (query, key, value))
    query, key, value = _ensure_4d(query), _ensure_4d(key), _ensure_4d(value)
    bias = _ensure_4d(bias) if bias is not None else None
    mask = _ensure_4d(mask) if mask is not None else None
    if mask is not None and mask.dtype != np.dtype(bool) and (
            jnp.issubdtype(mask.dtype, jnp.number)):
        mask = mask != 0  # Flax's `make_attention_mask` is float32: nonzero attends
    lengths = [None if t is None else jnp.asarray(t)
               for t in (query_seq_lengths, key_value_seq_lengths)]
    B, S, K, H = key.shape
    _check(value, [B, S, K, H], key.dtype, "value")
    _check(query, [B, -1, -1, H], key.dtype, "query")
    _check(mask, [-1] * 4, np.dtype(bool), "mask")
    _check(bias, [-1] * 4, None, "bias")
    _check(lengths[0], [B], np.dtype("int32"), "query_seq_lengths")
    _check(lengths[1], [B], np.dtype("int32"), "key_value_seq_lengths")
    if query.shape[-2] % K != 0:
        raise ValueError(f"The number of query heads must be a multiple of key/value heads, "
                         f"but got {query.shape[-2]} vs {K}")
    return query, key, value, bias, mask, *lengths


@overload
def dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
    mask: ArrayLike | None = None, *, scale: float | None = None, is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None, key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: Literal[False] = False, dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None, broadcast_dropout: bool = True,
    deterministic: bool = False, dtype: DTypeLike | None = None,
    precision: lax.PrecisionLike = None, module: object | None = None) -> Array: ...


@overload
def dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
    mask: ArrayLike | None = None, *, scale: float | None = None, is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None, key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: Literal[True], dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None, broadcast_dropout: bool = True,
    deterministic: bool = False, dtype: DTypeLike | None = None,
    precision: lax.PrecisionLike = None,
    module: object | None = None) -> tuple[Array, Array]: ...


def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
    broadcast_dropout: bool = True,
    deterministic: bool = False,
    dtype: DTypeLike | None = None,
    precision: lax.PrecisionLike = None,
    module: object | None = None,
) -> Array | tuple[Array, Array]:
    """Scaled dot-product attention, as `jax.nn.dot_product_attention(implementation='xla')`.

    A query row with no attendable key (all masked by `mask`, `is_causal`, the sequence lengths
    or the window, or all `-inf` in `bias`) gives output 0 and a zero gradient to `query`, `key`,
    `value` and `bias`, as PyTorch's `scaled_dot_product_attention` does since PR 131060.
    `jax.nn` instead attends uniformly over such a row. Every other row is `jax.nn`'s, bit for
    bit. The softmax runs in float32, as in `jax.nn`.

    **Arguments:** as `jax.nn.dot_product_attention`:

    - `query`: `[batch, q_len, heads, head_dim]` (or without the batch axis).
    - `key`, `value`: `[batch, kv_len, kv_heads, head_dim]`; `heads` must be a multiple of
      `kv_heads` (grouped-query attention).
    - `bias`: additive, 4D, broadcastable to `[batch, heads, q_len, kv_len]`; `-inf` masks.
    - `mask`: boolean, 4D, broadcastable like `bias`; `True` means attend. A numeric mask
      (Flax's `make_attention_mask` makes float32 ones) attends where it is nonzero, as Flax's
      attention reads it.
    - `scale`: logits scale, default `1 / sqrt(head_dim)`.
    - `is_causal`: query `i` attends to keys `j <= i`.
    - `query_seq_lengths`, `key_value_seq_lengths`: `int32[batch]` valid lengths; 0 is allowed.
    - `local_window_size`: `(left, right)` or a symmetric int.
    - `implementation`: `None` or `'xla'`, the path this function implements; `'cudnn'` is a
      `ValueError` (call `jax.nn`'s for cuDNN's kernel).
    - `return_residual`: also return jax.nn's residual, the logsumexp of each query row's
      scaled and masked logits, `[batch, q_len, heads]`, without gradient; `-inf` on a row
      with no attendable key (`jax.nn`'s is that of its large negative fill, about -2.4e38).

    and as Flax's `attention_fn` (so that `nnx.MultiHeadAttention(attention_fn=...)` and Linen's
    `MultiHeadDotProductAttention` take it as is): `dropout_rate`, `dropout_rng`,
    `broadcast_dropout`, `deterministic` (dropout on the weights, as Flax applies it), `dtype`
    (the inputs' computation dtype), `precision` (of both einsums) and `module` (the weights are
    sown on it as `attention_weights`). Dropout, `precision` and `module` need as many key/value
    heads as query heads, as Flax's attention has.

    **Returns:** an array shaped like `query`, or `(output, residual)` with `return_residual`.

    Example:

        mask = jnp.zeros((1, 1, 4, 6), bool).at[..., :2, :].set(True)  # rows 2, 3: no key
        out = jaxsafe.nn.dot_product_attention(q, k, v, mask=mask)      # out[:, 2:] == 0
    """
    _check_implementation(implementation)
    output_shape = jnp.asarray(query).shape
    query_arr, key_arr, value_arr, bias, mask, query_seq_lengths, key_value_seq_lengths = \
        _prepare(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths, dtype)
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    K, H = key_arr.shape[2:]
    scale_val = (1.0 / np.sqrt(H)) if scale is None else scale
    dropout = not deterministic and dropout_rate > 0.0
    if dropout and dropout_rng is None:
        raise ValueError("dot_product_attention: dropout (`dropout_rate` > 0, not "
                         "`deterministic`) needs `dropout_rng`, a PRNG key.")
    if dropout or module is not None or precision is not None:
        if query_arr.shape[-2] != K:
            raise ValueError(f"dot_product_attention: dropout, `precision` and `module` need "
                             f"as many key/value heads as query heads (Flax's attention); got "
                             f"{query_arr.shape[-2]} query heads and {K}.")
        finish = _flax_finish(module, dropout_rate, dropout_rng, broadcast_dropout,
                              deterministic)
        out, residual = _attention_core(
            query_arr, key_arr, value_arr, bias, mask, is_causal, scale_val, query_seq_lengths,
            key_value_seq_lengths, local_window_size, precision, finish, return_residual)
    else:
        out, residual = _attention_grouped(
            query_arr, key_arr, value_arr, bias, mask, is_causal, scale_val, query_seq_lengths,
            key_value_seq_lengths, local_window_size, return_residual)
    out = jnp.reshape(out, output_shape)
    if residual is None:
        return out
    return out, jnp.reshape(residual, output_shape[:-1])
