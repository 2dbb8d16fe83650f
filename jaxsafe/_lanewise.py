"""Scans that compute lane by lane: liveness crosses them, carries included.

A scan's carries in general need a fixed point over the iterations to know which of their lanes
are live, so a scan is treated conservatively (every operand lane live where any output lane is,
carries live in the body). But many scans compute lane by lane: Horner's rule over a vector
(`jnp.polyval`, and with it `scipy.special.erfcx`, `dawsn`, `ndtri`), an iterated map over an
array of states, an explicit integrator of elementwise dynamics. In such a body every value has
one *lane shape* S (or is a scalar), and every equation is elementwise, so lane i of a carry at
step t depends only on lane i of the carries, the S-shaped constants and the step's S-shaped
inputs, and on the scalars. The fixed point is then immediate: lane i of every S-shaped operand is
live exactly when lane i of some S-shaped output is live, at any step; scalar operands are live
when anything is.

`lane_shape` recognizes such bodies (anything else: None, and the scan stays conservative);
`scan_masks` / `scan_kinds` are the scan row's liveness rules; `carry_masks` gives the body's
carries their masks when the body is rewritten (`_bodies.ScanBody`).

A scan without carries (`lax.map`) computes step by step, whatever its body: step t's outputs
read step t's inputs and the constants only. A step of its stacked inputs is live exactly when
some output of that step is (lane by lane too, for a lane-by-lane body), so a drop after a
second `lax.map` reaches the first one's steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from ._atoms import shape_of
from ._compat import ClosedJaxpr, JaxprEqn, scan_counts
from ._masks import any_of, broadcast, broadcast_mask, reduce_any
from ._nested import call_jaxpr, sub_jaxprs
from ._rules import Context, Kind, Mask, rule_for


def _lane_to_lane(eqn: JaxprEqn) -> bool:
    """Elementwise or a per-lane selection, or a scalar broadcast to a lane shape."""
    rule = rule_for(eqn.primitive)
    if rule.elementwise or rule.selection is not None or rule.paired:
        return True
    return rule.broadcast and all(shape_of(v) == () for v in eqn.invars)


def lane_shape(closed: ClosedJaxpr) -> tuple[int, ...] | None:
    """The one non-scalar shape of every value of a lane-by-lane body, or None when the body is
    not lane by lane (a reduction, a reshape, a nested loop, two non-scalar shapes, or only
    scalars, where there is nothing to gain). Inlined calls (`jnp.where`'s `jit`) and the
    bodies of equations that compute as their bodies do (`PrimitiveRule.runs_bodies_once`: a
    `cond` on the step, a `jax.checkpoint`, a custom rule read as its primal body, as
    `custom_rule_masks` reads it) are looked into, with a worklist."""
    shapes = lane_shapes(closed)
    if shapes is None:
        return None
    shapes.discard(())
    if len(shapes) != 1:
        return None
    return shapes.pop()


def lane_shapes(closed: ClosedJaxpr) -> set[tuple[int, ...]] | None:
    """The shapes of the values of a body that computes lane by lane (`lane_shape`), scalars
    included, or None when it does not."""
    shapes: set[tuple[int, ...]] = set()
    pending = [closed.jaxpr]
    while pending:
        jaxpr = pending.pop()
        shapes.update(shape_of(v) for v in (*jaxpr.constvars, *jaxpr.invars, *jaxpr.outvars))
        for eqn in jaxpr.eqns:
            if eqn.effects:
                return None
            rule = rule_for(eqn.primitive)
            if rule.inline:
                pending.append(call_jaxpr(eqn).jaxpr)
            elif rule.runs_bodies_once:
                pending.extend(body.jaxpr for body in sub_jaxprs(eqn))
            elif not _lane_to_lane(eqn):
                return None
            shapes.update(shape_of(v) for v in (*eqn.invars, *eqn.outvars))
    return shapes


# body jaxpr -> its lane shape: asked by every liveness sweep, plan and emission of the scan
_LANE_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scan_lane_shape(eqn: JaxprEqn) -> tuple[int, ...] | None:
    body = eqn.params["jaxpr"]
    if body.jaxpr not in _LANE_SHAPES:
        _LANE_SHAPES[body.jaxpr] = lane_shape(body)
    return _LANE_SHAPES[body.jaxpr]


def _per_step(k: int, stacked_from: int, shape: tuple) -> tuple:
    """The shape one step sees of input or output k (stacked ones lose their step axis)."""
    return shape[1:] if k >= stacked_from else shape


def _lane_mask(eqn: JaxprEqn, outs: Sequence[Mask], lanes: tuple[int, ...]) -> Mask:
    """The lanes live in some output, at some step: final carries, and the per-step outputs
    reduced over their step axis."""
    _, n_carry = scan_counts(eqn.params)
    per_lane: list[Mask] = []
    for k, (v, m) in enumerate(zip(eqn.outvars, outs, strict=True)):
        if _per_step(k, n_carry, shape_of(v)) != lanes:
            continue
        per_lane.append(reduce_any(m, [0]) if k >= n_carry and m is not None else m)
    if not per_lane:
        return None  # pragma: no cover - a lane-shaped body has a lane-shaped output
    return any_of(per_lane)


def _anything(outs: Sequence[Mask]) -> Mask:
    """Whether any output lane is live (None: some output is live in every lane)."""
    return any_of([reduce_any(m, range(m.ndim)) if m is not None else None for m in outs])


def _step_by_step(eqn: JaxprEqn) -> bool:
    """A scan without carries (`lax.map`): step t reads step t's inputs and the constants."""
    return scan_counts(eqn.params)[1] == 0 and len(eqn.outvars) > 0


def _step_mask(outs: Sequence[Mask], shape: tuple, lanes: tuple[int, ...] | None) -> Mask:
    """The mask of a stacked input of `shape` of a scan without carries: lane i of step t is
    live where some output of step t is live, in lane i when the output and the input are both
    lane-shaped (a lane-by-lane body), in any lane otherwise."""
    per_input: list[Mask] = []
    for m in outs:
        if m is None:
            return None
        if lanes is not None and m.shape[1:] == lanes == shape[1:]:
            per_input.append(m)
        else:
            step = reduce_any(m, range(1, m.ndim))
            per_input.append(broadcast_mask(step, shape, (0,)))
    return any_of(per_input)


def scan_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
               ctx: Context) -> list[Mask]:
    """A lane-by-lane scan: lane i of a lane-shaped operand is live where lane i of some output
    is (at any step); scalars where anything is. A scan without carries: a step of a stacked
    input is live where that step of some output is (`_step_mask`). Any other scan: every
    operand lane is live where any output lane is."""
    anything = _anything(outs)
    lanes = _scan_lane_shape(eqn)
    lane = None if lanes is None else _lane_mask(eqn, outs, lanes)
    n_lead = sum(scan_counts(eqn.params))
    by_step = _step_by_step(eqn)
    masks: list[Mask] = []
    for k, v in enumerate(eqn.invars):
        shape = shape_of(v)
        if by_step and k >= n_lead:
            masks.append(_step_mask(outs, shape, lanes))
            continue
        if lanes is not None and _per_step(k, n_lead, shape) == lanes:
            m = lane
            if m is not None and k >= n_lead:
                m = broadcast_mask(m, shape, tuple(range(1, len(shape))))
        else:
            m = anything if anything is None else broadcast(anything, shape)
        masks.append(m)
    return masks


def _lane_kind(eqn: JaxprEqn, out_kinds: Sequence[Kind], lanes: tuple[int, ...]) -> Kind:
    """The kind of the lane mask: the union of the lane-shaped outputs' (an output that no lane
    reaches, such as an unused final carry, adds nothing)."""
    _, n_carry = scan_counts(eqn.params)
    kinds = [k for i, (v, k) in enumerate(zip(eqn.outvars, out_kinds, strict=True))
             if _per_step(i, n_carry, shape_of(v)) == lanes]
    return max(kinds, default=Kind.LIVE)


def scan_kinds(eqn: JaxprEqn, out_kinds: list[Kind], ctx: Context) -> list[Kind]:
    """Lane-shaped operands of a lane-by-lane scan take the kind of its lane mask, the stacked
    inputs of a scan without carries the union of its outputs' kinds; every other operand is
    live (the conservative default)."""
    lanes = _scan_lane_shape(eqn)
    n_lead = sum(scan_counts(eqn.params))
    step = max(out_kinds) if _step_by_step(eqn) else None  # any step of any output
    lane = Kind.LIVE if lanes is None else _lane_kind(eqn, out_kinds, lanes)
    kinds = []
    for k, v in enumerate(eqn.invars):
        if step is not None and k >= n_lead:
            kinds.append(step)
        elif lanes is not None and _per_step(k, n_lead, shape_of(v)) == lanes:
            kinds.append(lane)
        else:
            kinds.append(Kind.LIVE)
    return kinds


def carry_kinds(eqn: JaxprEqn, out_kinds: Sequence[Kind]) -> list[Kind]:
    """The kinds of the body's carry outputs: MAYBE for a lane-shaped carry of a lane-by-lane
    scan some of whose output lanes are dropped, LIVE otherwise."""
    carries = eqn.outvars[:scan_counts(eqn.params)[1]]
    lanes = _scan_lane_shape(eqn)
    if lanes is None or _lane_kind(eqn, out_kinds, lanes) == Kind.LIVE:
        return [Kind.LIVE] * len(carries)
    return [Kind.MAYBE if shape_of(v) == lanes else Kind.LIVE for v in carries]


def carry_masks(eqn: JaxprEqn, outs: Sequence[Mask]) -> list[Mask]:
    """The masks of the body's carry outputs, the same at every step: the scan's lane mask for a
    lane-shaped carry, live for a scalar one (and for every carry of any other scan)."""
    _, n_carry = scan_counts(eqn.params)
    lanes = _scan_lane_shape(eqn)
    if lanes is None:
        return [None] * n_carry
    lane = _lane_mask(eqn, outs, lanes)
    return [lane if shape_of(v) == lanes else None for v in eqn.outvars[:n_carry]]
