"""Every JAX-version-sensitive name jaxsafe uses, in one place.

jaxsafe works on public APIs (`jax.make_jaxpr`, `jax.extend.core`, `jax.core.eval_jaxpr`).
Three things have no public spelling in JAX 0.10; they are imported here, each with its reason,
so that a JAX upgrade breaks in this file only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax
from jax.extend import core as jex

# `dce_jaxpr` is JAX's own dead-code pass. The rewrite emits the original program, the mask
# computation and the guarded shadow, and relies on DCE to drop what the shadow made unused.
# There is no public DCE in jax 0.10.
from jax._src.interpreters.partial_eval import dce_jaxpr as _dce_jaxpr

# `source_info_util` carries the user's traceback onto re-emitted equations (so diagnostics
# and error messages keep naming the user's source line) and summarizes it as "file:line".
from jax._src import source_info_util as _source_info_util

Jaxpr = jex.Jaxpr
ClosedJaxpr = jex.ClosedJaxpr
JaxprEqn = jex.JaxprEqn
Literal = jex.Literal
Var = jex.Var
DropVar = jex.DropVar
Primitive = jex.Primitive
primitives = jex.primitives


def dce(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Drop equations whose results are unused (effects are kept)."""
    jaxpr = closed.jaxpr
    new_jaxpr, used_inputs = _dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    assert all(used_inputs)
    return ClosedJaxpr(new_jaxpr, closed.consts)


def source_summary(eqn: JaxprEqn) -> str:
    """'file:line (function)' of the user code that emitted `eqn`, or 'unknown'."""
    try:
        summary = _source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - best effort only
        summary = ""
    return summary or "(inside JAX, no user frame)"


def eqn_context(eqn: JaxprEqn) -> contextlib.AbstractContextManager:
    """Context that makes re-emitted equations keep `eqn`'s source info and name stack."""
    stack = contextlib.ExitStack()
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack.enter_context(
        _source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack))
    stack.enter_context(eqn.ctx.manager)
    return stack


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Bind `eqn`'s primitive on `invals` (as `jax.core.eval_jaxpr` does); always a list."""
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)
    with eqn_context(eqn):
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def trace_to_jaxpr(fun, avals: Sequence[Any]) -> ClosedJaxpr:
    """`jax.make_jaxpr` over abstract values (avals keep weak_type, ShapeDtypeStruct would not)."""
    return jax.make_jaxpr(fun)(*avals)
