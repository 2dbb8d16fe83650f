"""The emission pass: trace the planned program, with its guards, into a new jaxpr.

An interpreter over the original equations, run under `jax.make_jaxpr`, emits three parts:

1. **The original program.** Every equation is emitted once on original values, unless the plan
   says it is emitted again (`Decisions.reemit`); predicates and comparisons read these values.
2. **The masks**: for each guarded equation, the liveness of its output, emitted on first demand
   by the liveness pass (`Sweep.masks`), only on the paths between guards and drops.
3. **The guarded shadow**: the equations from each guard down to the outputs, emitted again with
   safe operands in dropped lanes, `select_n(live, safe, x)`; `max`/`min`/`clamp` with a changed
   operand as a `select_n` on the decision taken from the original values.

A guarded value with no dropped lane is the original value itself (the same tracer), so the
shadow shares everything it can with the original program; dead-code elimination then removes
what the shadow made unused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ._atoms import dtype_of, is_float, literal_value, shape_of
from ._compat import Literal, Var, bind_eqn, weak_constant
from ._liveness import LazyOperands, RuntimeMasks
from ._masks import (
    Placed,
    all_of,
    broadcast,
    decided_per_lane,
    mask_scope,
    materialize,
    not_mask,
    of_predicates,
    reduce_any,
    selecting,
)
from ._plan import Plan
from ._report import Site, note_failure
from ._rules import Kind, Mask, rule_for
from ._symbolic import Unknown


def emit(plan: Plan, changed: list[bool], *args: Any) -> list:
    """The planned program on `args`, every output live (traced by `jax.make_jaxpr`); appends
    to `changed` whether it differs from the original program (a guard whose masks, known when
    jaxsafe traces, are true in every lane emits nothing)."""
    return emit_masked(plan, [None] * len(plan.closed.jaxpr.outvars), args, changed)


def emit_masked(plan: Plan, out_masks: Sequence[Mask], args: Sequence[Any],
                changed: list[bool] | None = None) -> list:
    """The planned program on `args`, its outputs dropped where `out_masks` are False (a body
    that the program around it drops in places)."""
    with mask_scope():  # one trace: the masks' bookkeeping must not outlive it
        out_masks = [m.made() if isinstance(m, Placed) else m for m in out_masks]
        emitter = _Emitter(plan, out_masks, args)
        eqns = plan.closed.jaxpr.eqns
        i = 0
        try:
            for i in range(len(eqns)):
                emitter.equation(i)
        except Exception as e:
            note_failure(e, eqns[i], "emission")
            raise
        if changed is not None:
            changed.append(emitter.changed)
        return emitter.outputs()


class _Originals:
    """The original program's values, computed on demand: an env for the liveness rules.

    The forward pass computes each value once and shares it with the guarded program. Only a
    value that a guard may change (in its dropped lanes) and that a predicate or another
    non-differentiable use reads gets a second, original copy, computed here when first asked.
    """

    def __init__(self, plan: Plan, args: Sequence[Any]):
        jaxpr = plan.closed.jaxpr
        self.plan = plan
        self.values: dict = dict(zip(jaxpr.constvars, plan.closed.consts, strict=True))
        self.values.update(zip(jaxpr.invars, args, strict=True))

    def __getitem__(self, v: Any) -> Any:
        if isinstance(v, Literal):
            if getattr(v.aval, "weak_type", False):  # its results stay weakly typed
                return weak_constant(literal_value(v), dtype_of(v))
            return literal_value(v)
        if v in self.values:
            return self.values[v]
        eqns, producer = self.plan.closed.jaxpr.eqns, self.plan.sweep.producer
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
            self.values.update(zip(eqn.outvars, outs, strict=True))
        return self.values[v]


class _Emitter:
    """One emission of a plan: the original values, the guarded ones, and the masks."""

    def __init__(self, plan: Plan, out_masks: Sequence[Mask], args: Sequence[Any]):
        self.plan = plan
        self.orig = _Originals(plan, args)
        self.safe: dict = {}  # the guarded program's values, where its derivative path differs
        self.out_masks = list(out_masks)
        self._masks: RuntimeMasks | None = None
        # whether the emitted program differs from the original (conservatively: rewritten
        # bodies, re-decided selections and cuts count, each emitted guard `select_n` does)
        self.changed = bool(plan.nested or plan.masked or plan.decisions.selections
                            or plan.report.backward_rules)

    def _runtime_masks(self) -> RuntimeMasks:
        if self._masks is None:  # one backward sweep, the first time a guard needs a mask
            self._masks = self.plan.sweep.masks(self.orig, self.out_masks)
        return self._masks

    def mask_of(self, v: Any) -> Mask:
        return self._runtime_masks()(v)

    def key_value(self, key: Any) -> Any:
        """A coarse guard's key as it runs: a predicate's value, or the mask this body is given
        for an output (`Unknown.output`), along the axes it runs along."""
        if not isinstance(key, Unknown):
            return self.orig[key]
        if key.output is None:
            raise AssertionError("a coarse guard read an unnamed mask")
        index, shape, axes = key.output
        outvars = self.plan.closed.jaxpr.outvars
        if index >= len(outvars) or tuple(shape_of(outvars[index])) != shape:
            raise AssertionError("a coarse guard read another body's output mask")
        mask = self.out_masks[index]
        if mask is None:
            return jnp.ones(tuple(shape[a] for a in axes), bool)
        return reduce_any(mask, [a for a in range(len(shape)) if a not in axes])

    def operand_masks(self, i: int) -> list[Mask]:
        return self._runtime_masks().operand_masks(i)

    def equation(self, i: int) -> None:
        plan, orig, safe = self.plan, self.orig, self.safe
        decisions = plan.decisions
        eqn = plan.closed.jaxpr.eqns[i]
        # Operands read as guarded: differentiable ones, and decisions the plan allows. A
        # guarded value with no dropped lane is the original value itself (same tracer):
        # equations that read only such values are computed once, for both programs.
        as_guarded = [isinstance(v, Var) and v in safe and
                      (d or i in decisions.chain or k in decisions.safe_reads.get(i, ()))
                      for k, (d, v) in enumerate(zip(plan.sweep.diff[i], eqn.invars,
                                                     strict=True))]
        shared = all(not g or safe[v] is orig.values.get(v)
                     for g, v in zip(as_guarded, eqn.invars, strict=True))
        if i not in decisions.reemit and shared:
            if i in decisions.selections:
                # a non-finite cotangent: selected, not weighed. It carries the derivative
                # (`safe`): a decision (a mask, a predicate) may have computed the original
                # already, and later values from it; what reads it is then emitted again.
                # Where its values are the original ones in every lane, it serves both.
                outs = self._bind(i, [orig[v] for v in eqn.invars])
                chooser = rule_for(eqn.primitive).chooser
                keeps = chooser is None or chooser.keeps_dropped_values
                for o, val in zip(eqn.outvars, outs, strict=True):
                    safe[o] = val
                    if keeps:
                        orig.values.setdefault(o, val)
                return
            if eqn.outvars and all(o in orig.values for o in eqn.outvars):
                return  # already computed for a decision
            outs = bind_eqn(eqn, [orig[v] for v in eqn.invars], plan.nested.get(i))
            orig.values.update(zip(eqn.outvars, outs, strict=True))
            return
        invals = [safe[v] if g else orig[v] for g, v in zip(as_guarded, eqn.invars, strict=True)]
        if i in decisions.split_predicates:
            self._split_predicate(i, invals)
        site = plan.sites.get(i)
        free = None
        guarded = invals
        cut_lanes = None
        if site is not None:
            self._guard(i, site, invals)
            guarded = list(invals)
            free = self._guard_free(site, invals)
            cut_lanes = self._operand_cut_lanes(site, free, invals)
        outs = self._bind(i, invals)
        if site is not None:
            outs = self._cut_outputs(i, site, outs, free, guarded)
            if cut_lanes is not None:
                outs = self._cut_free_operands(i, site, outs, guarded, cut_lanes)
        self._record(i, outs, shared and site is None)

    def _split_predicate(self, i: int, invals: list) -> None:
        """A `select_n`'s predicate decided on the guarded values in the result's dropped lanes
        and on the original ones in its live lanes (`Decisions.split_predicates`)."""
        eqn = self.plan.closed.jaxpr.eqns[i]
        pred, out = eqn.invars[0], eqn.outvars[0]
        live = self.mask_of(out)
        if live is None or pred not in self.safe:
            return
        shape = shape_of(out)
        original, on_guarded = (broadcast(v, shape) for v in (self.orig[pred], self.safe[pred]))
        invals[0], = decided_per_lane(live, original, [(original, on_guarded)])

    def _operand_cut_lanes(self, site: Site, free: Any, invals: list) -> Any:
        """The lanes, at the shape of the operands of `Site.free_operands`, where all of them
        carry no derivative and the output does (`free`: the output's lanes that carry none,
        which `_cut_outputs` cuts); None where there are none to cut. Beside a free output,
        only at the output's shape (a broadcast operand's lanes would need a reduction).
        There those operands take their safe value in `invals`: the computation from them is
        not taken, its cotangent is 0, and `0 * -x / 1e-40` would reach the operand."""
        if not site.free_operands:
            return None
        operands = [site.eqn.invars[k] for k in site.free_operands]
        shape = shape_of(operands[0])  # the same for all (`operand_cuts`)
        if free is not None and shape != shape_of(site.eqn.outvars[0]):
            return None
        frees = []
        for u in operands:
            carrying = self.plan.sweep.carry_mask(u, self.orig)
            if carrying is None:
                return None
            frees.append(not_mask(carrying))
        if free is not None:
            frees.append(not_mask(free))
        self.changed = True
        lanes = materialize(all_of(frees), shape)
        for k, value in site.free_operands.items():
            invals[k] = lax.select_n(lanes, invals[k], lax.full_like(invals[k], value))
        return lanes

    def _cut_free_operands(self, i: int, site: Site, outs: list, guarded: list,
                           lanes: Any) -> list:
        """In `lanes` (`_operand_cut_lanes`: where the operands of `Site.free_operands` carry
        no derivative and the output does), the output computed again from the guarded
        operands with theirs cut (a `stop_gradient` of the whole operand: a select would give
        it a zero tangent, and forward mode would weigh it by the partial derivative, `0 *
        -x / 1e-40`). Elsewhere that computation takes each such operand's safe value, as the
        one computed before does in `lanes`: the cotangent of what is not taken is 0, and
        `0 / 0` there would reach an operand."""
        cut = list(guarded)
        for k, value in site.free_operands.items():
            operand = guarded[k]
            cut[k] = lax.stop_gradient(
                lax.select_n(lanes, lax.full_like(operand, value), operand))
        cut_out = self._bind(i, cut)[0]
        return [lax.select_n(broadcast(lanes, np.shape(outs[0])), outs[0], cut_out)]

    def _cut_outputs(self, i: int, site: Site, outs: list, free: Any, guarded: list) -> list:
        """The site's output lanes that pass no derivative: those that carry none (`free`),
        and its dropped lanes where it says so (`Site.cut_output`). A free lane takes the
        value of the operands as guarded before the free ones were replaced (`guarded`): the
        original value where the lane is live, and where it is dropped the value the guards
        upstream made safe, not the original's NaN (a product after it reads it)."""
        if free is not None or site.cut_output:
            self.changed = True
        if free is not None:
            # with `free_cut`, every operand's such lanes come from a selection
            original = outs[0] if site.free_cut else self._bind(i, guarded)[0]
            outs = [lax.select_n(selecting(free, outs[0]), outs[0],
                                 lax.stop_gradient(original))]
        if site.cut_output:
            cut = []
            for o, out in zip(site.eqn.outvars, outs, strict=True):
                live = self.mask_of(o) if is_float(o) else None
                cut.append(out if live is None else lax.select_n(
                    selecting(live, out), lax.stop_gradient(out), out))
            outs = cut
        return outs

    def _guard(self, i: int, site: Site, invals: list) -> None:
        """Replace the site's operands by their safe value (or cut them) in dropped lanes."""
        eqn = site.eqn
        # a coarse guard reads predicates only: no demand of the exact masks
        exact = site.cut or any(k not in site.coarse for k in site.replace)
        in_masks = self.operand_masks(i) if exact else [None] * len(eqn.invars)
        made: dict[tuple, tuple] = {}  # one guard for one operand read twice (`x * x`)
        for k, value in site.replace.items():
            live, operand = in_masks[k], invals[k]
            if k in site.coarse:
                live = of_predicates(site.coarse[k], self.key_value,
                                     shape_of(eqn.invars[k]))
            key = (eqn.invars[k], value) if isinstance(eqn.invars[k], Var) else None
            # the same mask: the same coarse formula, or the same exact mask object
            token = ("coarse", site.coarse[k]) if k in site.coarse else ("exact", id(live))
            if key in made and made[key][0] == token:
                invals[k] = made[key][1]
                continue
            out_shape = shape_of(eqn.outvars[0])
            if isinstance(eqn.invars[k], Literal) and np.shape(operand) != out_shape \
                    and rule_for(eqn.primitive).elementwise and len(eqn.outvars) == 1:
                # a literal (`x / 0.`): guarded lane by lane, at the output's shape. Other
                # broadcast operands keep their shape (live where any lane they feed is): XLA
                # divides by a broadcast row as by its reciprocal, so a full-shape divisor would
                # change the live lanes' last bit.
                live = self.mask_of(eqn.outvars[0])
                if live is not None:
                    operand = broadcast(operand, out_shape)
            if live is not None:
                self.changed = True
                invals[k] = lax.select_n(selecting(live, operand),
                                         lax.full_like(operand, value), operand)
                if key is not None:
                    made[key] = (token, invals[k])
        if site.cut:
            self.changed = True
        _cut(site, invals, in_masks)

    def _guard_free(self, site: Site, invals: list) -> Any:
        """Replace the `free` operands by their safe value in the output lanes that carry no
        derivative (`_free.py`; live ones only beside a value guard of dropped lanes); those
        lanes, or None where there are none."""
        if not site.free:
            return None
        out = site.eqn.outvars[0]
        sweep = self.plan.sweep
        carrying = sweep.carry_mask(out, self.orig)
        if carrying is None:
            return None
        free = not_mask(carrying)
        if site.replace and not site.free_cut and sweep.kind(out) != Kind.LIVE:
            # dropped lanes keep their value guard's result (`_dropped.py` may count on it);
            # elsewhere the original value comes back anyway
            live = self.mask_of(out)
            if live is not None:
                free = all_of([free, live])
        shape = shape_of(out)
        free = materialize(free, shape)
        self.changed = True
        if site.free_cut:
            return free
        for k, value in site.free.items():
            operand = invals[k]
            if np.shape(operand) != shape:
                operand = broadcast(operand, shape)
            invals[k] = lax.select_n(selecting(free, operand), operand,
                                     lax.full_like(operand, value))
        return free

    def _bind(self, i: int, invals: list) -> list:
        plan = self.plan
        eqn = plan.closed.jaxpr.eqns[i]
        rule = rule_for(eqn.primitive)
        if i in plan.masked:
            assert rule.masked_body is not None
            out_masks = [self.mask_of(o) for o in eqn.outvars]
            return rule.masked_body.emit(eqn, plan.masked[i], invals, out_masks,
                                         plan.nested.get(i) or eqn.params, emit_masked)
        if i in plan.decisions.selections:
            assert rule.chooser is not None
            originals = LazyOperands(self.orig, eqn.invars)
            return rule.chooser.emit(
                eqn, invals, originals, lambda: self.operand_masks(i),
                lambda: [self.mask_of(o) for o in eqn.outvars])
        return bind_eqn(eqn, invals, plan.nested.get(i))

    def _record(self, i: int, outs: list, shared_unguarded: bool) -> None:
        plan, orig, safe = self.plan, self.orig, self.safe
        eqn = plan.closed.jaxpr.eqns[i]
        for o, val in zip(eqn.outvars, outs, strict=True):
            if is_float(o) or i in plan.decisions.chain:
                safe[o] = val
                if plan.sweep.kind(o) == Kind.LIVE:  # no dropped lane: bitwise the original
                    orig.values.setdefault(o, val)
            elif shared_unguarded:  # an index or predicate from original values only
                orig.values.setdefault(o, val)
            else:
                safe[o] = val

    def outputs(self) -> list:
        jaxpr = self.plan.closed.jaxpr
        return [self.safe[v] if isinstance(v, Var) and v in self.safe else self.orig[v]
                for v in jaxpr.outvars]


def _cut(site: Site, invals: list, in_masks: list) -> None:
    """Cut the site's `cut` operands from differentiation in their dropped lanes (a custom rule's
    call: their dropped lanes hold a live lane's values where the call broadcasts a smaller
    operand over them, `_live_donors`)."""
    donors = _live_donors(site, invals, in_masks)
    for k in site.cut:
        live = in_masks[k]
        if live is not None:
            invals[k] = lax.select_n(selecting(live, invals[k]),
                                     donors.get(k, lax.stop_gradient(invals[k])), invals[k])
    for k, donor in donors.items():
        if k not in site.cut:
            invals[k] = lax.select_n(selecting(in_masks[k], invals[k]), donor,
                                     invals[k])


def _live_donors(site: Site, invals: list, in_masks: list) -> dict[int, Any]:
    """For a custom rule's call that broadcasts a smaller operand over the ones it cuts (the
    scalar `a` of `logaddexp(a, x)`, `mu` of `poisson.logpmf(k, mu)`): the full-size operands'
    values at one lane live in all of them, under `stop_gradient`, for their dropped lanes. The
    smaller operand feeds live lanes, so it is not cut, and takes the rule's derivative from
    every lane: in a dropped lane, that derivative is then the rule's at a point the program
    evaluates live, not at what the lane held (a NaN, a 0 under a `log`)."""
    eqn = site.eqn
    if not site.cut or not rule_for(eqn.primitive).custom_rule:
        return {}
    shape = max((shape_of(eqn.invars[k]) for k in site.cut), key=lambda s: int(np.prod(s)))
    size = int(np.prod(shape))
    if not any(isinstance(v, Var) and is_float(v) and int(np.prod(shape_of(v))) < size
               for v in eqn.invars):  # a literal takes no derivative
        return {}
    full = [k for k, v in enumerate(eqn.invars)
            if shape_of(v) == shape and in_masks[k] is not None]
    live = all_of([materialize(in_masks[k], shape) for k in full])
    if live is None:
        return {}
    first = lax.argmax(lax.reshape(lax.convert_element_type(live, np.int32), (size,)), 0,
                       np.int32)
    donors = {}
    for k in full:
        lane = lax.dynamic_index_in_dim(lax.reshape(invals[k], (size,)), first, keepdims=False)
        donors[k] = lax.stop_gradient(lax.broadcast_in_dim(lane, shape, ()))
    return donors

