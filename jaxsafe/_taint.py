"""Values that may be non-finite where no guard put it: the taint analysis.

A value guard protects a primitive from its own singularities. A value that already holds NaN or
inf in a dropped lane is a second hazard: a non-linear equation (`mul`, `pow`, ...) multiplies
the zero cotangent of that lane by it. Such values are *tainted*:

- NaN/inf literals and constants (except as the identity of their primitive, `max(-inf, x)`);
- values the program itself tests for NaN or inf, where the test decides a live selection, and
  the values they are computed from;
- the outputs of unknown primitives, and of bodies that contain a NaN-prone primitive;

and everything computed from them that no guard has cleaned (the guard pass, `_sites.py`,
carries the taint forward, since a guard cleans it).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ._atoms import is_float, is_nonfinite_literal
from ._bodies import sub_jaxprs
from ._compat import ClosedJaxpr, JaxprEqn, Tracer, Var
from ._liveness import Sweep
from ._rules import Kind, rule_for


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
    """Whether a constant of the program holds NaN or inf (a tracer closed over: unknown,
    treated like an argument)."""
    if isinstance(value, Tracer):
        return False
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        value = np.asarray(value)
        dtype = value.dtype
    if not jnp.issubdtype(dtype, jnp.inexact):  # PRNG keys and other extended dtypes too
        return False
    return not bool(np.all(np.isfinite(np.asarray(value))))


def contains_hazard(closed: ClosedJaxpr) -> bool:
    """Whether a body can make NaN/inf from finite inputs, at any depth."""
    stack = [closed]
    while stack:
        for eqn in stack.pop().jaxpr.eqns:
            rule = rule_for(eqn.primitive)
            if rule.guard is not None or not rule.known:
                return True
            if any(literal_taints(eqn, v) for v in eqn.invars):
                return True
            stack.extend(sub_jaxprs(eqn))
    return False


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


def nonfinite_seeds(closed: ClosedJaxpr, sweep: Sweep) -> set:
    """The taint pass's seeds: non-finite constants, and values the program tests for NaN/inf
    where the test decides a live selection, with the values they are computed from.

    `logsumexp` tests its max with isfinite only to feed stop_gradient: that says nothing about
    which values may be non-finite where it matters.
    """
    jaxpr = closed.jaxpr
    tainted = {v for v, c in zip(jaxpr.constvars, closed.consts, strict=True)
               if may_be_nonfinite_const(c)}
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
    while stack:  # a tested value may be non-finite because of any of its ancestors
        v = stack.pop()
        if v in tainted or not isinstance(v, Var) or not is_float(v):
            continue
        tainted.add(v)
        producer = sweep.producer_of(v)
        if producer is not None:
            stack.extend(u for u in producer.invars if isinstance(u, Var))
    return tainted
