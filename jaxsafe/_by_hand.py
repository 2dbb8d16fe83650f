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

In the dropped lanes where an operand does carry a derivative, the predicates that drop them
may bound it into the domain instead: `jnp.where(r < 2.5, f(r), 0.)` with `r = sqrt(r2)` drops
lanes where `r >= 2.5` (r never NaN there: it is finite in every lane), so `r2 >= 6.25`, back
through the primitives `r` grows with (`PrimitiveRule.preimage`, rounding allowed for), and
`sqrt` is finite with its derivatives to the third order. A term asking whether a finite value
is NaN or inf (`nan_to_num`'s tests) holds in no lane.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import numpy as np

from ._atoms import (
    dtype_of,
    is_float,
    literal_value,
    next_toward,
    readable_constant,
    shape_of,
)
from ._case_index import case_syms
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Var
from ._constants import PROOF_ORDER, domain_holds_above, finite_with_derivatives, fold
from ._diagonal import DiagonalValues
from ._finite_lanes import finite_where_dropped
from ._free import FreeValues
from ._liveness import Sweep
from ._ranges import compared
from ._rules import rule_for
from ._symbolic import (
    FALSE,
    TRUE,
    Sym,
    disjoint,
    expand_connectives,
    forced_everywhere,
    implies,
    join_on,
    predicate_literal,
    sym_and,
    sym_not,
    sym_or,
)
from ._taint import nonfinite_anywhere

MAX_STEPS = 4096
"""Equations the forward walk of one hazard looks at, at most; past that it keeps the guard."""


class HandGuards:
    """Which guarded equations of one program the program already guards by hand."""

    def __init__(self, closed: ClosedJaxpr, sweep: Sweep, free: FreeValues, seeds: Set):
        self.closed, self.seeds = closed, seeds
        self.eqns, self.sweep, self.free = closed.jaxpr.eqns, sweep, free
        self.outvars = {v for v in closed.jaxpr.outvars if isinstance(v, Var)}
        self.fixed = {v for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)
                      if readable_constant(c)}
        self._nonfinite: set | None = None
        self._diagonals: DiagonalValues | None = None

    @property
    def nonfinite(self) -> set:
        """The values that may hold NaN or inf in some lane of the original program (made on
        the first question: most programs never ask)."""
        if self._nonfinite is None:
            self._nonfinite = nonfinite_anywhere(self.closed, set(self.seeds))
        return self._nonfinite

    def _dead(self, eqn: JaxprEqn) -> Sym | None:
        """The dropped lanes of an elementwise equation's output that some lane can satisfy
        (None: unknown, or not elementwise)."""
        if len(eqn.outvars) != 1 or not rule_for(eqn.primitive).elementwise:
            return None
        dead = sym_not(self.sweep.sym(eqn.outvars[0]))
        if dead is None:
            return None
        # a NaN test of a finite value, a diagonal a predicate fails on
        return frozenset(term for term in dead if not self._impossible(term))

    def covers(self, i: int, eqn: JaxprEqn) -> bool:
        """Whether every derivative of `eqn`'s dropped lanes is already exactly zero."""
        dead = self._dead(eqn)
        if dead is None or dead == FALSE:
            return dead == FALSE
        out = eqn.outvars[0]
        if not self._operands_free(i, eqn, dead):
            return False
        # forward mode: a lane where the equation is finite with its derivatives makes no NaN
        differentiated = [k for k, (v, d) in enumerate(zip(eqn.invars, self.sweep.diff[i],
                                                           strict=True))
                          if d and isinstance(v, Var) and is_float(v)]
        singular = frozenset(term for term in dead
                             if not self._safe_on_diagonal(eqn, differentiated, term)
                             and not self._safe_at_taken_constants(eqn, differentiated, term))
        return singular == FALSE or self._tangent_dropped(i, out, singular)

    def covers_value(self, i: int, eqn: JaxprEqn, k: int) -> bool:
        """Whether operand k, which may be non-finite in `eqn`'s dropped lanes, meets only
        derivatives that selections stop there, as in a hand-written double where (`x *
        log(where(x > 0, x, 1.))` under `where(x > 0, ., 0.)`): (reverse) every differentiated
        operand whose derivative reads it carries no derivative in those lanes, made so by a
        selection, so the `0 * NaN` of its cotangent goes to the constant the inner `where`
        took; (forward) the NaN tangent it makes there is dropped by selections. Only where
        the row says which operands each derivative reads and operand k's own does not read it
        (a product, a quotient's numerator): its second derivatives then never weigh it by
        another operand's zero tangent (`pow`'s exponent does: hunt W)."""
        rule = rule_for(eqn.primitive)
        reads, dead = rule.derivative_reads, self._dead(eqn)
        if dead is not None and shape_of(eqn.invars[k]) == shape_of(eqn.outvars[0]) and \
                finite_where_dropped(dead, eqn.invars[k], self.sweep, self.free.bounds):
            return True  # finite where dropped, by the comparison that drops it
        if reads is None or k in reads[k] or dead is None:
            return False
        shape = shape_of(eqn.outvars[0])
        for j, (u, d) in enumerate(zip(eqn.invars, self.sweep.diff[i], strict=True)):
            if j == k or not d or j in rule.no_derivative or k not in reads[j]:
                continue
            if u is eqn.invars[k] or not isinstance(u, Var) or shape_of(u) != shape or \
                    not self.free.selected(u) or not implies(dead, self.free.free_sym(u)):
                return False
        return dead == FALSE or self._tangent_dropped(i, eqn.outvars[0], dead)

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
            # an operand no selection made: every dead lane must be in the domain
            free = self.free.free_sym(v) if self.free.selected(v) else FALSE
            if self._implies(dead, free):
                continue
            carrying = sym_not(free)
            rest = None if carrying is None else sym_and(dead, carrying)
            if rest is None or not self._in_domain(eqn, k, rest):
                return False
        return True

    def _implies(self, a: Sym, b: Sym) -> bool:
        """`a` implies `b`, also where they are read over the predicates that `and`, `or` and
        `not` compute theirs from (`jnp.select`'s branch guarded by `(x > 0) & ~(x > 1)`)."""
        if implies(a, b):
            return True
        expansion = self.sweep.connective_of
        return implies(expand_connectives(a, expansion), expand_connectives(b, expansion))

    def _in_domain(self, eqn: JaxprEqn, k: int, lanes: Sym) -> bool:
        """Whether operand k of `eqn` (the only one) is, in every lane of `lanes`, where a
        predicate of each term bounds it from below into the domain of a primitive that only
        gets safer above (`PrimitiveRule.decreasing`: `sqrt`, `log`); a term no lane can
        satisfy (a NaN test of a value that is finite) needs none."""
        bounded = k == 0 and len(eqn.invars) == 1 and rule_for(eqn.primitive).decreasing
        for term in lanes:
            if self._impossible(term) or self._safe_on_diagonal(eqn, [k], term):
                continue
            taken = self._decided(eqn.invars[0], term) if bounded else {}
            if not bounded or not any(self._bounds(eqn, lit, taken) for lit in term):
                return False
        return True

    def _safe_on_diagonal(self, eqn: JaxprEqn, operands: list[int], term: frozenset) -> bool:
        """Whether `term` holds on a diagonal only (the lanes `1 - eye(n)` drops), where every
        operand of `eqn` holds a known scalar at which it is finite with its derivatives in
        each of `operands` to `PROOF_ORDER` (jax-md's Morse, `(1 - exp(-alpha * (d -
        sigma))) ** 2.` at a particle's distance 0 to itself)."""
        shape = shape_of(eqn.outvars[0])
        for _, diagonal in self._diagonals_of(term):
            point = []
            for u in eqn.invars:
                if isinstance(u, Literal):
                    value = np.asarray(literal_value(u))
                else:
                    value = self.diagonals.holds(u, diagonal) if shape_of(u) == shape else None
                if value is None or value.ndim != 0:
                    break
                point.append(value)
            else:
                if all(finite_with_derivatives(eqn, point, PROOF_ORDER, wrt=k)
                       for k in operands):
                    return True
        return False

    def _safe_at_taken_constants(self, eqn: JaxprEqn, operands: list[int],
                                 term: frozenset) -> bool:
        """Whether, in the lanes of `term`, every operand of `eqn` is one known scalar that
        the selections `term` decides took from a constant, at which `eqn` is finite with its
        derivatives in each of `operands` to `PROOF_ORDER`: there the tangents are zero and
        meet finite derivatives (`sqrt(where(p, x, 1.))` whose lanes a `where(p, ...)` drops
        after a loop or a sum that mixes them, so that no forward walk can follow them)."""
        point = []
        for u in eqn.invars:
            value = self._taken_constant(u, term)
            if value is None:
                return False
            point.append(value)
        return all(finite_with_derivatives(eqn, point, PROOF_ORDER, wrt=k) for k in operands)

    def _taken_constant(self, operand: Any, term: frozenset) -> np.ndarray | None:
        """The one scalar `operand` holds in the lanes of `term`: a literal, or a constant the
        `select_n`s on `term`'s predicates take there (None: unknown, or not one scalar)."""
        v = operand
        for _ in range(MAX_STEPS):
            if isinstance(v, Literal):
                return np.asarray(literal_value(v))
            value = self.sweep.constant(v)
            if value is not None:
                flat = np.ravel(np.asarray(value))
                if flat.size == 0 or not np.all(flat == flat[0]):
                    return None
                return flat[0]
            producer = self.sweep.producer_of(v)
            if producer is None or len(producer.invars) != 3 \
                    or shape_of(producer.invars[1]) != shape_of(v):
                return None
            selection = rule_for(producer.primitive).selection
            pred = producer.invars[0]
            if selection is None or not selection.by_predicate or not isinstance(pred, Var) \
                    or dtype_of(pred) != np.bool_:
                return None
            key, _, embed = predicate_literal(pred, True, self.sweep.broadcast_of,
                                              self.sweep.same_as)
            holds = {positive for k, positive, e in term if k is key and e == embed}
            forced = forced_everywhere(term).get(key)
            if forced is not None:
                holds.add(forced)
            if not holds:
                holds = self._decided_by_connectives((key, True, embed), term)
            if len(holds) != 1:
                return None
            v = producer.invars[2 if holds.pop() else 1]
        return None

    def _decided_by_connectives(self, lit: tuple, term: frozenset) -> set[bool]:
        """The value `term` forces on a predicate that `and`, `or` and `not` compute from
        predicates `term` names (`(x > 0) & ~(x > 1)` where `x > 1` holds: False), as a set of
        one bool; empty where it forces none."""
        expanded = expand_connectives(frozenset({frozenset({lit})}), self.sweep.connective_of)
        lanes = frozenset({term})
        if disjoint(lanes, expanded):
            return {False}
        return {True} if implies(lanes, expanded) else set()

    def _decided(self, operand: Any, term: frozenset) -> dict:
        """The predicates `term` decides lane by lane for `operand` (same shape, same axes),
        with the value each takes."""
        rank = len(shape_of(operand))
        return {self.sweep.same_as(lit[0]): lit[1] for lit in term
                if isinstance(lit[0], Var) and lit[2] == tuple(range(rank))
                and shape_of(lit[0]) == shape_of(operand)}

    def _impossible(self, term: frozenset) -> bool:
        """Whether no lane satisfies `term`: a literal of it asks whether a finite value is NaN
        or inf (`_never_holds`), or it holds on a diagonal only, where another of its literals
        is known to fail (`_fails_on_diagonal`)."""
        return self._never_holds(term) or self._fails_on_diagonal(term)

    def _diagonals_of(self, term: frozenset) -> list[tuple[Any, tuple[int, int]]]:
        """The literals of `term` that hold exactly on a diagonal (`eq(i, j)` of an `eye`),
        each with that diagonal, in the frame of the value the term is about."""
        found = []
        for key, positive, embed in term:
            diagonal = self.diagonals.of_predicate(key, embed) if positive else None
            if diagonal is not None:
                found.append((key, diagonal))
        return found

    def _fails_on_diagonal(self, term: frozenset) -> bool:
        """`term` holds `eq(i, j)` (the lanes `1 - eye(n)` drops) and a predicate whose value on
        that diagonal is the opposite (`r2 > 0`, with `r2` a sum of `(x_j - x_i) ** 2`)."""
        diagonals = self.diagonals
        for key, diagonal in self._diagonals_of(term):
            for other, holds, other_embed in term:
                axes = diagonals.in_frame(diagonal, other_embed)
                if other is key or not isinstance(other, Var) or axes is None:
                    continue
                value = diagonals.holds(other, axes)
                if value is not None and value.dtype == np.bool_ and bool(value) != holds:
                    return True
        return False

    @property
    def diagonals(self) -> DiagonalValues:
        """What values hold on diagonals (made on the first question)."""
        if self._diagonals is None:
            self._diagonals = DiagonalValues(_DiagonalContext(self))
        return self._diagonals

    def _never_holds(self, term: frozenset) -> bool:
        """Whether a literal of `term` never holds: it asks whether a value is NaN or inf
        (`x != x`, `x == inf`, `isfinite`), and the value is finite in every lane."""
        for key, positive, _ in term:
            compare = self.sweep.producer_of(key) if isinstance(key, Var) else None
            if compare is None or len(compare.outvars) != 1:
                continue
            test = rule_for(compare.primitive).tests_nonfinite
            tested = test(compare) if test is not None else []
            if not tested or any(v in self.nonfinite for v in tested) or any(
                    isinstance(v, Var) and v not in tested for v in compare.invars):
                continue
            # the answer is the same for every finite value: ask it of 0
            values = [np.zeros((), dtype_of(v)) if isinstance(v, Var) else literal_value(v)
                      for v in compare.invars]
            if bool(np.all(fold(compare, values)[0])) != positive:
                return True
        return False

    def _bounds(self, eqn: JaxprEqn, lit: tuple, taken: dict) -> bool:
        """Whether the literal `lit` bounds `eqn`'s operand into its domain: it compares a value
        `a` with a constant, and bounds `a` from below (`a > c`; `a < c` fails, where `a` is
        never NaN), and `a` grows with the operand (`PrimitiveRule.preimage`: `sqrt(x) / s`,
        through the selections `taken` decides)."""
        key = lit[0]
        if not isinstance(key, Var) or self.sweep.same_as(key) not in taken:
            return False
        compare = self.sweep.producer_of(key)
        # `a < c` fails: `a >= c`, if neither is NaN
        if compare is None or (order := compared(compare, lit[1])) is None:
            return False
        value_side, strict = order
        a, c = compare.invars[value_side], compare.invars[1 - value_side]
        bound = literal_value(c) if isinstance(c, Literal) else self.sweep.constant(c)
        if bound is None or np.size(bound) != 1 or not isinstance(a, Var) or not is_float(a):
            return False  # an integer compared (`x.astype(int) > 0`): no float bound to carry
        point = np.asarray(bound, dtype_of(a)).reshape(())
        if not lit[1] and (a in self.nonfinite or not np.isfinite(point)):
            return False
        if strict:
            point = next_toward(point, 1)
        lower = self._operand_bound(eqn.invars[0], a, float(point), taken)
        if lower is None or not np.isfinite(lower):
            return False
        operand_point = np.asarray(lower, dtype_of(eqn.invars[0])).reshape(())
        if float(operand_point) > lower:  # rounded up: one step down
            operand_point = next_toward(operand_point, -1)
        return domain_holds_above(eqn, operand_point)

    def _operand_bound(self, operand: Any, a: Var, lower: float, taken: dict) -> float | None:
        """A lower bound of `operand` where `a >= lower`: back from `a` through the selections
        `taken` decides and the primitives it grows with, to `operand`, itself read through
        the selections `taken` decides (`log(where(x > 1, x, 1.))` where `x > 2`: `x`)."""
        operand = _taken_case(operand, taken, self.sweep)
        target = self.sweep.same_as(operand) if isinstance(operand, Var) else None
        v: Any = a
        shape = shape_of(operand)
        for _ in range(MAX_STEPS):
            if isinstance(v, Var) and self.sweep.same_as(v) is target:
                return lower
            v = _taken_case(v, taken, self.sweep)
            if not isinstance(v, Var) or shape_of(v) != shape:
                return None
            if self.sweep.same_as(v) is target:
                return lower
            producer = self.sweep.producer_of(v)
            if producer is None or lower <= 0 or len(producer.outvars) != 1:
                return None
            preimage = rule_for(producer.primitive).preimage
            if preimage is None:
                return None
            consts = [self.sweep.constant(u) for u in producer.invars]
            found = preimage(producer, lower, consts)
            if found is None:
                return None
            k, lower = found
            v = producer.invars[k]
        return None

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
        carried = self._carried(j, eqn, reads, poisoned)
        if carried is None:
            return False
        # terms no lane satisfies (`eq(i, j)` and `r2 > 0` together) poison nothing
        carried = frozenset(term for term in carried if not self._impossible(term))
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

    def _carried(self, j: int, eqn: JaxprEqn, reads: list[int], poisoned: dict) -> Sym | None:
        """The output lanes whose tangent may be NaN, from the operands' (None: unknown)."""
        rule = rule_for(eqn.primitive)
        if len(eqn.outvars) != 1:
            return None
        shape = shape_of(eqn.outvars[0])
        if any(shape_of(eqn.invars[k]) != shape for k in reads):
            return None
        pred = eqn.invars[0]
        if rule.selection is not None and rule.selection.by_predicate:
            if isinstance(pred, Var) and dtype_of(pred) != np.bool_:
                return self._carried_by_index(eqn, poisoned)
            if not isinstance(pred, Var) or dtype_of(pred) != np.bool_ \
                    or len(eqn.invars) != 3 or shape_of(pred) not in (shape, ()):
                return None
            lit = predicate_literal(pred, True, self.sweep.broadcast_of, self.sweep.same_as)
            cases = [poisoned.get(v, FALSE) if isinstance(v, Var) else FALSE
                     for v in eqn.invars[1:]]
            return join_on(lit, cases[0], cases[1])
        if rule.elementwise and rule.selection is None:
            out = FALSE
            for k in reads:
                out = sym_or(out, poisoned[eqn.invars[k]])
            if not rule.linear and self._weighs_another(j, eqn, reads, out):
                # `eps * sqrt(safe_mask(...))` with `eps` differentiated: a second reverse pass
                # weighs the NaN tangent's zero cotangent into `eps` (`0 * inf`; hunt AR)
                return None
            return out
        return None

    def _weighs_another(self, j: int, eqn: JaxprEqn, reads: list[int], lanes: Sym) -> bool:
        """Whether non-linear equation j has an operand besides the poisoned ones (`reads`)
        that carries a derivative in the poisoned `lanes`: its mixed second derivative carries
        their NaN to it. One a selection made free there hands it to a constant (`log(sqrt(y)
        - .5) / y` with `y = where(p, x, 0.)`)."""
        for k, (v, d) in enumerate(zip(eqn.invars, self.sweep.diff[j], strict=True)):
            if not d or k in reads or not isinstance(v, Var) or not is_float(v) or \
                    v in self.fixed:
                continue
            if not (self.free.selected(v) and self._implies(lanes, self.free.free_sym(v))):
                return True
        return False

    def _carried_by_index(self, eqn: JaxprEqn, poisoned: dict) -> Sym | None:
        """A `select_n` on an integer index read as predicates (`jnp.select`'s first True, a
        batched `cond`'s cast): each case's poisoned lanes where it is taken
        (`_case_index.case_syms`); None where the index is neither."""
        taken = case_syms(eqn, TRUE, self.sweep)
        if taken is None:
            return None
        out: Sym | None = FALSE
        for case, where in zip(eqn.invars[1:], taken[1:], strict=True):
            part = poisoned.get(case, FALSE) if isinstance(case, Var) else FALSE
            both = sym_and(part, where)
            if both is None:
                return None
            out = sym_or(out, both)
        return out


class _DiagonalContext:
    """What `_diagonal.py`'s rules ask, answered from the sweep and the taint pass."""

    def __init__(self, hand: HandGuards):
        self.hand = hand

    def finite(self, v: Any) -> bool:
        return v not in self.hand.nonfinite

    def same_as(self, v: Var) -> Var:
        return self.hand.sweep.same_as(v)

    def constant(self, v: Any) -> Any:
        return self.hand.sweep.constant(v)

    def producer_of(self, v: Any) -> JaxprEqn | None:
        return self.hand.sweep.producer_of(v)


def _taken_case(v: Any, taken: dict, sweep: Sweep) -> Any:
    """The value `v` is in the lanes where the predicates of `taken` hold as it says: through
    `select_n`s on them, the case taken (the others, `v` itself)."""
    while isinstance(v, Var):
        producer = sweep.producer_of(v)
        if producer is None or len(producer.invars) != 3:
            return v
        rule = rule_for(producer.primitive)
        pred = producer.invars[0]
        if rule.selection is None or not rule.selection.by_predicate \
                or not isinstance(pred, Var) or shape_of(pred) != shape_of(v):
            return v
        holds = taken.get(sweep.same_as(pred))
        if holds is None:
            return v
        v = producer.invars[2 if holds else 1]
    return v
