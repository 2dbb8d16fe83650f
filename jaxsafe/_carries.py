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

Primitives that are not lane to lane say how such lanes pass through them with a `Carries` rule
(`_rules.py`): the lanes of a `max`, `min` or `clamp` where a constant wins alone
(`jnp.maximum(x, 0.)`), a product's lanes where a factor that carries nothing is zero, and the
lanes that `pad`, `concatenate`, a `scatter` or `dynamic_update_slice` fill with constants, moved
by slices, gathers, reshapes and transposes. The same lanes are forward mode's dropped lanes: a
NaN-prone primitive there multiplies an exact zero tangent by its derivative (`_free.py`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Generator, Sequence
from typing import Any

import numpy as np
from jax import lax

from ._atoms import is_float, literal_value, shape_of
from ._compat import Jaxpr, JaxprEqn, Literal, Var, bind_eqn, sharded_like
from ._masks import (
    all_of,
    any_of,
    broadcast,
    known_false,
    materialize,
    not_mask,
    reduce_any,
    zeros,
)
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


def carry_classes(jaxpr: Jaxpr, diff: Sequence[Sequence[bool]],
                  fixed: Container = (), inputs: Sequence[Carry] | None = None,
                  masking: bool = False) -> dict[Any, Carry]:
    """The class of every variable of `jaxpr` (its inputs: ALL, but those in `fixed`, a body's
    inputs that carry no derivative in the program around it, or as `inputs` gives them, for an
    inner program whose inputs carry in part; constants: NONE). `diff`: the differentiable
    operands of each equation (`differentiable_operands`). `masking`: as the factors that mask
    a product see them (`Carries.masks_products`)."""
    if inputs is None:
        inputs = [Carry.NONE if v in fixed else Carry.ALL for v in jaxpr.invars]
    out: dict[Any, Carry] = {v: c if is_float(v) else Carry.NONE
                             for v, c in zip(jaxpr.invars, inputs, strict=True)}
    for eqn, d in zip(jaxpr.eqns, diff, strict=True):
        classes = [out.get(v, Carry.NONE) if isinstance(v, Var) and dk else Carry.NONE
                   for v, dk in zip(eqn.invars, d, strict=True)]
        rule = rule_for(eqn.primitive)
        if rule.selection is not None and rule.selection.by_predicate:
            cases = classes[1:]
            c = Carry(max(cases)) if len(set(cases)) == 1 else Carry.PART
        elif rule.carries is not None and len(eqn.outvars) == 1 and (
                rule.carries.masks_products or not masking):
            c = rule.carries.static(eqn, classes)
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
        row = rule_for(eqn.primitive)
        sel = row.selection
        if sel is not None and sel.by_predicate:
            pred = read(eqn.invars[0])
            cases = [materialize(None if m is None else broadcast(m, shape), shape)
                     for m in masks[1:]]
            which = broadcast(pred, shape)
            return lax.select_n(which, *[sharded_like(c, which) for c in cases])
        if row.carries is not None:  # a PART class: asked of this rule's lanes
            return row.carries.lanes(eqn, masks, lambda k: _value(eqn.invars[k], read))
        if row.broadcast:
            m = masks[0]
            if m is None:
                return None
            return lax.broadcast_in_dim(m, shape, eqn.params["broadcast_dimensions"])
        return any_of([None if m is None else broadcast(m, shape) for m in masks])

    return demand(atom, memo, rule)


def _value(atom: Any, read: Callable[[Any], Any]) -> Any:
    return literal_value(atom) if isinstance(atom, Literal) else read(atom)


def _float_classes(eqn: JaxprEqn, classes: list) -> list:
    return [c for v, c in zip(eqn.invars, classes, strict=True) if is_float(v)]


def _mixed(found: Sequence[Carry]) -> Carry:
    """NONE or ALL when every operand agrees, else PART."""
    return Carry(found[0]) if found and len(set(found)) == 1 else Carry.PART


# --------------------------------------------------------------------------- the rules

def moved_static(eqn: JaxprEqn, classes: list) -> Carry:
    return _mixed(_float_classes(eqn, classes))


def moved_lanes(eqn: JaxprEqn, masks: list, value: Callable[[int], Any]) -> Mask:
    """The primitive itself, run on the operands' carrying lanes (booleans) in place of their
    values: a pad's constant lanes are False, a scatter's overwritten lanes are its updates'."""
    operands = [materialize(m, shape_of(v)) if is_float(v) else value(k)
                for k, (v, m) in enumerate(zip(eqn.invars, masks, strict=True))]
    return bind_eqn(eqn, operands)[0]


def reduced_lanes(eqn: JaxprEqn, masks: list, value: Callable[[int], Any]) -> Mask:
    """A reduction's result carries where any lane of its row does: a row of a padded batch
    that a `where` filled with constants sums to a lane that carries nothing (the norm of a
    padding row, whose `sqrt` forward mode meets at 0)."""
    m = masks[0]
    return None if m is None else reduce_any(m, eqn.params["axes"])


def winner_static(eqn: JaxprEqn, classes: list) -> Carry:
    found = _float_classes(eqn, classes)
    if Carry.NONE in found and len(set(found)) > 1:
        return Carry.PART
    return _mixed(found)


def winner_lanes(eqn: JaxprEqn, masks: list, value: Callable[[int], Any]) -> Mask:
    """Where one operand wins alone, the output carries what it carries (a constant's: nothing);
    elsewhere (a tie shares, NaN) what any operand carries."""
    selection = rule_for(eqn.primitive).selection
    assert selection is not None and selection.wins is not None
    shape = shape_of(eqn.outvars[0])
    wins = selection.wins(eqn, [value(k) for k in range(len(eqn.invars))])
    if all(m is None for m in masks):
        return None
    carried = [w if m is None else all_of([w, broadcast(m, shape)])
               for w, m in zip(wins, masks, strict=True)
               if m is None or not known_false(m)]
    anyone = any_of([None if m is None else broadcast(m, shape) for m in masks])
    shared = not_mask(any_of(wins)) if anyone is None else all_of([not_mask(any_of(wins)),
                                                                    anyone])
    return any_of([*carried, shared])


def product_static(eqn: JaxprEqn, classes: list) -> Carry:
    """PART when a factor that carries nothing (or carries in part) may be zero."""
    found = _float_classes(eqn, classes)
    if len(found) != 2 or Carry.ALL not in found or set(found) == {Carry.ALL}:
        return _mixed(found) if found else Carry.NONE
    other = next(v for v, c in zip(eqn.invars, classes, strict=True) if c != Carry.ALL)
    if isinstance(other, Literal) and not np.any(np.asarray(literal_value(other)) == 0):
        return Carry.ALL
    return Carry.PART


def product_lanes(eqn: JaxprEqn, masks: list, value: Callable[[int], Any]) -> Mask:
    """`a * b` carries `a`'s derivative where `a` does and `b` is not a zero that carries
    nothing (`b * da` is an exact zero there), and `b`'s likewise."""
    shape = shape_of(eqn.outvars[0])
    parts = []
    # a square (`x * x`): both factors give the same lanes
    pairs = ((0, 1),) if eqn.invars[0] is eqn.invars[1] else ((0, 1), (1, 0))
    for k, j in pairs:
        if masks[k] is not None and known_false(masks[k]):
            continue
        other = value(j)
        nonzero = lax.ne(other, lax.full_like(other, 0))
        keeps = broadcast(nonzero if masks[j] is None else lax.bitwise_or(nonzero, masks[j]),
                          shape)
        own = None if masks[k] is None else broadcast(masks[k], shape)
        parts.append(keeps if own is None else all_of([own, keeps]))
    if not parts:
        return zeros(shape)
    return any_of(parts) if len(parts) > 1 else parts[0]
