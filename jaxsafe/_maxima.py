"""A value's maximum: `x - stop_gradient(max(x, axis, keepdims=True))`, the shift of every
softmax, is at most 0, and the sum of `exp` of it over the axes maximized over is at least 1.

Interval arithmetic cannot see it (`x` ranges over every float); the relation can. `maximum_of`
follows, from the subtrahend back to the minuend, equations each at least its operand lane by
lane (`PrimitiveRule.at_least`: a `reduce_max`, a `max`, a value moved unchanged; the finite
case of a selection on `is_finite`, as logsumexp takes it), composing
their alignments: every axis of the minuend must stay in place or be maximized over. For finite
values the relation is exact (no rounding is involved), so `exp` of the shift needs no overflow
guard and the `log` of its sum none at zero (`_ranges.py`, `_bounds.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ._atoms import literal_value, shape_of
from ._compat import JaxprEqn, Literal, Var
from ._rules import alignment, rule_for

MAX_CHAIN = 8
"""Equations between a value and its maximum that `maximum_of` follows."""


def maximum_of(b: object, a: object, producer: dict, eqns: Sequence[JaxprEqn]
               ) -> tuple[frozenset[int], bool] | None:
    """Whether `b` is, lane by lane, at least `a` (the same rank; `b` may have size 1 along
    axes it broadcasts over): the axes of `a` maximized over, and whether `b` is exactly that
    maximum (no `max` with anything but its identity, -inf, on the way). None: not shown."""
    if not isinstance(a, Var) or not isinstance(b, Var) or \
            len(shape_of(a)) != len(shape_of(b)):
        return None
    chain: list[tuple[JaxprEqn, int]] = []
    exact, u = True, b
    while len(chain) < MAX_CHAIN:
        i = producer.get(u)
        if i is None or len(eqns[i].outvars) != 1:
            return None
        step = eqns[i]
        rule = rule_for(step.primitive)
        facts = rule.at_least or (rule.at_least_when(step) if rule.at_least_when else None) \
            or _kept_where_finite(step, producer, eqns)
        reaching = [k for k in sorted(facts) if step.invars[k] is a]
        onward = reaching or [k for k in sorted(facts) if isinstance(step.invars[k], Var)]
        if not onward:
            return None
        exact = exact and all(_identity_of_max(step.invars[k])
                              for k in facts if k != onward[0])
        chain.append((step, onward[0]))
        if reaching:
            break
        u = step.invars[onward[0]]
    else:
        return None
    # a's axis -> the axis of the current value it runs along (None: maximized over, or size 1)
    axis_of: list[int | None] = list(range(len(shape_of(a))))
    for step, k in reversed(chain):
        align = alignment(step, k)
        if align is None:
            return None
        axis_of = [None if d is None else align[d] for d in axis_of]
    if not all(d is None or d == i for i, d in enumerate(axis_of)):
        return None
    sizes = shape_of(a)
    return frozenset(i for i, d in enumerate(axis_of) if d is None and sizes[i] != 1), exact


def reduced_by_a_max(eqn: JaxprEqn) -> frozenset[int]:
    """A one-operand `lax.reduce` whose computation is one `max` of its two arguments (a
    softmax's row max with a finite start, `jaxsafe.nn`'s): at least its operand and its
    initial value. The initial value is not the identity: not exactly the row's maximum."""
    bodies = [p for p in eqn.params.values() if hasattr(p, "eqns") or hasattr(p, "jaxpr")]
    if len(eqn.invars) != 2 or len(bodies) != 1:
        return frozenset()
    body = getattr(bodies[0], "jaxpr", bodies[0])
    if len(body.eqns) != 1 or len(body.invars) != 2:
        return frozenset()
    step = body.eqns[0]
    if rule_for(step.primitive).at_least != frozenset({0, 1}) \
            or set(step.invars) != set(body.invars) or step.outvars != body.outvars:
        return frozenset()
    return frozenset({0, 1})


def _kept_where_finite(step: JaxprEqn, producer: dict, eqns: Sequence[JaxprEqn]
                       ) -> frozenset[int]:
    """`select_n(is_finite(m), c, m)` (logsumexp's shift): `m` itself wherever `m` is finite,
    as every value is here (the callers' ranges and bounds hold for finite values)."""
    selection = rule_for(step.primitive).selection
    if selection is None or not selection.by_predicate or len(step.invars) != 3:
        return frozenset()
    i = producer.get(step.invars[0])
    if i is None or len(eqns[i].invars) != 1 or not rule_for(eqns[i].primitive).true_where_finite \
            or eqns[i].invars[0] is not step.invars[2]:
        return frozenset()
    return frozenset({2})


def _identity_of_max(atom: object) -> bool:
    """A `max` operand that changes nothing: the literal -inf (`jnp.max(..., initial=-inf)`)."""
    return isinstance(atom, Literal) and float(literal_value(atom)) == float("-inf")


def largest_term(eqn: JaxprEqn, producer: dict, eqns: Sequence[JaxprEqn]) -> float | None:
    """For a sum (`PrimitiveRule.sums`) of `g(a - max(a))` with `g` increasing (`exp`) over
    axes that include those maximized over: the value `g(0)` that its largest term takes, in
    the lane where `a` is largest (`sum(exp(x - max(x)))` is at least 1). None: not shown.
    Whether the terms are non-negative is the caller's to show."""
    i = producer.get(eqn.invars[0])
    if i is None or len(eqns[i].outvars) != 1 or len(eqns[i].invars) != 1:
        return None
    term = eqns[i]
    rule = rule_for(term.primitive)
    if not rule.increasing or rule.range is None or not rule.elementwise:
        return None
    j = producer.get(term.invars[0])
    if j is None or not rule_for(eqns[j].primitive).difference:
        return None
    shift = eqns[j]
    found = maximum_of(shift.invars[1], shift.invars[0], producer, eqns)
    if found is None or not found[1] or not found[0] <= set(eqn.params["axes"]) \
            or shape_of(shift.outvars[0]) != shape_of(shift.invars[0]):
        return None
    at_zero = rule.range(term, [(0.0, 0.0)], [None])
    return None if at_zero is None else float(at_zero[0])
