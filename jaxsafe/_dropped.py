"""What values hold in all their dropped lanes, known when the rewrite is planned.

A guard whose operand is known to be inside the primitive's domain in its dropped lanes
(`div(_, exp(guarded x))` has 1 there already, `log(2.)` always, a softmax's row sums) is a
no-op: the guard pass leaves it out, and XLA keeps folding the constant.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

import numpy as np

from ._atoms import SMALL_CONSTANT, dtype_of, literal_value, shape_of
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Tracer, Var
from ._constants import finite_with_derivatives, fold
from ._liveness import Sweep
from ._report import Site
from ._rules import alignment, rule_for
from ._symbolic import backward_mapping, forward_mapping, implies, move
from ._walk import demand

Known = tuple[np.ndarray, bool] | None
"""(value, is_constant): the value a variable holds in its dropped lanes (everywhere, when it
is a constant), or None when unknown."""


class DroppedValues:
    """The known dropped values of one jaxpr, computed on demand while the guard pass runs.

    A constant (literals only, or a small concrete constant) holds its value everywhere. `v =
    op(a, b, ...)`, elementwise, holds `op` of its operands' known values, when each operand is
    a constant, is replaced there by this equation's guard, or is itself known in its dropped
    lanes and every dropped lane of `v` reads only dropped lanes of it (`reads_dropped`). A
    primitive with a `scalar_move` rule (a broadcast, a size-1 reshape, a reduction) carries a
    value known to be one scalar in dropped lanes, on the same condition: the row sums of a
    softmax whose dropped rows are guarded to `exp(0) = 1` hold the row length there.

    `sites` is the guard pass's own table, filled in as it goes: a value is computed when first
    asked for, after every equation it depends on has been planned.
    """

    def __init__(self, closed: ClosedJaxpr, sites: Mapping[int, Site], sweep: Sweep):
        self.eqns, self.sites, self.sweep = closed.jaxpr.eqns, sites, sweep
        self.reads: dict[Any, int] = {}
        for e in self.eqns:
            for v in e.invars:
                if isinstance(v, Var):
                    self.reads[v] = self.reads.get(v, 0) + 1
        for v in closed.jaxpr.outvars:
            if isinstance(v, Var):
                self.reads[v] = self.reads.get(v, 0) + 1
        self.memo: dict[Any, Known] = {}
        for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
            if not isinstance(c, Tracer) and np.size(c) <= SMALL_CONSTANT:
                self.memo[v] = (np.asarray(c), True)

    def get(self, atom: Any) -> Known:
        """What `atom` holds in its dropped lanes."""
        if isinstance(atom, Literal):
            return np.asarray(literal_value(atom)), True
        return demand(atom, self.memo, self._compute)

    # -- the walk ---------------------------------------------------------------------------

    def _producer(self, v: Any) -> tuple[int, JaxprEqn] | None:
        i = self.sweep.producer.get(v)
        return None if i is None else (i, self.eqns[i])

    def _elementwise(self, i: int, eqn: JaxprEqn) -> bool:
        site = self.sites.get(i)
        return (len(eqn.outvars) == 1 and not eqn.effects and rule_for(eqn.primitive).elementwise
                and not (site is not None and site.cut))

    def _compute(self, v: Any) -> Generator[Any, Known, Known]:
        """The rule `demand` runs: yields each operand it needs, receives what it holds."""
        found = self._producer(v)
        if found is None:
            return None
        i, eqn = found
        if self._moves_scalar(eqn):
            u = eqn.invars[0]
            return self._moved_scalar(eqn, self.get(u) if isinstance(u, Literal) else (yield u))
        if not self._elementwise(i, eqn):
            return None
        site = self.sites.get(i)
        vals, constant = [], True
        for k, u in enumerate(eqn.invars):
            if site is not None and k in site.replace:
                vals.append(np.asarray(site.replace[k], dtype_of(u)))
                constant = False
                continue
            known = self.get(u) if isinstance(u, Literal) else (yield u)
            if known is None:
                return None
            if not known[1]:  # known in dropped lanes only: v's must read only those
                if not self.reads_dropped(eqn, k):
                    return None
                constant = False
            vals.append(known[0])
        if constant and int(np.prod(shape_of(v))) > SMALL_CONSTANT:
            return None  # a large constant array: not worth evaluating at rewrite time
        return fold(eqn, vals)[0], constant

    @staticmethod
    def _moves_scalar(eqn: JaxprEqn) -> bool:
        return (rule_for(eqn.primitive).scalar_move is not None and len(eqn.outvars) == 1
                and not eqn.effects)

    def _moved_scalar(self, eqn: JaxprEqn, known: Known) -> Known:
        """A value that holds one scalar in its dropped lanes (or everywhere), moved."""
        if known is None or np.ndim(known[0]) != 0:
            return None
        if not known[1] and not self.reads_dropped(eqn, 0):
            return None
        move_scalar = rule_for(eqn.primitive).scalar_move
        assert move_scalar is not None
        value = move_scalar(eqn, np.asarray(known[0]))
        return None if value is None else (value, known[1])

    # -- queries ----------------------------------------------------------------------------

    def reads_dropped(self, eqn: JaxprEqn, k: int) -> bool:
        """Whether each dropped lane of `eqn`'s output reads only dropped lanes of operand k: a
        live operand lane feeds live output lanes only (static masks, `_symbolic.implies`)."""
        u, v = eqn.invars[k], eqn.outvars[0]
        if self.reads.get(u, 0) == 1 and shape_of(u) == shape_of(v) and \
                rule_for(eqn.primitive).elementwise and len(eqn.outvars) == 1:
            return True  # the operand's dropped lanes are exactly the output's
        align = alignment(eqn, k)
        if align is None:
            return False
        su, sv = self.sweep.sym(u), self.sweep.sym(v)
        if {a for a in align if a is not None} == set(range(len(shape_of(v)))):
            # every output axis is an operand axis (a reduction, the same shape): in u's lanes
            return implies(su, move(sv, backward_mapping(align)))
        if all(a is not None or n == 1 for a, n in zip(align, shape_of(u), strict=True)):
            # every operand axis is an output axis (a broadcast): in v's lanes
            return implies(move(su, forward_mapping(align)), sv)
        return False

    def guard_is_noop(self, eqn: JaxprEqn, k: int, safe: Mapping[int, float]) -> bool:
        """Whether operand k of `eqn` is known, in the lanes its guard would replace, to be a
        value at which `eqn` and its first derivatives are finite."""
        known = self.get(eqn.invars[k])
        if known is None or (not known[1] and not self.reads_dropped(eqn, k)):
            return False
        point = []
        for j, a in enumerate(eqn.invars):  # the others: known, else their safe value, else 1
            other = known if j == k else self.get(a)
            if other is not None and (j == k or other[1]):
                point.append(np.asarray(other[0]))
            else:
                point.append(np.asarray(safe.get(j, 1.0), dtype_of(a)))
        return finite_with_derivatives(eqn, point)


# --------------------------------------------------------------------------- scalar moves
# `PrimitiveRule.scalar_move` rules: the scalar an output holds in its dropped lanes, given the
# scalar its operand holds in the lanes they read.


def same_scalar(eqn: JaxprEqn, value: np.ndarray) -> np.ndarray | None:
    """A broadcast or a squeeze: the same scalar."""
    return value


def reshaped_scalar(eqn: JaxprEqn, value: np.ndarray) -> np.ndarray | None:
    """A reshape: the same scalar, unless it transposes first (`dimensions`)."""
    return value if eqn.params.get("dimensions") is None else None


def _row_length(eqn: JaxprEqn, value: np.ndarray) -> int | None:
    n = int(np.prod([shape_of(eqn.invars[0])[a] for a in eqn.params["axes"]]))
    return None if n == 0 or not np.issubdtype(value.dtype, np.floating) else n


def chosen_scalar(eqn: JaxprEqn, value: np.ndarray) -> np.ndarray | None:
    """`reduce_max`, `reduce_min` over a non-empty row of one scalar: that scalar."""
    return None if _row_length(eqn, value) is None else value


def summed_scalar(eqn: JaxprEqn, value: np.ndarray) -> np.ndarray | None:
    """`reduce_sum` of a row of one scalar: the scalar times the row length."""
    n = _row_length(eqn, value)
    if n is None:
        return None
    total = float(value) * n  # the row sums a run computes differ by rounding only
    if not abs(total) < float(np.finfo(value.dtype).max) / 2:
        return None
    return np.asarray(total, value.dtype)
