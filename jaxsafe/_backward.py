"""The structural-zero pass: backward rules that JAX calls, made safe where a drop wrote zeros.

A `custom_vjp`'s backward rule is the user's (or a library's) Python: equinox's checkpointed
while loop, which diffrax solves run in, re-traces its loop body there and differentiates it with
`jax.vjp`. The rewritten primal program never reaches that code, so a `jnp.where` inside it leaks
as in plain JAX: the transpose of the `where` hands the untaken branch a zero cotangent, and
`0 * inf` from the branch's `sqrt` makes NaN.

The pass runs where JAX transposes the rewritten program: each such call's `bwd` is wrapped
(`guarded_backward`), and when JAX calls it, the program it makes is traced with
`jax.make_jaxpr` and evaluated again by an interpreter that follows *structural zeros* (the
lanes that hold 0 whatever cotangent the rule is handed: what a drop's transpose writes,
`_zero_lanes.py`). Wherever a product (or a quotient's numerator) has a structurally zero
factor, the other operands read 1 there (the double where's inner half), so the output is that
zero and `0 * inf` never happens. A live lane's cotangent is never a structural zero (it
depends on the cotangent handed in), so real singularities stay: an inf that reaches a live
lane is kept.

It runs only on the calls whose body can make NaN or inf (or that take a value that may hold
them); bodies (`while`, `scan`, `cond`) are guarded on their own, their inputs counted as not
zero. The guarded program keeps the rule's values; its own derivative (`jax.hessian`'s forward
over reverse, or reverse over reverse) is that of its jaxsafe rewrite, which guards the lanes
the new selections drop.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from ._atoms import is_float, literal_value, shape_of
from ._compat import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    SymbolicZero,
    Tracer,
    bind_eqn,
    eval_jaxpr,
    trace_to_jaxpr,
    wrap_function,
)
from ._custom_rules import one_lane_shape
from ._masks import broadcast, materialize, not_mask
from ._nested import call_jaxpr
from ._rules import rule_for
from ._zero_lanes import ZeroMask, as_array, union

_DROPPED_COTANGENTS: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "jaxsafe_dropped_cotangents", default=None)
"""The structural zeros of the cotangents that the next guarded backward rule JAX calls is
handed (one boolean array or None per output of its call), set by `SeededBackward` around the
pullback that calls it, taken (and cleared) by that rule."""


def guarded_backward(bwd: Any, runner: Callable[[ClosedJaxpr], Callable[..., list]]) -> Any:
    """`bwd` (a custom_vjp's backward rule as JAX binds it) with the structural-zero pass run on
    the program it makes, each time JAX calls it. `runner` (jaxsafe's rewrite) makes the guarded
    program a function whose own derivative (reverse over reverse) is safe too."""
    def run(*args: Any) -> list:
        seeds = _DROPPED_COTANGENTS.get()
        if seeds is not None:  # this call's; a rule that the rule calls gets none
            _DROPPED_COTANGENTS.set(None)
        # arrays are traced; anything else (a symbolic zero, a Python flag) is handed on as is
        traced = [k for k, a in enumerate(args) if isinstance(a, Tracer | jax.Array | np.ndarray)]
        seeded = _seeded_inputs(args, traced, seeds)
        symbolic: dict[int, Any] = {}

        def staged(*xs: Any) -> list:
            full = list(args)
            for k, x in zip(traced, xs, strict=True):
                full[k] = x
            outs = list(bwd.call_wrapped(*full))
            symbolic.update((k, o) for k, o in enumerate(outs) if isinstance(o, SymbolicZero))
            return [o for o in outs if not isinstance(o, SymbolicZero)]

        closed = trace_to_jaxpr(staged, [jax.typeof(args[k]) for k in traced])
        # the rule's own drops (a `where` written in it) too: a derivative of this derivative
        # differentiates the program (`runner` is the program itself when nothing is guarded);
        # the dropped lanes of the cotangents it is handed are its inputs' structural zeros
        run_guarded = runner(structural_zeros(closed, [jax.typeof(m) for m in seeded.values()],
                                              list(seeded)))
        values = iter(run_guarded(*[args[k] for k in traced], *seeded.values()))
        count = len(closed.jaxpr.outvars) + len(symbolic)
        return [symbolic[k] if k in symbolic else next(values) for k in range(count)]
    return wrap_function(run, bwd)


def guarded_forward(thunk: Any, runner: Callable[[ClosedJaxpr], Callable[..., list]]) -> Any:
    """A custom_vjp's forward-program thunk (`fwd_jaxpr_thunk`) whose program is differentiated
    as its jaxsafe rewrite: JAX evaluates that program when it differentiates the call, and a
    derivative of that derivative (reverse over reverse) differentiates it as plain code, where
    a `where` in the forward rule leaks as in plain JAX. Its values stay the program's own
    (`runner`). Made once per set of symbolic-zero flags, as JAX's own thunk is."""
    made: dict[tuple, tuple] = {}

    def make(*nonzeros: Any) -> tuple:
        key = tuple(nonzeros)
        if key not in made:
            jaxpr, consts = thunk.call_wrapped(*nonzeros)
            closed = ClosedJaxpr(jaxpr, consts)
            if any(isinstance(c, Tracer) for c in consts):
                made[key] = jaxpr, consts  # an outer trace's value: runs as it is
            else:
                run = runner(closed)
                # a literal output (a Python residual: `True`) stays one: the rule reads it
                # as the Python value JAX hands on for it
                literals = {i: v.val for i, v in enumerate(jaxpr.outvars)
                            if isinstance(v, Literal)}

                def outputs(*xs: Any) -> list:
                    return [literals.get(i, o) for i, o in enumerate(run(*xs))]
                new = trace_to_jaxpr(outputs, [v.aval for v in jaxpr.invars])
                made[key] = new.jaxpr, new.consts
        return made[key]
    return wrap_function(make, thunk)


class SeededBackward:
    """A `custom_vjp` call whose outputs the program drops in places, staged again so that its
    guarded backward rule knows the cotangents' dropped lanes (a `MaskedBody`, with no body to
    plan): the transpose of the `where` outside the call writes zeros there, which the rule
    then multiplies by its own values (`g[0] / sqrt(x)` at `x = 0`) while the input lane stays
    live through another output, so the primal cut does not apply. The call is wrapped in a
    `jax.custom_vjp` whose forward runs the call under `jax.vjp` and saves the output masks;
    its backward sets them (`_DROPPED_COTANGENTS`) around the pullback, which calls the guarded
    rule: they seed its structural zeros. A live lane is never seeded, so an inf that reaches
    one stays (contract 3). Planned only for the calls the backward-rule pass guards, without
    closed-over constants (JAX refuses to differentiate those: the call stays as it is), and
    not for one output computed lane to lane, where the primal cut covers the dropped lanes."""

    def outside_syms(self, eqn: JaxprEqn, syms: Sequence[Any]) -> list:
        return [None] * len(eqn.outvars)

    def plan(self, eqn: JaxprEqn, out_kinds: Sequence[Any], plan_body: Callable) -> list | None:
        # one output computed lane to lane: an input lane is read by its own output lane only,
        # and the primal cut (stop_gradient in the dropped lanes) already covers it
        if eqn.params.get("num_consts", 0) or one_lane_shape(eqn):
            return None
        return []

    def emit(self, eqn: JaxprEqn, plans: list, invals: list, out_masks: list, params: dict,
             emit_body: Callable) -> list:
        seeds = [None if m is None or not is_float(o)
                 else broadcast(not_mask(materialize(m, shape_of(o))), shape_of(o))
                 for m, o in zip(out_masks, eqn.outvars, strict=True)]
        placed = tuple(k for k, s in enumerate(seeds) if s is not None)
        call = _seeded_call(eqn, params, placed)
        return list(call(tuple(invals), tuple(seeds[k] for k in placed)))


def _seeded_call(eqn: JaxprEqn, params: dict, placed: tuple[int, ...]) -> Callable:
    """`eqn` bound with `params`, as a function of (its operands, the structural zeros of its
    outputs `placed`) whose backward seeds its guarded rule with those zeros. It closes over
    no value of the trace it is staged in (a custom_vjp's rules outlive it)."""
    n_outs = len(eqn.outvars)

    @jax.custom_vjp
    def seeded(args: tuple, zeros: tuple) -> list:
        return bind_eqn(eqn, args, params)

    def forward(args: tuple, zeros: tuple) -> tuple:
        # differentiated in the operands JAX perturbs only, as the call itself would be (a
        # library's rule may assert that one is not: equinox's `nondifferentiable`)
        moving = tuple(k for k, a in enumerate(args) if a.perturbed)
        values = [a.value for a in args]

        def on_moving(*ys: Any) -> list:
            full = list(values)
            for k, y in zip(moving, ys, strict=True):
                full[k] = y
            return bind_eqn(eqn, full, params)
        outs, pullback = jax.vjp(on_moving, *(values[k] for k in moving))
        return outs, (pullback, [z.value for z in zeros], _Positions(moving))

    def backward(saved: tuple, cotangents: list) -> tuple:
        pullback, zeros, moving = saved
        handed: list[Any] = [None] * n_outs
        for k, zero in zip(placed, zeros, strict=True):
            handed[k] = zero
        token = _DROPPED_COTANGENTS.set(tuple(handed))
        try:
            grads = pullback([_instantiated(c) for c in cotangents])
        finally:
            _DROPPED_COTANGENTS.reset(token)
        out: list[Any] = [None] * len(eqn.invars)
        for k, g in zip(moving.positions, grads, strict=True):
            out[k] = g
        return tuple(out), (None,) * len(placed)

    seeded.defvjp(forward, backward, symbolic_zeros=True)
    return seeded


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Positions:
    """Argument positions saved with a custom_vjp's residuals, static (not traced)."""
    positions: tuple[int, ...]


def _instantiated(cotangent: Any) -> Any:
    """A symbolic zero cotangent as an array of zeros (what a pullback takes)."""
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
        aval: Any = cotangent.aval
        return np.zeros(aval.shape, aval.dtype)
    return cotangent


def _seeded_inputs(args: Sequence[Any], traced: Sequence[int],
                   seeds: tuple | None) -> dict[int, Any]:
    """Traced input position -> the boolean array of its structural zeros, for the cotangents
    (the last arguments) that `seeds` gives, where its shape is theirs."""
    if seeds is None or len(seeds) > len(args):
        return {}
    position = {k: j for j, k in enumerate(traced)}
    first = len(args) - len(seeds)
    return {position[first + n]: seed for n, seed in enumerate(seeds)
            if seed is not None and first + n in position
            and np.shape(args[first + n]) == np.shape(seed)}


def structural_zeros(closed: ClosedJaxpr, seed_avals: Sequence[Any] = (),
                     seeded: Sequence[int] = ()) -> ClosedJaxpr:
    """`closed` with structural zeros kept zero through products; itself when none meets one.
    `seeded`: inputs whose structural zeros are given, as boolean inputs appended in that order
    (of `seed_avals`); the program returned then takes them, whether it guards or not."""
    interpreter = _Interpreter()
    n = len(closed.jaxpr.invars)

    def guarded(*xs: Any) -> list:
        masks: list[ZeroMask] = [None] * n
        for k, seed in zip(seeded, xs[n:], strict=True):
            masks[k] = seed
        return interpreter.run(closed.jaxpr, closed.consts, xs[:n], masks)[0]
    new = trace_to_jaxpr(guarded, [*(v.aval for v in closed.jaxpr.invars), *seed_avals])
    if interpreter.guards:
        return new
    if not seeded:
        return closed
    return trace_to_jaxpr(lambda *xs: eval_jaxpr(closed.jaxpr, closed.consts, *xs[:n]),
                          [*(v.aval for v in closed.jaxpr.invars), *seed_avals])


class _Interpreter:
    """Evaluates a program with each value's structural zeros beside it; counts its guards."""

    def __init__(self) -> None:
        self.guards = 0

    def run(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
            masks: Sequence[ZeroMask] | None = None) -> tuple[list, list]:
        values: dict = dict(zip(jaxpr.constvars, consts, strict=True))
        values.update(zip(jaxpr.invars, args, strict=True))
        zeros: dict = {v: _constant_zeros(c) for v, c in zip(jaxpr.constvars, consts,
                                                              strict=True)}
        if masks is not None:
            zeros.update(zip(jaxpr.invars, masks, strict=True))

        def read(a: Any) -> Any:
            return literal_value(a) if isinstance(a, Literal) else values[a]

        def mask(a: Any) -> ZeroMask:
            if isinstance(a, Literal):
                return _constant_zeros(literal_value(a))
            return zeros.get(a)

        for eqn in jaxpr.eqns:
            invals = [read(a) for a in eqn.invars]
            outs, out_masks = self.equation(eqn, invals, [mask(a) for a in eqn.invars])
            values.update(zip(eqn.outvars, outs, strict=True))
            zeros.update((o, m) for o, m in zip(eqn.outvars, out_masks, strict=True)
                         if m is not None)
        return [read(a) for a in jaxpr.outvars], [mask(a) for a in jaxpr.outvars]

    def equation(self, eqn: JaxprEqn, invals: list, masks: list) -> tuple[list, list]:
        rule = rule_for(eqn.primitive)
        none = [None] * len(eqn.outvars)
        if rule.inline:  # a call: its body is read as part of the program
            body = call_jaxpr(eqn)
            return self.run(body.jaxpr, body.consts, invals, masks)
        if rule.nested_params and not rule.custom_rule:
            return bind_eqn(eqn, invals, self.bodies(eqn)), none
        zeros = rule.zeros
        if zeros is None or all(m is None for m in masks) or len(eqn.outvars) != 1:
            return bind_eqn(eqn, invals), none
        if zeros.absorbs and is_float(eqn.outvars[0]):
            invals = self.guard(eqn, invals, masks, zeros.absorbs)
        return bind_eqn(eqn, invals), zeros.lanes(eqn, masks, invals)

    def guard(self, eqn: JaxprEqn, invals: list, masks: list, absorbs: frozenset[int]) -> list:
        """`eqn`'s operands with 1 wherever another operand that absorbs is a structural zero
        (and the operand itself is not): the output is that zero there (`0 * 1`, `0 / 1`), as
        with a hand-written double where, and so is the derivative at every order."""
        shape = shape_of(eqn.outvars[0])
        out = list(invals)
        for j, atom in enumerate(eqn.invars):
            if _finite_literal(atom) or not is_float(atom):
                continue
            others = [masks[k] for k in absorbs if k != j and masks[k] is not None]
            if not others:
                continue
            where = union(others, shape)
            if j in absorbs and masks[j] is not None:
                where = lax.bitwise_and(where, lax.bitwise_not(as_array(masks[j], shape)))
            operand = broadcast(invals[j], shape)
            out[j] = lax.select_n(where, operand, lax.full_like(operand, 1))
            self.guards += 1
        return out

    def bodies(self, eqn: JaxprEqn) -> dict | None:
        """`eqn`'s parameters with each body guarded on its own (inputs not zero), or None when
        no body needs a guard."""
        params = dict(eqn.params)
        changed = False
        for name in rule_for(eqn.primitive).nested_params:
            value = params[name]
            bodies = value if isinstance(value, tuple) else (value,)
            new = tuple(self.body(b) for b in bodies)
            if any(n is not b for n, b in zip(new, bodies, strict=True)):
                changed = True
                params[name] = new if isinstance(value, tuple) else new[0]
        return params if changed else None

    def body(self, body: Any) -> Any:
        closed = body if isinstance(body, ClosedJaxpr) else ClosedJaxpr(body, ())
        new = structural_zeros(closed)
        if new is closed or (isinstance(body, Jaxpr) and new.consts):
            return body
        self.guards += 1
        return new if isinstance(body, ClosedJaxpr) else new.jaxpr


def _constant_zeros(value: Any) -> ZeroMask:
    """True for a constant that is 0 in every lane (a literal, `zeros_like`'s), else None."""
    if isinstance(value, Tracer) or (not hasattr(value, "shape") and not np.isscalar(value)):
        return None
    if np.size(value) > 4096:
        return None
    array = np.asarray(value)
    if array.dtype.kind not in "fciub":
        return None
    return True if not np.any(array) else None


def _finite_literal(atom: Any) -> bool:
    if not isinstance(atom, Literal):
        return False
    value = np.asarray(literal_value(atom))
    return value.dtype.kind not in "fc" or bool(np.all(np.isfinite(value)))
