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

from ._aligned import Aligned, Placement, aligned_axes
from ._atoms import shape_of
from ._compat import ClosedJaxpr, JaxprEqn, scan_counts
from ._masks import all_of, any_of, broadcast, broadcast_mask, place, reduce_any
from ._nested import call_jaxpr, sub_jaxprs
from ._rules import Context, Kind, Mask, rule_for
from ._symbolic import Sym, unknown


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


# body jaxpr -> its aligned axes: asked by every liveness sweep, plan and emission of the scan
_ALIGNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def scan_alignment(eqn: JaxprEqn) -> Aligned | None:
    """The classes of a scan body's inputs and outputs, its carries joined to the carries it
    returns (`_aligned.py`), or None where none keeps a class."""
    body = eqn.params["jaxpr"]
    if body.jaxpr not in _ALIGNED:
        n_consts, n_carry = scan_counts(eqn.params)
        loops = [(n_consts + i, i) for i in range(n_carry)]
        _ALIGNED[body.jaxpr] = aligned_axes(body, loops)
    return _ALIGNED[body.jaxpr]


def _per_step(k: int, stacked_from: int, shape: tuple) -> tuple:
    """The shape one step sees of input or output k (stacked ones lose their step axis)."""
    return shape[1:] if k >= stacked_from else shape


class _Anything:
    """A group that no output has an axis in: its operands are live where anything is."""


ANYTHING = _Anything()


def _group_masks(eqn: JaxprEqn, al: Aligned, outs: Sequence[Mask], steps: int | None
                 ) -> list[Any]:
    """Per group, its lanes live in some output: a lane of the group is live where some output
    lane at its coordinates is (an output with only some of the group's axes is the same along
    the others). `steps`: keep the step axis of that length (a scan without carries), else any
    step counts."""
    _, n_carry = scan_counts(eqn.params)
    per_group: list[list[Mask]] = [[] for _ in al.groups]
    for k, (m, placed) in enumerate(zip(outs, al.outputs, strict=True)):
        stacked = int(k >= n_carry)
        for g in al.groups_of(placed):
            if m is None:
                per_group[g].append(None)
                continue
            axes = [(j + stacked, a[1]) for j, a in enumerate(placed)
                    if a is not None and a[0] == g]
            kept = {j for j, _ in axes} | ({0} if steps is not None and stacked else set())
            core = reduce_any(m, [d for d in range(m.ndim) if d not in kept])
            lead = 1 if steps is not None else 0
            to = ([0] if steps is not None and stacked else []) + [c + lead for _, c in axes]
            shape = ((steps,) if steps is not None else ()) + al.groups[g]
            per_group[g].append(place(core, to, shape))
    return [any_of(masks) if masks else ANYTHING for masks in per_group]


def _projected(groups: Sequence[Any], al: Aligned, placed: Placement, shape: tuple,
               stacked: bool, steps: int | None) -> Mask | _Anything:
    """The mask of an operand from its groups' masks: the and over its groups of the group's
    lanes at the operand's coordinates (with the step axis for a stacked operand of a scan
    without carries; reduced over the steps for any other)."""
    lead = int(stacked)
    parts: list[Mask] = []
    for g in al.groups_of(placed):
        gm = groups[g]
        if gm is ANYTHING:
            return ANYTHING
        if gm is None:
            continue
        here = {a[1]: j + lead for j, a in enumerate(placed) if a is not None and a[0] == g}
        step = 1 if steps is not None else 0
        missing = [c + step for c in range(len(al.groups[g])) if c not in here]
        if steps is not None and not stacked:
            missing.append(0)
        core = reduce_any(gm, missing)
        to = ([0] if steps is not None and stacked else []) + [here[c] for c in sorted(here)]
        parts.append(place(core, to, shape))
    return all_of(parts) if parts else None


def _anything(outs: Sequence[Mask]) -> Mask:
    """Whether any output lane is live (None: some output is live in every lane)."""
    return any_of([reduce_any(m, range(m.ndim)) if m is not None else None for m in outs])


def _step_by_step(eqn: JaxprEqn) -> bool:
    """A scan without carries (`lax.map`): step t reads step t's inputs and the constants."""
    return scan_counts(eqn.params)[1] == 0 and len(eqn.outvars) > 0


def _step_mask(outs: Sequence[Mask], shape: tuple) -> Mask:
    """The mask of a stacked input of `shape` of a scan without carries, with no aligned axis:
    step t is live where some output of step t is live, in any lane."""
    per_input: list[Mask] = []
    for m in outs:
        if m is None:
            return None
        step = reduce_any(m, range(1, m.ndim))
        per_input.append(broadcast_mask(step, shape, (0,)))
    return any_of(per_input)


def scan_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
               ctx: Context) -> list[Mask]:
    """An operand with aligned axes (`_aligned.py`): its lane is live where some output lane at
    the same coordinates is, at some step (at that step, for a stacked input of a scan without
    carries). Any other operand: a stacked input of a scan without carries, a step is live where
    that step of some output is (`_step_mask`); otherwise every lane is live where any output
    lane is."""
    anything = _anything(outs)
    al = scan_alignment(eqn)
    n_lead = sum(scan_counts(eqn.params))
    by_step = _step_by_step(eqn)
    steps = eqn.params["length"] if by_step else None
    groups = _group_masks(eqn, al, outs, steps) if al is not None else []
    masks: list[Mask] = []
    for k, v in enumerate(eqn.invars):
        shape = shape_of(v)
        stacked = k >= n_lead
        m: Any = ANYTHING
        if al is not None:
            m = _projected(groups, al, al.inputs[k], shape, stacked, steps)
        if m is ANYTHING and by_step and stacked:
            m = _step_mask(outs, shape)
        elif m is ANYTHING:
            m = anything if anything is None else broadcast(anything, shape)
        masks.append(m)
    return masks


def _group_kinds(eqn: JaxprEqn, al: Aligned, out_kinds: Sequence[Kind]) -> list[Kind | None]:
    """Per group, the union of the kinds of the outputs with an axis in it (None: no output
    has; an output that no lane reaches, such as an unused final carry, adds nothing)."""
    kinds: list[Kind | None] = [None] * len(al.groups)
    for placed, kind in zip(al.outputs, out_kinds, strict=True):
        for g in al.groups_of(placed):
            kinds[g] = kind if kinds[g] is None else max(kinds[g], kind)  # type: ignore[type-var]
    return kinds


def _aligned_kind(groups: Sequence[Kind | None], al: Aligned, placed: Placement) -> Kind | None:
    """The kind of a value with aligned axes (None: it has none, or a group no output has)."""
    mine = [groups[g] for g in al.groups_of(placed)]
    if not mine or any(k is None for k in mine):
        return None
    return max(mine)  # type: ignore[type-var]


def scan_kinds(eqn: JaxprEqn, out_kinds: list[Kind], ctx: Context) -> list[Kind]:
    """Operands with aligned axes take the kinds of the outputs that share them, the stacked
    inputs of a scan without carries the union of its outputs' kinds; every other operand is
    live (the conservative default)."""
    al = scan_alignment(eqn)
    n_lead = sum(scan_counts(eqn.params))
    step = max(out_kinds) if _step_by_step(eqn) else None  # any step of any output
    groups = _group_kinds(eqn, al, out_kinds) if al is not None else []
    kinds = []
    for k in range(len(eqn.invars)):
        aligned = None if al is None else _aligned_kind(groups, al, al.inputs[k])
        if aligned is not None:
            kinds.append(aligned)
        elif step is not None and k >= n_lead:
            kinds.append(step)
        else:
            kinds.append(Kind.LIVE)
    return kinds


def carry_kinds(eqn: JaxprEqn, out_kinds: Sequence[Kind]) -> list[Kind]:
    """The kinds of the body's carry outputs: MAYBE for a carry with aligned axes some of whose
    lanes are dropped, LIVE otherwise."""
    n_carry = scan_counts(eqn.params)[1]
    al = scan_alignment(eqn)
    if al is None:
        return [Kind.LIVE] * n_carry
    groups = _group_kinds(eqn, al, out_kinds)
    kinds = [_aligned_kind(groups, al, al.outputs[i]) for i in range(n_carry)]
    return [Kind.LIVE if k in (None, Kind.LIVE) else Kind.MAYBE for k in kinds]


def carry_masks(eqn: JaxprEqn, outs: Sequence[Mask]) -> list[Mask]:
    """The masks of the body's carry outputs, the same at every step: a carry with aligned axes
    is live where some output lane at its coordinates is, at some step; any other carry is
    live."""
    n_carry = scan_counts(eqn.params)[1]
    al = scan_alignment(eqn)
    if al is None:
        return [None] * n_carry
    groups = _group_masks(eqn, al, outs, None)
    masks: list[Mask] = []
    for v, placed in zip(eqn.outvars[:n_carry], al.outputs, strict=False):
        m = _projected(groups, al, placed, shape_of(v), False, None)
        masks.append(None if m is ANYTHING else m)
    return masks


def carry_syms(eqn: JaxprEqn, syms: Sequence[Sym]) -> list[Sym | None]:
    """The static formulas of the body's carry outputs: a carry with aligned axes is live along
    them alone (its mask is a projection of the groups' masks: the same along its other axes,
    so a matmul's operand there is guarded without a run-time reduction); the per-step outputs
    get their kinds' formulas."""
    n_carry = scan_counts(eqn.params)[1]
    al = scan_alignment(eqn)
    out: list[Sym | None] = [None] * len(eqn.outvars)
    if al is None:
        return out
    for i in range(n_carry):
        axes = [j for j, a in enumerate(al.outputs[i]) if a is not None]
        if axes:
            out[i] = frozenset({frozenset({unknown(axes)})})
    return out
