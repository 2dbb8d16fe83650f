"""A `select_n`'s integer case index read as the predicates it is computed from.

`jnp.select(conds, cases, default)` stacks `[False, *conds]` along a new axis, takes the
`argmax` of the booleans (the first True, or 0 where none is) and picks with a `select_n` on
that integer. Case k (k >= 1) is taken exactly where `conds[k-1]` holds and no earlier one
does; the default where none holds. A `cond` under `vmap` picks its branches' results with a
`select_n` on its predicate cast to an integer: case 1 where it holds. Read so, each case's
liveness is a formula over the user's own predicates, as a `jnp.where`'s is, instead of an
unknown decided at run time: a branch the user guarded by hand with its own condition is seen
to be (`_by_hand.py`), and its guard reads predicates the program already has.

JAX 0.10 stacks with `stack`; JAX 0.9 concatenates size-1 broadcasts of the conditions. Each
stacking primitive says how it stacks (`PrimitiveRule.stacked_rows`), `argmax` says it finds
the first True of booleans (`PrimitiveRule.first_true`), and a cast says it is one
(`PrimitiveRule.casts`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._atoms import dtype_of, shape_of
from ._compat import JaxprEqn, Literal, Var
from ._rules import Context, rule_for
from ._symbolic import FALSE, Lit, Sym, negate, predicate_literal, split_on, sym_and_literal, sym_or


def rows_of_stack(eqn: JaxprEqn, axis: int, ctx: Context) -> list[Any] | None:
    """`stack` along `axis`: its operands, in order."""
    return list(eqn.invars) if eqn.params["axis"] == axis else None


def rows_of_concatenate(eqn: JaxprEqn, axis: int, ctx: Context) -> list[Any] | None:
    """A `concatenate` along `axis` of size-1 broadcasts that add that axis to values of the
    other axes' shape: those values, in order."""
    if eqn.params["dimension"] != axis:
        return None
    out_shape = shape_of(eqn.outvars[0])
    row_shape = out_shape[:axis] + out_shape[axis + 1:]
    rows = []
    for v in eqn.invars:
        broadcast = ctx.broadcast_of(v) if isinstance(v, Var) else None
        if broadcast is None or shape_of(v)[axis] != 1:
            return None
        src = broadcast.invars[0]
        dims = tuple(broadcast.params["broadcast_dimensions"])
        if shape_of(src) != row_shape or dims != tuple(d for d in range(len(out_shape))
                                                       if d != axis):
            return None
        rows.append(src)
    return rows


def first_true_of_argmax(eqn: JaxprEqn, ctx: Context) -> list[Any] | None:
    """`argmax` over one axis of booleans that a stacking primitive stacks along it: the
    stacked conditions, each of the index's shape (None where it is not that)."""
    operand = eqn.invars[0]
    axes = tuple(eqn.params["axes"])
    if len(axes) != 1 or not isinstance(operand, Var) or dtype_of(operand) != np.bool_:
        return None
    stacking = ctx.producer_of(operand)
    if stacking is None:
        return None
    stacked_rows = rule_for(stacking.primitive).stacked_rows
    rows = stacked_rows(stacking, axes[0], ctx) if stacked_rows is not None else None
    if rows is None or any(shape_of(r) != shape_of(eqn.outvars[0]) for r in rows):
        return None
    return rows


def case_syms(eqn: JaxprEqn, out: Sym, ctx: Context) -> list[Sym] | None:
    """The formulas of a `select_n`'s cases whose integer index is a boolean cast (case 1 where
    it holds) or the first True of stacked conditions `c_0, ..., c_n` (one case each): case k
    is taken where `c_k` holds and no earlier one does, case 0 also where none holds. None
    where the index is neither."""
    index = eqn.invars[0]
    producer = ctx.producer_of(index) if isinstance(index, Var) else None
    if producer is None or shape_of(index) != shape_of(eqn.outvars[0]):
        return None
    cast = _cast_predicate(producer)
    if cast is not None and len(eqn.invars) == 3:
        lit = predicate_literal(cast, True, ctx.broadcast_of, ctx.same_as)
        return [FALSE, *split_on(out, lit)]
    first_true = rule_for(producer.primitive).first_true
    rows = first_true(producer, ctx) if first_true is not None else None
    if rows is None or len(rows) != len(eqn.invars) - 1:
        return None
    holds = [_literal(r, True, ctx) for r in rows]
    fails = [_literal(r, False, ctx) for r in rows]
    syms: list[Sym] = [FALSE]  # the index carries no derivative
    earlier_fail = out
    for k in range(len(rows)):
        syms.append(_and(earlier_fail, holds[k]))
        earlier_fail = _and(earlier_fail, fails[k])
    syms[1] = sym_or(syms[1], earlier_fail)  # none holds: argmax's 0
    return syms


def _cast_predicate(producer: JaxprEqn) -> Var | None:
    """The boolean an index is cast from (a batched `cond`'s predicate: 0 or 1), else None."""
    source = producer.invars[0] if producer.invars else None
    if not rule_for(producer.primitive).casts or not isinstance(source, Var) or \
            dtype_of(source) != np.bool_ or shape_of(source) != shape_of(producer.outvars[0]):
        return None
    return source


def _literal(row: Any, positive: bool, ctx: Context) -> Lit | bool:
    """`row` (or its negation) as a literal, or a bool where it is known alike in every lane
    (`jnp.select`'s leading False)."""
    if isinstance(row, Literal):  # a scalar
        return bool(np.asarray(row.val)) == positive
    value = ctx.constant(row)
    if value is not None and (bool(np.all(value)) or not np.any(value)):
        return bool(np.all(value)) == positive
    lit = predicate_literal(row, True, ctx.broadcast_of, ctx.same_as)
    return lit if positive else negate(lit)


def _and(sym: Sym, part: Lit | bool) -> Sym:
    if isinstance(part, bool):
        return sym if part else FALSE
    return sym_and_literal(sym, part)
