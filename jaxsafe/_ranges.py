"""Ranges of values, for every finite input: a power whose base stays inside (0, inf) needs no
guard.

jax-md's soft sphere computes `(1 - d) ** alpha` on `d = jnp.where(d < 1, d, 0)` of a
non-negative distance: the base is in [2**-24, 1] in float32, whatever the positions are, and a
power with a constant exponent is finite there with its derivatives. A lower bound alone
(`_bounds.py`) cannot show it: the base is a difference, bounded from below by the upper bound
of what it subtracts, and that upper bound comes from the comparison that selects it.

Each value's range is derived from its equation, one rule per primitive (`PrimitiveRule.range`,
filled in by `_primitives.py`); a `select_n` narrows each case by the comparison that takes it
(`where(d < 1, d, 0)`: the case `d` only where `d < 1`). Ends are computed in float64 and
rounded outward in the value's dtype (one ulp past the rounding of the dtype's own arithmetic,
which is monotone). A range assumes finite operands, as the lower bounds do (values that may
be NaN are the taint pass's business): no range ever admits NaN.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np

from ._atoms import dtype_of, is_float, next_toward, shape_of
from ._compat import JaxprEqn, Literal, Var
from ._constants import fold
from ._maxima import maximum_of
from ._rules import RangeRule, rule_for
from ._walk import demand

Range = tuple[float, float] | None
"""lo <= every value <= hi (floats, possibly infinite); None: nothing known."""


def _outward(eqn: JaxprEqn, lo: float, hi: float, exact: bool = True) -> Range:
    """[lo, hi] (computed in float64) as ends in the output's dtype that hold whatever the
    dtype's own rounding of the operation gives (correctly rounded or faithful): an end that
    rounds inward is moved one ulp out. `exact`: the operation's result is exactly `lo`/`hi`
    where those are representable (a sum, a product), not only close (a root, a quotient).
    None where NaN came in."""
    if np.isnan(lo) or np.isnan(hi) or lo > hi:
        return None
    dtype = dtype_of(eqn.outvars[0])
    if not np.issubdtype(dtype, np.floating):
        return None
    return _end(lo, dtype, -np.inf, exact), _end(hi, dtype, np.inf, exact)


def _end(x: float, dtype: Any, outward: float, exact: bool) -> float:
    with np.errstate(over="ignore"):
        q = np.asarray(x, dtype)
    inward = float(q) < x if outward > 0 else float(q) > x
    if inward or (float(q) == x and not exact and x != 0):
        q = np.nextafter(q, np.asarray(outward, dtype))
    return float(q)


def between(lo: float, hi: float) -> RangeRule:
    """The rule of a primitive whose value lies in [lo, hi] for every finite operand (`tanh`,
    `logistic`), an ulp wider each side: XLA's are faithful, not correctly rounded."""
    def rule(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
        return _outward(eqn, lo, hi, exact=False)
    return rule


def constant_range(value: Any) -> Range:
    """The range of a constant: its smallest and largest lanes, when none is NaN."""
    value = np.asarray(value)
    if value.size == 0 or value.dtype.kind not in "fiu" or np.any(np.isnan(value)):
        return None
    return float(np.min(value)), float(np.max(value))


def same_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """Lanes that move, unchanged (a broadcast, a reshape, a copy)."""
    return ranges[0]


def converted_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """A conversion rounds monotonically: the ends, converted (outward)."""
    return None if ranges[0] is None else _outward(eqn, *ranges[0])


def negated_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    return None if ranges[0] is None else (-ranges[0][1], -ranges[0][0])


def absolute_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """`abs` of a real value: at least 0 (every finite input: an unknown operand included)."""
    if not np.issubdtype(dtype_of(eqn.invars[0]), np.floating):
        return None  # `abs` of a complex value: not a range of reals
    a = ranges[0]
    if a is None:
        return 0.0, np.inf
    ends = (abs(a[0]), abs(a[1]))
    return (0.0 if a[0] <= 0 <= a[1] else min(ends)), max(ends)


def sum_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    a, b = ranges
    if a is None or b is None:
        return None
    with np.errstate(invalid="ignore"):
        return _outward(eqn, a[0] + b[0], a[1] + b[1])


def difference_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    a, b = ranges
    if a is None or b is None:
        return None
    with np.errstate(invalid="ignore"):
        return _outward(eqn, a[0] - b[1], a[1] - b[0])


def _either(r: Range) -> tuple[float, float]:
    return (-np.inf, np.inf) if r is None else r


def max_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """`max`: at least the larger lower end (an unknown operand ranges over every float)."""
    (a0, a1), (b0, b1) = _either(ranges[0]), _either(ranges[1])
    return _outward(eqn, max(a0, b0), max(a1, b1))


def min_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """`min`: at most the smaller upper end (`jnp.minimum(x, 0.)` is at most 0)."""
    (a0, a1), (b0, b1) = _either(ranges[0]), _either(ranges[1])
    return _outward(eqn, min(a0, b0), min(a1, b1))


def product_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """Interval product; None where an infinite end meets a zero (0 * inf is NaN). A value times
    itself (`y * y`) is a square: at least 0, for unknown operands too."""
    a, b = ranges
    if eqn.invars[0] is eqn.invars[1] and isinstance(eqn.invars[0], Var):
        return _square(eqn, a)
    if a is None or b is None:
        return None
    ends = [x * y for x in a for y in b]
    if any(np.isnan(e) for e in ends):
        return None
    return _outward(eqn, min(ends), max(ends))


def quotient_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """Division by a divisor whose range is finite and excludes 0 (a constant, or a scalar the
    program computes from constants: `(r_c - r_o) ** 3`)."""
    a, d = ranges
    if a is None or d is None or not (np.isfinite(d[0]) and np.isfinite(d[1])) or \
            d[0] <= 0 <= d[1]:
        return None
    with np.errstate(invalid="ignore"):
        ends = [x / y for x in a for y in d]
    if any(np.isnan(e) for e in ends):
        return None
    return _outward(eqn, min(ends), max(ends), exact=False)


def root_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    a = ranges[0]
    if a is None or a[0] < 0:
        return None
    return _outward(eqn, float(np.sqrt(a[0])), float(np.sqrt(a[1])), exact=False)


def even_power_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """`integer_pow` with a positive even exponent: at least 0, at most the larger end's power
    (every finite input: unknown operands included); a positive odd one is increasing: the
    ends' powers (`(6.25 - 4.) ** 3`)."""
    y = eqn.params["y"]
    if y <= 0:
        return None
    a = ranges[0]
    if y % 2:
        if a is None:
            return None
        with np.errstate(over="ignore"):
            return _outward(eqn, float(np.float64(a[0]) ** y), float(np.float64(a[1]) ** y),
                            exact=False)
    return _square(eqn, a, y)


def square_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """`square`: at least 0, at most the larger end's square."""
    return _square(eqn, ranges[0])


def _square(eqn: JaxprEqn, a: Range, y: int = 2) -> Range:
    """An even power `y` of a value in `a` (None: unknown): at least 0 for every finite input.
    Floating point only: an integer square wraps (`int8(12) * 12` is -112)."""
    if not np.issubdtype(dtype_of(eqn.outvars[0]), np.floating):
        return None
    if a is None:
        return 0.0, np.inf
    with np.errstate(over="ignore"):
        ends = (abs(a[0]) ** y if np.isfinite(a[0]) else np.inf,
                abs(a[1]) ** y if np.isfinite(a[1]) else np.inf)
    low = 0.0 if a[0] <= 0 <= a[1] else min(ends)
    return _outward(eqn, low, max(ends), exact=False)


EXP_SLACK = 1e-5
"""The relative error allowed to XLA's `exp` and `exp2` (faithful to a few ulps, not correctly
rounded), past the outward rounding of the ends."""


def _exponential(eqn: JaxprEqn, ranges: list, fn) -> Range:
    """`fn` (exp, exp2, expm1: increasing) at the ends, widened by `EXP_SLACK`: (0, inf) for an
    unknown operand (underflow gives 0, overflow inf)."""
    a = ranges[0]
    if a is None:
        return _outward(eqn, 0.0, np.inf)
    with np.errstate(over="ignore"):
        lo, hi = float(fn(a[0])), float(fn(a[1]))
    return _outward(eqn, lo - abs(lo) * EXP_SLACK, hi + abs(hi) * EXP_SLACK, exact=False)


def exp_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    return _exponential(eqn, ranges, np.exp)


def expm1_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """At least -1 (`expm1(-inf)`), otherwise as `exp`."""
    found = _exponential(eqn, ranges, np.expm1)
    if found is None:
        return None
    return max(found[0], -1.0) if ranges[0] is not None else -1.0, found[1]


def exp2_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    return _exponential(eqn, ranges, np.exp2)


def power_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """`x ** y` for a scalar constant y: a whole y >= 1 at any finite base (`(1 - e) ** 2.`,
    odd ones monotone, even ones through 0), another y > 0 over a base at least 0, a y < 0 over
    a base above 0. Widened by `EXP_SLACK` (XLA computes it as `exp(y * log(x))`)."""
    a, y = ranges[0], consts[1]
    if a is None or y is None or np.size(y) != 1:
        return None
    y = float(np.asarray(y).reshape(()))
    lo, hi = a
    if not (np.isfinite(y) and np.isfinite(lo) and np.isfinite(hi)) or y == 0:
        return None
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if y == int(y) and y >= 1:
            ends = [lo ** y, hi ** y]
            if int(y) % 2 == 0:
                top = max(ends)
                bottom = 0.0 if lo <= 0 <= hi else min(ends)
            else:
                bottom, top = ends
        elif y > 0 and lo >= 0:
            bottom, top = lo ** y, hi ** y
        elif y < 0 and lo > 0:
            bottom, top = hi ** y, lo ** y
        else:
            return None
    return _outward(eqn, bottom - abs(bottom) * EXP_SLACK, top + abs(top) * EXP_SLACK,
                    exact=False)


def non_negative_sum_range(eqn: JaxprEqn, ranges: list, consts: list) -> Range:
    """A sum of non-negative lanes: at least 0, at most their count times the largest."""
    a = ranges[0]
    if a is None or a[0] < 0:
        return None
    count = int(np.prod(shape_of(eqn.invars[0]))) // max(1, int(np.prod(shape_of(eqn.outvars[0]))))
    return _outward(eqn, 0.0, a[1] * max(count, 1) * 2)  # 2: the rounding of a long sum


def compared(compare: JaxprEqn, holds: bool) -> tuple[int, bool] | None:
    """Where the comparison `compare` holds (or fails), which operand is at least the other,
    and strictly or not: `a > c` holds: (0, True); `a < c` fails: (0, False), if neither is
    NaN (NaN fails every comparison: the caller must know the operands are not NaN)."""
    order = rule_for(compare.primitive).bounds_below
    if order is None or len(compare.invars) != 2:
        return None
    strict, greater = order
    return (greater, strict) if holds else (1 - greater, not strict)


MAX_GIVEN_STEPS = 256
"""Values a range under a predicate (`Ranges.given`) derives again, at most; past that the
range is unknown."""


class Ranges:
    """The ranges of the values of one jaxpr, computed on demand and memoized.

    `given`: values whose ranges are known to be narrower than their own, each with that range
    (a `where`'s case under the comparison that takes it: `Ranges.given`). Such a view derives
    at most `MAX_GIVEN_STEPS` values, and does not narrow by a comparison again (one level: the
    cost stays linear in the selections). A value computed before the first of them cannot
    depend on them: the view reads the range the program's own ranges found for it (`parent`,
    where they have one, without deriving anything there), so a case that reads a long chain
    (`c / x` under `abs(x) > c`) does not derive the chain again."""

    def __init__(self, eqns, producer: dict, constants: dict, given: dict | None = None,
                 parent: Ranges | None = None):
        self.eqns, self.producer, self.constants = eqns, producer, constants
        self.memo: dict = dict(given or {})
        self.steps_left = None if given is None else MAX_GIVEN_STEPS
        self.parent = parent
        self.before = min((producer.get(v, -1) for v in (given or {})), default=-1)

    def given(self, atom, known: dict) -> Range:
        """The range of `atom` where each value of `known` lies in its range there
        (`jnp.where(d < 2.5, (6.25 - d ** 2) ** 2, 0.)`: the case is finite for d below 2.5)."""
        return Ranges(self.eqns, self.producer, self.constants, known, parent=self).of(atom)

    def constant_of(self, atom):
        if isinstance(atom, Literal):
            return np.asarray(atom.val)
        return self.constants.get(atom)

    def of(self, atom) -> Range:
        value = self.constant_of(atom)
        if value is not None:
            return constant_range(value)
        return demand(atom, self.memo, self._range)

    def _range(self, v) -> Generator[Any, Range, Range]:
        """The rule `demand` runs: yields each operand whose range it needs."""
        i = self.producer.get(v)
        if i is None or len(self.eqns[i].outvars) != 1 or not is_float(v):
            return None
        if self.parent is not None and i < self.before and v in self.parent.memo:
            return self.parent.memo[v]  # computed before what the view narrows: the same
        if self.steps_left is not None:
            if self.steps_left <= 0:
                return None
            self.steps_left -= 1
        eqn = self.eqns[i]
        rule = rule_for(eqn.primitive)
        if rule.selection is not None and rule.selection.by_predicate:
            return (yield from self._selected(eqn))
        if rule.range is None:
            return None
        consts = [self.constant_of(u) for u in eqn.invars]
        ranges: list[Range] = []
        for u, c in zip(eqn.invars, consts, strict=True):
            ranges.append(constant_range(c) if c is not None else (yield u))
        found = rule.range(eqn, ranges, consts)
        if rule.difference and maximum_of(eqn.invars[1], eqn.invars[0], self.producer,
                                           self.eqns) is not None:
            # `x - max(x)`: at most 0
            lo = -np.inf if found is None else found[0]
            return (lo, 0.0) if lo <= 0 else found
        return found

    def _selected(self, eqn: JaxprEqn) -> Generator[Any, Range, Range]:
        """`select_n`: the hull of its cases, each narrowed by the comparison that takes it."""
        if len(eqn.invars) != 3:
            return None
        pred, cases = eqn.invars[0], eqn.invars[1:]
        at = self.producer.get(pred) if isinstance(pred, Var) else None
        compare = None if at is None else self.eqns[at]
        always = None if compare is None else (yield from self._decided(compare))
        hull: list[float] = []
        for holds, case in zip((False, True), cases, strict=True):
            if always is not None and always != holds:
                continue  # never taken
            c = self.constant_of(case)
            r = constant_range(c) if c is not None else (yield case)
            if compare is not None and isinstance(case, Var) and \
                    shape_of(case) == shape_of(eqn.outvars[0]):
                # a value compared with a constant (elu's `where(x > 0, 0., x)`, at most 0):
                # every finite value, narrowed; a NaN it may hold is the taint pass's
                r = self._narrowed(compare, holds, case, (-np.inf, np.inf) if r is None else r)
                if r == (-np.inf, np.inf):
                    r = None
                if (r is None or not np.all(np.isfinite(r))) and self.steps_left is None \
                        and case not in compare.invars:
                    r = (yield from self._under(compare, holds, case)) or r
            if r is None:
                return None
            hull = [min(hull[0], r[0]), max(hull[1], r[1])] if hull else list(r)
        return hull[0], hull[1]

    def _decided(self, compare: JaxprEqn) -> Generator[Any, Range, bool | None]:
        """A test for NaN or inf (`nan_to_num`'s `x != x`, `x == inf`) of values whose ranges
        are finite: its answer in every lane (that of any finite value), else None."""
        test = rule_for(compare.primitive).tests_nonfinite
        tested = test(compare) if test is not None else []
        if not tested or len(compare.outvars) != 1 or any(
                isinstance(v, Var) and v not in tested for v in compare.invars):
            return None
        for v in tested:
            r = yield v
            if r is None or not (np.isfinite(r[0]) and np.isfinite(r[1])):
                return None
        values = [np.zeros((), dtype_of(v)) if isinstance(v, Var) else np.asarray(v.val)
                  for v in compare.invars]
        return bool(np.all(fold(compare, values)[0]))

    def _under(self, compare: JaxprEqn, holds: bool, case: Any) -> Generator[Any, Range, Range]:
        """The range of `case` where `compare` holds (or fails), derived again with the value
        it compares with a finite constant narrowed (`d` below 2.5 in `(6.25 - d ** 2) ** 2`).
        Where it holds the value is not NaN (NaN fails every comparison); where it fails, only a
        value with a range is known not to be NaN."""
        if len(compare.invars) != 2:
            return None
        for d, other in (compare.invars, compare.invars[::-1]):
            c = self.constant_of(other)
            if isinstance(d, Var) and self.constant_of(d) is None and c is not None and \
                    np.size(c) == 1 and bool(np.isfinite(c)) and is_float(d):
                break
        else:
            return None
        known = yield d
        if known is None:
            if not holds:
                return None
            known = (-np.inf, np.inf)
        narrowed = self._narrowed(compare, holds, d, known)
        if narrowed == known:
            return None
        return self.given(case, {d: narrowed})

    def _narrowed(self, compare: JaxprEqn, holds: bool, case: Any, r: tuple) -> tuple:
        """`r`, the range of `case`, where `compare` holds (or fails) and compares `case` with
        a finite constant. `case` has a range, so it is never NaN."""
        order = compared(compare, holds)
        if order is None or case not in compare.invars:
            return r
        greater, strict = order
        other = compare.invars[1 - compare.invars.index(case)]
        c = self.constant_of(other)
        if c is None or np.size(c) != 1 or not np.isfinite(c):
            return r
        dtype = dtype_of(case)
        point = np.asarray(c, dtype).reshape(())
        if compare.invars.index(case) == greater:  # case >= c
            if strict:
                point = next_toward(point, 1)
            return max(r[0], float(point)), r[1]
        if strict:  # case <= c
            point = next_toward(point, -1)
        return r[0], min(r[1], float(point))
