"""Reading the jaxprs an equation holds in its parameters (calls, bodies, branches)."""

from __future__ import annotations

from collections.abc import Callable

from ._compat import ClosedJaxpr, Jaxpr, JaxprEqn


def call_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr:
    """The body of a call-like equation (`jit`, `closed_call`, `remat`, custom rule calls)."""
    params = eqn.params
    inner = params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]
    return inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())


def branch_jaxpr(eqn: JaxprEqn, i: int) -> ClosedJaxpr:
    """A `cond`'s branch `i` (clamped into range, as `cond` clamps its index)."""
    branches = eqn.params["branches"]
    return branches[min(max(i, 0), len(branches) - 1)]


KERNEL_PLATFORMS = frozenset({"mosaic", "mosaic_gpu", "triton"})
"""The platforms `lax.platform_dependent` may name that only a Pallas kernel lowers to: a
program run through XLA (jaxsafe's rewrite) never takes their cases."""


def default_platform_case(eqn: JaxprEqn) -> int | None:
    """`platform_index`: the default case, where every other case is for kernel platforms only
    (`jnp.diagonal`: `mosaic=`, `default=`); else None (a case for `cpu` or `tpu` is decided
    when the program is lowered, for a platform jaxsafe does not know when it plans)."""
    platforms = eqn.params.get("platforms")
    if not isinstance(platforms, tuple) or platforms.count(None) != 1 or not all(
            p is None or set(p) <= KERNEL_PLATFORMS for p in platforms):
        return None
    return platforms.index(None)


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
