"""Forward mode through a custom rule that selects its tangent: `jax.nn.relu`'s zeros.

`jnp.maximum(x, 0.)` takes the constant 0 where it wins: those lanes carry no derivative
(`_carries.py`), and a `sqrt` there is forward mode's dropped lane (`_free.py`). `jax.nn.relu`
computes the same `max` in a `custom_jvp` call whose rule hands back `select_n(x > 0, 0, t)`:
read structurally, every lane of the call carries what its operand carries, and
`jax.jacfwd(lambda x: jnp.sqrt(jax.nn.relu(x)))` stays NaN where `x < 0`.

A call that `_custom_rules` reads by value (one lane shape, a tangent program that decides on
primal values only) carries in a lane where its rule's tangent program carries a tangent there
(the tangents take their operands' carrying lanes, the primals none). Where the rule only
selects and moves its tangents (`_Tangents.weighs` false), that alone decides, and its zeros
are selections (`Carries.selects`): at relu's 0 itself, where the body's `max` ties, the rule
hands back an exact zero, as reverse mode reads it, and the value is the body's constant there
too (a tie's operands are equal), which `held` reads from the body (`FreeValues`). A rule that
weighs carries also where its body does (as the primal body computes it, each operand that
carries in some lane counted as carrying in every lane).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._atoms import dtype_of, literal_value, shape_of
from ._carries import Carry, carry_classes, carrying_lanes
from ._compat import ClosedJaxpr, JaxprEqn, Literal
from ._custom_rules import (
    flat_body,
    one_lane_shape,
    reading,
    reading_a_rule,
    tangent_program,
)
from ._free import FreeValues, Held, held_union
from ._liveness import Sweeps, Values, differentiable_operands
from ._masks import any_of, known_false, zeros
from ._nested import call_jaxpr
from ._rules import Kind, Mask


def _programs(eqn: JaxprEqn) -> tuple[ClosedJaxpr, ClosedJaxpr] | None:
    """The call's rule tangent program and its flattened body, where it is read by value."""
    if not one_lane_shape(eqn):
        return None
    tangents = tangent_program(eqn)
    return None if tangents is None else (tangents.program, flat_body(eqn))


def _classes(closed: ClosedJaxpr, inputs: Sequence[Carry]) -> dict:
    """`carry_classes` of an inner program whose inputs have the given classes (PART inputs
    are followed by their run-time masks, `_lanes`)."""
    jaxpr = closed.jaxpr
    return carry_classes(jaxpr, [differentiable_operands(e) for e in jaxpr.eqns],
                         inputs=inputs)


def _body_inputs(classes: Sequence[Carry]) -> list[Carry]:
    """The body's inputs: as the operands carry, but where more than one carries in part,
    those count as carrying in every lane. `held` reads a lane-by-lane body with one input
    that carries in part as two bodies, one where it carries in every lane and one where it
    carries in none: each lane of the call is a lane of one of them."""
    if sum(c == Carry.PART for c in classes) <= 1:
        return list(classes)
    return [Carry.NONE if c == Carry.NONE else Carry.ALL for c in classes]


def _rule_inputs(classes: Sequence[Carry]) -> list[Carry]:
    """The tangent program's inputs: the primals carry nothing, the tangents what their
    operands carry."""
    return [Carry.NONE] * len(classes) + list(classes)


def _joined(a: Carry, b: Carry) -> Carry:
    if Carry.ALL in (a, b):
        return Carry.ALL
    return Carry.NONE if a == b == Carry.NONE else Carry.PART


# call body -> {(its inputs' classes, inside a rule): its output's class}: asked by every
# carry pass of every program that calls it
_BODY_CLASS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def custom_jvp_static(eqn: JaxprEqn, classes: list) -> Carry:
    """The call's output class: where its rule or its body may carry. The rule's tangent
    program is read only where the body alone leaves some lane carrying nothing (relu's
    `max` with 0): elsewhere the union carries in every lane anyway."""
    if not any(classes):
        return Carry.NONE
    if not one_lane_shape(eqn):
        return Carry.ALL
    body = flat_body(eqn)
    inputs = _body_inputs(classes)
    known = _BODY_CLASS.setdefault(call_jaxpr(eqn).jaxpr, {})
    key = (tuple(inputs), reading_a_rule())  # inside a rule, nested calls carry everywhere
    if key not in known:
        known[key] = _output_class(body, _classes(body, inputs))
    if known[key] == Carry.ALL or reading_a_rule():
        return Carry.ALL
    tangents = tangent_program(eqn)
    if tangents is None:
        return Carry.ALL
    with reading(eqn):
        rule = _classes(tangents.program, _rule_inputs(classes))
    return _joined(_output_class(tangents.program, rule), known[key])


def _output_class(closed: ClosedJaxpr, classes: dict) -> Carry:
    out = closed.jaxpr.outvars[0]
    return Carry.NONE if isinstance(out, Literal) else classes.get(out, Carry.NONE)


def _values(closed: ClosedJaxpr, args: Sequence[Any]) -> Callable[[Any], Any]:
    """An inner program's values on `args`, each emitted when first read (a predicate)."""
    values = Values(closed.jaxpr, closed.consts, args)

    def read(atom: Any) -> Any:
        return literal_value(atom) if isinstance(atom, Literal) else values[atom]

    return read


def _lanes(closed: ClosedJaxpr, classes: dict, inputs: Sequence[Mask],
           args: Sequence[Any]) -> Mask:
    """The carrying lanes of an inner program's output, its inputs' given."""
    jaxpr = closed.jaxpr
    out = jaxpr.outvars[0]
    if isinstance(out, Literal) or classes.get(out, Carry.NONE) == Carry.NONE:
        return zeros(closed.out_avals[0].shape)
    memo: dict = {v: m for v, m in zip(jaxpr.invars, inputs, strict=True)
                  if classes.get(v, Carry.NONE) == Carry.PART}
    producer = {o: e for e in jaxpr.eqns for o in e.outvars}
    return carrying_lanes(out, classes, producer, memo, _values(closed, args))


def custom_jvp_lanes(eqn: JaxprEqn, masks: list, value: Callable[[int], Any]) -> Mask:
    """The output lanes that carry: where the rule's tangent may (the rule is the call's
    derivative: at relu's 0, where the body's `max` ties, its tangent is an exact zero, as
    reverse mode reads it), for a rule that only selects its tangents; for one that weighs,
    also where the body may."""
    programs = _programs(eqn)
    if programs is None:  # pragma: no cover - its class is ALL or NONE, never asked
        return None
    tangents, body = programs
    n = len(eqn.invars)
    operands = [value(k) for k in range(n)]
    classes = [_class_of(m) for m in masks]
    with reading(eqn):  # as `custom_jvp_static` read it
        rule = _lanes(tangents, _classes(tangents, _rule_inputs(classes)),
                      [zeros(shape_of(v)) for v in eqn.invars] + list(masks),
                      operands + [_zero_tangent(v) for v in eqn.invars])
    if custom_jvp_selects(eqn):
        return rule
    inputs = _body_inputs(classes)
    inner = _lanes(body, _classes(body, inputs),
                   [zeros(shape_of(v)) if c == Carry.NONE else m if c == Carry.PART else None
                    for v, c, m in zip(eqn.invars, inputs, masks, strict=True)], operands)
    return any_of([rule, inner])


def _class_of(mask: Mask) -> Carry:
    """A run-time mask's class (an operand that carries nothing has a known all-False one)."""
    if mask is None:
        return Carry.ALL
    return Carry.NONE if known_false(mask) else Carry.PART


def _zero_tangent(v: Any) -> Any:
    """A placeholder tangent: the tangent program's decisions read no tangent."""
    return np.zeros(shape_of(v), dtype_of(v))


def custom_jvp_held(eqn: JaxprEqn, classes: list, helds: list[Held]) -> Held:
    """What the output holds where it carries nothing: what the body's output holds where the
    body carries nothing, its operands that carry nothing holding what they hold."""
    programs = _programs(eqn)
    if programs is None:
        return None
    body = programs[1]
    inputs = _body_inputs(classes)
    if Carry.PART not in inputs:
        return _held(body, inputs, helds)
    every = _held(body, [Carry.ALL if c == Carry.PART else c for c in inputs], helds)
    none = _held(body, [Carry.NONE if c == Carry.PART else c for c in inputs], helds)
    return None if every is None or none is None else held_union([every, none])


def _held(body: ClosedJaxpr, inputs: Sequence[Carry], helds: list[Held]) -> Held:
    """What the body's output holds where it carries nothing, each input carrying in every
    lane (ALL) or in none (NONE, holding what it holds)."""
    jaxpr = body.jaxpr
    known = {v: h for v, c, h in zip(jaxpr.invars, inputs, helds, strict=True)
             if c == Carry.NONE}
    sweep = Sweeps().get(jaxpr, [Kind.LIVE] * len(jaxpr.outvars), False,
                         known_inputs=known)
    return FreeValues(body, sweep).held(jaxpr.outvars[0])


def custom_jvp_selects(eqn: JaxprEqn) -> bool:
    """Whether the rule's zeros are selections (it only selects and moves tangents)."""
    tangents = tangent_program(eqn) if one_lane_shape(eqn) else None
    return tangents is not None and not tangents.weighs

