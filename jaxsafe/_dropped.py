"""What values hold in all their dropped lanes, known when the rewrite is planned.

A guard whose operand is known to be inside the primitive's domain in its dropped lanes
(`div(_, exp(guarded x))` has 1 there already, `log(2.)` always, a softmax's row sums) is a
no-op: the guard pass leaves it out, and XLA keeps folding the constant.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._atoms import (
    SMALL_CONSTANT,
    dtype_of,
    float_info,
    is_float,
    is_numeric,
    literal_value,
    readable_constant,
    shape_of,
)
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Var
from ._constants import finite_with_derivatives, fold
from ._free import FreeValues
from ._liveness import Sweep
from ._report import Site
from ._rules import Guard, alignment, rule_for
from ._symbolic import backward_mapping, forward_mapping, implies, move, sym_not
from ._walk import demand

CHAIN_SAFE_VALUES = (1.0, 0.5, 2.0)
"""What a guard at the start of a dropped chain may take instead of its own safe value, tried in
order (`DroppedValues.move_chain_guards`)."""

Known = tuple[np.ndarray, bool] | None
"""(value, is_constant): the value a variable holds in its dropped lanes (everywhere, when it
is a constant), or None when unknown."""


class DroppedValues:
    """The known dropped values of one jaxpr, computed on demand while the guard pass runs.

    A constant (literals only, or a small concrete constant) holds its value everywhere. `v =
    op(a, b, ...)`, elementwise, holds `op` of its operands' known values, when each operand is
    a constant, is replaced there by this equation's guard, or is itself known in its dropped
    lanes and every dropped lane of `v` reads only dropped lanes of it (`reads_dropped`). A
    primitive with a `scalar_move` rule (a broadcast, a size-1 reshape, a reduction) carries a
    value known to be one scalar in dropped lanes, on the same condition: the row sums of a
    softmax whose dropped rows are guarded to `exp(0) = 1` hold the row length there.

    `sites` is the guard pass's own table, filled in as it goes: a value is computed when first
    asked for, after every equation it depends on has been planned.
    """

    def __init__(self, closed: ClosedJaxpr, sites: Mapping[int, Site], sweep: Sweep):
        self.eqns, self.sites, self.sweep = closed.jaxpr.eqns, sites, sweep
        self.reads: dict[Any, int] = {}
        for e in self.eqns:
            for v in e.invars:
                if isinstance(v, Var):
                    self.reads[v] = self.reads.get(v, 0) + 1
        for v in closed.jaxpr.outvars:
            if isinstance(v, Var):
                self.reads[v] = self.reads.get(v, 0) + 1
        self.memo: dict[Any, Known] = {}
        self.free: FreeValues | None = None  # set by the guard pass: what free lanes hold
        for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
            if readable_constant(c) and np.size(c) <= SMALL_CONSTANT:
                self.memo[v] = (np.asarray(c), True)

    def get(self, atom: Any) -> Known:
        """What `atom` holds in its dropped lanes."""
        if isinstance(atom, Literal):
            return np.asarray(literal_value(atom)), True
        return demand(atom, self.memo, self._compute)

    # -- the walk ---------------------------------------------------------------------------

    def _producer(self, v: Any) -> tuple[int, JaxprEqn] | None:
        i = self.sweep.producer.get(v)
        return None if i is None else (i, self.eqns[i])

    def _elementwise(self, i: int, eqn: JaxprEqn) -> bool:
        """Lane to lane in value: elementwise, or a selection (`select_n`, `max`, `min`,
        `clamp`; `min(2., 3.)` is a constant, and lgamma of it needs no guard)."""
        site = self.sites.get(i)
        rule = rule_for(eqn.primitive)
        return (len(eqn.outvars) == 1 and not eqn.effects
                and (rule.elementwise or rule.selection is not None)
                and not (site is not None and site.cut) and _evaluable(eqn))

    def _compute(self, v: Any) -> Generator[Any, Known, Known]:
        """The rule `demand` runs: yields each operand it needs, receives what it holds."""
        known = yield from self._computed(v)
        return known if known is not None else self._held_where_free(v)

    def _held_where_free(self, v: Any) -> Known:
        """What `v` holds in its dropped lanes when they all carry no derivative and hold one
        value there (`jnp.where(norm <= eps, 1., x)` read only where `norm > eps`)."""
        if self.free is None:
            return None
        dead = sym_not(self.sweep.sym(v))
        if dead is None or not implies(dead, self.free.free_sym(v)):
            return None
        held = self.free.held(v)
        if held is None or len(held) != 1:
            return None
        return np.asarray(held[0], dtype_of(v)), False

    def _computed(self, v: Any) -> Generator[Any, Known, Known]:
        found = self._producer(v)
        if found is None:
            return None
        i, eqn = found
        if self._moves_scalar(eqn):
            u = eqn.invars[0]
            return self._moved_scalar(eqn, self.get(u) if isinstance(u, Literal) else (yield u))
        if not self._elementwise(i, eqn):
            return None
        site = self.sites.get(i)
        vals, constants = [], []
        for k, u in enumerate(eqn.invars):
            if site is not None and k in site.replace:
                vals.append(np.asarray(site.replace[k], dtype_of(u)))
                constants.append(False)
                continue
            known = self.get(u) if isinstance(u, Literal) else (yield u)
            if known is None:
                return None
            if not known[1] and not self.reads_dropped(eqn, k):
                return None  # known in dropped lanes only: v's must read only those
            vals.append(known[0])
            constants.append(known[1])
        if not self._foldable(eqn, vals, all(constants)):
            return None
        if not all(constants):
            return self._guarded_value(eqn, vals, constants)
        return fold(eqn, vals)[0], True

    @staticmethod
    def _guarded_value(eqn: JaxprEqn, vals: list, constants: list[bool]) -> Known:
        """What the rewritten program's `eqn` holds in dropped lanes where some operand holds
        a guard's value (not the original's). Only a float is emitted again on guarded values:
        a comparison, a predicate, an index reads the original values, known here only when
        constant. A selection picks its case as the original values decide (`select_n` on the
        original predicate, `max` re-decided on the original operands: `_choosers.by_wins`), not
        as the guarded values would: known when the predicate is a constant, or when every case
        holds the same value."""
        if not is_float(eqn.outvars[0]):
            return None
        selection = rule_for(eqn.primitive).selection
        if selection is None:
            return fold(eqn, vals)[0], False
        if selection.by_predicate and constants[0]:
            return fold(eqn, vals)[0], False
        cases = vals[1:] if selection.by_predicate else vals
        shape = np.broadcast_shapes(*(np.shape(c) for c in cases))
        first = np.broadcast_to(np.asarray(cases[0], dtype_of(eqn.outvars[0])), shape)
        if all(np.array_equal(first, np.broadcast_to(c, shape)) for c in cases[1:]):
            return first, False
        return None

    @staticmethod
    def _foldable(eqn: JaxprEqn, vals: list, constant: bool) -> bool:
        if constant and int(np.prod(shape_of(eqn.outvars[0]))) > SMALL_CONSTANT:
            return False  # a large constant array: not worth evaluating at rewrite time
        # a selection's cases must match: not a scalar known in dropped lanes beside an array
        return rule_for(eqn.primitive).selection is None or len({np.shape(x) for x in vals}) == 1

    @staticmethod
    def _moves_scalar(eqn: JaxprEqn) -> bool:
        return (rule_for(eqn.primitive).scalar_move is not None and len(eqn.outvars) == 1
                and not eqn.effects)

    def _moved_scalar(self, eqn: JaxprEqn, known: Known) -> Known:
        """A value that holds one scalar in its dropped lanes (or everywhere), moved."""
        if known is None or np.ndim(known[0]) != 0:
            return None
        if not known[1] and not self.reads_dropped(eqn, 0):
            return None
        move_scalar = rule_for(eqn.primitive).scalar_move
        assert move_scalar is not None
        value = move_scalar(eqn, np.asarray(known[0]))
        return None if value is None else (value, known[1])

    # -- queries ----------------------------------------------------------------------------

    def reads_dropped(self, eqn: JaxprEqn, k: int) -> bool:
        """Whether each dropped lane of `eqn`'s output reads only dropped lanes of operand k: a
        live operand lane feeds live output lanes only (static masks, `_symbolic.implies`)."""
        u, v = eqn.invars[k], eqn.outvars[0]
        if self.reads.get(u, 0) == 1 and shape_of(u) == shape_of(v) and \
                rule_for(eqn.primitive).elementwise and len(eqn.outvars) == 1:
            return True  # the operand's dropped lanes are exactly the output's
        align = alignment(eqn, k)
        if align is None:
            return False
        su, sv = self.sweep.sym(u), self.sweep.sym(v)
        if {a for a in align if a is not None} == set(range(len(shape_of(v)))):
            # every output axis is an operand axis (a reduction, the same shape): in u's lanes
            return implies(su, move(sv, backward_mapping(align)))
        if all(a is not None or n == 1 for a, n in zip(align, shape_of(u), strict=True)):
            # every operand axis is an output axis (a broadcast): in v's lanes
            return implies(move(su, forward_mapping(align)), sv)
        return False

    def guard_is_noop(self, eqn: JaxprEqn, k: int, guard: Guard) -> bool:
        """Whether operand k of `eqn` is known, in the lanes its guard would replace, to be a
        value at which `eqn` and its first derivatives are finite."""
        known = self.get(eqn.invars[k])
        if known is None or (not known[1] and not self.reads_dropped(eqn, k)) or \
                self._may_overflow_through(eqn, k, guard) or not _evaluable(eqn):
            return False
        return finite_with_derivatives(eqn, self._point(eqn, k, np.asarray(known[0]), guard.safe))

    # -- one guard at the start of a chain ----------------------------------------------------

    def _may_overflow_through(self, eqn: JaxprEqn, k: int, guard: Guard) -> bool:
        """Whether another operand whose finite values alone can overflow `eqn` (a power's
        exponent) is not a known constant: a check at one point says nothing of the others."""
        return any(j != k and j < len(eqn.invars) and not (
            (known := self.get(eqn.invars[j])) is not None and known[1])
            for j in guard.overflows_through)

    def move_chain_guards(self, eqn: JaxprEqn, k: int, guard: Guard) -> bool:
        """Whether the guards that start operand k's dropped chain can take another safe value at
        which every equation of the chain, and `eqn`, are finite with their derivatives; if so,
        they take it and `eqn` needs no guard of its own.

        The chain is elementwise and read once along the way (`abs -> pow -> igamma` in
        `gennorm.cdf`): nothing else reads its dropped values, so no earlier decision changes.
        One guard at its start, as a hand-written double where puts it, instead of one per NaN-prone
        step, leaves XLA free to rewrite across the chain (`log(x ** 1.5)` to `1.5 * log(x)`),
        so live lanes keep the original program's last bit.
        """
        if self._may_overflow_through(eqn, k, guard) or not _evaluable(eqn):
            return False
        chain = self._chain(eqn.invars[k])
        if chain is None:
            return False
        safe = guard.safe
        order, roots = chain
        for candidate in CHAIN_SAFE_VALUES:
            values = self._evaluate_chain(order, roots, candidate)
            if values is None:
                continue
            if not finite_with_derivatives(eqn, self._point(eqn, k, values[eqn.invars[k]], safe)):
                continue
            for i, j in roots:
                self.sites[i].replace[j] = candidate
                self.sites[i].reasons[j] += f" (at {candidate:g}: guards the chain after it)"
            for i in order:
                self.memo.pop(self.eqns[i].outvars[0], None)
            return True
        return False

    def _point(self, eqn: JaxprEqn, k: int, value: Any, safe: Mapping[int, float]) -> list:
        """`eqn`'s operands with operand k at `value`, the others at their known constant, else
        their safe value, else 1."""
        point = []
        for j, a in enumerate(eqn.invars):
            other = self.get(a) if j != k else None
            if j == k:
                point.append(value)
            elif other is not None and other[1]:
                point.append(np.asarray(other[0]))
            else:
                point.append(np.asarray(safe.get(j, 1.0), dtype_of(a)))
        return point

    def _chain(self, u: Any) -> tuple[list[int], list[tuple[int, int]]] | None:
        """The elementwise equations that compute `u`'s dropped value from guarded operands and
        constants, each output read once; and those guarded operands, (equation, operand)."""
        if not isinstance(u, Var) or self.reads.get(u, 0) != 1:
            return None
        known = self.get(u)
        if known is None or known[1]:
            return None
        order: set[int] = set()
        roots: list[tuple[int, int]] = []
        stack = [u]
        while stack:
            v = stack.pop()
            found = self._producer(v)
            if found is None:
                return None
            i, e = found
            if not self._elementwise(i, e):
                return None
            order.add(i)
            site = self.sites.get(i)
            for j, a in enumerate(e.invars):
                if site is not None and j in site.replace:
                    roots.append((i, j))
                    continue
                value = self.get(a)
                if value is not None and value[1]:
                    continue  # a constant
                if not (isinstance(a, Var) and self.reads.get(a, 0) == 1
                        and shape_of(a) == shape_of(e.outvars[0])):
                    return None
                stack.append(a)
        return (sorted(order), roots) if roots else None

    def _evaluate_chain(self, order: list[int], roots: list[tuple[int, int]],
                        candidate: float) -> dict[Any, np.ndarray] | None:
        """The chain's dropped values with its guards at `candidate`, or None where an equation
        or its derivative is not finite there."""
        replaced = set(roots)
        values: dict[Any, np.ndarray] = {}
        for i in order:
            e = self.eqns[i]
            point = []
            for j, a in enumerate(e.invars):
                if (i, j) in replaced:
                    point.append(np.asarray(candidate, dtype_of(a)))
                elif isinstance(a, Var) and a in values:
                    point.append(values[a])
                else:
                    known = self.get(a)
                    assert known is not None
                    point.append(np.asarray(known[0]))
            if not finite_with_derivatives(e, point):
                return None
            values[e.outvars[0]] = fold(e, point)[0]
        return values


# --------------------------------------------------------------------------- scalar moves
# `PrimitiveRule.scalar_move` rules: the scalar an output holds in its dropped lanes, given the
# scalar its operand holds in the lanes they read.


def same_scalar(eqn: JaxprEqn, value: np.ndarray) -> np.ndarray | None:
    """A broadcast or a squeeze: the same scalar."""
    return value


def reshaped_scalar(eqn: JaxprEqn, value: np.ndarray) -> np.ndarray | None:
    """A reshape: the same scalar, unless it transposes first (`dimensions`)."""
    return value if eqn.params.get("dimensions") is None else None


def _row_length(eqn: JaxprEqn, value: np.ndarray) -> int | None:
    n = int(np.prod([shape_of(eqn.invars[0])[a] for a in eqn.params["axes"]]))
    return None if n == 0 or not jnp.issubdtype(value.dtype, jnp.floating) else n


def chosen_scalar(eqn: JaxprEqn, value: np.ndarray) -> np.ndarray | None:
    """`reduce_max`, `reduce_min` over a non-empty row of one scalar: that scalar."""
    return None if _row_length(eqn, value) is None else value


def summed_scalar(eqn: JaxprEqn, value: np.ndarray) -> np.ndarray | None:
    """`reduce_sum` of a row of one scalar: the scalar times the row length."""
    n = _row_length(eqn, value)
    if n is None:
        return None
    total = float(value) * n  # the row sums a run computes differ by rounding only
    if not abs(total) < float(float_info(value.dtype).max) / 2:
        return None
    return np.asarray(total, value.dtype)


def _evaluable(eqn: JaxprEqn) -> bool:
    """Whether `eqn` can be evaluated at a point made of NumPy values: not a sampler's key
    (`random_gamma`), whose operand has no value to try."""
    return all(is_numeric(a) for a in eqn.invars)
