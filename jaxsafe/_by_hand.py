"""Hazards the program already guards by hand: no guard is added there.

A hand-written double where, `jnp.where(p, jnp.sqrt(jnp.where(p, x, 0.)), 0.)` (jax-md's
`safe_mask`), leaves `sqrt` singular in its dropped lanes (`sqrt(0)`), yet every derivative is
right: the lanes the outer `where` drops are lanes the inner one filled with a constant.

- Reverse mode: the zero cotangent meets `sqrt`'s infinite derivative there (`0 * inf`), but
  the NaN lands in the cotangent of the inner `where`'s output, in lanes that come from the
  constant: the `where`'s transpose hands them to the constant, and `x` gets 0.
- Forward mode: the tangent there is `inf * 0` too, and it stays in lanes that the outer
  `where` drops by selection, so no output reads it.

So an equation needs no guard of its dropped lanes when (reverse) each of its differentiated
operands carries no derivative in those lanes, made so by a selection (`FreeValues`: its free
lanes and `selected`), and (forward) the tangent that can be NaN there reaches no live lane: it
is followed forward, lane by lane, and must be dropped by selections (`select_n` on a predicate)
before anything weighs it (`0 * NaN` in a masked product, `max`'s derivative) or an output reads
it. Both are shown with the static formulas (`_symbolic.py`); predicates the program computes
twice count as one (`Sweep.same_as`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._atoms import dtype_of, is_float, literal_value, shape_of
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Tracer, Var
from ._constants import domain_holds_above
from ._free import FreeValues
from ._liveness import Sweep
from ._rules import rule_for
from ._symbolic import (
    FALSE,
    Sym,
    disjoint,
    implies,
    negate,
    predicate_literal,
    sym_and,
    sym_and_literal,
    sym_not,
    sym_or,
)

MAX_STEPS = 4096
"""Equations the forward walk of one hazard looks at, at most; past that it keeps the guard."""


class HandGuards:
    """Which guarded equations of one program the program already guards by hand."""

    def __init__(self, closed: ClosedJaxpr, sweep: Sweep, free: FreeValues):
        self.eqns, self.sweep, self.free = closed.jaxpr.eqns, sweep, free
        self.outvars = {v for v in closed.jaxpr.outvars if isinstance(v, Var)}
        self.fixed = {v for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)
                      if not isinstance(c, Tracer)}

    def covers(self, i: int, eqn: JaxprEqn) -> bool:
        """Whether every derivative of `eqn`'s dropped lanes is already exactly zero."""
        if len(eqn.outvars) != 1 or not rule_for(eqn.primitive).elementwise:
            return False
        out = eqn.outvars[0]
        dead = sym_not(self.sweep.sym(out))
        if dead is None or dead == FALSE:
            return dead == FALSE
        return self._operands_free(i, eqn, dead) and self._tangent_dropped(i, out, dead)

    def _operands_free(self, i: int, eqn: JaxprEqn, dead: Sym) -> bool:
        """Reverse mode: each differentiated operand carries no derivative in the dead lanes,
        made so by a selection, so whatever reaches its cotangent there stops; or, in the dead
        lanes where it does carry one, a predicate holds that keeps the equation finite with
        its derivative (`safe_mask(r2 > 1e-12, jnp.sqrt, r2)`: `sqrt` where `r2 > 1e-12`)."""
        shape = shape_of(eqn.outvars[0])
        for k, (v, d) in enumerate(zip(eqn.invars, self.sweep.diff[i], strict=True)):
            if not d or not isinstance(v, Var) or not is_float(v) or v in self.fixed:
                continue
            if shape_of(v) != shape:  # a broadcast operand: its lane feeds live lanes too
                return False
            free = self.free.free_sym(v)
            if not self.free.selected(v):
                return False
            if implies(dead, free):
                continue
            carrying = sym_not(free)
            rest = None if carrying is None else sym_and(dead, carrying)
            if rest is None or not self._in_domain(eqn, k, rest):
                return False
        return True

    def _in_domain(self, eqn: JaxprEqn, k: int, lanes: Sym) -> bool:
        """Whether operand k of `eqn` (the only one) is, in every lane of `lanes`, where a
        predicate of each term bounds it from below into the domain of a primitive that only
        gets safer above (`PrimitiveRule.decreasing`: `sqrt`, `log`)."""
        if k != 0 or len(eqn.invars) != 1 or not rule_for(eqn.primitive).decreasing:
            return False
        return all(any(self._bounds(eqn, term_lit) for term_lit in term if term_lit[1])
                   for term in lanes)

    def _bounds(self, eqn: JaxprEqn, lit: tuple) -> bool:
        """Whether the positive literal `lit` (a predicate holds) bounds `eqn`'s operand into
        its domain: the operand is, where the predicate holds, a value `a` the predicate
        compares with a constant from below (`a > c`, `a >= c`, `c < a`, `c <= a`)."""
        key = lit[0]
        if not isinstance(key, Var):
            return False
        compare = self.sweep.producer_of(key)
        if compare is None or len(compare.invars) != 2:
            return False
        bounds = rule_for(compare.primitive).bounds_below
        if bounds is None:
            return False
        strict, value_side = bounds
        a, c = compare.invars[value_side], compare.invars[1 - value_side]
        bound = literal_value(c) if isinstance(c, Literal) else self.sweep.constant(c)
        if bound is None or np.size(bound) != 1 or not isinstance(a, Var):
            return False
        if _taken_where(eqn.invars[0], key, self.sweep) is not self.sweep.same_as(a):
            return False
        point = np.asarray(bound, dtype_of(a)).reshape(())
        if strict:
            point = np.nextafter(point, np.asarray(np.inf, point.dtype))
        return domain_holds_above(eqn, point)

    def _tangent_dropped(self, i: int, out: Var, dead: Sym) -> bool:
        """Forward mode: the lanes whose tangent may be NaN (`dead`, from `out` on) are dropped
        by selections before anything weighs them or an output reads them."""
        poisoned: dict[Any, Sym] = {out: dead}
        if out in self.outvars:
            return False
        for j in range(i + 1, min(len(self.eqns), i + 1 + MAX_STEPS)):
            eqn = self.eqns[j]
            reads = [k for k, (v, d) in enumerate(zip(eqn.invars, self.sweep.diff[j],
                                                      strict=True))
                     if d and isinstance(v, Var) and v in poisoned]
            if reads and not self._step(j, eqn, reads, poisoned):
                return False
            if not poisoned:
                return True
        return not poisoned

    def _step(self, j: int, eqn: JaxprEqn, reads: list[int], poisoned: dict) -> bool:
        """Carry the poisoned lanes across equation j; False where they reach a live lane."""
        carried = self._carried(eqn, reads, poisoned)
        if carried is None:
            return False
        target = eqn.outvars[0]
        if carried != FALSE:
            if target in self.outvars or not disjoint(carried, self.sweep.sym(target)):
                return False
            if self.sweep.consumers.get(target):  # else nothing passes its tangent on
                poisoned[target] = carried
        for k in reads:  # a value read for the last time needs no more following
            v = eqn.invars[k]
            if v in poisoned and all(c <= j for c, _ in self.sweep.consumers.get(v, ())):
                del poisoned[v]
        return True

    def _carried(self, eqn: JaxprEqn, reads: list[int], poisoned: dict) -> Sym | None:
        """The output lanes whose tangent may be NaN, from the operands' (None: unknown)."""
        rule = rule_for(eqn.primitive)
        if len(eqn.outvars) != 1:
            return None
        shape = shape_of(eqn.outvars[0])
        if any(shape_of(eqn.invars[k]) != shape for k in reads):
            return None
        pred = eqn.invars[0]
        if rule.selection is not None and rule.selection.by_predicate:
            if not isinstance(pred, Var) or dtype_of(pred) != np.bool_ \
                    or len(eqn.invars) != 3 or shape_of(pred) not in (shape, ()):
                return None
            lit = predicate_literal(pred, True, self.sweep.broadcast_of, self.sweep.same_as)
            cases = [poisoned.get(v, FALSE) if isinstance(v, Var) else FALSE
                     for v in eqn.invars[1:]]
            return sym_or(sym_and_literal(cases[0], negate(lit)),
                          sym_and_literal(cases[1], lit))
        if rule.elementwise and rule.selection is None:
            out = FALSE
            for k in reads:
                out = sym_or(out, poisoned[eqn.invars[k]])
            return out
        return None


def _taken_where(v: Any, key: Var, sweep: Sweep) -> Any:
    """The value `v` is in the lanes where predicate `key` holds: through `select_n`s on
    `key`, the case taken when it holds (the others, `v` itself)."""
    while True:
        producer = sweep.producer_of(v)
        if producer is None or len(producer.invars) != 3:
            return sweep.same_as(v)
        rule = rule_for(producer.primitive)
        pred = producer.invars[0]
        if rule.selection is None or not rule.selection.by_predicate \
                or not isinstance(pred, Var) or sweep.same_as(pred) is not sweep.same_as(key) \
                or not isinstance(producer.invars[2], Var):
            return sweep.same_as(v)
        v = producer.invars[2]
