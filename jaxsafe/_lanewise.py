"""Scans whose axes stay aligned: liveness crosses them, carries included.

A scan's carries in general need a fixed point over the iterations to know which of their lanes
are live, so a scan is treated conservatively (every operand lane live where any output lane is,
carries live in the body). But many scans keep some axes aligned (`_aligned.py`): Horner's rule
over a vector (`jnp.polyval`, and with it `scipy.special.erfcx`, `dawsn`, `ndtri`) and an
iterated map keep every axis; a scan over layers keeps the rows of its batch through matmuls
and norms; an RNN over time its batch rows. Lane i of a value along its aligned axes at step t
depends only on lane i of what it reads, at that step and the ones before, so the fixed point is
immediate: an operand's lane is live exactly where some output that has all of its classes is
live at the same coordinates, at some step; an operand with no aligned axis is live where
any output it reaches is (`reached_outputs`: through the body and the carries).

`scan_masks` / `scan_kinds` are the scan row's liveness rules; `carry_masks` and `body_syms`
give the body's carries their masks and formulas when the body is rewritten
(`_bodies.ScanBody`). `lane_shapes` (one shape, elementwise equations only) is what a custom
rule's body is read by (`_custom_rules.py`).

A scan without carries (`lax.map`) computes step by step, whatever its body: step t's outputs
read step t's inputs and the constants only. A step of its stacked inputs is live exactly when
some output of that step is (along its aligned axes too), so a drop after a second `lax.map`
reaches the first one's steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from ._aligned import Aligned, Placement, aligned_axes, classes_of
from ._atoms import shape_of
from ._compat import ClosedJaxpr, JaxprEqn, Var, scan_counts
from ._hoisted import hoisted_mask, step_mask_program
from ._masks import all_of, any_of, broadcast, broadcast_mask, place, reduce_any, zeros
from ._nested import call_jaxpr, sub_jaxprs
from ._rules import Context, Kind, LoopLinks, Mask, rule_for
from ._symbolic import (
    FALSE,
    Sym,
    given_mask,
    move,
    one_step,
    opaque,
    output_mask_literal,
    sym_and,
    sym_or,
)


def _lane_to_lane(eqn: JaxprEqn) -> bool:
    """Elementwise or a per-lane selection, or a scalar broadcast to a lane shape."""
    rule = rule_for(eqn.primitive)
    if rule.elementwise or rule.selection is not None or rule.paired:
        return True
    return rule.broadcast and all(shape_of(v) == () for v in eqn.invars)


def lane_shapes(closed: ClosedJaxpr) -> set[tuple[int, ...]] | None:
    """The shapes of the values of a body that computes lane by lane (every equation elementwise,
    a per-lane selection or a scalar broadcast; inlined calls and the bodies of equations that
    run them once are looked into, with a worklist), scalars included, or None when it does
    not."""
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


def scan_loop_links(eqn: JaxprEqn) -> list[LoopLinks]:
    """A scan's body: the constants and the initial carries run along its first inputs, the
    stacked inputs (past their step axis) along the rest; the final carries and the stacked
    outputs along its outputs; each carry it returns comes back as its carry input."""
    body = eqn.params["jaxpr"].jaxpr
    n_consts, n_carry = scan_counts(eqn.params)
    n_lead = n_consts + n_carry
    inputs = tuple((v, b, int(k >= n_lead))
                   for k, (v, b) in enumerate(zip(eqn.invars, body.invars, strict=True)))
    outputs = tuple((v, b, int(k >= n_carry))
                    for k, (v, b) in enumerate(zip(eqn.outvars, body.outvars, strict=True)))
    loops = tuple((body.outvars[i], body.invars[n_consts + i]) for i in range(n_carry))
    return [LoopLinks(body, inputs, outputs, loops)]


def while_loop_links(eqn: JaxprEqn) -> list[LoopLinks]:
    """A `while_loop`'s body and condition: their constants and the carries run along the
    operands; the body's outputs along the results, and back into its carries and the
    condition's."""
    p = eqn.params
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = eqn.invars[:nc], eqn.invars[nc:nc + nb], eqn.invars[nc + nb:]
    carries_in = body.invars[nb:]
    body_links = LoopLinks(
        body,
        tuple((v, b, 0) for v, b in zip([*body_consts, *init], body.invars, strict=True)),
        tuple((v, b, 0) for v, b in zip(eqn.outvars, body.outvars, strict=True)),
        tuple(zip(body.outvars, carries_in, strict=True)))
    cond_links = LoopLinks(
        cond,
        tuple((v, b, 0) for v, b in zip([*cond_consts, *init], cond.invars, strict=True)),
        (),
        tuple(zip(body.outvars, cond.invars[nc:], strict=True)))
    return [body_links, cond_links]


class _Anything:
    """An operand with aligned axes that no output has all of: live where anything is."""


ANYTHING = _Anything()


def _projected(eqn: JaxprEqn, al: Aligned, outs: Sequence[Mask], placed: Placement,
               shape: tuple, stacked: bool, steps: int | None) -> Mask | _Anything:
    """The mask of a value with aligned axes (an operand, or a carry the body returns): its lane
    is live where some output that has all of its classes is live at the same coordinates, at
    some step (at that step, for a stacked input of a scan without carries: `steps`). An
    output without one of its classes never reads it."""
    mine = classes_of(placed)
    _, n_carry = scan_counts(eqn.params)
    where = {c: j + int(stacked) for j, c in enumerate(placed) if c is not None}
    by_step = steps is not None and stacked
    parts: list[Mask] = []
    for k, (m, theirs) in enumerate(zip(outs, al.outputs, strict=True)):
        if not mine <= classes_of(theirs):
            continue
        if m is None:
            return None
        lead = int(k >= n_carry)
        kept = {j + lead: c for j, c in enumerate(theirs) if c in mine}
        if by_step:
            kept[0] = -1  # the step axis
        core = reduce_any(m, [d for d in range(m.ndim) if d not in kept])
        to = [0 if kept[d] == -1 else where[kept[d]] for d in sorted(kept)]
        parts.append(place(core, to, shape))
    return any_of(parts) if parts else ANYTHING


def _anything(outs: Sequence[Mask]) -> Mask:
    """Whether any output lane is live (None: some output is live in every lane)."""
    return any_of([reduce_any(m, range(m.ndim)) if m is not None else None for m in outs])


# body jaxpr -> per scan operand, the scan outputs it can reach
_REACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reached_outputs(eqn: JaxprEqn) -> list[frozenset[int]]:
    """Per operand of a scan, the outputs it can reach: through the body's equations within a
    step (an equation's outputs read all of its operands, a nested body included), and
    through the carries to later steps, to a fixed point; a carry's init reaches its final
    carry (a loop of no steps). An output no path reaches from an operand cannot make it live:
    a loop's second carry, dropped whole after it, leaves the first one's init live."""
    body = eqn.params["jaxpr"].jaxpr
    hit = _REACHED.get(body)
    if hit is not None:
        return hit
    n_consts, n_carry = scan_counts(eqn.params)
    reads: dict[Any, frozenset[int]] = {v: frozenset({i}) for i, v in enumerate(body.invars)}
    for e in body.eqns:
        found = frozenset().union(*(reads.get(u, frozenset()) for u in e.invars
                                    if isinstance(u, Var)))
        reads.update((o, found) for o in e.outvars)
    reach = [set() for _ in body.invars]
    for j, v in enumerate(body.outvars):
        for i in reads.get(v, frozenset()) if isinstance(v, Var) else ():
            reach[i].add(j)
    for c in range(n_carry):
        reach[n_consts + c].add(c)
    changed = True
    while changed:  # a carry reached goes on to what its next step's input reaches
        changed = False
        for r in reach:
            more = set().union(*(reach[n_consts + j] for j in r if j < n_carry)) - r
            if more:
                r |= more
                changed = True
    _REACHED[body] = out = [frozenset(r) for r in reach]
    return out


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
    that step of some output is (`_step_mask`); otherwise every lane is live where any lane of
    an output it reaches is (`reached_outputs`). A stacked input or a constant is also dropped
    where the body drops it by the step's own stacked inputs and the constants
    (`_hoisted.py`)."""
    reach = reached_outputs(eqn)
    al = scan_alignment(eqn)
    n_consts, n_carry = scan_counts(eqn.params)
    n_lead = n_consts + n_carry
    by_step = _step_by_step(eqn)
    steps = eqn.params["length"] if by_step else None
    masks: list[Mask] = []
    for k, v in enumerate(eqn.invars):
        shape = shape_of(v)
        stacked = k >= n_lead
        m: Any = ANYTHING
        if al is not None and classes_of(al.inputs[k]):
            m = _projected(eqn, al, outs, al.inputs[k], shape, stacked, steps)
        if m is ANYTHING and by_step and stacked:
            m = _step_mask(outs, shape)
        elif m is ANYTHING and not reach[k]:
            m = zeros(shape)  # it reaches no output
        elif m is ANYTHING:
            anything = _anything([outs[o] for o in sorted(reach[k])])
            m = anything if anything is None else broadcast(anything, shape)
        if stacked or k < n_consts:  # and what the body drops by the step's own inputs
            m = all_of([m, hoisted_mask(eqn, k, ctx.structural, invals)])
        masks.append(m)
    return masks


def _aligned_kind(al: Aligned, placed: Placement, out_kinds: Sequence[Kind]) -> Kind | None:
    """The kind of a value with aligned axes: the union of the kinds of the outputs that have
    all of its classes (None: it has no class, or no output has them all; an output that no
    lane reaches, such as an unused final carry, adds nothing)."""
    mine = classes_of(placed)
    if not mine:
        return None
    kinds = [kind for theirs, kind in zip(al.outputs, out_kinds, strict=True)
             if mine <= classes_of(theirs)]
    return max(kinds, default=None)


def scan_kinds(eqn: JaxprEqn, out_kinds: list[Kind], ctx: Context) -> list[Kind]:
    """Operands with aligned axes take the kinds of the outputs that share them, the stacked
    inputs of a scan without carries the union of its outputs' kinds step by step; every other
    operand the union of the kinds of the outputs it reaches (`reached_outputs`). A stacked
    input or a constant the body drops by the step's inputs alone is MAYBE (`_hoisted.py`)."""
    al = scan_alignment(eqn)
    n_consts, n_carry = scan_counts(eqn.params)
    n_lead = n_consts + n_carry
    reach = reached_outputs(eqn)
    step = max(out_kinds, default=Kind.LIVE) if _step_by_step(eqn) else None  # any output's
    kinds = []
    for k in range(len(eqn.invars)):
        aligned = None if al is None else _aligned_kind(al, al.inputs[k], out_kinds)
        if aligned is not None:
            kind = aligned
        elif step is not None and k >= n_lead:
            kind = step
        else:  # live where any output lane it reaches is (`_anything`)
            kind = max((out_kinds[o] for o in reach[k]), default=Kind.DEAD)
        if kind == Kind.LIVE and (k >= n_lead or k < n_consts) \
                and step_mask_program(eqn, k, ctx.structural) is not None:
            kind = Kind.MAYBE  # the body drops some of its lanes by the step's inputs
        kinds.append(kind)
    return kinds


def scan_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym]:
    """The static formulas of the operands, as `scan_masks` computes their masks: an operand
    with aligned axes, the OR over the outputs that have all of its classes of their formulas
    moved onto it (step by step where `scan_masks` goes step by step); a stacked input of a
    scan without carries with none, its step's; any other operand, the OR over the outputs it
    reaches of their formulas over all of their axes. So a drop after a
    second scan (a stacked LSTM's upper layer) reaches the first one's per-step outputs along
    the rows, and its body's matmul operand in a padded row is guarded."""
    al = scan_alignment(eqn)
    n_consts, n_carry = scan_counts(eqn.params)
    n_lead = n_consts + n_carry
    by_step = _step_by_step(eqn)
    reach = reached_outputs(eqn)
    syms: list[Sym] = []
    for k in range(len(eqn.invars)):
        stacked = k >= n_lead
        placed = al.inputs[k] if al is not None else ()
        mine = classes_of(placed)
        where = {c: j + int(stacked) for j, c in enumerate(placed) if c is not None}
        found: Sym | None = None
        for o, (sym, theirs) in enumerate(zip(out_syms, al.outputs if al is not None else
                                              [()] * len(out_syms), strict=True)):
            if not mine or not mine <= classes_of(theirs):
                continue
            lead = int(o >= n_carry)
            mapping = {j + lead: where[c] for j, c in enumerate(theirs) if c in mine}
            if by_step and stacked:
                mapping[0] = 0
            found = sym_or(FALSE if found is None else found, move(sym, mapping))
        if found is None:  # as `scan_masks`: step by step, or where any output lane it
            found = FALSE  # reaches is
            for o, sym in enumerate(out_syms):
                if by_step and stacked:
                    found = sym_or(found, move(sym, {0: 0}))
                elif o in reach[k]:
                    found = sym_or(found, move(sym, {}))
        if (stacked or k < n_consts) and step_mask_program(eqn, k, ctx.structural) is not None:
            found = sym_and(found, opaque()) or opaque()  # and what the body drops by step
        syms.append(found)
    return syms


def carry_kinds(eqn: JaxprEqn, out_kinds: Sequence[Kind]) -> list[Kind]:
    """The kinds of the body's carry outputs: MAYBE for a carry with aligned axes some of whose
    lanes are dropped, LIVE otherwise."""
    n_carry = scan_counts(eqn.params)[1]
    al = scan_alignment(eqn)
    if al is None:
        return [Kind.LIVE] * n_carry
    kinds = [_aligned_kind(al, al.outputs[i], out_kinds) for i in range(n_carry)]
    return [Kind.LIVE if k in (None, Kind.LIVE) else Kind.MAYBE for k in kinds]


def carry_masks(eqn: JaxprEqn, outs: Sequence[Mask]) -> list[Mask]:
    """The masks of the body's carry outputs, the same at every step: a carry with aligned axes
    is live where some output lane at its coordinates is, at some step; any other carry is
    live."""
    n_carry = scan_counts(eqn.params)[1]
    al = scan_alignment(eqn)
    if al is None:
        return [None] * n_carry
    masks: list[Mask] = []
    for v, placed in zip(eqn.outvars[:n_carry], al.outputs, strict=False):
        m = _projected(eqn, al, outs, placed, shape_of(v), False, None) \
            if classes_of(placed) else None
        masks.append(None if m is ANYTHING else m)
    return masks


def body_syms(eqn: JaxprEqn, syms: Sequence[Sym]) -> list[Sym | None]:
    """The static formulas of the body's outputs (`MaskedBody.outside_syms`). A carry with
    aligned axes is live along them alone: its mask is a projection of the outputs' masks, the
    same along its other axes, so a matmul's operand there is guarded without a run-time
    reduction. The body is given that mask (`carry_masks`): a coarse guard reads it by name
    (`output_mask_literal`) where the exact mask would vary along other axes too (a ReLU
    layer's, an LSTM's gates). A per-step output is given its mask outside at that step, the
    same along the axes its formula outside does not run along (`one_step`), and named so too
    (`given_mask`). Other carries get their kinds' formulas."""
    n_carry = scan_counts(eqn.params)[1]
    al = scan_alignment(eqn)
    out: list[Sym | None] = [None] * n_carry
    for i in range(n_carry, len(syms)):  # the mask the body is given at this step, by name
        out.append(given_mask(one_step(syms[i]), i, shape_of(eqn.outvars[i])[1:]))
    if al is None:
        return out
    for i in range(n_carry):
        axes = [j for j, a in enumerate(al.outputs[i]) if a is not None]
        if axes:
            literal = output_mask_literal(i, shape_of(eqn.outvars[i]), axes)
            out[i] = frozenset({frozenset({literal})})
    return out
