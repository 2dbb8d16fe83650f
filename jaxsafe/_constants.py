"""Evaluating equations while the rewrite is planned, on small concrete values.

The static passes fold predicates computed from literals (`_liveness.Sweep.constant`), compute
what a value holds in its dropped lanes (`_dropped.DroppedValues`) and check that a primitive and
its derivatives are finite at a point (`finite_with_derivatives`). All of them evaluate through
`fold`, on the host, even while an outer `jit` is tracing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ._compat import JaxprEqn, bind_eqn
from ._rules import rule_for


def fold(eqn: JaxprEqn, values: Sequence[Any]) -> list[np.ndarray]:
    """`eqn`'s outputs on concrete operand values, as NumPy arrays."""
    with jax.ensure_compile_time_eval():  # a constant, even while an outer jit traces
        return [np.asarray(out) for out in bind_eqn(eqn, list(values))]


def finite_with_derivatives(eqn: JaxprEqn, point: Sequence[Any]) -> bool:
    """Whether `eqn`'s output and its first derivative in each floating-point operand are
    finite at `point` (one value per operand). False where JAX defines no such derivative."""
    point = [np.asarray(p).reshape(()) if np.size(p) == 1 else np.asarray(p) for p in point]
    floats = [j for j, p in enumerate(point) if np.issubdtype(p.dtype, np.inexact)]
    if any(j in rule_for(eqn.primitive).no_derivative for j in floats):
        return False

    def op(*xs):
        vals = list(point)
        for j, x in zip(floats, xs, strict=True):
            vals[j] = x
        return bind_eqn(eqn, vals)[0]

    with jax.ensure_compile_time_eval():
        args = [point[j] for j in floats]
        outs = [np.asarray(op(*args))]
        for j in range(len(floats)):
            tangents = [np.ones_like(a) if n == j else np.zeros_like(a)
                        for n, a in enumerate(args)]
            outs.append(np.asarray(jax.jvp(op, args, tangents)[1]))
    return all(bool(np.all(np.isfinite(o))) for o in outs)
