"""The rewrite: emit a program whose dropped lanes are safe to differentiate.

Given a traced program (a ClosedJaxpr), `rewrite` returns an equivalent one in three parts, all
emitted by tracing an interpreter over the original equations:

1. **The original program**, unchanged (nested scan/while/cond/remat bodies are rewritten on their
   own, keeping their signatures, so they return bitwise the same values). Every predicate and
   comparison that decides liveness reads these original values.
2. **The masks**: for each guarded equation, the liveness of its output, computed backward from
   the outputs by the rules in `_liveness` (only on the paths between hazards and drops).
3. **The guarded shadow**: the equations from each guard down to the outputs, re-emitted with safe
   operands in dropped lanes: `select_n(live, safe, x)`. An equation is guarded when its output has
   dropped lanes and either it is in the guard table (`_guards`: sqrt, log, div, ...) or one of its
   operands may be non-finite there (a NaN/inf literal or constant, a value the program itself
   tests with isnan/isinf/isfinite, or the output of a primitive we know nothing about) and the
   equation is not linear, so a zero cotangent would meet that NaN in a product.
   Implicit selections (`max`, `min`, `clamp`) whose operands changed are re-emitted as a
   `select_n` on the original decision, so in dropped lanes they return the winning operand itself.

Dead-code elimination then removes whatever the shadow made unused: for `jnp.where(c, sqrt(x), 0)`
the result is exactly the hand-written double where. When nothing needs a guard, the original
ClosedJaxpr is returned as it is.

`jit` and `closed_call` equations are inlined first (a jit boundary changes no value), so liveness
and guards cross them: `jnp.where` is itself a jit, and the hazard and the drop usually sit on
opposite sides of it.
"""

from __future__ import annotations

import dataclasses
import gc
from functools import partial
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _liveness as L
from . import _masks as M
from . import _signs as B
from . import _symbolic as S
from ._compat import (ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var, bind_eqn, dce,
                      trace_to_jaxpr)
from ._compat import primitives as P
from ._guards import GUARDS, guard_for

# Primitives through which a zero cotangent never meets a value: a NaN in a dropped lane of an
# operand cannot leak into another operand's derivative.
LINEAR: frozenset = frozenset({
    P.add_p, P.sub_p, P.neg_p, P.reshape_p, P.broadcast_in_dim_p, P.squeeze_p, P.transpose_p,
    P.rev_p, P.slice_p, P.dynamic_slice_p, P.dynamic_update_slice_p, P.pad_p, P.concatenate_p,
    P.select_n_p, P.reduce_sum_p, P.cumsum_p, P.convert_element_type_p, P.copy_p,
    P.real_p, P.imag_p, P.conj_p, P.complex_p, P.gather_p, P.scatter_add_p, P.add_jaxvals_p,
    P.reduce_precision_p, P.stop_gradient_p,
    # not linear, but their derivative only selects (weights 0, 1/2, 1 from comparisons): a NaN
    # operand never meets a cotangent in a product, and a guard there would bend the decision
    P.max_p, P.min_p, P.clamp_p,
})

INLINED: frozenset = frozenset({P.jit_p, P.closed_call_p})

# Parameters that hold sub-jaxprs rewritten on their own (signature kept, outputs all live).
NESTED_PARAMS: dict = {
    P.scan_p: ("jaxpr",),
    P.while_p: ("body_jaxpr",),
    P.cond_p: ("branches",),
    P.remat_p: ("jaxpr",),
}

COMPARISONS: frozenset = frozenset({P.eq_p, P.ne_p, P.lt_p, P.le_p, P.gt_p, P.ge_p})

# Bodies that are rewritten again, with the output masks of the surrounding program, when that
# program drops some of their output lanes (liveness flows into them from outside).
MASKED_BODIES: frozenset = frozenset({P.remat_p, P.cond_p, P.scan_p})

_JAX_PRIMITIVES = frozenset(  # JAX's own: no rule means "conservative", not "unknown"
    v for module in (P, lax) for v in vars(module).values()
    if isinstance(v, jax.extend.core.Primitive))


@dataclasses.dataclass
class Site:
    """One guarded equation: which operands take which value in its dropped lanes, and why;
    `cut` operands keep their value but pass no derivative there (a custom rule's call)."""
    eqn: JaxprEqn
    replace: dict[int, float]
    reasons: dict[int, str]
    cut: frozenset = frozenset()


@dataclasses.dataclass
class Report:
    """What a rewrite did, for `jaxsafe.explain` and the tests."""
    sites: list[Site] = dataclasses.field(default_factory=list)
    selections: list[JaxprEqn] = dataclasses.field(default_factory=list)
    unknown: list[JaxprEqn] = dataclasses.field(default_factory=list)
    nested: list[tuple[JaxprEqn, "Report"]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[JaxprEqn, str]] = dataclasses.field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.sites or self.selections or
                    any(r.changed for _, r in self.nested))


# --------------------------------------------------------------------------- inlining jit

def _has_inlinable(jaxpr: Jaxpr) -> bool:
    return any(e.primitive in INLINED for e in jaxpr.eqns)


def flatten(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same program with every jit/closed_call inlined (recursively).

    Built by copying equations with renamed variables, not by tracing again: nothing is
    re-evaluated, and every equation keeps its source info.
    """
    if not _has_inlinable(closed.jaxpr):
        return closed
    constvars, consts = list(closed.jaxpr.constvars), list(closed.consts)
    eqns: list[JaxprEqn] = []

    def sub_atom(sub: dict, a):
        return sub.get(a, a) if isinstance(a, Var) else a

    top_sub: dict = {}
    # frames: (jaxpr, substitution, rename outputs?, equation iterator, the call being inlined)
    stack = [(closed.jaxpr, top_sub, False, iter(closed.jaxpr.eqns), None)]
    while stack:  # iterative: jit chains can be deep
        jaxpr, sub, fresh, it, call = stack[-1]
        eqn = next(it, None)
        if eqn is None:
            stack.pop()
            if call is not None:  # the call's outputs are the body's results
                outer_sub, outer_eqn = call
                for o, a in zip(outer_eqn.outvars, jaxpr.outvars):
                    outer_sub[o] = sub_atom(sub, a)
            continue
        invars = [sub_atom(sub, v) for v in eqn.invars]
        if eqn.primitive in INLINED:
            inner = L._call_jaxpr(eqn)
            inner_sub: dict = {}
            for cv, c in zip(inner.jaxpr.constvars, inner.consts):
                inner_sub[cv] = new_var = Var(cv.aval)
                constvars.append(new_var)
                consts.append(c)
            inner_sub.update(zip(inner.jaxpr.invars, invars))
            stack.append((inner.jaxpr, inner_sub, True, iter(inner.jaxpr.eqns), (sub, eqn)))
            continue
        outvars = list(eqn.outvars)
        if fresh:  # a body inlined more than once must not reuse its variables
            outvars = [DropVar(o.aval) if isinstance(o, DropVar) else Var(o.aval)
                       for o in eqn.outvars]
            sub.update(zip(eqn.outvars, outvars))
        eqns.append(eqn.replace(invars=invars, outvars=outvars))
    outvars = [sub_atom(top_sub, v) for v in closed.jaxpr.outvars]
    jaxpr = Jaxpr(constvars, closed.jaxpr.invars, outvars, eqns, closed.jaxpr.effects,
                  closed.jaxpr.debug_info)
    return ClosedJaxpr(jaxpr, consts)


# --------------------------------------------------------------------------- the plan

def _is_nonfinite_literal(atom) -> bool:
    if not isinstance(atom, Literal) or not L.is_float(atom):
        return False
    return not bool(np.all(np.isfinite(np.asarray(atom.val))))


def _literal_taints(eqn: JaxprEqn, atom) -> bool:
    """A NaN/inf literal operand can make `eqn`'s result non-finite, except as the identity
    of max/min (`max(-inf, x)`, the start of every softmax and logsumexp)."""
    if not _is_nonfinite_literal(atom):
        return False
    value = complex(np.asarray(atom.val))
    if eqn.primitive is P.max_p and value == -np.inf:
        return False
    if eqn.primitive is P.min_p and value == np.inf:
        return False
    return True


def _may_be_nonfinite_const(value) -> bool:
    if isinstance(value, jax.core.Tracer):
        return False  # unknown; treated like an input: tainted only if the program tests it
    try:
        arr = np.asarray(value)
    except Exception:  # pragma: no cover
        return False
    return arr.dtype.kind in "fc" and not bool(np.all(np.isfinite(arr)))


def _tested_for_nonfinite(eqn: JaxprEqn) -> list[Var]:
    """Values that the program tests for NaN/inf: `x != x`, `is_finite(x)`, `x == inf`, ..."""
    prim, ins = eqn.primitive, eqn.invars
    if prim is P.is_finite_p:
        return [v for v in ins if isinstance(v, Var)]
    if prim in COMPARISONS and len(ins) == 2:
        a, b = ins
        if a is b and isinstance(a, Var):
            return [a]
        if _is_nonfinite_literal(a) and isinstance(b, Var):
            return [b]
        if _is_nonfinite_literal(b) and isinstance(a, Var):
            return [a]
    return []


def _decides_a_live_selection(test: JaxprEqn, eqns: Sequence[JaxprEqn], sweep: L.Sweep) -> bool:
    """Whether a test's result (through boolean logic) picks lanes of a selection whose result
    is differentiated. `logsumexp` tests its max with isfinite only to feed stop_gradient: that
    says nothing about which values may be non-finite where it matters."""
    if not _tested_for_nonfinite(test):
        return False
    flags = {o for o in test.outvars}
    for eqn in eqns:
        if not any(isinstance(v, Var) and v in flags for v in eqn.invars):
            continue
        if eqn.primitive is P.select_n_p:
            if eqn.invars[0] in flags and any(sweep.kind(o) != L.Kind.DEAD
                                              for o in eqn.outvars):
                return True
        elif not any(L.is_float(o) for o in eqn.outvars):
            flags.update(eqn.outvars)  # not, and, or, convert to int, ...
    return False


_SMALL = 64  # constants up to this size are evaluated at rewrite time


class DroppedValues:
    """What some values hold in all their dropped lanes, known when the rewrite is planned.

    A constant (literals only, or a small concrete constant) holds its value everywhere. `v =
    op(a, b, ...)`, elementwise, holds `op` of its operands' known values, when each operand is
    a constant, is replaced there by this equation's guard, or is itself known in its dropped
    lanes and every dropped lane of `v` reads only dropped lanes of it (`reads_dropped`). A
    broadcast, a size-1 reshape or a reduction of a value known to hold one scalar in its dropped
    lanes holds it too (a sum: times the row length), on the same condition: the row sums of a
    softmax whose dropped rows are guarded to `exp(0) = 1` hold the row length there.

    A guard whose operand is known to be inside the primitive's domain there (`div(_,
    sqrt(guarded x))` has 1 already, `log(2.)` always, a softmax's row sums) is a no-op: it is
    left out, and XLA keeps folding the constant.
    """

    def __init__(self, closed: ClosedJaxpr, sites: dict, producer: dict, reads: dict,
                 sweep: L.Sweep):
        self.eqns, self.sites, self.producer, self.reads = closed.jaxpr.eqns, sites, producer, reads
        self.sweep = sweep
        self.memo: dict = {}
        for v, c in zip(closed.jaxpr.constvars, closed.consts):
            if not isinstance(c, jax.core.Tracer) and np.size(c) <= _SMALL:
                self.memo[v] = (np.asarray(c), True)

    def _get(self, atom):
        """(value, is_constant) or None."""
        if isinstance(atom, Literal):
            return np.asarray(atom.val, atom.aval.dtype), True  # its own dtype, also under x64
        if atom in self.memo:
            return self.memo[atom]
        self.memo[atom] = None  # cycles cannot happen; this guards re-entry on failure
        self.memo[atom] = result = self._compute(atom)
        return result

    def reads_dropped(self, eqn: JaxprEqn, k: int) -> bool:
        """Whether each dropped lane of `eqn`'s output reads only dropped lanes of operand k: a
        live operand lane feeds live output lanes only (static masks, `_symbolic.implies`)."""
        u, v = eqn.invars[k], eqn.outvars[0]
        if self.reads.get(u, 0) == 1 and _shape_of(u) == _shape_of(v) and _is_elementwise(eqn):
            return True  # the operand's dropped lanes are exactly the output's
        align = L.alignment(eqn, k)
        if align is None:
            return False
        su, sv = self.sweep.sym(u), self.sweep.sym(v)
        if {a for a in align if a is not None} == set(range(len(_shape_of(v)))):
            # every output axis is an operand axis (a reduction, the same shape): in u's lanes
            return S.implies(su, S.move(sv, S.backward_mapping(align)))
        if all(a is not None or n == 1 for a, n in zip(align, _shape_of(u))):
            # every operand axis is an output axis (a broadcast): in v's lanes
            return S.implies(S.move(su, S.forward_mapping(align)), sv)
        return False

    def _compute(self, v):
        i = self.producer.get(v)
        if i is None:
            return None
        eqn = self.eqns[i]
        if eqn.primitive in _SCALAR_MOVES and len(eqn.outvars) == 1 and not eqn.effects:
            return self._moved_scalar(eqn)
        rule = L.RULES.get(eqn.primitive)
        if len(eqn.outvars) != 1 or eqn.effects or rule is None or rule.masks is not L.elementwise:
            return None
        site = self.sites.get(i)
        if site is not None and site.cut:
            return None
        vals, constant = [], True
        for k, u in enumerate(eqn.invars):
            if site is not None and k in site.replace:
                vals.append(np.asarray(site.replace[k], u.aval.dtype))
                constant = False
                continue
            known = self._get(u)
            if known is None:
                return None
            if not known[1]:  # known in dropped lanes only: v's must read only those
                if not self.reads_dropped(eqn, k):
                    return None
                constant = False
            vals.append(known[0])
        if constant and int(np.prod(_shape_of(v))) > _SMALL:
            return None  # a large constant array: not worth evaluating at rewrite time
        try:
            with jax.ensure_compile_time_eval():  # a constant, even while an outer jit traces
                out = np.asarray(bind_eqn(eqn, vals)[0])
        except Exception:  # noqa: BLE001 - unknown: treated as unknown
            return None
        return out, constant

    def _moved_scalar(self, eqn: JaxprEqn):
        """A broadcast, size-1 reshape or reduction of a value that holds one scalar in its
        dropped lanes (or everywhere)."""
        u = eqn.invars[0]
        known = self._get(u)
        if known is None or np.ndim(known[0]) != 0 or (
                eqn.primitive is P.reshape_p and eqn.params.get("dimensions") is not None):
            return None
        if not known[1] and not self.reads_dropped(eqn, 0):
            return None
        value = np.asarray(known[0])
        if eqn.primitive in (P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p):
            n = int(np.prod([_shape_of(u)[a] for a in eqn.params["axes"]]))
            if n == 0 or not np.issubdtype(value.dtype, np.floating):
                return None
            if eqn.primitive is P.reduce_sum_p:
                total = float(value) * n  # the row sums a run computes differ by rounding only
                if not abs(total) < float(np.finfo(value.dtype).max) / 2:
                    return None
                value = np.asarray(total, value.dtype)
        return value, known[1]

    def guard_is_noop(self, eqn: JaxprEqn, k: int, safe: dict) -> bool:
        """Whether operand k of `eqn` is known, in the lanes its guard would replace, to be a
        value at which `eqn` and its first derivatives are finite."""
        u = eqn.invars[k]
        known = self._get(u)
        if known is None or (not known[1] and not self.reads_dropped(eqn, k)):
            return False
        point = []
        for j, a in enumerate(eqn.invars):  # the others: known, else their safe value, else 1
            other = known if j == k else self._get(a)
            if other is not None and (j == k or other[1]):
                point.append(np.asarray(other[0]))
            else:
                point.append(np.asarray(safe.get(j, 1.0), a.aval.dtype))
        return _finite_with_derivatives(eqn, point)


_SCALAR_MOVES = frozenset({P.broadcast_in_dim_p, P.reshape_p, P.squeeze_p, P.reduce_sum_p,
                           P.reduce_max_p, P.reduce_min_p})
"""Primitives that carry a value known to be one scalar in dropped lanes (see DroppedValues)."""


def _is_elementwise(eqn: JaxprEqn) -> bool:
    rule = L.RULES.get(eqn.primitive)
    return rule is not None and rule.masks is L.elementwise and len(eqn.outvars) == 1


def _bounded_into_domain(eqn: JaxprEqn, k: int, bounds: B.Bounds, tainted: set) -> bool:
    """Whether operand k is, for every finite input, at or above a positive point where `eqn`
    and its derivative are finite, for a primitive that only gets safer above it."""
    v = eqn.invars[k]
    if eqn.primitive not in B.DECREASING or k != 0 or not isinstance(v, Var) or v in tainted:
        return False
    lower = bounds.of(v)
    if lower is None or lower <= 0:
        return False
    point = np.asarray(lower, v.aval.dtype)
    return bool(0 < float(point) <= lower) and _finite_with_derivatives(eqn, [point])


def _finite_with_derivatives(eqn: JaxprEqn, point: list) -> bool:
    point = [np.asarray(p).reshape(()) if np.size(p) == 1 else np.asarray(p) for p in point]
    floats = [j for j, p in enumerate(point) if np.issubdtype(p.dtype, np.inexact)]

    def op(*xs):
        vals = list(point)
        for j, x in zip(floats, xs):
            vals[j] = x
        return bind_eqn(eqn, vals)[0]
    try:
        with jax.ensure_compile_time_eval():
            args = [point[j] for j in floats]
            outs = [np.asarray(op(*args))]
            for j in range(len(floats)):
                tangents = [np.ones_like(a) if n == j else np.zeros_like(a)
                            for n, a in enumerate(args)]
                outs.append(np.asarray(jax.jvp(op, args, tangents)[1]))
    except Exception:  # noqa: BLE001 - unknown: keep the guard
        return False
    return all(bool(np.all(np.isfinite(o))) for o in outs)


def _shape_of(atom) -> tuple:
    return tuple(atom.aval.shape)


def _contains_hazard(closed: ClosedJaxpr) -> bool:
    """Whether a sub-jaxpr can make NaN/inf from finite inputs (recursively)."""
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive in GUARDS or eqn.primitive not in _JAX_PRIMITIVES:
            return True
        if any(_literal_taints(eqn, v) for v in eqn.invars):
            return True
        for sub in _sub_jaxprs(eqn):
            if _contains_hazard(sub):
                return True
    return False


def _sub_jaxprs(eqn: JaxprEqn) -> list[ClosedJaxpr]:
    out = []
    for v in eqn.params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(item, ClosedJaxpr):
                out.append(item)
            elif isinstance(item, Jaxpr):
                out.append(ClosedJaxpr(item, ()))
    return out


@dataclasses.dataclass
class Plan:
    closed: ClosedJaxpr
    sweep: L.Sweep
    sites: dict[int, Site]
    reemit: set[int]
    selections: set[int]
    nested: dict[int, dict]
    masked: dict[int, list]
    report: Report
    producer: dict
    chain: set = dataclasses.field(default_factory=set)
    """Decisions computed from guarded values (every operand read as guarded)."""
    safe_reads: dict = dataclasses.field(default_factory=dict)
    """eqn index -> operands read for their value only that may be read as guarded."""


class ChangedLanes:
    """Where the guarded program's values may differ from the original's, as symbolic masks.

    A value recomputed from guarded operands differs in its dropped lanes only (the complement
    of its liveness). A decision reads values without differentiating them (a predicate, the
    `stop_gradient(max(x))` of a softmax); it must see the original values wherever its result
    is live. When the lanes that a guarded read would change are provably dropped lanes of the
    result (a row that a `where` drops as a whole), the decision reads the guarded value, and
    the original program is not computed a second time for it.
    """

    def __init__(self, sweep: L.Sweep):
        self.sweep = sweep
        self.chain: dict = {}  # values of decisions computed from guarded values -> changed lanes
        self._dropped: dict = {}

    def of(self, v, changed: set):
        """Changed lanes of `v`: a Sym, FALSE when unchanged, None when unknown."""
        if v in self.chain:
            return self.chain[v]
        if v not in changed:
            return S.FALSE
        if v not in self._dropped:
            self._dropped[v] = S.sym_not(self.sweep.sym(v))
        return self._dropped[v]

    def pushed(self, eqn: JaxprEqn, k: int, changed: set):
        """The lanes of `eqn`'s output that operand k's changed lanes reach, or None."""
        sym = self.of(eqn.invars[k], changed)
        if sym is None or sym == S.FALSE:
            return sym
        align = L.alignment(eqn, k)
        if align is None:
            return None
        return S.move(sym, S.forward_mapping(align))

    def reads_dropped_only(self, eqn: JaxprEqn, k: int, changed: set) -> bool:
        """Whether reading operand k as guarded changes dropped lanes of the result only."""
        reach = self.pushed(eqn, k, changed)
        return reach is not None and S.disjoint(reach, self.sweep.sym(eqn.outvars[0]))


def make_plan(closed: ClosedJaxpr, out_kinds: Sequence[L.Kind] | None = None) -> Plan:
    """Decide what to guard. `out_kinds`: static liveness of the outputs (all LIVE at the top;
    MAYBE for a body whose outputs are dropped in places by the program around it)."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    report = Report()
    if out_kinds is None:
        out_kinds = [L.Kind.LIVE] * len(jaxpr.outvars)
    sweep = L.sweep_for(jaxpr, list(out_kinds), False)

    # Nested bodies: rewritten on their own, unless nothing differentiates their results (read
    # by comparisons only, say): then no derivative runs through them.
    nested: dict[int, dict] = {}
    for i, eqn in enumerate(eqns):
        names = NESTED_PARAMS.get(eqn.primitive)
        if not names or all(sweep.kind(o) == L.Kind.DEAD for o in eqn.outvars):
            continue
        new_params = dict(eqn.params)
        for name in names:
            value = eqn.params[name]
            if isinstance(value, tuple):
                results = [rewrite_with_report(br) for br in value]
                new_value = tuple(r[0] for r in results)
                for _, rep in results:
                    if rep.changed:
                        report.nested.append((eqn, rep))
            elif isinstance(value, Jaxpr):  # remat: an open jaxpr, no constants allowed
                new_closed, rep = rewrite_with_report(ClosedJaxpr(value, ()))
                if rep.changed and new_closed.consts:
                    report.skipped.append((eqn, "rewritten body needs constants"))
                    new_value = value
                else:
                    new_value = new_closed.jaxpr
                    if rep.changed:
                        report.nested.append((eqn, rep))
            else:
                new_value, rep = rewrite_with_report(value)
                if rep.changed:
                    report.nested.append((eqn, rep))
            new_params[name] = new_value
        if any(new_params[n] is not eqn.params[n] for n in names):
            nested[i] = new_params

    # Taint: values whose dropped lanes may hold NaN/inf that no guard put there.
    tainted: set = set()
    for v, c in zip(jaxpr.constvars, closed.consts):
        if _may_be_nonfinite_const(c):
            tainted.add(v)
    tested = [v for eqn in eqns if _decides_a_live_selection(eqn, eqns, sweep)
              for v in _tested_for_nonfinite(eqn)]
    if tested:
        producer = {o: e for e in eqns for o in e.outvars}
        stack = list(tested)
        while stack:  # a tested value may be non-finite because of any of its ancestors
            v = stack.pop()
            if v in tainted or not isinstance(v, Var) or not L.is_float(v):
                continue
            tainted.add(v)
            e = producer.get(v)
            if e is not None:
                stack.extend(u for u in e.invars if isinstance(u, Var))

    sites: dict[int, Site] = {}
    producer = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    reads: dict = {}
    for e in eqns:
        for v in e.invars:
            if isinstance(v, Var):
                reads[v] = reads.get(v, 0) + 1
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            reads[v] = reads.get(v, 0) + 1
    dropped = DroppedValues(closed, sites, producer, reads, sweep)
    bounds = B.Bounds(eqns, producer, {v: c for v, c in zip(jaxpr.constvars, closed.consts)
                                       if not isinstance(c, jax.core.Tracer)})
    masked: dict[int, list] = {}
    selections: set[int] = set()
    changed: set = set()
    reemit: set[int] = set()
    lanes = ChangedLanes(sweep)
    chain: set[int] = set()
    safe_reads: dict[int, frozenset] = {}
    for i, eqn in enumerate(eqns):
        diff = sweep.diff[i]
        out_kinds = [sweep.kind(o) for o in eqn.outvars]
        has_dropped = any(k == L.Kind.MAYBE and L.is_float(o)
                          for k, o in zip(out_kinds, eqn.outvars))
        known = eqn.primitive in _JAX_PRIMITIVES or L.has_rule(eqn.primitive)
        if not known:
            report.unknown.append(eqn)
        replace: dict[int, float] = {}
        reasons: dict[int, str] = {}
        cut: set[int] = set()
        out_kinds = [sweep.kind(o) for o in eqn.outvars]
        if has_dropped and not eqn.effects:
            op_kinds = L.operand_kinds(eqn, out_kinds, sweep.ctx)
            guard = guard_for(eqn)
            if guard is not None:
                for k, value in guard.safe.items():
                    # a literal operand (`x / 0.`) passes no tangent, but its value does
                    hazard_operand = k < len(eqn.invars) and (
                        diff[k] or isinstance(eqn.invars[k], Literal) and L.is_float(eqn.invars[k]))
                    if hazard_operand and op_kinds[k] != L.Kind.LIVE:
                        if dropped.guard_is_noop(eqn, k, guard.safe):
                            continue  # e.g. div(_, exp(guarded x)): exp(0) = 1 there already
                        if _bounded_into_domain(eqn, k, bounds, tainted):
                            continue  # e.g. rsqrt(mean(d ** 2) + 1e-5): in domain for any d
                        replace[k], reasons[k] = value, "table"
            if eqn.primitive not in LINEAR:
                for k, v in enumerate(eqn.invars):
                    if diff[k] and v in tainted and k not in replace \
                            and op_kinds[k] != L.Kind.LIVE:
                        replace[k], reasons[k] = 0.0, "may be non-finite"
            if eqn.primitive in L.CUSTOM_RULE_CALLS and \
                    any(_contains_hazard(sub) for sub in _sub_jaxprs(eqn)):
                # The user's derivative rule may be singular in dropped lanes, and no safe value
                # is known for it: cut those lanes from differentiation instead.
                for k, v in enumerate(eqn.invars):
                    if diff[k] and k not in replace and op_kinds[k] != L.Kind.LIVE:
                        cut.add(k)
                        reasons[k] = "custom derivative rule"
        if replace or cut:
            sites[i] = Site(eqn, replace, reasons, frozenset(cut))
        if has_dropped and not eqn.effects and eqn.primitive in MASKED_BODIES:
            inner = _masked_body_plans(eqn, out_kinds)
            if inner is not None:
                masked[i] = inner
                report.nested.extend((eqn, p.report) for p in inner if p is not None)
        operand_changed = any(d and isinstance(v, Var) and v in changed
                              for d, v in zip(diff, eqn.invars))
        read_differentiably = any(sweep.kind(o) != L.Kind.DEAD for o in eqn.outvars)
        # Decisions: values read for their value only, computed from changed values.
        touched = [k for k, v in enumerate(eqn.invars)
                   if isinstance(v, Var) and (v in lanes.chain or v in changed)]
        decided_on = [k for k in touched if not diff[k] or eqn.invars[k] in lanes.chain]
        safe_read = False
        if touched and not eqn.effects and eqn.primitive not in NESTED_PARAMS \
                and eqn.primitive not in L.CUSTOM_RULE_CALLS:
            if not read_differentiably and not replace and not cut:
                reach = S.FALSE  # a decision's intermediate value: computed from guarded values
                for k, v in enumerate(eqn.invars):
                    pushed = lanes.pushed(eqn, k, changed) if isinstance(v, Var) else S.FALSE
                    reach = None if reach is None or pushed is None else S.sym_or(reach, pushed)
                chain.add(i)
                lanes.chain.update((o, reach) for o in eqn.outvars)
            elif decided_on and read_differentiably and len(eqn.outvars) == 1 and all(
                    lanes.reads_dropped_only(eqn, k, changed) for k in decided_on):
                safe_reads[i] = frozenset(decided_on)
                safe_read = True
        if (replace or cut or operand_changed or safe_read or i in masked) and not eqn.effects \
                and read_differentiably:
            reemit.add(i)
            # a LIVE output has no dropped lane, so it is bitwise the original: not "changed"
            changed.update(o for o in eqn.outvars
                           if L.is_float(o) and sweep.kind(o) != L.Kind.LIVE)
            if eqn.primitive in (P.max_p, P.min_p, P.clamp_p):
                selections.add(i)  # any changed operand: decide on the original values
        # taint of the outputs, after the guards
        out_tainted = any(isinstance(v, Var) and v in tainted and k not in replace
                          for k, v in enumerate(eqn.invars))
        out_tainted |= any(_literal_taints(eqn, v) for v in eqn.invars)
        out_tainted |= not known
        if eqn.primitive in L.CUSTOM_RULE_CALLS or eqn.primitive in NESTED_PARAMS:
            out_tainted |= any(_contains_hazard(s) for s in _sub_jaxprs(eqn))
        if out_tainted:
            tainted.update(o for o in eqn.outvars if L.is_float(o))

    report.sites = list(sites.values())
    report.selections = [eqns[i] for i in sorted(selections)]
    return Plan(closed, sweep, sites, reemit, selections, nested, masked, report, producer,
                chain, safe_reads)


# --------------------------------------------------------------------------- emission

def _emit(plan: Plan, *args):
    return _emit_masked(plan, [None] * len(plan.closed.jaxpr.outvars), args)


class _Originals:
    """The original program's values, computed on demand: an env for the liveness rules.

    The forward pass computes each value once and shares it with the guarded program. Only a
    value that a guard may change (in its dropped lanes) and that a predicate or another
    non-differentiable use reads gets a second, original copy, computed here when first asked.
    """

    def __init__(self, plan: Plan, args: Sequence[Any]):
        jaxpr = plan.closed.jaxpr
        self.plan = plan
        self.values: dict = dict(zip(jaxpr.constvars, plan.closed.consts))
        self.values.update(zip(jaxpr.invars, args))

    def __getitem__(self, v) -> Any:
        if isinstance(v, Literal):
            return L.literal_value(v)
        if v in self.values:
            return self.values[v]
        eqns, producer = self.plan.closed.jaxpr.eqns, self.plan.producer
        todo: set[int] = set()
        stack = [v]
        while stack:  # iterative: chains can be long
            u = stack.pop()
            if isinstance(u, Literal) or u in self.values or producer[u] in todo:
                continue
            todo.add(producer[u])
            stack.extend(eqns[producer[u]].invars)
        for i in sorted(todo):
            eqn = eqns[i]
            outs = bind_eqn(eqn, [self[u] for u in eqn.invars], self.plan.nested.get(i))
            self.values.update(zip(eqn.outvars, outs))
        return self.values[v]


def _emit_masked(plan: Plan, out_masks: Sequence[L.Mask], args: Sequence[Any]) -> list:
    with M.mask_scope():  # one trace: the masks' bookkeeping must not outlive it
        return _emit_masked_in_scope(plan, out_masks, args)


def _emit_masked_in_scope(plan: Plan, out_masks: Sequence[L.Mask], args: Sequence[Any]) -> list:
    jaxpr = plan.closed.jaxpr
    sweep = plan.sweep
    orig = _Originals(plan, args)
    safe: dict = {}  # the guarded program's values, where its derivative path differs
    masks: list = []

    def mask_of(v) -> L.Mask:
        if not masks:  # one backward sweep, the first time a guard needs a mask
            masks.append(sweep.masks(orig, list(out_masks)))
        return masks[0](v)

    for i, eqn in enumerate(jaxpr.eqns):
        diff = sweep.diff[i]
        # A guarded value with no dropped lane is the original value itself (same tracer):
        # equations that read only such values are computed once, for both programs.
        # Operands read as guarded: differentiable ones, and decisions the plan allows.
        as_guarded = [isinstance(v, Var) and v in safe and
                      (d or i in plan.chain or k in plan.safe_reads.get(i, ()))
                      for k, (d, v) in enumerate(zip(diff, eqn.invars))]
        shared = all(not g or safe[v] is orig.values.get(v)
                     for g, v in zip(as_guarded, eqn.invars))
        if i not in plan.reemit and shared:
            if eqn.outvars and all(o in orig.values for o in eqn.outvars):
                continue  # already computed for a decision
            outs = bind_eqn(eqn, [orig[v] for v in eqn.invars], plan.nested.get(i))
            orig.values.update(zip(eqn.outvars, outs))
            continue
        originals = L.LazyOperands(orig, eqn.invars)  # read only by the decision rules
        invals = [safe[v] if g else orig[v] for g, v in zip(as_guarded, eqn.invars)]
        site = plan.sites.get(i)
        if site is not None:
            in_masks = L.operand_masks(eqn, [mask_of(o) for o in eqn.outvars], originals,
                                       sweep.ctx)
            for k, value in site.replace.items():
                live, operand = in_masks[k], invals[k]
                out_shape = L._shape(eqn.outvars[0])
                if isinstance(eqn.invars[k], Literal) and np.shape(operand) != out_shape \
                        and _is_elementwise(eqn):
                    # a literal (`x / 0.`): guarded lane by lane, at the output's shape. Other
                    # broadcast operands keep their shape (live where any lane they feed is): XLA
                    # divides by a broadcast row as by its reciprocal, so a full-shape divisor
                    # would change the live lanes' last bit.
                    live = mask_of(eqn.outvars[0])
                    if live is not None:
                        operand = M.broadcast(operand, out_shape)
                if live is not None:
                    invals[k] = lax.select_n(live, lax.full_like(operand, value), operand)
            for k in site.cut:
                live = in_masks[k]
                if live is not None:
                    invals[k] = lax.select_n(live, lax.stop_gradient(invals[k]), invals[k])
        if i in plan.masked:
            outs = _emit_masked_body(eqn, plan.masked[i], invals,
                                     [mask_of(o) for o in eqn.outvars], plan.nested.get(i))
        elif i in plan.selections:
            out = bind_eqn(eqn, invals)[0]
            cases = [out] + [M.broadcast(lax.convert_element_type(x, out.dtype), out.shape)
                             for x in invals]
            outs = [lax.select_n(L.winner(eqn, originals), *cases)]
        else:
            outs = bind_eqn(eqn, invals, plan.nested.get(i))
        for o, val in zip(eqn.outvars, outs):
            if L.is_float(o) or i in plan.chain:
                safe[o] = val
                if sweep.kind(o) == L.Kind.LIVE:  # no dropped lane: bitwise the original
                    orig.values.setdefault(o, val)
            elif shared and site is None:  # an index or predicate from original values only
                orig.values.setdefault(o, val)
            else:
                safe[o] = val
    return [safe[v] if isinstance(v, Var) and v in safe else orig[v] for v in jaxpr.outvars]


# --------------------------------------------------------------------------- masked bodies
# A body whose outputs the surrounding program drops in places: rewritten with those output
# masks as extra inputs and staged again through the public API (jax.checkpoint, lax.switch,
# lax.scan), so the structure stays and no params are edited by hand.

def _body_out_kinds(kinds: Sequence[L.Kind]) -> list[L.Kind]:
    return [L.Kind.LIVE if k == L.Kind.LIVE else L.Kind.MAYBE for k in kinds]


def _plan_if_changed(closed: ClosedJaxpr, out_kinds) -> Plan | None:
    plan = make_plan(flatten(closed), out_kinds)
    return plan if plan.report.changed else None


def _masked_body_plans(eqn: JaxprEqn, out_kinds: Sequence[L.Kind]) -> list | None:
    prim, params = eqn.primitive, eqn.params
    kinds = _body_out_kinds(out_kinds)
    if prim is P.remat_p:
        plans = [_plan_if_changed(ClosedJaxpr(params["jaxpr"], ()), kinds)]
    elif prim is P.cond_p:
        plans = [_plan_if_changed(br, kinds) for br in params["branches"]]
    else:  # scan: the stacked outputs' masks are sliced per step; carries stay live
        n_carry = params["num_carry"]
        kinds = [L.Kind.LIVE] * n_carry + kinds[n_carry:]
        if all(k == L.Kind.LIVE for k in kinds):
            return None
        plans = [_plan_if_changed(params["jaxpr"], kinds)]
    return plans if any(p is not None for p in plans) else None


def _body_fn(plan: Plan | None, closed: ClosedJaxpr):
    if plan is None:
        return lambda args, masks: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    return lambda args, masks: _emit_masked(plan, masks, args)


def _emit_masked_body(eqn: JaxprEqn, plans: list, invals: list, out_masks: list,
                      nested_params: dict | None) -> list:
    prim = eqn.primitive
    params = nested_params or eqn.params
    if prim is P.remat_p:
        fn = _body_fn(plans[0], ClosedJaxpr(params["jaxpr"], ()))
        return list(jax.checkpoint(fn, prevent_cse=params["prevent_cse"],
                                   policy=params["policy"])(invals, out_masks))
    if prim is P.cond_p:
        fns = [_body_fn(p, br) for p, br in zip(plans, params["branches"])]
        return list(lax.switch(invals[0], fns, invals[1:], out_masks))
    # scan
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, init, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                        invals[n_consts + n_carry:])
    fn = _body_fn(plans[0], params["jaxpr"])

    def body(carry, x_and_masks):
        x, masks = x_and_masks
        outs = fn([*consts, *carry, *x], [None] * n_carry + list(masks))
        return outs[:n_carry], outs[n_carry:]

    carry, ys = lax.scan(body, list(init), (list(xs), list(out_masks[n_carry:])),
                         length=params["length"], reverse=params["reverse"],
                         unroll=params["unroll"])
    return [*carry, *ys]


def rewrite_with_report(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, Report]:
    """Rewrite `closed`; returns it unchanged (the same object) when nothing needs a guard."""
    if gc.isenabled():  # the rewrite makes many small objects and frees none: skip the scans
        gc.disable()
        try:
            return rewrite_with_report(closed)
        finally:
            gc.enable()
    # Planned on the program without its unused results: a guard that only they would need
    # (a scan's unused stacked output) is not planned, and the original comes back unchanged.
    flat = dce(flatten(closed))
    plan = make_plan(flat)
    if not plan.report.changed:
        return closed, plan.report
    avals = [v.aval for v in closed.jaxpr.invars]
    new = dce(trace_to_jaxpr(partial(_emit, plan), avals))
    return new, plan.report


def rewrite(closed: ClosedJaxpr) -> ClosedJaxpr:
    return rewrite_with_report(closed)[0]
