"""What every pass reads off a jaxpr atom (a variable or a literal): shape, value, float-ness."""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from ._compat import Literal, Tracer

SMALL_CONSTANT = 64
"""Values up to this many lanes are evaluated when the rewrite is planned (a predicate computed
from literals, a value known in dropped lanes); larger ones are not worth it."""

MAX_WEIGHT = 1 << 16
"""Float constants up to this many lanes, and values computed from them alone, are read when
the rewrite is planned (a contraction with a closed-over weight matrix, or its transpose: which
lanes its zeros mask)."""


def shape_of(atom: Any) -> tuple[int, ...]:
    """The shape of a jaxpr atom."""
    return tuple(cast(Any, atom.aval).shape)


def dtype_of(atom: Any) -> Any:
    """The dtype of a jaxpr atom (a NumPy dtype, or an extended dtype such as a PRNG key's)."""
    return cast(Any, atom.aval).dtype


def is_float(atom: Any) -> bool:
    """Whether an atom (or a value) is floating point or complex: what carries a derivative."""
    dtype = dtype_of(atom) if hasattr(atom, "aval") else np.result_type(atom)
    inexact = _INEXACT.get(dtype)
    if inexact is None:
        try:
            inexact = _INEXACT[dtype] = bool(jnp.issubdtype(dtype, jnp.inexact))
        except TypeError:  # extended dtypes (PRNG keys, float0)
            inexact = False
    return inexact


def is_numeric(atom: Any) -> bool:
    """Whether an atom's dtype is a NumPy one (not a PRNG key's, not float0): a value of it
    can be made to evaluate its equation at planning time."""
    return not jnp.issubdtype(dtype_of(atom), jax.dtypes.extended)


_INEXACT: dict[Any, bool] = {}  # dtype -> is_float: asked for every atom of every equation


def literal_value(atom: Literal) -> Any:
    """A literal's value with its aval's dtype: a Python scalar (`jnp.where(True, ...)`) has
    none, rules read `.dtype` of their operands, and x64 must not widen a float32 literal."""
    val = atom.val
    if isinstance(val, bool | int | float | complex):
        return np.asarray(val, dtype_of(atom))
    return val


def is_nonfinite_literal(atom: Any) -> bool:
    """Whether `atom` is a floating-point literal holding inf or NaN."""
    if not isinstance(atom, Literal) or not is_float(atom):
        return False
    return not bool(np.all(np.isfinite(np.asarray(atom.val))))


def readable_constant(value: Any) -> bool:
    """Whether a closed-over constant's values can be read when the rewrite is planned: a
    concrete array of numbers or booleans, not a tracer of an outer transformation, nor a typed
    PRNG key (`jax.random.key`), which NumPy cannot hold."""
    if isinstance(value, Tracer):
        return False
    dtype = getattr(value, "dtype", None)
    return dtype is None or not jnp.issubdtype(dtype, jax.dtypes.extended)


def float_info(dtype: Any) -> Any:
    """`np.finfo` for every float dtype JAX has: NumPy's refuses bfloat16 and the float8s
    (`ml_dtypes`), and an analysis that raised there would leave the program unguarded."""
    return jnp.finfo(dtype)


def farthest(dtype: Any, sign: int) -> np.ndarray:
    """The value of `dtype` beyond every other on the side of `sign` (+1 or -1): `±inf`, or
    the largest finite number where the dtype has no inf (`float8_e4m3fn` and the `fnuz`
    float8s, where `inf` converts to NaN, which a `max` or a comparison would spread), or an
    integer's extreme."""
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        info = np.iinfo(dtype)
        return np.asarray(info.max if sign > 0 else info.min, dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        value = np.asarray(sign * np.inf).astype(dtype)
    if not np.isinf(value):
        finfo = float_info(dtype)
        value = np.asarray(finfo.max if sign > 0 else finfo.min, dtype)
    return value


def next_toward(point: np.ndarray, sign: int) -> np.ndarray:
    """The next value of `point`'s dtype above it (`sign` +1) or below it (-1). NumPy's
    `nextafter` toward `inf` gives NaN in a float8 without inf."""
    return np.nextafter(point, farthest(point.dtype, sign))
