"""Values shown finite in the lanes a program drops, by the comparison that drops them.

`jnp.sqrt(jnp.maximum(jnp.sum(x ** 2), 1e-12))` drops `sum(x ** 2)` where 1e-12 beats it: there
the sum is below 1e-12 and not NaN (a comparison with NaN fails, and `max` keeps a NaN), and a
sum of squares is never below 0, so the sum is finite; an inf or NaN `x` would have made it inf
or NaN. So `x` is finite in those lanes, its square's derivative `2 x` too, and the zero
cotangent there stays 0: `x ** 2` needs no guard for an `x` that may be non-finite elsewhere.

A literal of a dropped lane's term shows a value `a` finite when it is a comparison that holds
against a finite constant (`a < c`, `a >= c`: not NaN, and bounded on that side) or a `max`/`min`
operand that loses to a finite constant (`Unknown.wins`), and `a`'s range (`_ranges.py`) bounds
it on the other side. The range is derived for finite inputs; an inf input gives an IEEE
operation's limit at inf, which lies in the closure of that range, and a NaN is excluded by the
comparison. From `a`, finiteness goes back to the operations' operands that would have made it
inf or NaN (`PrimitiveRule.finite_where_finite`): lane by lane where `a` has the operand's lanes,
or every lane where `a` is a scalar.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._atoms import dtype_of, literal_value, shape_of
from ._compat import JaxprEqn, Literal, Var
from ._ranges import compared
from ._rules import rule_for
from ._symbolic import Lit, Sym, Unknown

MAX_STEPS = 256
"""Values the walk back from a compared value looks at, at most; past that it shows nothing."""


def finite_where_dropped(dead: Sym, v: Any, sweep: Any, bounds: Any) -> bool:
    """Whether `v` (an operand of an elementwise equation, of its output's shape) is finite in
    every lane of `dead`, the equation's dropped lanes: each term holds a literal that shows
    a value finite from which `v`'s lanes would have been seen inf or NaN. `sweep`: the
    program's `Sweep` (producers, constants); `bounds`: its `Bounds` (ranges)."""
    if not isinstance(v, Var) or not _real_float(v) or bounds is None:
        return False
    return all(any(_shows_finite(lit, v, sweep, bounds) for lit in term) for term in dead)


def _real_float(atom: Any) -> bool:
    return np.issubdtype(dtype_of(atom), np.floating)


def _shows_finite(lit: Lit, v: Any, sweep: Any, bounds: Any) -> bool:
    compared_value = _bounded_by_a_constant(lit, sweep)
    if compared_value is None:
        return False
    a, below = compared_value  # `a` is not NaN, and at most (below) or at least a finite c
    known = bounds.range_of(a)
    lo, hi = known if known is not None else (-np.inf, np.inf)
    if not np.isfinite(lo if below else hi):
        return False
    key, _, embed = lit
    shape = shape_of(v)
    if shape_of(a) == ():
        return _finite_back_to(a, v, sweep, lanewise=False)
    same_frame = embed in (tuple(range(len(shape))),
                           tuple(i for i, n in enumerate(shape) if n != 1))
    return shape_of(a) == shape and same_frame and _finite_back_to(a, v, sweep, lanewise=True)


def _bounded_by_a_constant(lit: Lit, sweep: Any) -> tuple[Var, bool] | None:
    """(a, below) where `lit` holds: `a` is not NaN, and is at most a finite constant (below)
    or at least one."""
    key, holds, _ = lit
    if isinstance(key, Var):
        compare: JaxprEqn | None = sweep.producer_of(key)
        if compare is None or not holds or (order := compared(compare, True)) is None:
            return None
        greater = order[0]
        sides = [(compare.invars[greater], compare.invars[1 - greater], False),
                 (compare.invars[1 - greater], compare.invars[greater], True)]
    elif isinstance(key, Unknown) and key.wins is not None and not holds:
        chooser, k = key.wins  # operand k loses: the other one beats it strictly
        selection = rule_for(chooser.primitive).selection
        if selection is None or selection.larger_wins is None or len(chooser.invars) != 2:
            return None
        sides = [(chooser.invars[k], chooser.invars[1 - k], selection.larger_wins)]
    else:
        return None
    for a, c, below in sides:
        if isinstance(a, Var) and _real_float(a) and _finite_constant(c, sweep):
            return a, below
    return None


def _finite_constant(atom: Any, sweep: Any) -> bool:
    value = literal_value(atom) if isinstance(atom, Literal) else sweep.constant(atom)
    return value is not None and np.size(value) == 1 and bool(np.isfinite(np.asarray(value)))


def _finite_back_to(a: Var, v: Any, sweep: Any, lanewise: bool) -> bool:
    """Whether `v` is among the values whose inf or NaN would make `a` inf or NaN: lane by
    lane through elementwise equations of one shape (`lanewise`), else every lane."""
    target = sweep.same_as(v)
    pending, seen = [a], set()
    for _ in range(MAX_STEPS):
        if not pending:
            return False
        u = pending.pop()
        if sweep.same_as(u) is target:
            return True
        if u in seen:
            continue
        seen.add(u)
        producer: JaxprEqn | None = sweep.producer_of(u)
        if producer is None or len(producer.outvars) != 1 or not np.prod(shape_of(u)):
            continue  # an empty value reads no lane of its operands (a broadcast to size 0)
        rule = rule_for(producer.primitive)
        if rule.finite_where_finite is None or lanewise and not rule.elementwise:
            continue
        for k in rule.finite_where_finite(producer):
            w = producer.invars[k]
            if isinstance(w, Var) and _real_float(w) and \
                    not (lanewise and shape_of(w) != shape_of(u)):
                pending.append(w)
    return False
