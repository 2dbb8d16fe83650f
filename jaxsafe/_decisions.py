"""The decision pass: which equations are emitted again, and what their decisions read.

Once an operand is guarded, every equation downstream of it on a differentiated path is emitted
again, on the guarded values (the *shadow*); the rest of the program is emitted once. A value
recomputed from guarded operands differs from the original in its dropped lanes only (the
complement of its liveness).

A *decision* reads values without differentiating them: a predicate, an index, the
`stop_gradient(max(x))` of a softmax. It must see the original values wherever its result is
live, or a guard could flip it. When the lanes that a guarded read would change are provably
dropped lanes of the result (a row that a `where` drops as a whole), the decision reads the
guarded value and the original program is not computed a second time for it (`ChangedLanes`).
`max`, `min` and `clamp` with a changed operand are re-decided on the original values, and so
are those whose cotangent may be non-finite (`_cotangents.py`), emitted once, as a `select_n`.

Reads: the liveness (`Sweep`), the guard sites and the masked bodies. Produces: `Decisions`, and
the re-decided selections in the report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._atoms import is_float, literal_value, shape_of
from ._bounds import Bounds, never_weighed_by_zero
from ._carries import Carry
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Var
from ._cotangents import Cotangents, selects_by_value
from ._liveness import Sweep
from ._ranges import compared
from ._report import Report, Site, note_failure
from ._rules import Kind, alignment, rule_for
from ._symbolic import FALSE, Sym, disjoint, forward_mapping, move, sym_not, sym_or


@dataclasses.dataclass
class Decisions:
    """What the emission pass needs to know beyond the guards."""

    reemit: set[int] = dataclasses.field(default_factory=set)
    """Equations emitted again on guarded operands (their results differ in dropped lanes)."""
    selections: set[int] = dataclasses.field(default_factory=set)
    """`max`/`min`/`clamp` equations emitted as a `select_n` on the original decision."""
    chain: set[int] = dataclasses.field(default_factory=set)
    """Decisions computed from guarded values (every operand read as guarded)."""
    safe_reads: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    """Equation -> operands read for their value only that may be read as guarded."""
    split_predicates: set[int] = dataclasses.field(default_factory=set)
    """`select_n` equations emitted again whose predicate was computed from guarded values:
    decided on those in the result's dropped lanes, on the original values in its live lanes."""


class ChangedLanes:
    """Where the guarded program's values may differ from the original's, as static formulas."""

    def __init__(self, sweep: Sweep):
        self.sweep = sweep
        self.chain: dict[Any, Sym | None] = {}  # decision values computed from guarded values
        self.changed: set = set()  # values recomputed from guarded operands
        self._dropped: dict[Any, Sym | None] = {}

    def of(self, v: Any) -> Sym | None:
        """Changed lanes of `v`: FALSE when unchanged, None when unknown."""
        if v in self.chain:
            return self.chain[v]
        if v not in self.changed:
            return FALSE
        if v not in self._dropped:
            self._dropped[v] = sym_not(self.sweep.sym(v))
        return self._dropped[v]

    def pushed(self, eqn: JaxprEqn, k: int) -> Sym | None:
        """The lanes of `eqn`'s output that operand k's changed lanes reach, or None."""
        sym = self.of(eqn.invars[k])
        if sym is None or sym == FALSE:
            return sym
        align = alignment(eqn, k)
        if align is None:
            return None
        return move(sym, forward_mapping(align))

    def reach(self, eqn: JaxprEqn) -> Sym | None:
        """The lanes of `eqn`'s output that any operand's changed lanes reach, or None."""
        reach: Sym | None = FALSE
        for k, v in enumerate(eqn.invars):
            pushed = self.pushed(eqn, k) if isinstance(v, Var) else FALSE
            reach = None if reach is None or pushed is None else sym_or(reach, pushed)
        return reach

    def reads_dropped_only(self, eqn: JaxprEqn, k: int) -> bool:
        """Whether reading operand k as guarded changes dropped lanes of the result only."""
        reach = self.pushed(eqn, k)
        return reach is not None and disjoint(reach, self.sweep.sym(eqn.outvars[0]))


def plan_decisions(closed: ClosedJaxpr, sweep: Sweep, sites: Mapping[int, Site],
                   masked: Mapping[int, list], report: Report,
                   cotangents: Cotangents | None = None,
                   bounds: Bounds | None = None) -> Decisions:
    """Walk the equations forward, following the guarded values. `cotangents`: the values
    whose cotangent may be non-finite (`_cotangents.py`; None: none is). `bounds`: the
    values' bounds, where known (a `max` whose differentiable operand never loses weighs
    nothing by 0)."""
    out = Decisions()
    lanes = ChangedLanes(sweep)
    i = 0
    try:
        for i, eqn in enumerate(closed.jaxpr.eqns):
            _plan_equation(i, eqn, sweep, sites, masked, lanes, out, report, cotangents,
                           bounds)
    except Exception as e:
        note_failure(e, closed.jaxpr.eqns[i], "decision")
        raise
    return out


def _plan_equation(i: int, eqn: JaxprEqn, sweep: Sweep, sites: Mapping[int, Site],
                   masked: Mapping[int, list], lanes: ChangedLanes, out: Decisions,
                   report: Report, cotangents: Cotangents | None,
                   bounds: Bounds | None) -> None:
    """Whether `eqn` is emitted again, and how it reads changed values."""
    rule = rule_for(eqn.primitive)
    diff = sweep.diff[i]
    read_differentiably = any(sweep.reached_by_derivative(o) for o in eqn.outvars)
    safe_read = False
    if not eqn.effects and not rule.has_body:
        safe_read = _plan_decision(i, eqn, diff, read_differentiably, i in sites, lanes, out)
    operand_changed = any(d and isinstance(v, Var) and v in lanes.changed
                          for d, v in zip(diff, eqn.invars, strict=True))
    if not (i in sites or operand_changed or safe_read or i in masked) or eqn.effects \
            or not read_differentiably:
        chooser = rule.chooser
        weighs = chooser is not None and not chooser.picks and (  # a picker never weighs
            chooser.weighs is None or chooser.weighs(eqn, sweep))
        if read_differentiably and not eqn.effects and weighs and cotangents is not None \
                and selects_by_value(eqn, sweep) \
                and cotangents.weighs_nonfinite(eqn, carrying := _carrying(eqn, sweep)) \
                and any(carrying) and not (
                bounds is not None and never_weighed_by_zero(eqn, carrying, bounds)) \
                and not wins_wherever_live(eqn, carrying, sweep):
            # its derivative weighs a cotangent that may be inf or NaN: select it instead
            out.selections.add(i)
            report.selections.append(eqn)
            if chooser is not None and not chooser.keeps_dropped_values:
                lanes.changed.update(o for o in eqn.outvars
                                     if is_float(o) and sweep.kind(o) != Kind.LIVE)
        return
    out.reemit.add(i)
    if i in sites and not sites[i].replace and not operand_changed and not safe_read \
            and i not in masked:
        return  # cuts only: every value is the original's, only derivatives differ
    # a LIVE output has no dropped lane, so it is bitwise the original: not "changed"
    lanes.changed.update(o for o in eqn.outvars if is_float(o) and sweep.kind(o) != Kind.LIVE)
    if _splits_its_predicate(i, eqn, lanes, out):
        out.split_predicates.add(i)
    if selects_by_value(eqn, sweep):
        out.selections.add(i)  # any changed operand: decide on the original values
        report.selections.append(eqn)


def _splits_its_predicate(i: int, eqn: JaxprEqn, lanes: ChangedLanes, out: Decisions) -> bool:
    """Whether a `select_n` emitted again takes a changed case by a predicate that guarded
    values would decide differently. The ranges (`_ranges.py`) narrow a case by the comparison
    that takes it (`jnp.where(s > eps, s, eps)` is at least eps, so a `sqrt` of it goes
    unguarded); on the original predicate, a guarded `s` of 0 in a dropped lane would be taken
    where the original `s` passed. Deciding the dropped lanes on the guarded values keeps the
    narrowing true there; the live lanes keep the original decision."""
    selection = rule_for(eqn.primitive).selection
    pred = eqn.invars[0] if eqn.invars else None
    return selection is not None and selection.by_predicate and isinstance(pred, Var) \
        and pred in lanes.chain and 0 not in out.safe_reads.get(i, ()) \
        and any(isinstance(v, Var) and v in lanes.changed for v in eqn.invars[1:])


def wins_wherever_live(eqn: JaxprEqn, carrying: list[bool], sweep: Sweep) -> bool:
    """Whether the one operand of a `max` (`min`) that carries a derivative wins alone in every
    lane where the result is live: each term of the result's live mask holds a comparison of the
    result, or of that operand, that puts it strictly above (below) the other operands,
    constants. Its cotangent, non-zero in live lanes only, is then weighed by 1 and never by 0:
    nothing to re-decide. `jnp.where(s > 0, jnp.sqrt(jnp.where(s > 0, s, 1.)), 0.)` with
    `s = jnp.maximum(q, 0.)`: the hand-written double where over a ReLU."""
    larger = rule_for(eqn.primitive).selection
    larger = None if larger is None or larger.by_predicate else larger.larger_wins
    if larger is None or sum(carrying) != 1 or len(eqn.outvars) != 1:
        return False
    found = [_scalar_constant(v, sweep) for v, c in zip(eqn.invars, carrying, strict=True)
             if not c]
    bounds = [b for b in found if b is not None]
    out = eqn.outvars[0]
    mover = next(v for v, c in zip(eqn.invars, carrying, strict=True) if c)
    if len(bounds) != len(found) or not isinstance(mover, Var):
        return False
    terms = sweep.sym(out)
    return bool(terms) and all(
        any(_beyond(lit, (out, mover), bounds, larger, sweep) for lit in term) for term in terms)


def _scalar_constant(atom: Any, sweep: Sweep) -> float | None:
    value = literal_value(atom) if isinstance(atom, Literal) else sweep.constant(atom)
    if value is None or np.size(value) != 1 or not np.isfinite(value).all():
        return None
    return float(np.asarray(value).reshape(()))


def _beyond(lit: tuple, values: tuple[Var, Var], others: list[float], larger: bool,
            sweep: Sweep) -> bool:
    """Whether the literal `lit` holds only where one of `values` (a `max`'s result, its operand
    that carries) is strictly above every value of `others` (strictly below, for a `min`): a
    positive comparison of it with a constant."""
    key, positive, embed = lit
    out = values[0]
    lane_to_lane = tuple(i if n != 1 else None for i, n in enumerate(shape_of(out)))
    if not positive or not isinstance(key, Var) or shape_of(key) != shape_of(out) \
            or embed != lane_to_lane:
        return False  # not the comparison of each lane itself (a transposed or broadcast one)
    compare = sweep.producer_of(key)
    if compare is None or (order := compared(compare, True)) is None:
        return False
    bounded, strict = order
    side = bounded if larger else 1 - bounded  # where `out` must sit in the comparison
    value = compare.invars[side]
    if not isinstance(value, Var) or sweep.same_as(value) not in \
            {sweep.same_as(v) for v in values}:
        return False
    point = _scalar_constant(compare.invars[1 - side], sweep)
    if point is None:
        return False
    if larger:
        return all(point > c or (strict and point >= c) for c in others)
    return all(point < c or (strict and point <= c) for c in others)


def _carrying(eqn: JaxprEqn, sweep: Sweep) -> list[bool]:
    """Which operands of `eqn` carry a derivative of the inputs in some lane (`_carries.py`)."""
    classes = sweep.carry_classes()
    return [isinstance(v, Var) and classes.get(v, Carry.NONE) != Carry.NONE
            for v in eqn.invars]


def _plan_decision(i: int, eqn: JaxprEqn, diff: list[bool], read_differentiably: bool,
                   guarded: bool, lanes: ChangedLanes, out: Decisions) -> bool:
    """Record how `eqn` reads changed values for their value only; True when it may read them
    as guarded although its result is differentiated (a safe read)."""
    touched = [k for k, v in enumerate(eqn.invars)
               if isinstance(v, Var) and (v in lanes.chain or v in lanes.changed)]
    if not touched:
        return False
    if not read_differentiably and not guarded:
        # a decision's intermediate value: computed from guarded values
        out.chain.add(i)
        reach = lanes.reach(eqn)
        lanes.chain.update((o, reach) for o in eqn.outvars)
        return False
    decided_on = [k for k in touched if not diff[k] or eqn.invars[k] in lanes.chain]
    if decided_on and read_differentiably and len(eqn.outvars) == 1 and all(
            lanes.reads_dropped_only(eqn, k) for k in decided_on):
        out.safe_reads[i] = frozenset(decided_on)
        return True
    return False
