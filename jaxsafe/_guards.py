"""`register_guard`: declare a primitive NaN-prone, with the safe value of its operands.

A NaN-prone primitive computes NaN or inf (or a NaN/inf derivative) for some finite inputs:
`sqrt` below 0 and at 0, `log` at 0, `div` by 0, `exp` on overflow, ... When the output of such an
equation has lanes that reach no output (dropped lanes), the rewrite replaces the listed operands
there by a safe value, `select_n(live, safe, x)`, so the forward pass stays finite in those lanes
and the zero cotangent they receive is never multiplied by NaN. Live lanes are never touched.

JAX's own NaN-prone primitives are in the table already (`_primitives.py`, the `guard=` of each
row); `register_guard` adds yours, or changes an entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ._compat import JaxprEqn, Primitive
from ._primitives import register_elementwise
from ._rules import RULES, Guard, update

GENERATION = 0
"""Counts registrations; part of nan_safe's cache key, so functions are rewritten again after
one."""


def register_guard(primitive: Primitive, safe: Mapping[int, float] | float,
                   applies: Callable[[JaxprEqn], bool] | None = None) -> None:
    """Declare `primitive` NaN-prone and give the in-domain value of its operands in dropped lanes.

    **Arguments:**

    - `primitive`: a `jax.extend.core.Primitive` (for example your own, or `lax.sqrt_p`).
    - `safe`: `{operand_index: value}`, or one value for operand 0. The value must be inside the
      primitive's domain and away from its singularities (sqrt: 1, log: 1, div denominator: 1).
    - `applies`: optional predicate on the equation; the guard is used only where it is true.

    Registering a primitive that is already in the table replaces its guard. A primitive with no
    row of its own is registered as elementwise (a guard is a per-lane substitution, so the
    primitive must be elementwise for it to make sense).

    Example:

        jaxsafe.register_guard(my_log_p, {0: 1.0})
    """
    if not isinstance(primitive, Primitive):
        raise TypeError(
            f"register_guard: `primitive` must be a jax.extend.core.Primitive, got {primitive!r}.")
    if applies is not None and not callable(applies):
        raise TypeError(f"register_guard: `applies` must be a callable taking the equation "
                        f"(or None), got {type(applies).__name__}: {applies!r}.")
    if not isinstance(safe, Mapping):
        safe = {0: safe}
    if not safe:
        raise ValueError(f"register_guard: `safe` names no operand of {primitive}; give "
                         f"`{{operand_index: value}}`, or one value for operand 0.")
    checked = {}
    for index, value in safe.items():
        if not isinstance(index, int | np.integer) or isinstance(index, bool) or index < 0:
            raise TypeError(f"register_guard: operand index {index!r} in `safe` must be an "
                            f"int >= 0.")
        checked[int(index)] = value
        if not _real_number(value):
            raise TypeError(f"register_guard: `safe` value {value!r} for operand {index} of "
                            f"{primitive} must be a real number (a Python or NumPy scalar).")
        if not np.isfinite(float(value)):
            raise ValueError(f"register_guard: `safe` value {value!r} for operand {index} of "
                             f"{primitive} must be finite.")
    guard = Guard(checked) if applies is None else Guard(checked, applies)
    global GENERATION
    GENERATION += 1
    if primitive in RULES:
        update(primitive, guard=guard)
    else:  # not evaluated at planning time: a user primitive need not run on the host
        register_elementwise(primitive, guard=guard, foldable=False)


def _real_number(value: object) -> bool:
    """A real scalar: an int or float, Python or NumPy, or a 0-d real array (not a bool, a
    string or a complex number: the guard's value is cast to the operand's dtype)."""
    if isinstance(value, bool | np.bool_):
        return False
    array = np.asarray(value) if isinstance(value, int | float | np.number | np.ndarray) \
        else None
    return array is not None and array.ndim == 0 and array.dtype.kind in "iuf"
