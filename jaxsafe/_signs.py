"""Lower bounds of values, for every finite input: guards that cannot matter are left out.

`rsqrt(mean((x - mu) ** 2) + 1e-5)` (a layer norm) is in the domain of `rsqrt` whatever `x` is:
its operand is at least 1e-5. A guard there replaces nothing singular, yet it costs a mask, a
select and the select's derivative. Each value's lower bound is derived from its equation, one
rule per primitive (`RULES`); a guard on a primitive whose value and derivative only shrink as
its operand grows (`DECREASING`) is left out when they are finite at the operand's bound.

Bounds assume finite operands (as the rest of the analysis does; values tested for NaN are
guarded separately) and allow +inf, which rounding can reach and where those primitives and
their derivatives are finite or zero. A bound is a number at or below every value, NaN never
included: a product of two non-negative values has none (0 * inf is NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np

from ._compat import JaxprEqn, Literal, Var
from ._compat import primitives as P
from ._walk import postorder

Bound = Optional[float]  # every value is >= the bound; None: nothing known


def constant_bound(value) -> Bound:
    value = np.asarray(value)
    if value.size == 0 or value.dtype.kind not in "fiu" or not np.all(value >= 0):
        return None  # NaN fails `>= 0` too
    return float(np.min(value))


def _both(f):
    def rule(eqn, bounds, consts):
        return None if any(b is None for b in bounds) else f(*bounds)
    return rule


def _scaled(eqn, bounds, consts):
    """mul or div by a positive finite constant: non-negative stays non-negative (the exact
    bound is not kept: the product is rounded, and may underflow to 0)."""
    value, factor = bounds
    const = consts[1]
    if eqn.primitive is P.mul_p and const is None and consts[0] is not None:
        value, factor, const = factor, value, consts[0]
    if value is None or factor is None or const is None or factor <= 0 or \
            not np.all(np.isfinite(const)):
        return None
    return 0.0


def _even_power(eqn, bounds, consts):
    y = eqn.params["y"]
    return 0.0 if y > 0 and y % 2 == 0 else None


def _same_dtype(eqn, bounds, consts):
    same = eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype
    return bounds[0] if same else (None if bounds[0] is None else 0.0)


def _moved(eqn, bounds, consts):
    return bounds[0]


def _zero(eqn, bounds, consts):
    return 0.0


Rule = Callable[[JaxprEqn, list, list], Bound]

RULES: dict = {
    # x + y >= max(x, y) for non-negative x, y; rounding is monotone, so the bound holds after it
    P.add_p: _both(max),
    P.max_p: _both(max),
    P.select_n_p: lambda eqn, bounds, consts: (
        None if any(b is None for b in bounds[1:]) else min(bounds[1:])),
    P.mul_p: _scaled,
    P.div_p: _scaled,
    P.integer_pow_p: _even_power,
    P.square_p: _zero,
    P.abs_p: _zero,
    P.exp_p: _zero,  # underflows to 0
    P.exp2_p: _zero,
    P.sqrt_p: lambda eqn, bounds, consts: None if bounds[0] is None else 0.0,
    P.reduce_sum_p: lambda eqn, bounds, consts: None if bounds[0] is None else 0.0,
    P.convert_element_type_p: _same_dtype,
    P.reduce_precision_p: lambda eqn, bounds, consts: None if bounds[0] is None else 0.0,
    # lanes that move, unchanged
    P.broadcast_in_dim_p: _moved,
    P.reshape_p: _moved,
    P.squeeze_p: _moved,
    P.transpose_p: _moved,
    P.slice_p: _moved,
    P.copy_p: _moved,
    P.stop_gradient_p: _moved,
}
"""Lower bound of the output from the operands' bounds (and values, when constant)."""

DECREASING: frozenset = frozenset({P.sqrt_p, P.rsqrt_p, P.cbrt_p, P.log_p})
"""Guarded (operand 0) primitives whose value and derivative are finite for every operand at or
above a positive point where they are finite."""


class Bounds:
    """Lower bounds of the values of one jaxpr, computed on demand and memoized."""

    def __init__(self, eqns, producer: dict, constants: dict):
        self.eqns, self.producer, self.constants = eqns, producer, constants
        self.memo: dict = {}

    def _constant(self, atom):
        if isinstance(atom, Literal):
            return np.asarray(atom.val)
        return self.constants.get(atom)

    def of(self, atom) -> Bound:
        value = self._constant(atom)
        if value is not None:
            return constant_bound(value)
        return postorder(atom, self.memo, self._inputs, self._bound)

    def _rule(self, v):
        i = self.producer.get(v)
        eqn = None if i is None else self.eqns[i]
        rule = None if eqn is None or len(eqn.outvars) != 1 else RULES.get(eqn.primitive)
        return eqn, rule

    def _inputs(self, v) -> list:
        eqn, rule = self._rule(v)
        if rule is None:
            return []
        return [u for u in eqn.invars if isinstance(u, Var) and self._constant(u) is None]

    def _bound(self, v) -> Bound:
        eqn, rule = self._rule(v)
        if rule is None:
            return None
        consts = [self._constant(u) for u in eqn.invars]
        bounds = [constant_bound(c) if c is not None else self.memo[u]
                  for u, c in zip(eqn.invars, consts)]
        return rule(eqn, bounds, consts)
