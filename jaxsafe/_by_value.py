"""Tracing with the values in hand: a jaxpr for a program whose shapes depend on its data.

`jax.make_jaxpr` traces with abstract shapes, so `x[mask]`, `jnp.nonzero(m)` without `size=`
and `jnp.unique` cannot be traced. When the call is eager, the values are known: a value tracer
carries each intermediate's concrete value next to its staged tracer, so that JAX's own
`concrete_or_error` (the `size` of a boolean index, a Python `if` on a value) reads the value,
while every primitive is also recorded in the jaxpr. The jaxpr is then exact for these
arguments: a boolean index becomes a gather at `jnp.nonzero(mask, size=n)`, with `n` this call's
count, and nan_safe rewrites it like any other program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._compat import (
    ClosedJaxpr,
    ConcretizationTypeError,
    Trace,
    Tracer,
    concrete_value,
    eval_context,
    init_tracer,
    reset_stores,
    set_current_trace,
    take_current_trace,
    with_aval_property,
)


@with_aval_property(lambda tracer: jax.typeof(tracer.staged))
class _ValueTracer(Tracer):
    """An intermediate with both its concrete value and its tracer in the jaxpr being built."""

    __slots__ = ("value", "staged", "differentiated")

    def __init__(self, trace: _ValueTrace, value: Any, staged: Any, differentiated: bool):
        init_tracer(self, trace, jax.typeof(staged))
        self.value = value
        self.staged = staged
        self.differentiated = differentiated

    def _constant_would_cut(self) -> bool:
        """A float that depends on a differentiated argument: as a constant in the jaxpr its
        derivative would be silently lost (eager `jax.grad` of `jnp.unique(x)` is 0 for that
        reason), so its value is refused and JAX raises its ConcretizationTypeError."""
        return self.differentiated and jax.numpy.issubdtype(jax.typeof(self.staged).dtype,
                                                            jax.numpy.inexact)

    def to_concrete_value(self):
        return None if self._constant_would_cut() else self.value

    def full_lower(self):
        return self

    def __array__(self, *args, **kwargs):  # type: ignore[override]  # pyright: ignore[reportIncompatibleMethodOverride]
        # NumPy on a boolean or integer value (JAX expands a boolean index with np.where): it
        # carries no derivative, so the jaxpr may hold it as a constant, as eager JAX does. A
        # differentiated float keeps JAX's error.
        if self._constant_would_cut():
            return super().__array__(*args, **kwargs)
        return np.asarray(self.value, *args, **kwargs)


class _ValueTrace(Trace):
    """Every primitive runs twice: eagerly on the values, staged on the tracers."""

    def __init__(self, parent: Any):
        super().__init__()
        self.parent = parent
        self.requires_low = False

    def pair(self, x: Any) -> tuple[Any, Any]:
        """(value, staged) of an operand: constants and outer concrete tracers are both."""
        if isinstance(x, _ValueTracer) and x._trace is self:
            return x.value, x.staged
        return concrete_value(x), x

    def split(self, tracers: Sequence[Any]) -> tuple[tuple, tuple, bool]:
        """Operands' values, staged operands, and whether any depends on a differentiated
        argument (an outer tracer closed over counts as one)."""
        differentiated = any(x.differentiated if isinstance(x, _ValueTracer) and x._trace is self
                             else isinstance(x, Tracer) for x in tracers)
        values, staged = zip(*map(self.pair, tracers), strict=True) if tracers else ((), ())
        return values, staged, differentiated

    def wrap(self, values: Sequence[Any], staged: Sequence[Any],
             differentiated: bool) -> list[_ValueTracer]:
        return [_ValueTracer(self, v, s, differentiated)
                for v, s in zip(values, staged, strict=True)]

    def stage_value(self, val):
        (value,), (staged,), differentiated = self.split([val])
        return _ValueTracer(self, value, self.parent.stage_value(staged), differentiated)

    def process_primitive(self, primitive, tracers, params, /):
        values, staged, differentiated = self.split(tracers)
        # Eagerly on the values. JAX >= 0.12 binds with no current trace while a trace processes
        # a primitive (earlier releases left the eval trace current): name it.
        with eval_context():
            out_values = primitive.bind(*values, **params)
        with set_current_trace(self.parent):
            out_staged = primitive.bind(*staged, **params)
        if primitive.multiple_results:
            return self.wrap(out_values, out_staged, differentiated)
        return _ValueTracer(self, out_values, out_staged, differentiated)

    def process_call(self, primitive, f, tracers, params, /):
        with set_current_trace(self):  # a call primitive: inline its body
            return f.call_wrapped(*tracers)

    def process_custom_jvp_call(self, primitive, fun, jvp, tracers, /, *, symbolic_zeros):
        # Staged as a custom_jvp_call, so the rule is kept; its body then runs once more on the
        # values (a shape that depends on data inside a custom_jvp body is not supported).
        values, staged, differentiated = self.split(tracers)
        out_staged = self.parent.process_custom_jvp_call(
            primitive, fun, jvp, staged, symbolic_zeros=symbolic_zeros)
        reset_stores(fun)
        with eval_context():
            out_values = fun.call_wrapped(*values)
        return self.wrap(out_values, out_staged, differentiated)

    def process_custom_vjp_call(self, primitive, fun, fwd, bwd, tracers, /, *, out_trees,
                                symbolic_zeros):
        values, staged, differentiated = self.split(tracers)
        out_staged = self.parent.process_custom_vjp_call(
            primitive, fun, fwd, bwd, staged, out_trees=out_trees,
            symbolic_zeros=symbolic_zeros)
        reset_stores(fun)
        with eval_context():
            out_values = fun.call_wrapped(*values)
        return self.wrap(out_values, out_staged, differentiated)


def concrete_values(leaves: Sequence[Any]) -> list[Any] | None:
    """The leaves' concrete values (an eager call, or the primals of an eager jax.grad), or
    None where any is abstract (under jit or vmap, a ShapeDtypeStruct)."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return None
    try:
        return [concrete_value(x) for x in leaves]
    except ConcretizationTypeError:
        return None


def make_jaxpr_by_value(flat_fun: Callable, values: Sequence[Any],
                        differentiated: Sequence[bool]) -> tuple[ClosedJaxpr, Any]:
    """`jax.make_jaxpr(flat_fun, return_shape=True)` at these values: shapes that depend on the
    data take this call's, so the jaxpr holds for these values (and any with the same counts).
    `differentiated[i]`: argument i is a tracer of an outer transformation (eager jax.grad)."""

    def staged_fun(*staged):
        with take_current_trace() as parent:
            trace = _ValueTrace(parent)
        tracers = [_ValueTracer(trace, v, s, d)
                   for v, s, d in zip(values, staged, differentiated, strict=True)]
        with set_current_trace(trace):
            outs = flat_fun(*tracers)
        leaves, tree = jax.tree_util.tree_flatten(outs)
        leaves = [trace.pair(x)[1] for x in leaves]
        trace.invalidate()
        return jax.tree_util.tree_unflatten(tree, leaves)

    avals = [jax.typeof(v) for v in values]
    return jax.make_jaxpr(staged_fun, return_shape=True)(*avals)
