"""Lanes that carry no derivative: forward mode's dropped lanes.

A lane of a value carries no derivative of the inputs when the program's structure cuts every
path to it from them (`_carries.py`): `jnp.where(x > 0, x, 0.)` takes a constant there,
`jnp.maximum(x, 0.)` a constant that wins, `m * x` a zero factor that carries nothing, `jnp.pad`
a padding constant. Its tangent is an exact zero. A NaN-prone primitive whose derivative is
infinite there (`sqrt` of the 0 that the `where` put in) multiplies that zero by inf: forward mode
(`jvp`, `jacfwd`) gets NaN in every lane that the sum of the output mixes it into, while reverse
mode gets 0 (the `where` hands the inf cotangent to the constant). The mirror image of a dropped
lane, whose zero cotangent meets an infinite derivative in reverse mode.

**The guard** (`Site.free`, emitted by `_emit.py`), in the lanes of such an equation's output
that carry no derivative: where every such lane of its operands was made so by a selection
(`selected`: a `select_n`, a pad, a scatter, a `max` that a constant wins, which is emitted as a
`select_n` below a NaN-prone primitive), a cut of the output, `select_n(free, y,
stop_gradient(y))` (`Site.free_cut`): the tangent there is an exact zero, and the `0 * inf` that
reverse mode then computes in the operand's cotangent stays in those lanes until the selection
that made them drops it, at every order. Otherwise (a product's zero factor would weigh it,
`0 * NaN`) its NaN-prone operands take the table's safe value there and the output takes the
original value back with its derivative cut, `select_n(free, f(safe), stop_gradient(f(x)))`
(live lanes only beside a value guard of dropped lanes). The forward value is the original,
bit for bit, either way.

**Beside an operand that carries** (`FreeValues.operand_cuts`, `Site.free_operands`): a
divisor whose lanes carry nothing where the numerator's carry (`v / jnp.maximum(norm(v), eps)`
at `v = 0`) has a zero tangent that forward mode weighs by `-v * y ** -2`, inf for a tiny `eps`.
The output's lanes carry, so there the equation is computed again with that operand's
derivative cut (`_emit.py`), where its known values make a derivative in it non-finite.

**No guard where the values are known** (`FreeValues`): the lanes that carry nothing hold values
the program fixes (the constant a `where` takes, a padding value), often known when the rewrite is
planned. Where the primitive and its derivatives are finite at every such value, there is nothing
to guard: `jnp.where(x > 0, x, 1.)`, the inner half of a hand-written double where, or
`jnp.maximum(x, 1e-12)` before a `sqrt`, cost nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._atoms import (
    MAX_WEIGHT,
    dtype_of,
    float_info,
    is_float,
    literal_value,
    readable_constant,
    shape_of,
)
from ._bounds import Bounds, never_wins_alone
from ._carries import Carry
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Var
from ._constants import finite_with_derivatives, fold
from ._ranges import compared
from ._rules import PrimitiveRule, guard_for, rule_for
from ._symbolic import (
    FALSE,
    TRUE,
    Sym,
    disjoint,
    join_on,
    opaque,
    predicate_literal,
    sym_and,
)
from ._walk import demand

if TYPE_CHECKING:
    from ._liveness import Sweep

MAX_VALUES = 8
"""At most this many distinct values are followed per variable; more count as unknown."""

MAX_POINTS = 16
"""At most this many combinations of operand values are evaluated per equation."""

Held = tuple | None
"""The values (NumPy scalars) that a value holds in its lanes that carry no derivative (every
lane, for a value that carries none), or None when unknown."""


def _distinct(values: Any) -> Held:
    flat = np.unique(np.asarray(values).reshape(-1)) if np.size(values) else np.asarray([])
    if flat.size > MAX_VALUES:
        return None
    return tuple(flat[j] for j in range(flat.size))


def held_union(parts: list[Held]) -> Held:
    if any(p is None for p in parts):
        return None
    merged = [x for p in parts if p is not None for x in p]
    return _distinct(np.asarray(merged)) if merged else ()


class FreeValues:
    """What the lanes of one jaxpr's values that carry no derivative hold, computed on demand."""

    def __init__(self, closed: ClosedJaxpr | None, sweep: Sweep, bounds: Bounds | None = None,
                 consts: dict | None = None):
        """`closed`: the program, for its constants' values (None: they are unknown, but for
        `consts`, the concrete float constants a sweep holds: `Sweep.weights`).
        `bounds`: its values' bounds, where known: an operand of `max` that another is always
        at least as large as never shows its lanes (None: every operand may win)."""
        self.eqns, self.sweep, self.bounds = sweep.jaxpr.eqns, sweep, bounds
        self.memo: dict[Any, Held] = {}
        self.syms: dict[Any, Sym] = {}
        self.selections: dict[Any, bool] = {}
        self.consts = dict(consts or {}) if closed is None else {
            v: c for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)
            if readable_constant(c) and np.size(c) <= MAX_WEIGHT}

    def carry(self, atom: Any) -> Carry:
        if isinstance(atom, Literal):
            return Carry.NONE
        return self.sweep.carry_classes().get(atom, Carry.NONE)

    def held(self, atom: Any) -> Held:
        if isinstance(atom, Literal):
            return _distinct(literal_value(atom))
        return demand(atom, self.memo, self._compute)

    def _compute(self, v: Any) -> Generator[Any, Held, Held]:
        """The rule `demand` runs: yields each operand it needs, receives what it holds."""
        if not is_float(v):
            return (np.bool_(False), np.bool_(True)) if dtype_of(v) == np.bool_ else None
        if v in self.consts:  # a concrete constant, read only when asked for
            return _distinct(np.asarray(self.consts[v]))
        if v in self.sweep.known_inputs:  # a body's input, as the program around holds it
            return self.sweep.known_inputs[v]
        i = self.sweep.producer.get(v)
        if i is None or self.carry(v) == Carry.ALL:
            return None
        eqn = self.eqns[i]
        rule = rule_for(eqn.primitive)
        diff = self.sweep.diff[i]
        classes = [self.carry(u) if d else Carry.NONE for u, d in zip(eqn.invars, diff,
                                                                      strict=True)]
        helds: list[Held] = []
        for u, c in zip(eqn.invars, classes, strict=True):
            if c == Carry.ALL:
                helds.append(None)
            elif isinstance(u, Literal):
                helds.append(self.held(u))
            else:
                helds.append((yield u))
        if self.bounds is not None and rule.selection is not None \
                and rule.selection.larger_wins is not None:
            helds = [() if h != () and never_wins_alone(eqn, k, self.bounds) else h
                     for k, h in enumerate(helds)]
        if rule.selection is not None and rule.selection.by_predicate:
            helds = self._taken_where_compared(eqn, helds)
        return _combined(eqn, rule, classes, helds)

    def _taken_where_compared(self, eqn: JaxprEqn, helds: list[Held]) -> list[Held]:
        """A `select_n` on a comparison of one of its own cases with a constant takes that case
        only where the comparison says so: of what it holds, only the values that pass.
        `jnp.where(s > 0, s, 1.)` with `s = jnp.maximum(q, 0.)`: `s` carries nothing where it
        is 0, a value the `where` never takes (a hand-written double where over a ReLU). The
        comparison may be of a twin of the case, or of an operand of the `max` (`min`) that
        computes the case (`jnp.where(q > 0, s, 1.)`): that operand is at most (least) the
        case's value, and a comparison false (true) there stays so below (above) it."""
        pred = eqn.invars[0]
        compare = self.sweep.producer_of(pred) if isinstance(pred, Var) else None
        if compare is None or len(eqn.invars) != 3 or len(compare.invars) != 2 \
                or dtype_of(pred) != np.bool_ or not rule_for(compare.primitive).foldable \
                or compare.invars[0] is compare.invars[1]:
            return helds
        out = list(helds)
        for k in (1, 2):
            case, held = eqn.invars[k], helds[k]
            if held is None or not isinstance(case, Var) or shape_of(case) != shape_of(pred):
                continue
            found = self._compared(compare, case)
            if found is None:
                continue
            at, valid = found
            other = compare.invars[1 - at]
            bound = literal_value(other) if isinstance(other, Literal) \
                else self.sweep.constant(other)
            if bound is None or np.size(bound) != 1:
                continue
            bound = np.asarray(bound).reshape(())
            kept = []
            for value in held:
                operands = [value, bound] if at == 0 else [bound, value]
                result = bool(np.asarray(fold(compare, operands)[0]))
                if result == (k == 2) or (valid is not None and result != valid):
                    kept.append(value)
            out[k] = tuple(kept)
        return out

    def _compared(self, compare: JaxprEqn, case: Var) -> tuple[int, bool | None] | None:
        """Which operand of `compare` stands for `case`, and which result of the comparison at
        the case's value holds for that operand too (None: both, it is the case or a twin)."""
        twins = [j for j, u in enumerate(compare.invars)
                 if isinstance(u, Var) and self.sweep.same_as(u) is self.sweep.same_as(case)]
        if twins:
            return twins[0], None
        chooser = self.sweep.producer_of(case)
        if chooser is None:
            return None
        order = compared(compare, True)
        selection = rule_for(chooser.primitive).selection
        if order is None or selection is None or selection.larger_wins is None:
            return None
        operands = {self.sweep.same_as(u) for u in chooser.invars if isinstance(u, Var)}
        for j, u in enumerate(compare.invars):
            if isinstance(u, Var) and self.sweep.same_as(u) in operands:
                # a max's operand is at most its value: "u is the larger" false at the value
                # stays false below it; "u is the smaller" true stays true
                u_is_larger = j == order[0]
                return j, (not u_is_larger) if selection.larger_wins else u_is_larger
        return None

    def free_sym(self, atom: Any) -> Sym:
        """The lanes of `atom` that carry no derivative, as a static formula that holds every
        such lane (and maybe more): `~p` for `jnp.where(p, x, 0.)`."""
        if isinstance(atom, Literal):
            return TRUE
        return demand(atom, self.syms, self._free_sym)

    def _free_sym(self, v: Any) -> Generator[Any, Sym, Sym]:
        carry = self.carry(v)
        if carry != Carry.PART:
            return TRUE if carry == Carry.NONE else FALSE
        i = self.sweep.producer.get(v)
        if i is None:  # pragma: no cover - a PART value has a producer
            return opaque()
        eqn, diff, shape = self.eqns[i], self.sweep.diff[i], shape_of(v)
        rule = rule_for(eqn.primitive)
        pred = eqn.invars[0]
        if rule.selection is not None and rule.selection.by_predicate and len(eqn.invars) == 3 \
                and isinstance(pred, Var) and dtype_of(pred) == np.bool_ \
                and shape_of(pred) in (shape, ()):
            cases = []
            for u, d in zip(eqn.invars[1:], diff[1:], strict=True):
                cases.append((yield u) if isinstance(u, Var) and d else TRUE)
            lit = predicate_literal(pred, True, self.sweep.broadcast_of,
                                    self.sweep.same_as)
            return join_on(lit, cases[0], cases[1])
        if rule.elementwise and rule.carries is None and len(eqn.outvars) == 1:
            out: Sym | None = TRUE
            for u, d in zip(eqn.invars, diff, strict=True):
                if not (isinstance(u, Var) and d and is_float(u)):
                    continue
                if shape_of(u) != shape:
                    part = TRUE if self.carry(u) == Carry.NONE else opaque()
                else:
                    part = yield u
                out = None if out is None else sym_and(out, part)
            return opaque() if out is None else out
        return opaque()

    def selected(self, atom: Any) -> bool:
        """Whether every lane of `atom` that carries nothing was made so by a selection
        (`select_n`, a `Carries` rule that `selects`), through lane-to-lane equations: its
        derivative stops whatever reaches that lane's cotangent."""
        if isinstance(atom, Literal) or self.carry(atom) != Carry.PART:
            return True
        return demand(atom, self.selections, self._selected)

    def _selected(self, v: Any) -> Generator[Any, bool, bool]:
        i = self.sweep.producer.get(v)
        if i is None:  # pragma: no cover - a PART value has a producer
            return False
        eqn, diff = self.eqns[i], self.sweep.diff[i]
        rule = rule_for(eqn.primitive)
        if rule.carries is not None:
            if not rule.carries.selects_at(eqn):
                return False
        elif not ((rule.selection is not None and rule.selection.by_predicate)
                  or rule.broadcast or (rule.elementwise and len(eqn.outvars) == 1)):
            return False
        for u, d in zip(eqn.invars, diff, strict=True):
            if isinstance(u, Var) and d and self.carry(u) == Carry.PART and not (yield u):
                return False
        return True

    # -- the guard ---------------------------------------------------------------------------

    def guards(self, i: int, eqn: JaxprEqn, rule: PrimitiveRule) -> tuple[dict[int, float], bool]:
        """The operands of a NaN-prone equation that take the safe value in the lanes of its
        output that carry no derivative (empty: nothing to guard), and whether a cut of the
        output suffices there instead (`selected`: no second evaluation, no operand changed)."""
        found = self._guards(i, eqn, rule)
        return found, bool(found) and all(self.selected(u) for u in eqn.invars)

    def _guards(self, i: int, eqn: JaxprEqn, rule: PrimitiveRule) -> dict[int, float]:
        guard = guard_for(eqn)
        if guard is None or not rule.elementwise or len(eqn.outvars) != 1 \
                or not is_float(eqn.outvars[0]) or self.carry(eqn.outvars[0]) != Carry.PART:
            return {}
        diff = self.sweep.diff[i]
        operands = {k: value for k, value in guard.safe.items()
                    if k < len(eqn.invars) and is_float(eqn.invars[k]) and (
                        diff[k] or isinstance(eqn.invars[k], Literal))}
        if not operands or disjoint(self.free_sym(eqn.outvars[0]), self.sweep.sym(eqn.outvars[0])):
            return {}  # its such lanes are all dropped (a hand-written double where's inner half)
        # a primitive singular only where its value is inf or NaN (a pole) shows it in the
        # forward value. Known values are read all the same: `log(1e-5)` is finite in
        # float16, its derivative 1e5 is not.
        shows = not guard.finite_at_singularities
        finite = self._finite_there(eqn, shows)
        if finite or (finite is None and shows):
            return {}
        return operands

    def operand_cuts(self, i: int, eqn: JaxprEqn, rule: PrimitiveRule) -> dict[int, float]:
        """The NaN-prone operands whose lanes that carry no derivative meet another operand's
        that do (`x / jnp.maximum(n, 1e-20)` where the constant wins: the output carries `x`'s
        derivative): forward mode weighs their zero tangent by a partial derivative that may
        be inf at a finite value (`-x / 1e-40`). Operand -> its safe value; there, the output
        is computed again with the operand's derivative cut (`_emit.py`). Only where the values
        they hold are known: elsewhere, as for a free output, a pole is taken to show in the
        forward value."""
        guard = guard_for(eqn)
        if guard is None or not rule.elementwise or len(eqn.outvars) != 1 \
                or not is_float(eqn.outvars[0]):
            return {}
        diff, shape = self.sweep.diff[i], shape_of(eqn.outvars[0])
        passing = [k for k, (u, d) in enumerate(zip(eqn.invars, diff, strict=True))
                   if d and isinstance(u, Var) and is_float(u)]
        if len(passing) < 2:
            return {}
        live = self.sweep.sym(eqn.outvars[0])
        cuts = {}
        for k, value in guard.safe.items():
            u = eqn.invars[k] if k < len(eqn.invars) else None
            # a scalar or a row keeps its shape (XLA divides by it as by its reciprocal)
            if k not in passing or not _broadcasts_to(shape_of(u), shape) \
                    or any(shape_of(eqn.invars[j]) != shape_of(u) for j in cuts) \
                    or self.carry(u) != Carry.PART or disjoint(self.free_sym(u), live):
                continue
            held = self.held(u)
            if held is None or len(held) > MAX_POINTS:
                continue
            # the others' values are not known: a partial derivative that is the others' value
            # times a factor of this operand alone (a divisor's -x / y ** 2) is read at 1
            if k not in guard.apart or not all(
                    _finite_at(eqn, _at_one(eqn, k, h), [k], not guard.finite_at_singularities)
                    for h in held):
                cuts[k] = value
        return cuts

    def _finite_there(self, eqn: JaxprEqn, shows: bool) -> bool | None:
        """Whether `eqn` and its derivatives are finite at every value its operands may hold
        where its output carries no derivative; None where those values are not known.
        `shows`: a point where the value itself is inf or NaN counts as finite (a pole that the
        forward value shows: `log(0)`)."""
        helds = [self.held(u) for u in eqn.invars]
        points = _points(helds)
        # derivatives in the operands that pass a tangent only: a literal exponent has none
        # (`(1 - e) ** 2.` at a negative base: its derivative in the exponent is NaN)
        passing = [k for k, u in enumerate(eqn.invars) if isinstance(u, Var) and is_float(u)]
        if points is None:
            return None
        return all(_finite_at(eqn, p, passing, shows) for p in points)


def _finite_at(eqn: JaxprEqn, point: Sequence, wrt: Sequence[int], shows: bool) -> bool:
    """Whether `eqn` and its derivatives in the operands `wrt` (to `FREE_LANE_ORDER`; the
    first, in every float operand, where `wrt` is empty) are finite at `point`; with `shows`, or
    its value there is not."""
    if shows and not np.all(np.isfinite(fold(eqn, [np.asarray(x) for x in point])[0])):
        return True
    if not wrt:
        return finite_with_derivatives(eqn, point)
    # to a higher order in each operand (forward over forward differentiates each derivative
    # again): `0. ** 2.` is finite with its first two derivatives, not its third
    return all(finite_with_derivatives(eqn, point, order=FREE_LANE_ORDER, wrt=k) for k in wrt)


FREE_LANE_ORDER = 3
"""The derivative order to which a NaN-prone equation must be finite at the values its operands
hold where its output carries no derivative, for those lanes to need no forward-mode guard
(a power of 0 with a whole exponent y is finite to order y and singular at order y + 1): to
the third, as the bounds of the hand-guarded code (`_by_hand.py`), Hessians and one more.
`jnp.sqrt(jnp.maximum(x, 1e-12))`'s fourth derivative overflows float32 at 1e-12."""


def _combined(eqn: JaxprEqn, rule: PrimitiveRule, classes: list, helds: list[Held]) -> Held:
    """What `eqn`'s output holds where it carries nothing, from its operands' such values."""
    if rule.selection is not None and rule.selection.by_predicate:
        return held_union([h for h, c in zip(helds[1:], classes[1:], strict=True)
                       if c != Carry.ALL])
    if rule.carries is not None and len(eqn.outvars) == 1:
        return rule.carries.held(eqn, classes, helds)
    if rule.broadcast:
        return helds[0]
    if rule.elementwise and rule.foldable and len(eqn.outvars) == 1:
        return evaluate_at(eqn, helds)
    return None


def _broadcasts_to(operand: tuple, shape: tuple) -> bool:
    """Whether an elementwise operand of this shape broadcasts to `shape` (rank 0, or the same
    rank with axes of size 1)."""
    return operand == () or (len(operand) == len(shape)
                             and all(a in (1, b) for a, b in zip(operand, shape, strict=True)))


def _at_one(eqn: JaxprEqn, k: int, value: Any) -> list:
    """A point with operand `k` at `value` and every other operand at 1 (of its dtype)."""
    return [value if j == k else np.ones((), dtype_of(u)) for j, u in enumerate(eqn.invars)]


def _points(helds: list[Held]) -> list[tuple] | None:
    if any(h is None for h in helds):
        return None
    sizes = [len(h) for h in helds if h is not None]
    if int(np.prod(sizes)) > MAX_POINTS:
        return None
    return list(itertools.product(*[h for h in helds if h is not None]))


def evaluate_at(eqn: JaxprEqn, helds: list[Held]) -> Held:
    """`eqn` at every combination of its operands' values (an elementwise equation)."""
    points = _points(helds)
    if points is None:
        return None
    return held_union([_distinct(fold(eqn, [np.asarray(x) for x in p])[0]) for p in points])


# --------------------------------------------------------------------------- rows' rules
# What the lanes that carry nothing hold, for the primitives with a `Carries` rule.

def moved_held(eqn: JaxprEqn, classes: list, helds: list[Held]) -> Held:
    """A pad, concatenate, scatter, ...: what its operands' such lanes hold."""
    return held_union([h for u, c, h in zip(eqn.invars, classes, helds, strict=True)
                   if is_float(u) and c != Carry.ALL])


def summed_held(eqn: JaxprEqn, classes: list, helds: list[Held]) -> Held:
    """A sum over a row whose lanes all hold one value `a` (`jnp.where(small, ones, x)` before
    a norm: optax's `safe_norm`) is `k * a` for a row of `k` lanes, where that sum is exact in
    any order (no partial sum rounds); a row of zeros sums to a zero (of either sign). Else
    unknown."""
    held = helds[0]
    if held is None or held == ():
        return held
    dtype = dtype_of(eqn.outvars[0])
    zero = np.zeros((), dtype)
    if all(float(x) == 0 for x in held):
        return held_union([held, (zero,)])
    shape = shape_of(eqn.invars[0])
    k = int(np.prod([shape[a] for a in eqn.params["axes"]], dtype=np.int64))
    if k == 0:
        return (zero,)
    if len(held) != 1 or not _sums_exactly(held[0], k, dtype):
        return None
    return (np.asarray(k * float(held[0]), dtype)[()],)


MAX_SUMMED = 64
"""Rows longer than this sum to an unknown value (`summed_held`)."""


def _sums_exactly(a: Any, k: int, dtype: Any) -> bool:
    """Whether every partial sum of `k` copies of `a` is exact in `dtype`, whatever the order
    of the additions: each `j * a` (j <= k) is representable (doubling always is, so a row of
    two holds `2 * a` for any `a`), and far from overflow."""
    info = float_info(dtype)
    a = float(a)
    if k > MAX_SUMMED or not np.isfinite(a) or abs(a) * k > float(info.max) / 4:
        return False
    return all(float(np.asarray(j * a, dtype)) == j * a for j in range(1, k + 1))


def winner_held(eqn: JaxprEqn, classes: list, helds: list[Held]) -> Held:
    """`max`, `min`, `clamp`: what the operands hold where they carry nothing (the lanes where
    such an operand wins alone)."""
    return held_union([h for u, c, h in zip(eqn.invars, classes, helds, strict=True)
                   if is_float(u) and c != Carry.ALL])


def product_held(eqn: JaxprEqn, classes: list, helds: list[Held]) -> Held:
    """`a * b`: the products, when neither factor carries everywhere; beside a factor that does,
    nothing when the other is never zero, else unknown (`0 * a`: a zero of either sign, or
    NaN)."""
    if Carry.ALL not in classes:
        return evaluate_at(eqn, helds)
    other = [h for c, h in zip(classes, helds, strict=True) if c != Carry.ALL]
    if len(other) != 1 or other[0] is None:
        return None
    return () if all(float(np.abs(x)) != 0 for x in other[0]) else None
