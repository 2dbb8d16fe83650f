"""The inlining pass: every `jit` and `closed_call` replaced by its body, every scalar constant by
a literal, and every selection on a predicate computed from literals by the case it takes. A
`cond` on an index that is one value wherever an XLA program runs (`platform_index` with only
Pallas kernel platforms besides the default: `jnp.diagonal`) is its default case.

A jit boundary changes no value, and `jnp.where` is itself a `jit`: the hazard and the drop
usually sit on opposite sides of one, so liveness and guards must cross it. Which primitives are
inlined is a fact of their row (`PrimitiveRule.inline`). A scalar the program closes over
(`jnp.float32(2.)`, a parameter made with `jnp.array`) is a constant JAX did not make a literal;
as one, the rules read its value where they read a literal's (`r / sigma` with a positive
`sigma` divides by no zero: jax-md's Lennard-Jones energy keeps 234 equations instead of 340).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._atoms import dtype_of, literal_value, shape_of
from ._compat import (
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Tracer,
    Var,
    is_user_filename,
)
from ._constants import small_constant
from ._nested import call_jaxpr
from ._rules import rule_for
from ._walk import demand


def _has_inlinable(jaxpr: Jaxpr) -> bool:
    return any(rule_for(e.primitive).inline or rule_for(e.primitive).case_body is not None
               for e in jaxpr.eqns)


def _inlined_body(eqn: JaxprEqn, invars: list, produced: dict) -> tuple[ClosedJaxpr, list] | None:
    """The body an equation inlines and its operands: a call's, or the case a choice by an
    index fixed wherever the program runs takes (`jnp.diagonal`'s default case); else None."""
    rule = rule_for(eqn.primitive)
    if rule.inline:
        return call_jaxpr(eqn), invars
    if rule.case_body is None or not isinstance(invars[0], Var):
        return None
    source = produced.get(invars[0])
    if source is None:
        return None
    fixed = rule_for(source.primitive).fixed_index
    index = None if fixed is None else fixed(source)
    return None if index is None else (rule.case_body(eqn, index), invars[1:])


def _sub_atom(sub: dict, a: Any) -> Any:
    return sub.get(a, a) if isinstance(a, Var) else a


def _user_body(jaxpr: Jaxpr) -> bool:
    """Whether a call's body is a function of the user's files (unknown: counted as one)."""
    where = getattr(jaxpr.debug_info, "func_src_info", None)
    if not where or " at " not in where:
        return True
    return bool(is_user_filename(where.rsplit(" at ", 1)[1].rsplit(":", 1)[0]))


def flatten(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same program with every inlinable call inlined (at any depth); `closed` itself when
    it has none.

    Built by copying equations with renamed variables, not by tracing again: nothing is
    re-evaluated, and every equation keeps its source info, except in the body of a library's
    call (`jnp.where`, `jnp.nan_to_num`: functions outside the user's files), whose equations
    take the call's traceback: JAX caches such a body, so its own traceback is that of the first
    trace, at whatever line made it. Iterative: jit chains can be deep.
    """
    if not _has_inlinable(closed.jaxpr):
        return closed
    constvars, consts = list(closed.jaxpr.constvars), list(closed.consts)
    eqns: list[JaxprEqn] = []
    top_sub: dict = {}
    produced: dict = {}  # an emitted variable -> its equation (a case's index)
    # frames: (jaxpr, substitution, rename outputs?, equation iterator, the call being inlined,
    # the traceback its equations take: None, their own)
    stack: list[tuple[Jaxpr, dict, bool, Any, Any, Any]] = [
        (closed.jaxpr, top_sub, False, iter(closed.jaxpr.eqns), None, None)]
    while stack:
        jaxpr, sub, fresh, it, call, traceback = stack[-1]
        eqn = next(it, None)
        if eqn is None:
            stack.pop()
            if call is not None:  # the call's outputs are the body's results
                outer_sub, outer_eqn = call
                for o, a in zip(outer_eqn.outvars, jaxpr.outvars, strict=True):
                    outer_sub[o] = _sub_atom(sub, a)
            continue
        invars = [_sub_atom(sub, v) for v in eqn.invars]
        if traceback is not None:
            eqn = eqn.replace(source_info=eqn.source_info.replace(traceback=traceback))
        inlined = _inlined_body(eqn, invars, produced)
        if inlined is not None:
            inner, invars = inlined
            inner_sub: dict = {}
            for cv, c in zip(inner.jaxpr.constvars, inner.consts, strict=True):
                inner_sub[cv] = new_var = Var(cv.aval)
                constvars.append(new_var)
                consts.append(c)
            inner_sub.update(zip(inner.jaxpr.invars, invars, strict=True))
            inner_traceback = None if _user_body(inner.jaxpr) else eqn.source_info.traceback
            stack.append((inner.jaxpr, inner_sub, True, iter(inner.jaxpr.eqns), (sub, eqn),
                          inner_traceback))
            continue
        outvars = list(eqn.outvars)
        if fresh:  # a body inlined more than once must not reuse its variables
            outvars = [DropVar(o.aval) if isinstance(o, DropVar) else Var(o.aval)
                       for o in eqn.outvars]
            sub.update(zip(eqn.outvars, outvars, strict=True))
        eqns.append(eqn.replace(invars=invars, outvars=outvars))
        produced.update((o, eqns[-1]) for o in outvars)
    outvars = [_sub_atom(top_sub, v) for v in closed.jaxpr.outvars]
    jaxpr = Jaxpr(constvars, closed.jaxpr.invars, outvars, eqns, closed.jaxpr.effects,
                  closed.jaxpr.debug_info)
    return ClosedJaxpr(jaxpr, consts)


def _scalar_value(const: Any) -> Any:
    """A concrete numeric scalar constant's value as a NumPy scalar; None for anything else (an
    array, a tracer, a PRNG key)."""
    if isinstance(const, Tracer) or np.shape(const) != ():
        return None
    dtype = getattr(const, "dtype", None)
    if dtype is None or not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
        return None
    return np.asarray(const)[()]


def inline_scalar_constants(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same program with each concrete scalar constant replaced by a literal of its value
    (in its equations' operands and its outputs); `closed` itself when it has none."""
    literals = {}
    for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
        value = _scalar_value(c)
        if value is not None:
            literals[v] = Literal(value, v.aval)
    if not literals:
        return closed
    jaxpr = closed.jaxpr
    kept = [(v, c) for v, c in zip(jaxpr.constvars, closed.consts, strict=True)
            if v not in literals]
    eqns = [e.replace(invars=[_sub_atom(literals, a) for a in e.invars])
            if any(isinstance(a, Var) and a in literals for a in e.invars) else e
            for e in jaxpr.eqns]
    outvars = [_sub_atom(literals, a) for a in jaxpr.outvars]
    new = Jaxpr([v for v, _ in kept], jaxpr.invars, outvars, eqns, jaxpr.effects,
                jaxpr.debug_info)
    return ClosedJaxpr(new, [c for _, c in kept])


def take_constant_selections(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same program with each `select_n` whose predicate it computes from literals alone,
    one case in every lane, replaced by that case: `jnp.std`'s `where(n - ddof > 0, var, nan)`
    with a static `ddof` takes `var`, and the untaken `nan` is no lane of anything (a select
    of a constant predicate gives the taken case bit for bit). `closed` itself when there is
    none."""
    jaxpr = closed.jaxpr
    constants = _Constants()
    taken: dict = {}  # a selection's output -> the case it takes
    # what an input or a constant reaches: an untaken case that does carries a derivative (a
    # zero cotangent meets its partials: a dropped value the analysis must see), and stays
    reached = set(jaxpr.invars) | set(jaxpr.constvars)
    eqns = []
    for eqn in jaxpr.eqns:
        if taken:
            eqn = eqn.replace(invars=[_sub_atom(taken, a) for a in eqn.invars])
        rule = rule_for(eqn.primitive)
        if rule.selection is not None and rule.selection.by_predicate \
                and not (isinstance(eqn.invars[0], Var) and eqn.invars[0] in reached):
            which = constants.value(eqn.invars[0])
            case = None if which is None else _constant_case(eqn, which, reached)
            if case is not None:
                taken[eqn.outvars[0]] = case
                continue
        if any(isinstance(a, Var) and a in reached for a in eqn.invars):
            reached.update(eqn.outvars)
        constants.produced(eqn)
        eqns.append(eqn)
    if not taken:
        return closed
    outvars = [_sub_atom(taken, a) for a in jaxpr.outvars]
    return ClosedJaxpr(Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, eqns, jaxpr.effects,
                             jaxpr.debug_info), closed.consts)


class _Constants:
    """Small values a program computes from literals alone, folded on demand (a selection's
    predicate only: folding binds the primitive, which a sharded value may refuse)."""

    def __init__(self):
        self.producer: dict = {}
        self.memo: dict = {}

    def produced(self, eqn: JaxprEqn) -> None:
        if len(eqn.outvars) == 1:
            self.producer[eqn.outvars[0]] = eqn

    def value(self, atom: Any) -> np.ndarray | None:
        if isinstance(atom, Literal):
            return np.asarray(literal_value(atom))
        return demand(atom, self.memo, self._fold)

    def _fold(self, v: Any) -> Generator[Any, Any, Any]:
        return small_constant(self.producer.get(v))


def _constant_case(eqn: JaxprEqn, which: np.ndarray, reached: set) -> Any:
    """The case a `select_n` takes in every lane, when `which` (its predicate's value) is one
    index throughout, that case is the output (same shape and dtype) and no other case is
    `reached` from an input, else None."""
    if which.size == 0 or not np.all(which == which.reshape(-1)[0]):
        return None
    k = int(which.reshape(-1)[0]) + 1
    if not 1 <= k < len(eqn.invars) or any(
            isinstance(a, Var) and a in reached
            for j, a in enumerate(eqn.invars[1:], 1) if j != k):
        return None
    case, out = eqn.invars[k], eqn.outvars[0]
    if not isinstance(case, Var) or shape_of(case) != shape_of(out) \
            or dtype_of(case) != dtype_of(out) or isinstance(out, DropVar):
        return None
    return case
