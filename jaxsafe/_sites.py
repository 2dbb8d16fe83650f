"""The guard pass: which operands of which equations get a safe value, or a cut, in their
dropped lanes.

An equation is guarded when its output has dropped lanes (static liveness says MAYBE) and

- its row has a guard (`sqrt`, `log`, `div`, ...): each listed operand that reaches the hazard
  takes the safe value, unless it is known to be in the domain there already (`_dropped.py`) or
  bounded into it for every finite input (`_bounds.py`), or the guards at the start of its
  dropped chain can take a safe value that carries the chain into it (`_dropped.py`: one guard
  where a hand fix puts it, so XLA's rewrites across the chain stay);
- or an operand may be non-finite there (`_taint.py`: an argument, a constant, ...) and the
  derivative of a differentiated operand reads it (`PrimitiveRule.derivative_reads`: `b` in
  `a * b`): that operand takes the table's safe value, else 0. Only where the guard needs no
  run-time reduction the program does not compute: every operand lane feeds output lanes that
  are dropped together, or the liveness is the same along the axes it would reduce (a padded
  row, a masked key's column), or the liveness the guard reads is computed anyway, for a guard
  placed before it (`_PaidMasks`: a NaN-prone value cut before a pooling whose results a
  convolution reads), or computed from constants alone (a `where` on a constant array, which
  XLA folds; what a `slice` or a `pad` cuts off, `jnp.arange(n) < k`): the guard then costs one
  `select_n`. Otherwise (a weight that only a ReLU drops, row by row) it is left, and reported;
- or it calls a custom derivative rule whose body is NaN-prone: its dropped input lanes are cut
  from differentiation (`select_n(live, stop_gradient(x), x)`), since no safe value is known for
  the user's rule.

A NaN-prone equation that only a pooling reads cuts its dropped lanes instead of replacing
them (`select_n(live, stop_gradient(x), x)`): the pooling's derivative picks lanes and never
weighs them, so the `0 * inf` a cut leaves in a dropped lane is never picked by a live result,
and every value stays the original (the pooling runs once). Where some pooled results are
dropped (a convolution after the pooling that reads only some of them), the equation's output
is cut in its dropped lanes too: a dropped window may pick that lane, and forward mode would
pass its `0 * inf` tangent on.

Independently of dropped lanes, a NaN-prone equation whose output has lanes that carry no
derivative (`sqrt(jnp.where(x > 0, x, 0.))`) has its derivative cut there (`Site.free`,
`_free.py`): forward mode's 0 * inf.

One forward walk over the equations does it, carrying the taint along, because a guard cleans
the taint of what it guards, and a later guard may be a no-op thanks to an earlier one.

Reads: the flattened program, its liveness (`Sweep`) and the taint seeds. Produces: the sites
(also appended to the report, with the unknown primitives met on the way).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Set

import numpy as np

from ._atoms import is_float, shape_of
from ._bounds import Bounds, operand_in_domain, value_finite_above_bound
from ._by_hand import HandGuards
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Tracer, Var
from ._dropped import DroppedValues
from ._free import FreeValues
from ._liveness import Sweep, kind_of_sym
from ._nested import call_jaxpr, sub_jaxprs
from ._report import Report, Site, note_failure
from ._rules import Guard, Kind, PrimitiveRule, alignment, guard_for, rule_for
from ._symbolic import (
    TRUE,
    Sym,
    backward_mapping,
    expand_connectives,
    known_lanes,
    made_of,
    move,
    named_along,
    runs_only_along,
)
from ._taint import (
    contains_hazard,
    literal_taints,
    makes_nonfinite,
    nan_free,
    nan_prone,
    selected_only_where_finite,
)


def place_guards(closed: ClosedJaxpr, sweep: Sweep, seeds: Set, report: Report,
                 bounds: Bounds) -> dict[int, Site]:
    """The guard sites of `closed`, by equation index. `bounds`: its values' bounds."""
    jaxpr = closed.jaxpr
    sites: dict[int, Site] = {}
    tainted = set(seeds)
    dropped = DroppedValues(closed, sites, sweep)
    free = dropped.free = FreeValues(closed, sweep, bounds)
    by_hand = HandGuards(closed, sweep, free, seeds)
    covered: set[int] = set()
    fixed = _without_tangent(closed)
    paid = _PaidMasks(sweep, fixed)
    i = 0
    try:
        for i, eqn in enumerate(jaxpr.eqns):
            rule = rule_for(eqn.primitive)
            if not rule.known:
                report.unknown.append(eqn)
            elif _liveness_stops(i, eqn, rule, sweep):
                report.conservative.append(eqn)
            if _from_constants_alone(eqn, rule, fixed, tainted, bounds, sweep):
                continue
            site = _site(i, eqn, rule, sweep, tainted, dropped, bounds, report, free, fixed,
                         paid, by_hand)
            if site is not None and (site.replace or site.cut) and by_hand.covers(i, eqn):
                # already guarded by hand (`_by_hand.py`): its dropped lanes stay as they are,
                # and may hold NaN or inf for what reads them
                covered.add(i)
                site = (Site(eqn, {}, {}, frozenset(), site.free, site.free_cut,
                             free_operands=site.free_operands)
                        if site.free or site.free_operands else None)
            if site is not None:
                sites[i] = site
                report.sites.append(site)
                if site.cut or site.cut_output or any(k not in site.coarse for k in site.replace):
                    paid.demand(eqn.outvars)  # a coarse guard reads predicates, not masks
            if (i in covered and not value_finite_above_bound(eqn, bounds)) or \
                    _taints_outputs(eqn, rule, tainted, site, bounds, sweep.producer_of):
                tainted.update(o for o in eqn.outvars if is_float(o))
    except Exception as e:
        note_failure(e, jaxpr.eqns[i], "guard")
        raise
    return sites


def _liveness_stops(i: int, eqn: JaxprEqn, rule: PrimitiveRule, sweep: Sweep) -> bool:
    """A drop reaches outputs of a primitive without a liveness rule (JAX's generic
    `reduce_window`, `scatter_add`): its differentiable operands were taken as live where any
    output lane is, and the user is told (the lanes before it keep plain JAX's gradient)."""
    return (rule.masks is None and rule.kinds is None and any(sweep.diff[i])
            and any(sweep.kind(o) == Kind.MAYBE for o in eqn.outvars))


class _PaidMasks:
    """The operand masks a guard reads at no run-time cost beyond its `select_n`: those the
    sites placed so far compute anyway (a site reads its output's mask, `RuntimeMasks`, which
    is built from the masks of every MAYBE value after it that it reaches, and from the masks
    their readers give each of their operands), and those computed from constants alone (a
    `where` on a constant array: XLA folds them). The guard pass walks forward, so when it
    meets an equation, every site that can demand its operands' masks is already placed."""

    def __init__(self, sweep: Sweep, fixed: Set):
        self.sweep, self.fixed = sweep, fixed
        self.demanded: set = set()

    def demand(self, outvars: list) -> None:
        """A site placed on these outputs reads their masks."""
        self.demanded.update(self.sweep.maybe_after(outvars, self.demanded))

    def paid(self, eqn: JaxprEqn, k: int) -> bool:
        """Whether the mask equation `eqn` gives its operand k costs nothing more."""
        v = eqn.invars[k]
        if isinstance(v, Literal) or len(eqn.outvars) != 1:
            return False
        return v in self.demanded or made_of(
            self.sweep.sym(eqn.outvars[0]), lambda key: isinstance(key, Var) and key in self.fixed)


def _site(i: int, eqn: JaxprEqn, rule: PrimitiveRule, sweep: Sweep, tainted: set,
          dropped: DroppedValues, bounds: Bounds, report: Report,
          free_values: FreeValues, fixed: Set, paid: _PaidMasks,
          by_hand: HandGuards) -> Site | None:
    if eqn.effects:
        return None
    out_kinds = [sweep.kind(o) for o in eqn.outvars]
    free, free_cut = free_values.guards(i, eqn, rule) if rule.guard is not None else ({}, False)
    free_operands = free_values.operand_cuts(i, eqn, rule) if rule.guard is not None else {}
    # as the liveness pass read them: a batched `cholesky` whose every matrix keeps a live
    # lane gives its operand no dropped lane, though its output has some
    guarded = [kind_of_sym(m) != Kind.LIVE for m in sweep.operand_syms[i]]
    drops_output = any(is_float(o) and (k == Kind.MAYBE or k == Kind.DEAD and
                                        sweep.reached_by_derivative(o))
                       for k, o in zip(out_kinds, eqn.outvars, strict=True))
    # a custom rule read by value (`_custom_rules.py`): dropped operand lanes under live output
    # lanes, where its rule may make NaN itself (`where(x > 0, t / sqrt(x), 0.)`)
    by_value = rule.custom_rule and not drops_output and any(guarded)
    if not (drops_output or by_value):
        return Site(eqn, {}, {}, frozenset(), free, free_cut, free_operands=free_operands) \
            if free or free_operands else None
    diff = sweep.diff[i]
    tangents = [d and v not in fixed for v, d in zip(eqn.invars, diff, strict=True)]
    replace, reasons = _value_guards(eqn, rule, diff, guarded, tainted, dropped, bounds)
    cut, cut_output = _cut_before_a_picker(eqn, rule, sweep, dropped, replace, reasons)
    guard = guard_for(eqn)
    # a body rewritten with its output masks guards its own reads of non-finite inputs
    body_guards_itself = rule.masked_body is not None and any(
        k == Kind.MAYBE and is_float(o) for k, o in zip(out_kinds, eqn.outvars, strict=True))
    # a cut (below) stops every derivative in dropped lanes: no value guard needed beside it
    nonfinite, coarse = ([], {}) if body_guards_itself or rule.cut_when_dropped else \
        _nonfinite_operands(eqn, rule, tangents, guarded, tainted, sweep, report, dropped, paid,
                            functools.partial(by_hand.covers_value, i, eqn))
    coarse = _guard_nonfinite(nonfinite, coarse, guard, replace, reasons, cut)
    if rule.custom_rule and (
            any(_may_be_nonfinite(eqn, v, tainted) for v in eqn.invars)
            or any(contains_hazard(sub) for sub in sub_jaxprs(eqn))
            or by_value) and not (
            rule.cut_needless is not None and rule.cut_needless(eqn)) or rule.cut_when_dropped:
        # The user's derivative rule may be singular in dropped lanes (its body is NaN-prone,
        # or an operand may be non-finite there), or the primitive's own derivative may be
        # (`cholesky`), and no safe value is known for it: cut those lanes from
        # differentiation instead.
        why = "custom derivative rule" if rule.custom_rule else "singular derivative"
        sizes = [int(np.prod(shape_of(v))) for v in eqn.invars if is_float(v)]
        if rule.custom_rule and sizes and min(sizes) < max(sizes):
            why += "; a live lane's values there, for the smaller operand it broadcasts"
        unread = _unread_by_backward_rule_call(eqn, rule, sweep)
        for k in range(len(eqn.invars)):
            if diff[k] and k not in replace and guarded[k]:
                cut.add(k)
                reasons[k] = why if k not in unread else (
                    why + "; its primal never reads this operand and its backward rule is not "
                          "seen: cut only where every output lane is dropped")
        # forward mode: the rule's tangent in a dropped output lane reads the cut operand's
        # value with a zero tangent (`t / x` at `x = 0`: 0 / 0), and a mask product after it
        # weighs that NaN by 0: the output's dropped lanes are cut too
        cut_output = cut_output or (rule.custom_rule and bool(cut) and drops_output
                                    and not _selected_only(eqn, sweep))
    if not replace and not cut and not free and not free_operands:
        return None
    return Site(eqn, replace, reasons, frozenset(cut), free, free_cut, cut_output, coarse,
                free_operands)


def _selected_only(eqn: JaxprEqn, sweep: Sweep) -> bool:
    """Whether every reader of `eqn`'s outputs takes them as a case of a `select_n` (a `where`):
    its derivative selects the tangent, so a NaN tangent in a dropped lane never passes."""
    outputs = set(v for v in sweep.jaxpr.outvars if isinstance(v, Var))
    for o in eqn.outvars:
        if o in outputs:  # read by the program around a body
            return False
        for i, k in sweep.consumers.get(o, []):
            selection = rule_for(sweep.jaxpr.eqns[i].primitive).selection
            if selection is None or not selection.by_predicate or k == 0:
                return False
    return True


def _unread_by_backward_rule_call(eqn: JaxprEqn, rule: PrimitiveRule,
                                  sweep: Sweep) -> frozenset[int]:
    """A `custom_vjp` call's operands its primal body never reads (a straight-through
    estimator's `soft`): which lanes its backward rule hands a cotangent is not known before
    JAX calls it, so they are cut only where every output lane is dropped (`explain` says so)."""
    if rule.backward_param is None:
        return frozenset()
    kinds = sweep.inner_kinds(call_jaxpr(eqn), [Kind.LIVE] * len(eqn.outvars), True)
    return frozenset(k for k, kind in enumerate(kinds) if kind == Kind.DEAD)


def _guard_nonfinite(nonfinite: list[int], coarse: dict[int, Sym], guard: Guard | None,
                     replace: dict[int, float], reasons: dict[int, str],
                     cut: set[int]) -> dict[int, Sym]:
    """Add the operands that may be non-finite to `replace` (the table's safe value, else 0),
    unless guarded or cut already; the coarse masks of those added."""
    added = {}
    for k in nonfinite:
        if k in replace or k in cut:
            continue
        replace[k] = guard.safe.get(k, 0.0) if guard is not None else 0.0
        reasons[k] = "may be non-finite"
        if k in coarse:
            reasons[k] += ("; where the program's predicates drop it (its exact mask would need a "
                           "run-time reduction)")
            added[k] = coarse[k]
    return added


def _cut_before_a_picker(eqn: JaxprEqn, rule: PrimitiveRule, sweep: Sweep,
                         dropped: DroppedValues, replace: dict[int, float],
                         reasons: dict[int, str]) -> tuple[set[int], bool]:
    """The table's value guards turned into cuts (moved out of `replace`), for an equation that
    only a picker reads (`_picker_reading`); and whether its output's dropped lanes are
    cut too: where some of the picker's results are dropped, a dropped window may pick the
    `0 * inf` tangent the cut leaves in a dropped lane (forward mode) and pass it on."""
    reader = _picker_reading(eqn, rule, sweep, dropped) if replace else None
    if reader is None:
        return set(), False
    cut = {k for k in replace if reasons[k] == "table"}
    for k in cut:
        del replace[k]
        reasons[k] = "only a pooling reads it: cut"
    return cut, not all(sweep.kind(o) == Kind.LIVE for o in reader.outvars)


def _picker_reading(eqn: JaxprEqn, rule: PrimitiveRule, sweep: Sweep,
                    dropped: DroppedValues) -> JaxprEqn | None:
    """The equation that alone reads `eqn` (lane to lane), if its derivative picks lanes
    (`Chooser.picks`: max pooling): then a tangent that a cut leaves in a dropped lane
    (`0 * inf`) is never picked by a live result, and the zero cotangent the picker writes
    there meets the cut's `select_n`, at every order. A cut keeps every value, so the pooling
    runs once, on the original values, instead of again on guarded ones."""
    if not rule.elementwise or len(eqn.outvars) != 1:
        return None
    out = eqn.outvars[0]
    readers = sweep.consumers.get(out, [])
    if dropped.reads.get(out, 0) != 1 or len(readers) != 1:
        return None
    reader = sweep.jaxpr.eqns[readers[0][0]]
    chooser = rule_for(reader.primitive).chooser
    if chooser is None or not chooser.picks or sweep.structural:
        return None
    return reader


def _from_constants_alone(eqn: JaxprEqn, rule: PrimitiveRule, fixed: Set, tainted: set,
                          bounds: Bounds, sweep: Sweep) -> bool:
    """Whether `eqn` is computed from constants alone (`fixed`): no derivative of its own, at
    any order, so no guard. What it may make non-finite is tainted, and a derivative that
    reads it (`x * log(k)`) guards it there: `optax.kl_divergence`'s `where(t == 0, 0.,
    log(t))` of a target computed from constants needs nothing."""
    if not all(isinstance(v, Literal) or v in fixed for v in eqn.invars):
        return False
    if nan_prone(eqn) or _taints_outputs(eqn, rule, tainted, None, bounds, sweep.producer_of):
        tainted.update(o for o in eqn.outvars if is_float(o))
    return True


def _without_tangent(closed: ClosedJaxpr) -> set:
    """Values computed from literals and known constants alone: no tangent ever reaches them
    (a closed-over tracer is not known: an outer transformation may differentiate it)."""
    jaxpr = closed.jaxpr
    fixed = {v for v, c in zip(jaxpr.constvars, closed.consts, strict=True)
             if not isinstance(c, Tracer)}
    for eqn in jaxpr.eqns:  # an `iota` too: `jnp.arange(n) < k`
        if not eqn.effects and all(isinstance(v, Literal) or v in fixed for v in eqn.invars):
            fixed.update(eqn.outvars)
    return fixed


def _nonfinite_operands(eqn: JaxprEqn, rule: PrimitiveRule, diff: list[bool],
                        guarded: list[bool], tainted: set, sweep: Sweep,
                        report: Report, dropped: DroppedValues, paid: _PaidMasks,
                        by_hand: Callable[[int], bool]) -> tuple[list[int], dict[int, Sym]]:
    """Operands that may be non-finite in dropped lanes where the derivative of an operand that
    carries a tangent (`diff`) reads them (a zero cotangent times NaN), that the program does
    not already guard by hand (`by_hand(k)`: `HandGuards.covers_value`), and that a guard can
    reach cheaply; and, of those, the ones guarded by a coarser mask (`Site.coarse`)."""
    if rule.linear or rule.zero_derivative or rule.custom_rule:  # a custom rule: cut instead
        return [], {}
    if rule.chooser is not None and rule.chooser.picks:
        return [], {}  # its derivative picks a lane, never weighs one: no `0 * inf` to meet
    found: list[int] = []
    coarse: dict[int, Sym] = {}
    for k, v in enumerate(eqn.invars):
        if not guarded[k] or not _may_be_nonfinite(eqn, v, tainted):
            continue
        if _finite_where_dropped(eqn, k, dropped) or by_hand(k) or \
                _counts_no_nan(rule, v, sweep, tainted):
            # `jnp.where(norm <= eps, 1., x)`: 1 in every lane read as dropped; by hand,
            # `x * log(where(x > 0, x, 1.))` under `where(x > 0, ., 0.)`
            continue
        if not any(d and j not in rule.no_derivative and
                   (rule.derivative_reads is None or k in rule.derivative_reads[j])
                   for j, d in enumerate(diff)):
            continue
        if isinstance(v, Literal) and not (rule.elementwise and len(eqn.outvars) == 1):
            continue
        if not _guard_needs_no_reduction(eqn, k, sweep) and not paid.paid(eqn, k):
            named = _named_by_predicates(eqn, k, rule, sweep)
            if named is None:
                report.skipped.append((eqn, f"operand {k} unguarded: it may be non-finite, but "
                                            f"a guard would need a run-time reduction of the "
                                            f"liveness"))
                continue
            coarse[k] = named
        found.append(k)
    return found, coarse


def _counts_no_nan(rule: PrimitiveRule, v: object, sweep: Sweep, tainted: set) -> bool:
    """A row maximum of a value free of NaN (`jnp.nanmax`): its derivative counts the lanes
    equal to it, inf included, and never divides by a zero count."""
    return rule.chooser is not None and rule.chooser.meets_nan_only and \
        nan_free(v, sweep.producer_of, tainted)


def _named_by_predicates(eqn: JaxprEqn, k: int, rule: PrimitiveRule,
                         sweep: Sweep) -> Sym | None:
    """Operand k's dropped lanes as a coarser mask, where its exact one would need a run-time
    reduction: the lanes the program's predicates drop along the axes the operand runs along
    (a padded row that a `where` drops, after a ReLU, a label gather or a constant mask that
    keep some of its lanes as well), moved to the operand's axes. None when they drop none.
    Not for a lane-to-lane equation, whose guarded operand's values in dropped lanes are
    read as the safe value's (`_dropped.py`)."""
    align = alignment(eqn, k)
    if align is None or rule.elementwise:
        return None
    along = backward_mapping(align)
    named = named_along(expand_connectives(sweep.sym(eqn.outvars[0]), sweep.connective_of),
                        along, sweep.known_mask)
    if named == TRUE:
        return None
    moved = move(named, along)
    known = known_lanes(moved, shape_of(eqn.invars[k]))
    if known is not None and known.all():
        return None  # the stretches of a split, every one: the predicates drop no lane
    return moved


def _finite_where_dropped(eqn: JaxprEqn, k: int, dropped: DroppedValues) -> bool:
    """Whether operand k is known finite in every lane that a dropped output lane reads."""
    known = dropped.get(eqn.invars[k])
    return (known is not None and bool(np.all(np.isfinite(known[0])))
            and (known[1] or dropped.reads_dropped(eqn, k)))


def _may_be_nonfinite(eqn: JaxprEqn, atom: object, tainted: set) -> bool:
    if isinstance(atom, Literal):
        return literal_taints(eqn, atom)
    return atom in tainted


def _guard_needs_no_reduction(eqn: JaxprEqn, k: int, sweep: Sweep) -> bool:
    """Whether operand k's liveness follows from its output's without an OR over output lanes
    whose liveness differs: each operand lane feeds one output lane (elementwise, a reduction's
    operand, a transpose), or the output's liveness is the same along the axes the operand
    does not run along (a key padding mask and the query axis of `q @ k.T`)."""
    rule = rule_for(eqn.primitive)
    if rule.elementwise and len(eqn.outvars) == 1 and (
            shape_of(eqn.invars[k]) == shape_of(eqn.outvars[0])
            or isinstance(eqn.invars[k], Literal)):  # `v * nan`: guarded at the output's shape
        return True
    align = alignment(eqn, k)
    if align is None or len(eqn.outvars) != 1:
        return False
    along = backward_mapping(align)  # output axis -> the operand axis running along it
    if set(along) >= set(range(len(shape_of(eqn.outvars[0])))):
        return True
    return runs_only_along(sweep.sym(eqn.outvars[0]), along)


def _value_guards(eqn: JaxprEqn, rule: PrimitiveRule, diff: list[bool], guarded: list[bool],
                  tainted: set, dropped: DroppedValues,
                  bounds: Bounds) -> tuple[dict[int, float], dict[int, str]]:
    """The guard table's safe values for the operands that need them."""
    replace: dict[int, float] = {}
    reasons: dict[int, str] = {}
    guard = guard_for(eqn)
    if guard is None:
        return replace, reasons
    for k, value in guard.safe.items():
        # a literal operand (`x / 0.`) passes no tangent, but its value does
        hazard_operand = k < len(eqn.invars) and (
            diff[k] or isinstance(eqn.invars[k], Literal) and is_float(eqn.invars[k]))
        if not hazard_operand or not guarded[k]:
            continue
        if dropped.guard_is_noop(eqn, k, guard):
            continue  # e.g. div(_, exp(guarded x)): exp(0) = 1 there already
        if operand_in_domain(eqn, k, bounds, tainted):
            continue  # rsqrt(mean(d ** 2) + 1e-5), (1 - where(d < 1, d, 0)) ** 2.5, exp(-r)
        if dropped.move_chain_guards(eqn, k, guard):
            continue  # e.g. igamma(_, abs(guarded x) ** 1.5): the guard of x takes 1, not 0
        replace[k], reasons[k] = value, "table"
    return replace, reasons


def _taints_outputs(eqn: JaxprEqn, rule: PrimitiveRule, tainted: set, site: Site | None,
                    bounds: Bounds, producer_of: Callable[[Var], JaxprEqn | None]) -> bool:
    """Whether `eqn`'s outputs may be non-finite where no guard put it, after its guards."""
    # a coarse guard leaves some dropped lanes as they were
    replaced = {k for k in site.replace if k not in site.coarse} if site is not None else set()
    if rule.chooser is not None and not rule.chooser.guarded_results:
        replaced = set()  # emitted again, its dropped results are the original's (`by_fill`)
    if any(isinstance(v, Var) and v in tainted and k not in replaced
           and not selected_only_where_finite(eqn, k, producer_of, bounds, tainted)
           for k, v in enumerate(eqn.invars)):
        return True
    if not rule.known or any(isinstance(v, Literal) and literal_taints(eqn, v)
                             for v in eqn.invars):
        return True
    if makes_nonfinite(eqn) and not (rule.finite_when is not None and
                                     rule.finite_when(eqn, bounds)):
        return True
    return rule.has_body and any(contains_hazard(s) for s in sub_jaxprs(eqn))
