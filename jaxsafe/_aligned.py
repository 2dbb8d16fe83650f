"""Axes of a loop body that keep their lanes: row i stays row i through every equation.

A scan over the layers of a network carries a batch of rows `h` of shape (B, D): every step
contracts `h`'s feature axis with a weight (`h @ w`), normalizes along it, adds a bias, but never
mixes two rows. Lane (i, *) of every value of the body then depends only on row i of the
carries, of the constants and of the step's inputs that have that axis, and on the values that
have no such axis at all. Liveness crosses such a scan as it crosses an elementwise one: row i of
the operands is live exactly where row i of some output is, at some step.

`aligned_axes` finds those axes with a union-find over (value, axis) pairs. Every equation
joins the axes its row's `align` rule says run along each other (an elementwise operation's,
a matmul's batch and free axes, a reduction's kept axes, a transpose's), or those its
`works_along` rule leaves in place (a slice's, a split's, a concatenation's, a sort's or a
cumsum's other axes); an axis of more than one lane that an equation reduces, contracts, moves
or reads in any other way (the axis a slice cuts, a gather, a primitive without either rule, a
nested loop) *spoils* its class, and with it every axis joined to it. A class is also spoiled
where two axes of one value fall in it (`h @ h.T`), or where two joined axes differ in size.
Calls and the bodies of equations that run them once (`jit`, a `cond` on the step, a
checkpoint, a custom rule's primal body) are joined to their operands and read with a worklist;
a scan's carries are joined to the carries it returns.

A custom rule's derivative need not follow its primal body: a `custom_jvp`'s tangent program
(traced once, `PrimitiveRule.rule_program`) is joined as well where it is not lane to lane, and
a rule that cannot be read (a `custom_vjp`'s backward function) spoils its operands' axes.

What is left is sound because no rule loses a class it keeps: a value never depends on a value
with a class it lacks, and a lane depends only on the lanes of what it reads at the same
coordinates in every class they share. So an input's lane is live exactly where some output
that has all of the input's classes is live at those coordinates (`_lanewise.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ._atoms import shape_of
from ._compat import ClosedJaxpr, Jaxpr, Literal
from ._nested import call_jaxpr, sub_jaxprs
from ._rules import LoopLinks, alignment, rule_for

Node = tuple[Any, int]
"""(a variable of the body, one of its axes)."""

Placement = tuple["int | None", ...]
"""For each axis of a value: its class, or None for an axis that keeps none (spoiled, or a
single lane)."""


def classes_of(placement: Placement) -> frozenset[int]:
    return frozenset(c for c in placement if c is not None)


@dataclasses.dataclass(frozen=True)
class Aligned:
    """The classes of each axis of a body's inputs and outputs."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]


class _Classes:
    """A union-find over (variable, axis) pairs, with the spoiled classes."""

    def __init__(self) -> None:
        self.parent: dict[Node, Node] = {}
        self.size: dict[Node, int] = {}
        self.spoiled: set[Node] = set()

    def find(self, node: Node) -> Node:
        root = node
        while self.parent.setdefault(root, root) != root:
            root = self.parent[root]
        while node != root:  # path compression
            up = self.parent[node]
            self.parent[node] = root
            node = up
        return root

    def add(self, var: Any) -> None:
        for axis, n in enumerate(shape_of(var)):
            self.size.setdefault((var, axis), n)

    def spoil(self, var: Any, axis: int) -> None:
        if isinstance(var, Literal) or shape_of(var)[axis] == 1:
            return
        self.add(var)
        self.spoiled.add(self.find((var, axis)))

    def spoil_all(self, var: Any) -> None:
        for axis in range(len(shape_of(var))):
            self.spoil(var, axis)

    def join(self, a: Any, i: int, b: Any, j: int) -> None:
        if isinstance(a, Literal) or isinstance(b, Literal):
            return
        self.add(a)
        self.add(b)
        ra, rb = self.find((a, i)), self.find((b, j))
        if ra == rb:
            return
        self.parent[rb] = ra
        if self.size[ra] != self.size[rb] or rb in self.spoiled:
            self.spoiled.add(ra)

    def join_values(self, a: Any, b: Any) -> bool:
        """Join two values of one shape axis by axis; False (nothing joined) otherwise."""
        if shape_of(a) != shape_of(b):
            return False
        for axis in range(len(shape_of(a))):
            self.join(a, axis, b, axis)
        return True

    def kept(self, var: Any, axis: int) -> Node | None:
        """The class of an axis that keeps one (of more than one lane, not spoiled)."""
        if isinstance(var, Literal) or shape_of(var)[axis] == 1:
            return None
        self.add(var)
        root = self.find((var, axis))
        return None if root in self.spoiled else root


def _link(classes: _Classes, outer_in: Sequence[Any], outer_out: Sequence[Any],
          body: Jaxpr) -> None:
    """Join a call's operands and results to its body's (the body reads the last operands: a
    `cond`'s index comes first); any mismatch spoils the operands."""
    n = len(body.invars)
    ins = list(outer_in[len(outer_in) - n:]) if n <= len(outer_in) else None
    if ins is None or len(body.outvars) != len(outer_out) or not all(
            shape_of(a) == shape_of(b) for a, b in
            (*zip(ins, body.invars, strict=True), *zip(outer_out, body.outvars, strict=True))):
        for v in outer_in:
            classes.spoil_all(v)
        return
    for a, b in (*zip(ins, body.invars, strict=True), *zip(outer_out, body.outvars, strict=True)):
        classes.join_values(a, b)


def _join_equation(classes: _Classes, eqn: Any) -> list[Jaxpr]:
    """Join and spoil the axes of one equation; the bodies it runs once, to read next."""
    rule = rule_for(eqn.primitive)
    if rule.inline or rule.runs_bodies_once:
        return _join_bodies(classes, eqn, rule)
    if rule.loop_links is not None:
        return _join_loop(classes, eqn, rule.loop_links(eqn))
    if rule.paired:
        for a, b in zip(eqn.invars, eqn.outvars, strict=True):
            if not classes.join_values(a, b):
                classes.spoil_all(a)
        return []
    if rule.align is None and rule.works_along is not None:
        _join_along(classes, eqn, set(rule.works_along(eqn)))
    else:
        _join_aligned(classes, eqn)
    return []


def _join_aligned(classes: _Classes, eqn: Any) -> None:
    """Each operand axis joined to the output axis its row's `align` rule runs it along,
    spoiled where none does (every axis, with no such rule)."""
    for k, v in enumerate(eqn.invars):
        along = alignment(eqn, k)
        if along is None:
            classes.spoil_all(v)
            continue
        for axis, out_axis in enumerate(along):
            if out_axis is None:
                classes.spoil(v, axis)
            else:
                classes.join(v, axis, eqn.outvars[0], out_axis)


def _join_along(classes: _Classes, eqn: Any, worked: set[int]) -> None:
    """A slice, a concatenation, a split, a sort: every operand of the outputs' rank joined to
    every output along the other axes, spoiled along these (their lanes move)."""
    rank = len(shape_of(eqn.outvars[0]))
    if any(len(shape_of(o)) != rank for o in eqn.outvars):
        for v in eqn.invars:  # pragma: no cover - the rows' outputs share a rank
            classes.spoil_all(v)
        return
    for v in eqn.invars:
        if len(shape_of(v)) != rank:
            classes.spoil_all(v)  # a pad's value, a dynamic slice's starts: scalars
            continue
        for axis in range(rank):
            if axis in worked:
                classes.spoil(v, axis)
                continue
            for out in eqn.outvars:
                classes.join(v, axis, out, axis)


def _join_loop(classes: _Classes, eqn: Any, links: Sequence[LoopLinks]) -> list[Jaxpr]:
    """A loop nested in the body: each of its bodies' inputs and outputs joined to the
    equation's operands and results, a step axis spoiled (the loop reads its steps one by one,
    and a carry mixes them), each carry joined to what the body hands back; the bodies, to
    read next (a `while_loop`'s condition too: what it reduces to decide the trip count
    spoils, as everything the loop computes depends on it)."""
    for link in links:
        for outer, inner, lead in (*link.inputs, *link.outputs):
            if isinstance(outer, Literal):
                continue
            if shape_of(outer)[lead:] != shape_of(inner):
                classes.spoil_all(outer)  # pragma: no cover - a loop's avals match
                continue
            for axis in range(lead):
                classes.spoil(outer, axis)
            for axis in range(len(shape_of(inner))):
                classes.join(outer, axis + lead, inner, axis)
        for out, back in link.loops:
            if not classes.join_values(back, out):
                classes.spoil_all(back)  # pragma: no cover - a carry keeps its aval
    return [link.body for link in links]


def _join_bodies(classes: _Classes, eqn: Any, rule: Any) -> list[Jaxpr]:
    """A call's or a once-run body's axes joined to the equation's (a custom rule's derivative
    too); the bodies, to read next."""
    bodies = [call_jaxpr(eqn).jaxpr] if rule.inline else [b.jaxpr for b in sub_jaxprs(eqn)]
    for body in bodies:
        _link(classes, eqn.invars, eqn.outvars, body)
    if rule.custom_rule:
        bodies += _join_rule(classes, eqn, rule)
    return bodies


def _join_rule(classes: _Classes, eqn: Any, rule: Any) -> list[Jaxpr]:
    """A custom rule's derivative, joined to the call where it may mix lanes its primal keeps
    apart: its tangent program's primal and tangent inputs to the operands, its tangents to the
    results. A rule that cannot be read spoils the operands (a `custom_vjp`'s backward may hand
    a row's cotangent to another row)."""
    readable, program = (False, None) if rule.rule_program is None else rule.rule_program(eqn)
    n = len(eqn.invars)
    if not readable or program is not None and len(program.jaxpr.invars) != 2 * n:
        for v in eqn.invars:
            classes.spoil_all(v)
        return []
    if program is None:
        return []  # lane to lane: the primal body stands for it
    _link(classes, [*eqn.invars, *eqn.invars], eqn.outvars, program.jaxpr)
    return [program.jaxpr]


def _read(classes: _Classes, closed: ClosedJaxpr) -> list[Jaxpr] | None:
    """Join and spoil along every equation of `closed` and the bodies it runs once (a
    worklist); the jaxprs read, or None for a body with effects (nothing is claimed of it)."""
    read, seen = [closed.jaxpr], {id(closed.jaxpr)}
    pending = [closed.jaxpr]
    while pending:
        for eqn in pending.pop().eqns:
            if eqn.effects:
                return None
            for body in _join_equation(classes, eqn):
                if id(body) not in seen:
                    seen.add(id(body))
                    pending.append(body)
                    read.append(body)
    return read


def _spoil_repeats(classes: _Classes, read: Sequence[Jaxpr]) -> None:
    """A class that two axes of one value fall in (`h @ h.T`) has no one coordinate there: every
    value of the jaxprs read, a custom rule's tangent program included."""
    for jaxpr in read:
        for v in (*jaxpr.invars, *(o for eqn in jaxpr.eqns for o in eqn.outvars)):
            if isinstance(v, Literal):
                continue
            seen: set[Node] = set()
            for axis in range(len(shape_of(v))):
                root = classes.kept(v, axis)
                if root is not None and root in seen:
                    classes.spoiled.add(root)
                elif root is not None:
                    seen.add(root)


def aligned_axes(closed: ClosedJaxpr, loops: Sequence[tuple[int, int]] = ()) -> Aligned | None:
    """The classes of `closed`'s inputs and outputs, `loops` (input, output) pairs joined (a
    scan's carries), or None when no input or output keeps one (or the body has effects)."""
    classes = _Classes()
    jaxpr = closed.jaxpr
    for i, o in loops:
        if not classes.join_values(jaxpr.invars[i], jaxpr.outvars[o]):
            classes.spoil_all(jaxpr.invars[i])  # pragma: no cover - a scan's carries match
    read = _read(classes, closed)
    if read is None:
        return None
    _spoil_repeats(classes, read)
    ids: dict[Node, int] = {}

    def placement(v: Any) -> Placement:
        if isinstance(v, Literal):
            return ()
        kept = [classes.kept(v, a) for a in range(len(shape_of(v)))]
        return tuple(None if c is None else ids.setdefault(c, len(ids)) for c in kept)

    inputs = tuple(placement(v) for v in jaxpr.invars)
    outputs = tuple(placement(v) for v in jaxpr.outvars)
    if not ids:
        return None
    return Aligned(inputs=inputs, outputs=outputs)
