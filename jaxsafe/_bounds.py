"""Lower bounds of values, for every finite input: guards that cannot matter are left out.

`rsqrt(mean((x - mu) ** 2) + 1e-5)` (a layer norm) is in the domain of `rsqrt` whatever `x` is:
its operand is at least 1e-5. A guard there replaces nothing singular, yet it costs a mask, a
select and the select's derivative. Each value's lower bound is derived from its equation, one
rule per primitive (`PrimitiveRule.bound`, filled in by `_primitives.py`); a guard on a
primitive whose value and derivative only shrink as its operand grows
(`PrimitiveRule.decreasing`) is left out when they are finite at the operand's bound.

Bounds assume finite operands (as the rest of the analysis does; values tested for NaN are
guarded separately) and allow +inf, which rounding can reach and where those primitives and
their derivatives are finite or zero. A bound is a number at or below every value, NaN never
included: a product of two non-negative values has none (0 * inf is NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Set
from typing import Any

import numpy as np

from ._atoms import dtype_of, float_info, next_toward, readable_constant, shape_of
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Var
from ._constants import (
    PROOF_ORDER,
    domain_holds_above,
    domain_holds_below,
    domain_holds_between,
    finite_with_derivatives,
    fold,
)
from ._maxima import largest_term
from ._ranges import Range, Ranges
from ._rules import BoundRule, PrimitiveRule, rule_for
from ._walk import demand

Bound = float | None  # every value is >= the bound; None: nothing known


def constant_bound(value) -> Bound:
    """The bound of a constant: its smallest lane, when every lane is non-negative."""
    value = np.asarray(value)
    if value.size == 0 or value.dtype.kind not in "fiu" or not np.all(value >= 0):
        return None  # NaN fails `>= 0` too
    return float(np.min(value))


def at_or_below(lower: float, dtype: Any) -> np.ndarray:
    """The largest value of `dtype` at or below `lower` (a bound the dtype holds: `0.001`
    rounds up in float32)."""
    point = np.asarray(lower, dtype)
    if float(point) > lower:
        point = next_toward(point, -1)
    return point


def of_all(combine: Callable[..., float]) -> BoundRule:
    """`combine` of the operands' bounds, when each has one (`add`, `max`: the largest)."""
    def rule(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
        return None if any(b is None for b in bounds) else combine(*bounds)
    return rule


def largest_known(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """`max`: at least each operand, so at least the largest bound known, whatever the others
    are (`jnp.maximum(x, 1e-6)` of an argument `x` is at least 1e-6)."""
    known = [b for b in bounds if b is not None]
    return max(known) if known else None


def smallest(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """`min`: at least the smallest operand's bound, when each has one."""
    return None if any(b is None for b in bounds) else min(bounds)


def clamped(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """`clamp(lo, x, hi)`, `min(max(x, lo), hi)`: at least the smaller of `lo`'s bound (or
    `x`'s, if larger) and `hi`'s."""
    lo, x, hi = bounds
    below = largest_known(eqn, [lo, x], consts)
    return None if below is None or hi is None else min(below, hi)


def of_cases(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """`select_n`: the smallest of the cases' bounds (the predicate has none)."""
    return None if any(b is None for b in bounds[1:]) else min(bounds[1:])


def _scaled(eqn: JaxprEqn, value: Bound, factor: Bound, const, divide: bool) -> Bound:
    """A non-negative value times (or over) a positive finite constant stays non-negative; a
    positive one stays above its bound scaled by the constant's smallest (largest) lane, less
    the rounding (`2. * max(x, 1e-6)`), where that is a normal number (else 0: it may
    underflow)."""
    if value is None or factor is None or const is None or factor <= 0 or \
            not np.all(np.isfinite(const)) or \
            not np.issubdtype(dtype_of(eqn.outvars[0]), np.floating):
        return None  # an integer product wraps
    c = np.asarray(const, np.float64)
    scaled = value / float(np.max(c)) if divide else value * float(np.min(c))
    lower = scaled * (1 - _slack(eqn))
    dtype = dtype_of(eqn.outvars[0])
    if not np.issubdtype(dtype, np.floating) or not np.isfinite(lower) \
            or lower < float(float_info(dtype).tiny):
        return 0.0
    return float(at_or_below(lower, dtype))


def product(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """`mul` by a positive finite constant, on either side; a value times itself: at least 0
    (floating point: an integer square wraps)."""
    if eqn.invars[0] is eqn.invars[1] and isinstance(eqn.invars[0], Var):
        return _non_negative_in(eqn)
    value, factor = bounds
    const = consts[1]
    if const is None and consts[0] is not None:
        value, factor, const = factor, value, consts[0]
    return _scaled(eqn, value, factor, const, divide=False)


def quotient(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """`div` by a positive finite constant."""
    return _scaled(eqn, bounds[0], bounds[1], consts[1], divide=True)


def even_power(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """`integer_pow` with a positive even exponent: at least 0 (floating point)."""
    y = eqn.params["y"]
    return _non_negative_in(eqn) if y > 0 and y % 2 == 0 else None


def converted(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """A conversion keeps the bound in the same dtype. To a float it is monotone (it rounds),
    so the bound converted bounds the value converted: an integer count at least 1 is a float
    at least 1 (`sum(x * m) / maximum(sum(m), 1)`, a masked mean); a boolean or unsigned
    operand is at least 0. To an integer the bound stands only where every value fits (a
    widening); a narrowing wraps, and a float past the end converts to anything."""
    source, target = np.dtype(dtype_of(eqn.invars[0])), np.dtype(dtype_of(eqn.outvars[0]))
    lower = bounds[0]
    if lower is None and source.kind in "bu":  # a mask or an unsigned count: at least 0
        lower = 0.0
    if lower is None or source == target:
        return lower
    if target.kind == "f" and source.kind in "fiub":
        return float(np.asarray(lower, np.float64).astype(target))
    if target.kind in "iu" and source.kind in "biu":
        largest = 1 if source.kind == "b" else np.iinfo(source).max
        return lower if np.iinfo(target).max >= largest else None
    return None


def non_negative_if_bounded(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """At least 0 when the operand is bounded (`sqrt`, a sum, a rounding)."""
    return None if bounds[0] is None else 0.0


def root(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """`sqrt`: at least the root of its operand's bound, less the rounding (a count's
    `sqrt(maximum(n, 1))` is at least about 1); at least 0 when the operand is bounded."""
    if bounds[0] is None or bounds[0] <= 0:
        return non_negative_if_bounded(eqn, bounds, consts)
    return float(np.sqrt(bounds[0])) * (1 - _slack(eqn))


def moved(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """Lanes that move, unchanged: the operand's bound."""
    return bounds[0]


def non_negative(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """At least 0 for every input (`square`, `abs`, `exp`, which underflows to 0), in floating
    point or unsigned integers: a signed integer's square or `abs` wraps (`abs(int8(-128))`)."""
    return _non_negative_in(eqn)


def absolute(eqn: JaxprEqn, bounds: list, consts: list) -> Bound:
    """`abs`: at least 0, and at least its operand's non-negative bound (logsumexp's
    `log(abs(sum(exp(x - max(x)))))` reads a sum at least 1)."""
    lower = _non_negative_in(eqn)
    if lower is None or bounds[0] is None:
        return lower
    return max(lower, bounds[0])


def _non_negative_in(eqn: JaxprEqn) -> Bound:
    dtype = dtype_of(eqn.outvars[0])
    return 0.0 if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.unsignedinteger) \
        else None


# -- preimages: from a lower bound of a result to one of the operand it grows with ----------

def _slack(eqn: JaxprEqn) -> float:
    """A relative margin wider than the rounding of one operation in `eqn`'s dtype."""
    return 8 * float(float_info(dtype_of(eqn.outvars[0])).eps)


def _positive_finite(const) -> float | None:
    if const is None or np.size(const) != 1:
        return None
    c = float(np.asarray(const).reshape(()))
    return c if np.isfinite(c) and c > 0 else None


def root_preimage(eqn: JaxprEqn, lower: float, consts: list) -> tuple[int, float] | None:
    """`sqrt(x) >= L > 0` (rounded) holds only where `x >= L ** 2`, less the rounding."""
    return 0, (lower * (1 - _slack(eqn))) ** 2


def quotient_preimage(eqn: JaxprEqn, lower: float, consts: list) -> tuple[int, float] | None:
    """`x / c >= L` for a positive finite constant c: `x >= L * c`, less the rounding."""
    c = _positive_finite(consts[1])
    return None if c is None or consts[0] is not None else (0, lower * c * (1 - _slack(eqn)))


def product_preimage(eqn: JaxprEqn, lower: float, consts: list) -> tuple[int, float] | None:
    """`x * c >= L` (either side) for a positive finite constant c: `x >= L / c`, less the
    rounding."""
    k = 0 if consts[0] is None else 1
    c = _positive_finite(consts[1 - k])
    return None if c is None or consts[k] is not None else (k, lower / c * (1 - _slack(eqn)))


def sum_preimage(eqn: JaxprEqn, lower: float, consts: list) -> tuple[int, float] | None:
    """`x + c >= L` (either side) for a finite constant c: `x >= L - c`, less the rounding."""
    k = 0 if consts[0] is None else 1
    c = consts[1 - k]
    if c is None or consts[k] is not None or np.size(c) != 1 or not np.isfinite(c):
        return None
    c = float(np.asarray(c).reshape(()))
    return k, lower - c - _slack(eqn) * (abs(lower) + abs(c))


def difference_preimage(eqn: JaxprEqn, lower: float, consts: list) -> tuple[int, float] | None:
    """`x - c >= L` for a finite constant c: `x >= L + c`, less the rounding."""
    c = consts[1]
    if c is None or consts[0] is not None or np.size(c) != 1 or not np.isfinite(c):
        return None
    c = float(np.asarray(c).reshape(()))
    return 0, lower + c - _slack(eqn) * (abs(lower) + abs(c))


def same_preimage(eqn: JaxprEqn, lower: float, consts: list) -> tuple[int, float] | None:
    """The value itself (`copy`, a conversion within one dtype)."""
    return (0, lower) if dtype_of(eqn.invars[0]) == dtype_of(eqn.outvars[0]) else None


class Bounds:
    """Lower bounds of the values of one jaxpr, computed on demand and memoized."""

    def __init__(self, eqns, producer: dict, constants: dict):
        self.eqns, self.producer, self.constants = eqns, producer, constants
        self.memo: dict = {}
        self._ranges: Ranges | None = None

    @property
    def ranges(self) -> Ranges:
        """The ranges of the same values (`_ranges.py`), made on first use."""
        if self._ranges is None:
            self._ranges = Ranges(self.eqns, self.producer, self.constants)
        return self._ranges

    def range_of(self, atom) -> Range:
        """The range of `atom` (`_ranges.py`), for every finite input."""
        return self.ranges.of(atom)

    def range_given(self, atom, known: dict) -> Range:
        """The range of `atom` where each value of `known` lies in its range
        (`Ranges.given`)."""
        return self.ranges.given(atom, known)

    def _constant(self, atom):
        if isinstance(atom, Literal):
            return np.asarray(atom.val)
        return self.constants.get(atom)

    def constant_of(self, atom):
        """The value of a literal or a concrete constant of the program, else None."""
        return self._constant(atom)

    def of(self, atom) -> Bound:
        value = self._constant(atom)
        if value is not None:
            return constant_bound(value)
        return demand(atom, self.memo, self._bound)

    def _rule(self, v) -> tuple[JaxprEqn, BoundRule] | None:
        i = self.producer.get(v)
        if i is None or len(self.eqns[i].outvars) != 1:
            return None
        rule = rule_for(self.eqns[i].primitive).bound
        return None if rule is None else (self.eqns[i], rule)

    def _bound(self, v) -> Generator[Any, Bound, Bound]:
        """The rule `demand` runs: yields each operand whose bound it needs."""
        found = self._rule(v)
        if found is None:
            return None
        eqn, rule = found
        consts = [self._constant(u) for u in eqn.invars]
        bounds: list[Bound] = []
        for u, c in zip(eqn.invars, consts, strict=True):
            bounds.append(constant_bound(c) if c is not None else (yield u))
        lower = rule(eqn, bounds, consts)
        if rule_for(eqn.primitive).sums and bounds[0] is not None and bounds[0] >= 0:
            largest = largest_term(eqn, self.producer, self.eqns)  # `sum(exp(x - max(x)))`
            if largest is not None and (lower is None or largest > lower):
                lower = largest
        if lower is not None and np.issubdtype(dtype_of(v), np.integer) \
                and rule not in _ORDER_PRESERVING:
            # integer arithmetic wraps (`uint8(255) + 1` is 0): a bound only where it cannot
            return 0.0 if self._counts_booleans(eqn) else None
        return lower

    def _counts_booleans(self, eqn: JaxprEqn) -> bool:
        """A sum of booleans converted to integers (`jnp.sum(mask)`), over fewer lanes than the
        integer type holds: at least 0, it cannot wrap."""
        if not rule_for(eqn.primitive).sums or not isinstance(eqn.invars[0], Var):
            return False
        i = self.producer.get(eqn.invars[0])
        source = None if i is None else self.eqns[i]
        if source is None or rule_for(source.primitive).bound is not converted or \
                dtype_of(source.invars[0]) != np.bool_:
            return False
        dtype = dtype_of(eqn.outvars[0])
        return int(np.prod(shape_of(eqn.invars[0]))) <= int(np.iinfo(dtype).max)


def of_program(closed: ClosedJaxpr, producer: dict | None = None) -> Bounds:
    """The bounds of `closed`'s values (its concrete constants known)."""
    jaxpr = closed.jaxpr
    if producer is None:
        producer = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
    return Bounds(jaxpr.eqns, producer,
                  {v: c for v, c in zip(jaxpr.constvars, closed.consts, strict=True)
                   if readable_constant(c)})


def lower_end(atom: Any, bounds: Bounds) -> Bound:
    """The larger of `atom`'s lower bound and its range's lower end: a range knows upper ends
    too (`1 - jnp.minimum(p, .999)` is at least .001, `-jnp.clip(p, 0., .999)` at least -.999)."""
    lower = bounds.of(atom)
    found = bounds.range_of(atom)
    if found is None or not np.isfinite(found[0]):
        return lower
    return float(found[0]) if lower is None else max(lower, float(found[0]))


def value_finite_above_bound(eqn: JaxprEqn, bounds: Bounds) -> bool:
    """Whether `eqn`, a primitive whose value only gets safer as its operand grows
    (`PrimitiveRule.decreasing`), has its operand bounded from below by a point where its value
    is finite (`sqrt` of a sum of squares): its value is finite in every lane for finite
    operands, whatever its derivative is at the bound (that is its guard's business)."""
    if not rule_for(eqn.primitive).decreasing or len(eqn.invars) != 1 \
            or len(eqn.outvars) != 1 or not isinstance(eqn.invars[0], Var):
        return False
    lower = lower_end(eqn.invars[0], bounds)
    if lower is None:
        return False
    point = np.asarray(lower, dtype_of(eqn.invars[0]))
    return bool(np.isfinite(point)) and bool(np.all(np.isfinite(fold(eqn, [point])[0])))


def value_finite_in_range(eqn: JaxprEqn, bounds: Bounds) -> bool:
    """Whether `eqn`'s output ranges between finite ends for finite operands (`_ranges.py`:
    `exp(-alpha * (r - sigma))` of a distance r >= 0, `(1 - e) ** 2.` of a bounded e): it makes
    no NaN or inf of its own. A range never admits NaN."""
    if len(eqn.outvars) != 1:
        return False
    found = bounds.range_of(eqn.outvars[0])
    return found is not None and bool(np.isfinite(found[0]) and np.isfinite(found[1]))


def ranged_operand(eqn: JaxprEqn, bounds: Bounds) -> tuple[int, Range, list] | None:
    """For a primitive monotone in one operand over (0, inf) (`PrimitiveRule.ranged_operand`,
    `pow`'s base) whose other operands are scalar constants: that operand, its range (None if
    unknown) and the operands' values (the ranged one's left None)."""
    k = rule_for(eqn.primitive).ranged_operand
    if k is None or len(eqn.outvars) != 1 or not isinstance(eqn.invars[k], Var):
        return None
    values = [None if j == k else bounds.constant_of(u) for j, u in enumerate(eqn.invars)]
    if any(c is None or np.size(c) != 1 for j, c in enumerate(values) if j != k):
        return None
    values = [c if c is None else np.asarray(c, dtype_of(u)).reshape(())
              for c, u in zip(values, eqn.invars, strict=True)]
    return k, bounds.range_of(eqn.invars[k]), values


def never_wins_alone(eqn: JaxprEqn, k: int, bounds: Bounds) -> bool:
    """Whether operand k of a `max` (`min`) never wins alone: another operand is at least (at
    most) as large in every lane, for every finite input (`jnp.maximum(sum_of_squares, 0.)`).
    A NaN lane is no one's win either, so NaN does not break it; a tie shares the derivative."""
    selection = rule_for(eqn.primitive).selection
    larger = None if selection is None else selection.larger_wins
    if larger is None or len(eqn.outvars) != 1:
        return False
    mine = bounds.range_of(eqn.invars[k])
    if mine is None:
        return False
    for j, other in enumerate(eqn.invars):
        if j == k:
            continue
        theirs = bounds.range_of(other)
        if larger:
            lower = max(-np.inf if theirs is None else theirs[0],
                        -np.inf if (b := bounds.of(other)) is None else b)
            if lower >= mine[1]:
                return True
        elif theirs is not None and theirs[1] <= mine[0]:
            return True
    return False


def never_loses(eqn: JaxprEqn, k: int, bounds: Bounds) -> bool:
    """Whether operand k of a `max` (`min`) wins or ties in every lane: no other operand ever
    wins alone against it, so its derivative never weighs the cotangent by 0 (a NaN lane is
    shared, as `_liveness_rules.winner_masks` reads it)."""
    selection = rule_for(eqn.primitive).selection
    if selection is None or selection.larger_wins is None or len(eqn.invars) < 2:
        return False
    return all(never_wins_alone(eqn, j, bounds) for j in range(len(eqn.invars)) if j != k)


def never_weighed_by_zero(eqn: JaxprEqn, carrying: list[bool], bounds: Bounds) -> bool:
    """Whether a `max` (`min`) never weighs the cotangent of an operand that carries a
    derivative by 0 (`jnp.maximum(sum_of_squares, 0.)`): an inf or NaN cotangent is then
    never multiplied by 0 there, and there is nothing to re-decide."""
    return any(carrying) and all(never_loses(eqn, k, bounds)
                                 for k, c in enumerate(carrying) if c)


# -- operands proven inside a primitive's domain ------------------------------------------

def operand_in_domain(eqn: JaxprEqn, k: int, bounds: Bounds, tainted: Set) -> bool:
    """Whether operand k of a NaN-prone `eqn`, not in `tainted` (the values that may be NaN or
    inf), is for every finite input where `eqn` is finite with its derivatives to the third
    order: bounded from below into the domain of a primitive that gets safer above
    (`decreasing`: `rsqrt(mean(d ** 2) + 1e-5)`), ranged inside (0, inf) for a power's base
    (`ranged_operand`), or ranged below a point for one that gets safer below (`increasing`:
    `exp(-alpha * r)` for r >= 0)."""
    rule = rule_for(eqn.primitive)
    return any(proof(eqn, k, rule, bounds, tainted)
               for proof in (_bounded_into_domain, _ranged_into_domain, _ranged_below_domain,
                             _bounded_divisor))


def _bounded_divisor(eqn: JaxprEqn, k: int, rule: PrimitiveRule, bounds: Bounds,
                     tainted: Set) -> bool:
    """Whether operand k divides (`PrimitiveRule.divisor`) and is, for every finite input, at or
    above a positive point where `eqn` and its derivatives are finite, the other operands
    finite: `1 / d` and its derivatives only shrink as `d` grows. A numerator with no known
    range is proven over a divisor at least 1 where it is an input, outside float16."""
    v = eqn.invars[k]
    if rule.divisor != k or not isinstance(v, Var) or v in tainted or len(eqn.invars) != 2 \
            or any(isinstance(u, Var) and u in tainted for u in eqn.invars):
        return False
    lower = lower_end(v, bounds)
    if lower is None or lower <= 0:
        return False
    dtype = dtype_of(v)
    point = at_or_below(lower, dtype)
    if not float(point) >= float(float_info(dtype).tiny):
        return False
    ends = _numerator_ends(eqn, 1 - k, bounds)
    if ends is None:
        # an input (finite: not tainted) over a divisor at least 1, in float32 or wider: each
        # derivative is at most a few times the numerator (`x / (abs(x) + 1.)`, soft sign). Not
        # a value computed here: `x * x * x` overflows to inf from a finite `x` (hunt AL)
        numerator = eqn.invars[1 - k]
        return float(point) >= 1.0 and isinstance(numerator, Var) \
            and numerator not in bounds.producer \
            and float(float_info(dtype).max) >= float(float_info(np.float32).max)
    points = [[point if j == k else np.asarray(end, dtype) for j in range(2)] for end in ends]
    return all(finite_with_derivatives(eqn, p, PROOF_ORDER, wrt=j) for p in points
               for j in range(2))


def _numerator_ends(eqn: JaxprEqn, j: int, bounds: Bounds) -> tuple[float, float] | None:
    """The smallest and largest value operand j (the numerator) takes, for every finite input:
    a constant's lanes or a finite range (`1000. / max(x, .1)` overflows float16's derivative,
    `1. / max(x, .1)` does not). None when unknown."""
    value = bounds.constant_of(eqn.invars[j])
    if value is not None:
        value = np.asarray(value, np.float64)
        if value.size == 0 or not np.all(np.isfinite(value)):
            return None
        return float(np.min(value)), float(np.max(value))
    found = bounds.range_of(eqn.invars[j])
    if found is None or not (np.isfinite(found[0]) and np.isfinite(found[1])):
        return None
    return float(found[0]), float(found[1])


def _bounded_into_domain(eqn: JaxprEqn, k: int, rule: PrimitiveRule, bounds: Bounds,
                         tainted: Set) -> bool:
    """Whether operand k is, for every finite input, at or above a positive point where `eqn`
    and its derivative are finite, for a primitive that only gets safer above it."""
    v = eqn.invars[k]
    if not rule.decreasing or k != 0 or not isinstance(v, Var) or v in tainted:
        return False
    lower = lower_end(v, bounds)
    if lower is None or lower <= rule.edge:
        return False
    point = at_or_below(lower, dtype_of(v))
    return bool(float(point) > rule.edge) and domain_holds_above(eqn, point)


def _ranged_below_domain(eqn: JaxprEqn, k: int, rule: PrimitiveRule, bounds: Bounds,
                         tainted: Set) -> bool:
    """Whether operand k ranges, for every finite input, at or below a point where `eqn` and
    its derivatives are finite, for a primitive that only gets safer below it (`exp`)."""
    v = eqn.invars[k]
    if not rule.increasing or k != 0 or not isinstance(v, Var) or v in tainted:
        return False
    found = bounds.range_of(v)
    return found is not None and domain_holds_below(eqn, np.asarray(found[1], dtype_of(v)))


def _ranged_into_domain(eqn: JaxprEqn, k: int, rule: PrimitiveRule, bounds: Bounds,
                        tainted: Set) -> bool:
    """Whether operand k (a power's base) ranges, for every finite input, inside (0, inf) where
    `eqn` is finite with its derivatives to the third order."""
    found = ranged_operand(eqn, bounds)
    if found is None or found[0] != k or found[1] is None or eqn.invars[k] in tainted:
        return False
    lo, hi = found[1]
    values = found[2]
    dtype = dtype_of(eqn.invars[k])
    return domain_holds_between(eqn, k, np.asarray(lo, dtype), np.asarray(hi, dtype), values)


# the rules that only choose among their operands' values or move them (and conversions, which
# judge their own dtypes): their bounds hold for integers too, which other arithmetic wraps
_ORDER_PRESERVING = frozenset({largest_known, smallest, clamped, of_cases, moved, converted})
