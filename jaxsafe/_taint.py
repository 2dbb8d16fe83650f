"""Values that may be non-finite where no guard put it: the taint analysis.

A value guard protects a primitive from its own singularities. A value that already holds NaN or
inf in a dropped lane is a second hazard: a non-linear equation (`mul`, `pow`, ...) multiplies
the zero cotangent of that lane by it. Such values are *tainted*:

- the program's arguments (a padded batch, a sensor's inf sentinel, missing observations as
  NaN), unless the user declared them finite (`nan_safe(f, finite_args=...)`); a body's
  arguments always (they come from the program around it);
- NaN/inf literals and constants (except as the identity of their primitive, `max(-inf, x)`),
  and constants whose value is not known (an outer trace's tracers);
- values the program itself tests for NaN or inf, where the test decides a live selection, and
  the values they are computed from that may hold NaN or inf in some lane (an argument's, a
  NaN-prone primitive's: `nonfinite_anywhere`);
- the outputs of unknown primitives, and of bodies that contain a NaN-prone primitive;

and everything computed from them that no guard has cleaned (the guard pass, `_sites.py`,
carries the taint forward, since a guard cleans it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence, Set
from typing import Any, cast

import numpy as np
from jax import lax

from ._atoms import dtype_of, float_info, is_float, is_nonfinite_literal, literal_value, shape_of
from ._bounds import (
    Bounds,
    of_program,
    operand_in_domain,
    value_finite_above_bound,
    value_finite_in_range,
)
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Tracer, Var, scan_counts
from ._constants import finite_with_derivatives
from ._liveness import Sweep
from ._nested import any_equation, sub_jaxprs
from ._rules import Kind, guard_for, rule_for
from ._symbolic import Connective


def compared_with_nonfinite(eqn: JaxprEqn) -> list[Var]:
    """A comparison that tests for NaN or inf: `x != x`, `x == inf`, `x < -inf`."""
    if len(eqn.invars) != 2:
        return []
    a, b = eqn.invars
    if a is b and isinstance(a, Var):
        return [a]
    if is_nonfinite_literal(a) and isinstance(b, Var):
        return [b]
    if is_nonfinite_literal(b) and isinstance(a, Var):
        return [a]
    return []


def not_nan_where_false(eqn: JaxprEqn) -> tuple[Var, bool] | None:
    """`x != x` (`jnp.isnan`): x is not NaN where it is False."""
    a, b = eqn.invars
    return (a, False) if a is b and isinstance(a, Var) else None


def not_nan_where_true(eqn: JaxprEqn) -> tuple[Var, bool] | None:
    """`x == x`, `is_finite(x)`: x is not NaN where it is True."""
    a = eqn.invars[0]
    if not isinstance(a, Var) or len(eqn.invars) == 2 and eqn.invars[1] is not a:
        return None
    return a, True


MAX_NAN_FREE_VALUES = 64
"""Values `nan_free` follows back, at most."""


def nan_free(atom: Any, producer_of: Callable[[Var], Any], tainted: Set) -> bool:
    """Whether `atom` holds NaN in no lane (inf allowed): a value that may be non-finite in no
    lane, a literal without NaN, lanes moved from such values, or a selection that takes a value
    only where a test shows it is not NaN (`jnp.nanmax`'s `where(isnan(x), -inf, x)`)."""
    stack, seen = [atom], set()
    while stack:
        u = stack.pop()
        if isinstance(u, Literal):
            if np.any(np.isnan(np.asarray(literal_value(u), dtype=np.float64))):
                return False
            continue
        if not isinstance(u, Var) or u not in tainted or u in seen:
            continue
        seen.add(u)
        eqn = producer_of(u)
        if eqn is None or len(seen) > MAX_NAN_FREE_VALUES:
            return False
        rule = rule_for(eqn.primitive)
        if rule.selection is not None and rule.selection.by_predicate:
            stack.extend(case for k, case in enumerate(eqn.invars[1:])
                         if not _chosen_where_not_nan(eqn, k, producer_of))
        elif rule.keeps_nan_free or rule.moves_only and not makes_nonfinite(eqn):
            # (a gather may fill with NaN)
            stack.extend(eqn.invars)
        else:
            return False
    return True


def _chosen_where_not_nan(eqn: JaxprEqn, k: int, producer_of: Callable[[Var], Any]) -> bool:
    """Whether case k of a boolean `select_n` is taken only where a NaN test of it fails."""
    predicate, case = eqn.invars[0], eqn.invars[1 + k]
    flipped = False
    while isinstance(predicate, Var) and dtype_of(predicate) == np.bool_:
        test = producer_of(predicate)
        if test is None:
            return False
        rule = rule_for(test.primitive)
        if rule.connective is Connective.NOT:
            predicate, flipped = test.invars[0], not flipped
            continue
        found = rule.not_nan_where(test) if rule.not_nan_where is not None else None
        return found is not None and found[0] is case and (found[1] != flipped) == bool(k)
    return False


def every_operand(eqn: JaxprEqn) -> list[Var]:
    """`is_finite(x)` tests its operand."""
    return [v for v in eqn.invars if isinstance(v, Var)]


def literal_taints(eqn: JaxprEqn, atom: Any) -> bool:
    """A NaN/inf literal operand can make `eqn`'s result non-finite, except as the identity
    of its primitive (`max(-inf, x)`, the start of every softmax and logsumexp)."""
    if not is_nonfinite_literal(atom):
        return False
    identity = rule_for(eqn.primitive).identity
    return identity is None or complex(np.asarray(atom.val)) != identity


def may_be_nonfinite_const(value: Any) -> bool:
    """Whether a constant of the program may hold NaN or inf: known values are checked; a
    tracer closed over is unknown, so it may, like an argument."""
    if not is_float(value):  # PRNG keys and other extended dtypes too
        return False
    return isinstance(value, Tracer) or not bool(np.all(np.isfinite(np.asarray(value))))


def _makes_nonfinite_itself(eqn: JaxprEqn) -> bool:
    """A NaN-prone primitive, an unknown one (or one that may make NaN, with no guard), or a
    non-finite literal operand (its body aside)."""
    rule = rule_for(eqn.primitive)
    return (not rule.known or makes_nonfinite(eqn) or nan_prone(eqn)
            or any(literal_taints(eqn, v) for v in eqn.invars))


def makes_nonfinite(eqn: JaxprEqn) -> bool:
    """Whether the rule says `eqn` may make NaN or inf from finite operands, with no guard
    known (`PrimitiveRule.makes_nonfinite`, `nonfinite_when`)."""
    rule = rule_for(eqn.primitive)
    return rule.makes_nonfinite or rule.nonfinite_when is not None and rule.nonfinite_when(eqn)


def fills_nonfinite(eqn: JaxprEqn) -> bool:
    """A gather in `FILL_OR_DROP` mode (`take_along_axis`, `.at[i].get(mode="fill")`): an
    out-of-range index gives the fill value, NaN unless another is given."""
    fill = eqn.params.get("fill_value")
    return (any(is_float(o) for o in eqn.outvars)
            and eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP
            and (fill is None or not np.isfinite(fill)))


def indices_in_range(eqn: JaxprEqn, bounds: Bounds) -> bool:
    """A gather's indices lie in range for every finite input (their range, `_ranges.py`:
    a label from `argmax`, a permutation from a `sort` of an `iota`): no lane is filled."""
    found = bounds.range_of(eqn.invars[1])
    if found is None:
        return False
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    shape = shape_of(eqn.invars[0])
    room = min((shape[d] - sizes[d] for d in dn.start_index_map), default=0)
    return bool(found[0] >= 0 and found[1] <= room)


def reduces_an_empty_axis(eqn: JaxprEqn) -> bool:
    """A row maximum over an axis of size 0: its identity, -inf (+inf for a minimum), from
    finite operands (`jnp.max(x, axis=1, initial=-jnp.inf)` of a batch with no entries)."""
    shape = shape_of(eqn.invars[0])
    return any(shape[a] == 0 for a in eqn.params["axes"]) and \
        int(np.prod(shape_of(eqn.outvars[0]))) > 0


def window_may_read_padding_only(eqn: JaxprEqn) -> bool:
    """A max (min) pooling some of whose windows may read no operand lane (padding as wide as
    the window, or holes of a base dilation): its result there is its start, -inf (inf)."""
    p = eqn.params
    for k, (lo, hi), base, dilation in zip(p["window_dimensions"], p["padding"],
                                           p["base_dilation"], p["window_dilation"],
                                           strict=True):
        reach = (k - 1) * dilation + 1
        if lo >= reach or hi >= reach or (base > 1 and reach < base):
            return True
    return False


def nan_prone(eqn: JaxprEqn) -> bool:
    """Whether `eqn` may make inf or NaN (or such a derivative) from finite operands: its guard
    applies (`integer_pow` only with a negative exponent) to a floating-point result, and not
    every operand its guard would replace is a literal inside the domain (`x / 3.`, every
    `jnp.mean`), or an operand that can overflow it is not a literal (`10. ** n`)."""
    guard = guard_for(eqn)
    if guard is None or not any(is_float(o) for o in eqn.outvars):
        return False  # integers hold no NaN: `jnp.remainder(i, 2)` on indices
    if not rule_for(eqn.primitive).elementwise or len(eqn.outvars) != 1 or \
            any(k >= len(eqn.invars) or not isinstance(eqn.invars[k], Literal)
                for k in guard.safe) or \
            any(k < len(eqn.invars) and not isinstance(eqn.invars[k], Literal)
                for k in guard.overflows_through):
        return True
    point = [np.asarray(literal_value(v)) if isinstance(v, Literal)
             else np.asarray(1, dtype_of(v)) for v in eqn.invars]
    return not finite_with_derivatives(eqn, point)  # remembered (`_constants`)


def contains_hazard(closed: ClosedJaxpr) -> bool:
    """Whether a body can make NaN/inf from finite inputs, at any depth."""
    return any_equation(closed, _makes_nonfinite_itself)


def _tested(eqn: JaxprEqn) -> list[Var]:
    test = rule_for(eqn.primitive).tests_nonfinite
    return [] if test is None else test(eqn)


def _reach_live_selections(sweep: Sweep) -> set:
    """Variables whose value, through boolean logic (equations without floating-point outputs),
    picks the lanes of a `select_n` whose result is differentiated."""
    reach: set = set()
    for eqn in reversed(sweep.jaxpr.eqns):
        selection = rule_for(eqn.primitive).selection
        if selection is not None and selection.by_predicate:
            if any(sweep.kind(o) != Kind.DEAD for o in eqn.outvars) and \
                    isinstance(eqn.invars[0], Var):
                reach.add(eqn.invars[0])
        elif not any(is_float(o) for o in eqn.outvars) and \
                any(o in reach for o in eqn.outvars):
            reach.update(v for v in eqn.invars if isinstance(v, Var))
    return reach


def nonfinite_seeds(closed: ClosedJaxpr, sweep: Sweep, finite_invars: Sequence[bool]) -> set:
    """The taint pass's seeds: the arguments not declared finite (`finite_invars`), non-finite
    constants, and values the program tests for NaN/inf where the test decides a live
    selection, with the values they are computed from that may hold NaN or inf in some lane.

    `logsumexp` tests its max with isfinite only to feed stop_gradient: that says nothing about
    which values may be non-finite where it matters.
    """
    jaxpr = closed.jaxpr
    tainted = {v for v, c in zip(jaxpr.constvars, closed.consts, strict=True)
               if may_be_nonfinite_const(c)}
    tainted.update(v for v, finite in zip(jaxpr.invars, finite_invars, strict=True)
                   if not finite and is_float(v))
    reach = None
    stack: list = []
    for eqn in jaxpr.eqns:
        tested = _tested(eqn)
        if not tested:
            continue
        if reach is None:
            reach = _reach_live_selections(sweep)
        if any(o in reach for o in eqn.outvars):
            stack.extend(tested)
    if not stack:
        return tainted
    # a tested value may be non-finite because of any of its ancestors that may be: one that
    # no argument, constant or NaN-prone equation makes non-finite holds finite values in
    # every lane (overflow of unguarded arithmetic aside, as everywhere: how-it-works.md)
    anywhere = nonfinite_anywhere(closed, tainted)
    while stack:
        v = stack.pop()
        if v in tainted or not isinstance(v, Var) or not is_float(v) or v not in anywhere:
            continue
        tainted.add(v)
        producer = sweep.producer_of(v)
        if producer is not None:
            stack.extend(u for u in producer.invars if isinstance(u, Var))
    return tainted


# --------------------------------------------------------------------------- bodies' inputs

def may_produce_nonfinite(eqn: JaxprEqn) -> bool:
    """Whether `eqn` can make NaN or inf from finite operands, in any lane (a NaN-prone
    primitive, an unknown one, a non-finite literal, a body with any of these)."""
    return _makes_nonfinite_itself(eqn) or (rule_for(eqn.primitive).has_body and any(
        contains_hazard(s) for s in sub_jaxprs(eqn)))


MAX_CASE_VALUES = 256
"""Values of a selected case `selected_only_where_finite` follows back, at most."""


def selected_only_where_finite(eqn: JaxprEqn, k: int, producer_of: Callable[[Var], Any],
                               bounds: Bounds, tainted: Set = frozenset()) -> bool:
    """Whether operand k of a `select_n` is taken only in lanes where it is finite: the
    predicate compares a value with a finite constant from above (`jnp.where(t < 1., t, 0.)`:
    NaN and +inf fail `t < 1.`), the value is bounded from below (a bound holds of every value
    but NaN, whatever the operands held: -inf is below it), and the case is that value, or a
    function of it whose range is finite there and whose other inputs may be non-finite in no
    lane (`tainted`: jax-md's cutoff, `jnp.where(d < 2.5, (6.25 - d ** 2) ** 2, 0.)`)."""
    rule = rule_for(eqn.primitive)
    if rule.selection is None or not rule.selection.by_predicate or len(eqn.invars) != 3 \
            or k != 2 or not isinstance(eqn.invars[0], Var):
        return False
    case = eqn.invars[2]
    compare = producer_of(eqn.invars[0])
    if compare is None or len(compare.invars) != 2:
        return False
    below = rule_for(compare.primitive).bounds_below
    if below is None:
        return False
    # the side bounded from below where the comparison holds is the constant's: the other
    # operand is bounded from above by it
    value, bound = compare.invars[1 - below[1]], compare.invars[below[1]]
    if shape_of(case) != shape_of(eqn.outvars[0]) or not isinstance(value, Var):
        return False
    limit = bounds.constant_of(bound)
    if limit is None or np.size(limit) != 1 or not bool(np.all(np.isfinite(limit))):
        return False
    lower = bounds.of(value)
    if lower is None:
        return False
    if value is case:
        return True
    if not _nonfinite_only_through(case, value, tainted, producer_of):
        return False
    found = bounds.range_given(case, {value: (lower, float(np.asarray(limit).reshape(())))})
    return found is not None and bool(np.all(np.isfinite(found)))


def _nonfinite_only_through(case: Any, value: Var, tainted: Set,
                            producer_of: Callable[[Var], Any]) -> bool:
    """Whether every input of `case` that may be non-finite is `value`: followed back through
    the values that may be, up to `value` (a value that may not is finite in every lane)."""
    stack, seen = [case], set()
    while stack:
        u = stack.pop()
        if u is value or not isinstance(u, Var) or u in seen or u not in tainted:
            continue
        seen.add(u)
        producer = producer_of(u)
        if producer is None or len(seen) > MAX_CASE_VALUES:
            return False
        stack.extend(producer.invars)
    return True


def nonfinite_anywhere(closed: ClosedJaxpr, seeds: set) -> set:
    """Every value that may hold NaN or inf in some lane, live or dropped, from `seeds` forward
    (no guard is counted: a guard cleans dropped lanes only). What a body receives from the
    program around it is judged by this."""
    tainted = set(seeds)
    # made on first use: most hazards have no bounded operand to ask about
    bounds_of = functools.cache(lambda: of_program(closed))
    producer: dict = {}
    for eqn in closed.jaxpr.eqns:
        producer.update((o, eqn) for o in eqn.outvars)
        # the cheap test first: in a program fed by arguments, most operands already are
        reads = [k for k, v in enumerate(eqn.invars) if isinstance(v, Var) and v in tainted]
        if reads and rule_for(eqn.primitive).selection is not None:
            reads = [k for k in reads
                     if not selected_only_where_finite(eqn, k, producer.get, bounds_of(), tainted)]
        if reads or may_produce_nonfinite(eqn) and not _proven_finite(eqn, bounds_of, tainted):
            tainted.update(o for o in eqn.outvars if is_float(o))
    return tainted


def _proven_finite(eqn: JaxprEqn, bounds_of: Callable[[], Bounds], tainted: set) -> bool:
    """Whether a NaN-prone `eqn` is finite in every lane for finite operands, by a bound or a
    range of what it reads: `sqrt` of a sum of squares, `(1 - where(d < 1, d, 0)) ** 2.5` of a
    distance and `exp(-alpha * (r - sigma))` of a distance r >= 0 (their ranges' ends are
    finite), a softmax's quotient by a sum at least 1 of terms at most 1 (a bounded divisor)."""
    rule = rule_for(eqn.primitive)
    divisor = rule.divisor
    checks: list[tuple[bool, Callable[[JaxprEqn, Any], bool]]] = [
        (rule.decreasing, value_finite_above_bound),
        (rule.range is not None, value_finite_in_range),
        (divisor is not None,
         lambda eqn, bounds: operand_in_domain(eqn, cast(int, divisor), bounds, tainted))]
    if rule.finite_when is not None:
        checks.append((True, rule.finite_when))
    return any(applies and check(eqn, bounds_of()) for applies, check in checks)


def computation_selects(eqn: JaxprEqn, bounds: Bounds) -> bool:
    """A generic reduction whose computation only picks among its operands (`lax.reduce` with
    `lax.max`, the row max of a softmax): each result is an operand lane or an initial value,
    finite where they are."""
    return all(rule_for(e.primitive).selection is not None
               for body in sub_jaxprs(eqn) for e in body.jaxpr.eqns)


def exponent_set_by(or_primitive: Any, shift_primitive: Any) -> Callable[[JaxprEqn, Bounds], bool]:
    """`bitcast_convert_type` to a float of `or(shift_right_logical(bits, k), c)`: the shift
    clears the sign and exponent bits (k at least their count), and the constant `c` sets an
    exponent that is not all ones, so every lane is finite (`jax.random.uniform`'s [1, 2))."""
    def finite(eqn: JaxprEqn, bounds: Bounds) -> bool:
        out = eqn.outvars[0]
        if not is_float(out) or not isinstance(eqn.invars[0], Var):
            return False
        info = float_info(dtype_of(out))
        width = np.dtype(dtype_of(out)).itemsize * 8
        joined = _produced_by(eqn.invars[0], or_primitive, bounds)
        if joined is None or np.dtype(dtype_of(eqn.invars[0])).itemsize * 8 != width:
            return False
        for shifted, constant in (joined.invars, joined.invars[::-1]):
            c, shift = bounds.constant_of(constant), _produced_by(shifted, shift_primitive, bounds)
            k = None if shift is None else bounds.constant_of(shift.invars[1])
            if c is None or k is None or np.size(c) != 1 or np.size(k) != 1:
                continue
            exponent = (int(np.asarray(c).reshape(())) >> info.nmant) & ((1 << info.nexp) - 1)
            if int(np.asarray(k).reshape(())) >= 1 + info.nexp and \
                    exponent != (1 << info.nexp) - 1:
                return True
        return False
    return finite


def _produced_by(atom: Any, primitive: Any, bounds: Bounds) -> JaxprEqn | None:
    i = bounds.producer.get(atom) if isinstance(atom, Var) else None
    eqn = None if i is None else bounds.eqns[i]
    return eqn if eqn is not None and eqn.primitive is primitive else None


def outputs_nonfinite(closed: ClosedJaxpr, inputs: Sequence[bool]) -> list[bool]:
    """Which outputs of a body may be non-finite, given which of its inputs may be."""
    jaxpr = closed.jaxpr
    seeds = {v for v, c in zip(jaxpr.constvars, closed.consts, strict=True)
             if may_be_nonfinite_const(c)}
    seeds.update(v for v, t in zip(jaxpr.invars, inputs, strict=True) if t)
    tainted = nonfinite_anywhere(closed, seeds)
    return [isinstance(v, Var) and v in tainted for v in jaxpr.outvars]


def _carried(body: ClosedJaxpr, fixed: list[bool], carry: list[bool], tail: list[bool],
             carry_out: slice) -> list[bool]:
    """A loop's carry inputs that may be non-finite at some iteration: the initial ones, and
    those the body makes so (a fixpoint; each round adds at least one, or stops)."""
    carry = list(carry)
    while True:
        outs = outputs_nonfinite(body, fixed + carry + tail)[carry_out]
        grown = [c or o for c, o in zip(carry, outs, strict=True)]
        if grown == carry:
            return carry
        carry = grown


def direct_body_inputs(eqn: JaxprEqn, operands: list[bool]) -> dict[str, list[bool]]:
    """A call (`remat`): its body's inputs are its operands."""
    return {"jaxpr": operands}


def cond_body_inputs(eqn: JaxprEqn, operands: list[bool]) -> dict[str, list[bool]]:
    """Every branch reads the operands after the index."""
    return {"branches": operands[1:]}


BodyOperands = dict[str, list[tuple[int, bool] | None]]


def direct_body_operands(eqn: JaxprEqn) -> BodyOperands:
    """A call (`remat`): its body's inputs are its operands."""
    return {"jaxpr": [(k, True) for k in range(len(eqn.invars))]}


def cond_body_operands(eqn: JaxprEqn) -> BodyOperands:
    """Every branch reads the operands after the index."""
    return {"branches": [(k, True) for k in range(1, len(eqn.invars))]}


def sliced_body_operands(eqn: JaxprEqn) -> BodyOperands:
    """`shard_map`: its body reads each device's slice of its operands."""
    return {"jaxpr": [(k, False) for k in range(len(eqn.invars))]}


def scan_body_operands(eqn: JaxprEqn) -> BodyOperands:
    """A scan's constants are the same in every step, its `xs` sliced; its carries change."""
    n_consts, n_carry = scan_counts(eqn.params)
    n = len(eqn.invars)
    return {"jaxpr": [(k, True) for k in range(n_consts)] + [None] * n_carry +
            [(k, False) for k in range(n_consts + n_carry, n)]}


def while_body_operands(eqn: JaxprEqn) -> BodyOperands:
    """A while loop's body constants are the same in every iteration; its carries change (its
    condition is a decision: nothing in it is differentiated)."""
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    n_carry = len(eqn.invars) - n_cond - n_body
    return {"body_jaxpr": [(k, True) for k in range(n_cond, n_cond + n_body)] +
            [None] * n_carry}


def scan_body_inputs(eqn: JaxprEqn, operands: list[bool]) -> dict[str, list[bool]]:
    n_consts, n_carry = scan_counts(eqn.params)
    consts, carry = operands[:n_consts], operands[n_consts:n_consts + n_carry]
    xs = operands[n_consts + n_carry:]
    carry = _carried(eqn.params["jaxpr"], consts, carry, xs, slice(0, n_carry))
    return {"jaxpr": consts + carry + xs}


def while_body_inputs(eqn: JaxprEqn, operands: list[bool]) -> dict[str, list[bool]]:
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    consts, carry = operands[n_cond:n_cond + n_body], operands[n_cond + n_body:]
    carry = _carried(eqn.params["body_jaxpr"], consts, carry, [], slice(0, len(carry)))
    return {"body_jaxpr": consts + carry}
