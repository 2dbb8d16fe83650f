"""Equations with bodies: staging them again with masks from outside.

A body whose outputs the surrounding program drops in places (a checkpoint, a cond branch, a
scan's per-step outputs) is rewritten again with those output masks as extra inputs, and staged
again through the public API (`jax.checkpoint`, `lax.switch`, `lax.scan`), so that the structure
stays and no parameters are edited by hand. One handler per primitive, held by its row
(`PrimitiveRule.masked_body`); the planning and emission passes hand it the functions that plan
and emit a body, so this module does not depend on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from ._atoms import shape_of
from ._compat import ClosedJaxpr, JaxprEqn, eval_jaxpr, scan_counts
from ._lanewise import body_syms, carry_kinds, carry_masks
from ._masks import Placed, factor
from ._rules import Kind, Mask
from ._symbolic import Sym, foreign_keys_unknown, given_mask

PlanBody = Callable[[ClosedJaxpr, list[Kind]], Any]
"""(body, its outputs' kinds) -> the body's plan, or None when it needs no change."""

EmitBody = Callable[[Any, Sequence[Mask], Sequence[Any]], list]
"""(plan, output masks, arguments) -> the body's outputs, emitted on the current trace."""


def _body_out_kinds(kinds: Sequence[Kind]) -> list[Kind]:
    return [Kind.LIVE if k == Kind.LIVE else Kind.MAYBE for k in kinds]


def _any_plan(plans: list) -> list | None:
    return plans if any(p is not None for p in plans) else None


def _same_outputs(eqn: JaxprEqn, syms: Sequence[Sym]) -> list[Sym | None]:
    """A body whose outputs are the equation's: a row that a `where` drops after a checkpoint
    is a row inside it (a matmul's operand there is guarded without a run-time reduction)."""
    return [given_mask(foreign_keys_unknown(s, (), outputs=False), i, shape_of(o))
            for i, (s, o) in enumerate(zip(syms, eqn.outvars, strict=True))]


def _body_fn(plan: Any, closed: ClosedJaxpr, emit_body: EmitBody) -> Callable:
    if plan is None:
        return lambda args, masks: eval_jaxpr(closed.jaxpr, closed.consts, *args)
    return lambda args, masks: emit_body(plan, masks, args)


def _placed(mask: Mask, shape: tuple) -> Placed:
    core, axes = factor(mask)
    return Placed(core, tuple(shape), tuple(axes))


class RematBody:
    """`jax.checkpoint`: one body, re-staged through `jax.checkpoint` (it stays a checkpoint)."""

    outside_syms = staticmethod(_same_outputs)

    def plan(self, eqn: JaxprEqn, out_kinds: Sequence[Kind], plan_body: PlanBody) -> list | None:
        return _any_plan([plan_body(ClosedJaxpr(eqn.params["jaxpr"], ()),
                                    _body_out_kinds(out_kinds))])

    def emit(self, eqn: JaxprEqn, plans: list, invals: list, out_masks: list, params: dict,
             emit_body: EmitBody) -> list:
        fn = _body_fn(plans[0], ClosedJaxpr(params["jaxpr"], ()), emit_body)
        return list(jax.checkpoint(fn, prevent_cse=params["prevent_cse"],
                                   policy=params["policy"])(invals, out_masks))


class CondBody:
    """`cond`: every branch, re-staged through `lax.switch`."""

    outside_syms = staticmethod(_same_outputs)

    def plan(self, eqn: JaxprEqn, out_kinds: Sequence[Kind], plan_body: PlanBody) -> list | None:
        kinds = _body_out_kinds(out_kinds)
        return _any_plan([plan_body(br, kinds) for br in eqn.params["branches"]])

    def emit(self, eqn: JaxprEqn, plans: list, invals: list, out_masks: list, params: dict,
             emit_body: EmitBody) -> list:
        fns = [_body_fn(p, br, emit_body) for p, br in zip(plans, params["branches"], strict=True)]
        return list(lax.switch(invals[0], fns, invals[1:], out_masks))


class ScanBody:
    """`scan`: the masks of the stacked outputs are scanned over with the inputs. The carries
    stay live (their liveness would need a fixed point across iterations), except along the
    axes that the body keeps aligned, where a carry's mask is the same at every step
    (`_lanewise.py`, `_aligned.py`)."""

    outside_syms = staticmethod(body_syms)

    def plan(self, eqn: JaxprEqn, out_kinds: Sequence[Kind], plan_body: PlanBody) -> list | None:
        _, n_carry = scan_counts(eqn.params)
        kinds = carry_kinds(eqn, out_kinds) + _body_out_kinds(out_kinds)[n_carry:]
        if all(k == Kind.LIVE for k in kinds):
            return None
        return _any_plan([plan_body(eqn.params["jaxpr"], kinds)])

    def emit(self, eqn: JaxprEqn, plans: list, invals: list, out_masks: list, params: dict,
             emit_body: EmitBody) -> list:
        n_consts, n_carry = scan_counts(params)
        consts, init, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                            invals[n_consts + n_carry:])
        fn = _body_fn(plans[0], params["jaxpr"], emit_body)
        # a carry's mask runs along its aligned axes: its core enters the loop, and is broadcast
        # in the body's trace, where what reduces it reduces the core (no OR over a padded row's
        # features at every step)
        carried = [None if m is None else _placed(m, shape_of(v))
                   for m, v in zip(carry_masks(eqn, out_masks), eqn.outvars, strict=False)]

        def body(carry, x_and_masks):
            x, masks = x_and_masks
            outs = fn([*consts, *carry, *x], [*carried, *masks])
            return outs[:n_carry], outs[n_carry:]

        carry, ys = lax.scan(body, list(init), (list(xs), list(out_masks[n_carry:])),
                             length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"])
        return [*carry, *ys]
