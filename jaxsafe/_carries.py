"""Which lanes of a value carry a derivative of the inputs: the factors that can mask a product.

In `m * v`, a lane where `m` is exactly zero and carries no derivative of the inputs drops the
lane of `v` (a constant 0/1 mask, `(x > 0).astype(f)`, `jnp.heaviside(x, 0.)`): its derivative is
`m * dv = 0` there, whatever `v` holds. A zero that depends on the inputs (`sqrt(x) * sqrt(x)` at
0) is a real singularity and is not a drop.

Statically each value is in one of three classes (`Carry`): NONE (no lane carries: constants,
literals, predicates converted to floats, `stop_gradient`), ALL (every lane may: the arguments
and anything computed from them by a primitive that mixes lanes), or PART (a `select_n` or an
elementwise combination of the two: `jnp.heaviside(x, 0.)` returns `x` itself in its NaN lanes).
Only a NONE or PART factor can mask a product; for PART, a run-time mask of the carrying lanes
follows the selections (`carry_mask`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator, Sequence
from typing import Any

from jax import lax

from ._atoms import is_float, shape_of
from ._compat import Jaxpr, JaxprEqn, Literal, Var
from ._masks import any_of, broadcast, materialize, zeros
from ._rules import Mask, rule_for
from ._walk import demand


class Carry(enum.IntEnum):
    NONE = 0
    PART = 1
    ALL = 2


def _by_lane(eqn: JaxprEqn) -> bool:
    """Lane to lane, so a lane carries only what its operands' lanes carry."""
    rule = rule_for(eqn.primitive)
    return len(eqn.outvars) == 1 and (rule.elementwise or rule.broadcast)


def carry_classes(jaxpr: Jaxpr, diff: Sequence[Sequence[bool]]) -> dict[Any, Carry]:
    """The class of every variable of `jaxpr` (its inputs: ALL; constants: NONE). `diff`: the
    differentiable operands of each equation (`differentiable_operands`)."""
    out: dict[Any, Carry] = {v: Carry.ALL if is_float(v) else Carry.NONE for v in jaxpr.invars}
    for eqn, d in zip(jaxpr.eqns, diff, strict=True):
        classes = [out.get(v, Carry.NONE) if isinstance(v, Var) and dk else Carry.NONE
                   for v, dk in zip(eqn.invars, d, strict=True)]
        rule = rule_for(eqn.primitive)
        if rule.selection is not None and rule.selection.by_predicate:
            cases = classes[1:]
            c = Carry(max(cases)) if len(set(cases)) == 1 else Carry.PART
        elif _by_lane(eqn):
            c = Carry.ALL if Carry.ALL in classes else Carry(max(classes, default=Carry.NONE))
        else:
            c = Carry.ALL if any(classes) else Carry.NONE
        for o in eqn.outvars:
            out[o] = c if is_float(o) else Carry.NONE
    return out


def carrying_lanes(atom: Any, classes: dict[Any, Carry], producer: dict[Any, JaxprEqn],
               memo: dict, read: Callable[[Any], Any]) -> Mask:
    """The lanes of `atom` that carry a derivative, at run time (None: every lane may).
    `read(var)`: a variable's original value (for the predicates of selections)."""

    def rule(v: Any) -> Generator[Any, Any, Mask]:
        c = Carry.NONE if isinstance(v, Literal) else classes.get(v, Carry.NONE)
        if c == Carry.NONE:
            return zeros(shape_of(v))
        if c == Carry.ALL:
            return None
        eqn = producer[v]
        shape = shape_of(v)
        masks = []
        for u in eqn.invars:
            masks.append((yield u) if isinstance(u, Var) else zeros(shape_of(u)))
        sel = rule_for(eqn.primitive).selection
        if sel is not None and sel.by_predicate:
            pred = read(eqn.invars[0])
            cases = [materialize(None if m is None else broadcast(m, shape), shape)
                     for m in masks[1:]]
            return lax.select_n(broadcast(pred, shape), *cases)
        if rule_for(eqn.primitive).broadcast:
            m = masks[0]
            if m is None:
                return None
            return lax.broadcast_in_dim(m, shape, eqn.params["broadcast_dimensions"])
        return any_of([None if m is None else broadcast(m, shape) for m in masks])

    return demand(atom, memo, rule)
