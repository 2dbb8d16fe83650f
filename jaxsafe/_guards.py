"""The guard table: NaN-prone primitives and the in-domain value each operand gets in dropped lanes.

A primitive listed here computes NaN or inf (or a NaN/inf derivative) for some finite inputs:
`sqrt` below 0 and at 0, `log` at 0, `div` by 0, `exp` on overflow, ... When the output of such an
equation has lanes that reach no output (dropped lanes), the rewrite replaces the listed operands
there by a safe value, `select_n(live, safe, x)`, so the forward pass stays finite in those lanes
and the zero cotangent they receive is never multiplied by NaN. Live lanes are never touched.

Extend it with `register_guard(primitive, {operand_index: safe_value})`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from . import _liveness
from ._compat import JaxprEqn, Primitive, primitives as P


@dataclasses.dataclass(frozen=True)
class Guard:
    """Safe values for some operands of one primitive.

    `safe` maps an operand index to the value that operand takes in dropped lanes. `applies`
    decides per equation whether the primitive is hazardous there at all (`integer_pow` only with
    a negative exponent, `abs` only on complex numbers).
    """

    safe: Mapping[int, float]
    applies: Callable[[JaxprEqn], bool] = lambda eqn: True


def _negative_exponent(eqn: JaxprEqn) -> bool:
    return eqn.params["y"] < 0


def _complex_operand(eqn: JaxprEqn) -> bool:
    return np.issubdtype(eqn.invars[0].aval.dtype, np.complexfloating)


GUARDS: dict[Primitive, Guard] = {}
GENERATION = 0


def register_guard(primitive: Primitive, safe: Mapping[int, float] | float,
                   applies: Callable[[JaxprEqn], bool] | None = None) -> None:
    """Declare `primitive` NaN-prone and give the in-domain value of its operands in dropped lanes.

    **Arguments:**
    - `primitive`: a `jax.extend.core.Primitive` (for example your own, or `lax.sqrt_p`).
    - `safe`: `{operand_index: value}`, or one value for operand 0. The value must be inside the
      primitive's domain and away from its singularities (sqrt: 1, log: 1, div denominator: 1).
    - `applies`: optional predicate on the equation; the guard is used only where it is true.

    Registering a primitive that is already in the table replaces its entry. A guarded
    primitive with no liveness rule of its own is treated as elementwise (a guard is a per-lane
    substitution, so the primitive must be elementwise for it to make sense).
    """
    if not isinstance(primitive, Primitive):
        raise TypeError(
            f"register_guard: `primitive` must be a jax.extend.core.Primitive, got {primitive!r}.")
    if not isinstance(safe, Mapping):
        safe = {0: safe}
    for index, value in safe.items():
        if not isinstance(index, int) or index < 0:
            raise TypeError(f"register_guard: operand index {index!r} must be an int >= 0.")
        if not np.isfinite(complex(value)):
            raise ValueError(f"register_guard: safe value {value!r} for operand {index} of "
                             f"{primitive} must be finite.")
    global GENERATION
    GENERATION += 1  # part of nan_safe's cache key: functions re-rewrite after a registration
    GUARDS[primitive] = Guard(dict(safe), applies or (lambda eqn: True))
    if not _liveness.has_rule(primitive):
        _liveness.register(primitive)(_liveness.elementwise)


for _prim, _safe in [
    # roots and logs: 1 is inside every domain and away from 0
    (P.sqrt_p, {0: 1.0}), (P.rsqrt_p, {0: 1.0}), (P.cbrt_p, {0: 1.0}), (P.log_p, {0: 1.0}),
    (P.log1p_p, {0: 0.0}),
    # quotients: the denominator
    (P.div_p, {1: 1.0}), (P.rem_p, {1: 1.0}),
    # powers: the base (x ** y is singular at x = 0 for y < 1, NaN for x < 0)
    (P.pow_p, {0: 1.0}),
    # inverse trig and friends: the middle of the domain
    (P.acos_p, {0: 0.0}), (P.asin_p, {0: 0.0}), (P.atanh_p, {0: 0.0}), (P.erf_inv_p, {0: 0.0}),
    (P.acosh_p, {0: 2.0}), (P.atan2_p, {0: 0.0, 1: 1.0}),
    # overflow: inf in the forward, inf * 0 = NaN in the backward
    (P.exp_p, {0: 0.0}), (P.exp2_p, {0: 0.0}), (P.expm1_p, {0: 0.0}), (P.sinh_p, {0: 0.0}),
    (P.cosh_p, {0: 0.0}), (P.tan_p, {0: 0.0}),
    # special functions with poles at the non-positive integers
    (P.lgamma_p, {0: 1.0}), (P.digamma_p, {0: 1.0}), (P.polygamma_p, {1: 1.0}),
    (P.igamma_p, {0: 1.0, 1: 1.0}), (P.igammac_p, {0: 1.0, 1: 1.0}),
    (P.igamma_grad_a_p, {0: 1.0, 1: 1.0}), (P.zeta_p, {0: 2.0, 1: 1.0}),
    (P.regularized_incomplete_beta_p, {0: 1.0, 1: 1.0, 2: 0.5}),
]:
    register_guard(_prim, _safe)
register_guard(P.integer_pow_p, {0: 1.0}, applies=_negative_exponent)
register_guard(P.abs_p, {0: 1.0}, applies=_complex_operand)


def guard_for(eqn: JaxprEqn) -> Guard | None:
    """The table entry that applies to `eqn`, or None."""
    guard = GUARDS.get(eqn.primitive)
    return guard if guard is not None and guard.applies(eqn) else None
