"""Reading the jaxprs an equation holds in its parameters (calls, bodies, branches)."""

from __future__ import annotations

from collections.abc import Callable

from ._compat import ClosedJaxpr, Jaxpr, JaxprEqn


def call_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr:
    """The body of a call-like equation (`jit`, `closed_call`, `remat`, custom rule calls)."""
    params = eqn.params
    inner = params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]
    return inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())


def sub_jaxprs(eqn: JaxprEqn) -> list[ClosedJaxpr]:
    """Every jaxpr in `eqn`'s parameters, closed."""
    out = []
    for value in eqn.params.values():
        for item in (value if isinstance(value, tuple | list) else (value,)):
            if isinstance(item, ClosedJaxpr):
                out.append(item)
            elif isinstance(item, Jaxpr):
                out.append(_closed(item))
    return out


def _closed(jaxpr: Jaxpr) -> ClosedJaxpr:
    """An open body as a closed one to read its equations; its constants, whose values the
    equation does not hold (lineax's `linear_solve` keeps such a body), read as arguments."""
    if jaxpr.constvars:
        jaxpr = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars],
                              debug_info=jaxpr.debug_info._replace(arg_names=None))
    return ClosedJaxpr(jaxpr, ())


def any_equation(closed: ClosedJaxpr, test: Callable[[JaxprEqn], bool]) -> bool:
    """Whether `test` holds for an equation of `closed`, at any depth (iterative)."""
    stack = [closed]
    while stack:
        for eqn in stack.pop().jaxpr.eqns:
            if test(eqn):
                return True
            stack.extend(sub_jaxprs(eqn))
    return False


def count_equations(closed: ClosedJaxpr) -> int:
    """Equations of `closed`, those of the jaxprs in their parameters included (iterative)."""
    count, stack = 0, [closed]
    while stack:
        for eqn in stack.pop().jaxpr.eqns:
            count += 1
            stack.extend(sub_jaxprs(eqn))
    return count
