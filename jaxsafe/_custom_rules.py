"""Custom rules whose derivative confirms their body's selections: `jax.nn.relu`'s losers.

A custom rule's call is read through its primal body structurally (`custom_rule_masks`): the
user's rule need not follow the body's selections, so `relu(x)`'s `max(x, 0.)` drops nothing
by value there. But where the rule's own tangent drops the same lanes (`relu`'s
`select_n(x > 0, 0, t)`), neither the value nor the derivative of a live output reads them: a
lane that the body's selections drop (its value reaches no output lane) and that the rule's
tangent drops too (its tangent reaches no tangent output lane, and no tangent output reads its
value) is a dropped lane, as a `jnp.maximum(x, 0.)` loser is. `jax.nn.relu(jnp.sqrt(x) - .8)`
is then guarded where relu's 0 wins, and `jax.grad` is 0 there, not NaN.

The rule's tangent program (`jax.jvp` of the call, its primal outputs left out) is traced once
per call body and rule, and read only where what it decides it decides on primal values: every
equation that reads a tangent passes it on linearly (a movement, a sum, a `select_n` case, a
product with a value that is not a tangent), never as a predicate or an index, nor into a body.
Only `custom_jvp` calls of one lane shape are read so: one output, every operand a literal or of
the output's shape, a body that computes lane by lane (`_lanewise.lane_shapes`). Lane i of the
output then reads lane i of each operand, so where an operand lane is dropped and the output
lane live, the call reads the operand's original value there with no derivative (`rechoose`):
the guarded program's value there may differ (a `sqrt` guarded to 1 before relu's `max`), and
would flip the body's selection. A rule declared with `symbolic_zeros` may take another branch
than the trace shows, and is read structurally. A rule that only selects and moves its tangents
and makes no NaN (relu's) never weighs a zero cotangent by an operand's value: it needs no cut
and no re-decision for a non-finite cotangent (`writes_its_zeros`, `weighs_tangents`); one
whose untaken branch may be NaN in the lanes it drops is cut there (`_sites._site`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from ._atoms import dtype_of, is_float, shape_of
from ._compat import (
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    Var,
    bind_eqn,
    custom_jvp_rule_of,
    custom_jvp_symbolic_zeros,
    dce,
)
from ._flatten import flatten
from ._lanewise import lane_shapes
from ._liveness_rules import custom_rule_kinds, custom_rule_masks, custom_rule_syms
from ._masks import all_of, any_of, not_mask, selecting
from ._nested import call_jaxpr
from ._rules import Context, Kind, Mask, rule_for
from ._symbolic import FALSE, Sym, sym_or
from ._taint import contains_hazard


@dataclasses.dataclass(frozen=True)
class _Tangents:
    """A rule's tangent program, read once when it is traced."""

    program: ClosedJaxpr
    weighs: bool
    """It multiplies or divides a tangent (`t * (x > 0)`), rather than only selecting and
    moving tangents (`jax.nn.relu`'s `select_n`)."""
    makes_nonfinite: bool
    """It may make NaN or inf itself (`where(x > 0, t / sqrt(x), 0.)`)."""


# call body -> [(the rule, its tangent program or None)], the rule compared by identity
_TANGENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# call body -> the same with its calls inlined
_FLAT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# call body or tangent program -> its lane shapes (`_lanewise.lane_shapes`)
_LANE_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_READING = threading.local()  # `depth`: how many rules' tangent programs are being read


@contextlib.contextmanager
def reading(eqn: JaxprEqn) -> Iterator[None]:
    """While a call's tangent program is read, every custom rule called inside it is read
    structurally (`reading_a_rule`); nested readings count, so leaving one keeps the outer."""
    _READING.depth = getattr(_READING, "depth", 0) + 1
    try:
        yield
    finally:
        _READING.depth -= 1


def reading_a_rule() -> bool:
    """Whether a rule's tangent program is being read: a custom rule called inside it (the
    primal of a nested rule, a rule that calls itself) is read by its structure. Each such
    call is a new equation of a newly traced program, with a rule object of its own: read by
    value, they would be traced again at every depth (`jax.scipy.stats.truncnorm.cdf`'s nested
    `log_ndtr` took 19 seconds)."""
    return getattr(_READING, "depth", 0) > 0


def rule_tangents(eqn: JaxprEqn, ctx: Context) -> ClosedJaxpr | None:
    """The rule's tangent program of a call whose selections by value are read (the module's
    conditions), else None: the call is read structurally."""
    if ctx.structural or not one_lane_shape(eqn):
        return None
    body = call_jaxpr(eqn)
    if reading_a_rule():
        return None  # a call inside a rule's tangent program: read by its structure
    # an operand the body does not read (a straight-through estimator's `soft`): the rule
    # may, and its tangent program says which lanes, where the body's structure cannot
    unread = any(k != Kind.LIVE for k in ctx.inner_kinds(body, [Kind.LIVE], True))
    if not unread and all(k == Kind.LIVE
                          for k in ctx.inner_kinds(flat_body(eqn), [Kind.LIVE], False)):
        return None  # it selects nothing by value
    tangents = tangent_program(eqn)
    if tangents is None:
        return None
    if not unread:
        with reading(eqn):
            if all(k == Kind.LIVE for k in _kinds(eqn, tangents.program, [Kind.LIVE], ctx)):
                return None  # the rule reads every lane (`logaddexp`'s): nothing to re-decide
    return tangents.program


def _kinds(eqn: JaxprEqn, tangents: ClosedJaxpr, out_kinds: list[Kind],
           ctx: Context) -> list[Kind]:
    """Each operand's kind: the union of the body's by value and the rule's, for its tangent
    and for its value."""
    body = ctx.inner_kinds(flat_body(eqn), out_kinds, False)
    rule = ctx.inner_kinds(tangents, out_kinds, False)
    n = len(eqn.invars)
    return [max(body[k], rule[k], rule[n + k]) for k in range(n)]


def flat_body(eqn: JaxprEqn) -> ClosedJaxpr:
    """The call's body with its calls inlined (`relu`'s `jit`): read by value, its formulas
    keep the predicates of the program around the call (a call inside would make them
    unknowns)."""
    body = call_jaxpr(eqn)
    if body.jaxpr not in _FLAT:
        flat = flatten(body)
        _FLAT[body.jaxpr] = None if flat is body else flat  # no reference to its key
    flat = _FLAT[body.jaxpr]
    return body if flat is None else flat


def one_lane_shape(eqn: JaxprEqn) -> bool:
    if len(eqn.outvars) != 1 or not is_float(eqn.outvars[0]):
        return False
    shape = shape_of(eqn.outvars[0])
    if not all(is_float(v) and (isinstance(v, Literal) or shape_of(v) == shape)
               for v in eqn.invars):
        return False
    shapes = _cached_lane_shapes(call_jaxpr(eqn))
    return shapes is not None and shapes <= {(), shape}


def _cached_lane_shapes(closed: ClosedJaxpr) -> set | None:
    """`lane_shapes`, once per jaxpr (a walk of a body, asked by every pass)."""
    if closed.jaxpr not in _LANE_SHAPES:
        _LANE_SHAPES[closed.jaxpr] = lane_shapes(closed)
    return _LANE_SHAPES[closed.jaxpr]


def tangent_program(eqn: JaxprEqn) -> _Tangents | None:
    if custom_jvp_symbolic_zeros(eqn) or not all(is_float(v) for v in eqn.invars):
        return None  # a rule handed symbolic zeros may take another branch than the trace's
    body = call_jaxpr(eqn).jaxpr
    rule = custom_jvp_rule_of(eqn)
    known = _TANGENTS.setdefault(body, [])
    for seen, program in known:
        if seen is rule:
            return program
    program = _traced_tangents(eqn)
    known.append((rule, program))
    return program


def derivative_program(eqn: JaxprEqn) -> tuple[bool, ClosedJaxpr | None]:
    """`PrimitiveRule.rule_program`: whether the rule's tangent program can be read, and the
    program where it is not lane to lane (`lane_shapes`: one shape, elementwise equations; the
    primal body then stands for it, at every order: it is the same rule)."""
    tangents = tangent_program(eqn)
    if tangents is None:
        return False, None
    program = tangents.program
    shapes = _cached_lane_shapes(program)
    if shapes is not None and len(shapes - {()}) <= 1:
        return True, None
    return True, program


def _traced_tangents(eqn: JaxprEqn) -> _Tangents | None:
    """(primals, tangents) -> the call's tangent outputs, as the rule computes them; None where
    what it decides may read a tangent."""
    n = len(eqn.invars)
    avals = [v.aval for v in eqn.invars]

    def tangents(*args: Any) -> Any:
        return jax.jvp(lambda *primals: bind_eqn(eqn, primals), args[:n], args[n:])[1]

    try:
        program = dce(flatten(jax.make_jaxpr(tangents)(*avals, *avals)))
    except Exception:  # noqa: BLE001 - a rule that cannot be traced alone: read structurally
        return None
    weighs = _weighs_if_readable(program, n)
    if weighs is None:
        return None
    return _Tangents(program, weighs, contains_hazard(program))


def _weighs_if_readable(program: ClosedJaxpr, n: int) -> bool | None:
    """None where an equation of `program` reads a value made from its inputs after the first
    `n` (the tangents) other than linearly, as a case of a selection or a factor of a product;
    or makes a float it passes no derivative through (`stop_gradient(scale)` as a factor): the
    liveness of the primal inputs does not count such a read of their values, which may be
    NaN in a lane it would drop (`jaxsafe.nn`'s `_scale_tangent`). Otherwise whether a
    tangent is a factor of a product or a quotient (`_Tangents.weighs`)."""
    tangent = set(program.jaxpr.invars[n:])
    weighs = False
    for eqn in program.jaxpr.eqns:
        rule = rule_for(eqn.primitive)
        if rule.zero_derivative and any(is_float(o) for o in eqn.outvars):
            return None
        reads = [isinstance(v, Var) and v in tangent for v in eqn.invars]
        if not any(reads):
            continue
        if eqn.effects or rule.has_body or not all(is_float(o) for o in eqn.outvars):
            return None
        for k, read in enumerate(reads):
            if read and not _linear_in(rule, eqn, k):
                return None
        weighs = weighs or not (rule.linear or rule.selection is not None)
        tangent.update(eqn.outvars)
    return weighs


def weighs_tangents(eqn: JaxprEqn, ctx: Context) -> bool:
    """Whether the rule's tangent program multiplies or divides a tangent (`t * (x > 0)`): a
    non-finite cotangent then meets the zero it weighs by (`Chooser.weighs`). A rule that only
    selects and moves tangents (`jax.nn.relu`'s) writes its zeros."""
    if rule_tangents(eqn, ctx) is None:
        return False
    tangents = tangent_program(eqn)
    return tangents is not None and tangents.weighs


def writes_its_zeros(eqn: JaxprEqn) -> bool:
    """Whether the call's rule only selects and moves tangents, and makes no NaN or inf
    itself (`jax.nn.relu`'s `select_n(x > 0, 0, t)`): a zero cotangent is never weighed by an
    operand's value, NaN or inf included, so its dropped lanes need no cut
    (`PrimitiveRule.cut_needless`)."""
    tangents = tangent_program(eqn)
    return tangents is not None and not tangents.weighs and not tangents.makes_nonfinite


def _linear_in(rule: Any, eqn: JaxprEqn, k: int) -> bool:
    """Whether `eqn`'s output is linear in operand k, which it reads as data: a movement or a
    sum (`linear`), a case of a selection, or an operand whose own derivative does not read
    it (a factor of `mul`, the numerator of `div`)."""
    if not is_float(eqn.invars[k]):
        return False
    if rule.linear:
        return True
    if rule.selection is not None:
        return k > 0  # `select_n`'s cases, not its predicate
    reads = rule.derivative_reads
    return reads is not None and k not in reads[k]


def _placeholders(eqn: JaxprEqn) -> list[Any]:
    """Tangent inputs for the masks of the tangent program: its masks read no tangent."""
    return [np.zeros(shape_of(v), dtype_of(v)) for v in eqn.invars]


def custom_jvp_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                     ctx: Context) -> list[Mask]:
    """An operand lane is live where the body's selections read it for a live output, or the
    rule's tangent program reads its tangent or its value (else `custom_rule_masks`)."""
    tangents = rule_tangents(eqn, ctx)
    if tangents is None:
        return custom_rule_masks(eqn, outs, invals, ctx)
    with reading(eqn):
        body = ctx.inner_masks(flat_body(eqn), invals, outs, False)
        rule = ctx.inner_masks(tangents, [*invals, *_placeholders(eqn)], outs, False)
    n = len(eqn.invars)
    return [any_of([body[k], rule[k], rule[n + k]]) for k in range(n)]


def custom_jvp_kinds(eqn: JaxprEqn, out_kinds: list[Kind], ctx: Context) -> list[Kind]:
    """`custom_jvp_masks`' kinds."""
    tangents = rule_tangents(eqn, ctx)
    if tangents is None:
        return custom_rule_kinds(eqn, out_kinds, ctx)
    with reading(eqn):
        return _kinds(eqn, tangents, out_kinds, ctx)


def custom_jvp_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """`custom_jvp_masks`' static formulas (the body's and the rule's predicates become
    unknowns here)."""
    tangents = rule_tangents(eqn, ctx)
    if tangents is None:
        return custom_rule_syms(eqn, out_syms, ctx)
    with reading(eqn):
        body = ctx.inner_syms(flat_body(eqn), out_syms, False)
        rule = ctx.inner_syms(tangents, out_syms, False)
    n = len(eqn.invars)
    return [FALSE if isinstance(v, Literal) else sym_or(sym_or(body[k], rule[k]), rule[n + k])
            for k, v in enumerate(eqn.invars)]


def confirms_selections(eqn: JaxprEqn, ctx: Context) -> bool:
    """The chooser's test: the call's selections by value are read."""
    return rule_tangents(eqn, ctx) is not None


def rechoose(eqn: JaxprEqn, invals: list, originals: Sequence[Any],
             operand_masks: Callable[[], list], out_masks: Callable[[], list]) -> list:
    """The call again, reading each operand's original value with no derivative where the
    operand lane is dropped and the output lane live: the output is the original's in every
    lane, and a dropped lane passes no derivative on (its guarded value may differ, and would
    flip the body's selection)."""
    masks = operand_masks()
    out_live = out_masks()[0]
    new = list(invals)
    for k, v in enumerate(eqn.invars):
        if isinstance(v, Literal) or masks[k] is None:
            continue
        dropped = not_mask(masks[k])
        take = dropped if out_live is None else all_of([dropped, out_live])
        new[k] = lax.select_n(selecting(take, invals[k]), invals[k],
                              lax.stop_gradient(originals[k]))
    return bind_eqn(eqn, new)
