"""A scan's per-step drops, hoisted: the stacked inputs and constants its body drops by the
stacked inputs and constants.

A scan with carries is read conservatively outside (`_lanewise.py`): a stacked input without an
aligned axis is live where any output is. But a body often drops a step by what that step reads
alone: generalized advantage estimation's `jnp.where(done[t], 0., r[t] + g * v[t + 1] - v[t])`,
a padded RNN's `jnp.where(mask[t], new_h, h)`. Then the lanes of the stacked input that step t
drops are known before the loop runs: the body's own mask of that input, computed from step t's
stacked inputs and the constants, for every t at once (`jax.vmap`). A value network run over
every step's observations before the loop (`values = obs @ w`) then has its dropped rows
guarded as it would have outside a loop, and a NaN observation of a terminal step no longer
reaches `w`'s gradient through the matmul's transpose.

The body's mask is read with every output of the body live at every step (what the outputs
outside keep is joined in after, as `_lanewise` does), so it is a mask the body would compute
anyway, never narrower. A constant of the loop (a cost matrix built before a Sinkhorn loop
whose body masks padded pairs by a closed-over mask) is read at every step: its mask is the OR
over the steps of the body's masks of it. Where it reads a carry (a value the step computes
from what earlier steps did), it cannot be known before the loop: the input stays live where
any output is (contract 5). The step's mask program is traced once per body and input, with
its own mask scope, and runs as plain JAX.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax

from ._atoms import shape_of
from ._compat import ClosedJaxpr, JaxprEqn, Tracer, eval_jaxpr, scan_counts
from ._masks import all_staged, broadcast, mask_scope, materialize, reduce_any, staged
from ._rules import Kind, Mask


class _ReadsCarry(Exception):
    """The step's mask reads a value computed from a carry: it is not known before the loop."""


class _Step(Sequence):
    """One step's inputs of a body: the constants and stacked inputs given, a carry raising
    `_ReadsCarry` when a mask rule reads it (through `_liveness.Values`, which computes only
    what is read)."""

    def __init__(self, given: dict[int, Any], size: int):
        self.given, self.size = given, size

    def __getitem__(self, k):  # type: ignore[override]
        if k not in self.given:
            raise _ReadsCarry
        return self.given[k]

    def __len__(self) -> int:
        return self.size


# body jaxpr -> {(stacked input index, structural): the step's mask program, or None}
_STEP_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# body jaxpr -> the sweeps its step programs are read from (its liveness with every output live)
_SWEEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_mask_program(eqn: JaxprEqn, k: int, structural: bool) -> ClosedJaxpr | None:
    """The mask of the scan's stacked input or constant `k` at one step, as a program of the
    constants and one step's stacked inputs, where the body drops some of its lanes by those
    alone; else None."""
    body = eqn.params["jaxpr"]
    known = _STEP_MASKS.setdefault(body.jaxpr, {})
    if (k, structural) not in known:
        known[(k, structural)] = _traced(body, eqn, k, structural)
    return known[(k, structural)]


def _traced(body: ClosedJaxpr, eqn: JaxprEqn, k: int, structural: bool) -> ClosedJaxpr | None:
    from ._liveness import Sweeps, Values  # the liveness pass reads this module's rule

    jaxpr = body.jaxpr
    n_consts, n_carry = scan_counts(eqn.params)
    if any(isinstance(c, Tracer) for c in body.consts):
        return None  # an outer trace's value: the program, cached per body, must not hold it
    sweeps = _SWEEPS.setdefault(jaxpr, Sweeps())  # one per body, whichever operand asks
    sweep = sweeps.get(jaxpr, [Kind.LIVE] * len(jaxpr.outvars), structural)
    target = jaxpr.invars[k]
    if sweep.kind(target) != Kind.MAYBE:
        return None
    outside = [*range(n_consts), *range(n_consts + n_carry, len(jaxpr.invars))]

    def step(*xs: Any) -> Any:
        values = Values(jaxpr, body.consts,
                        _Step(dict(zip(outside, xs, strict=True)), len(jaxpr.invars)))
        with mask_scope(), all_staged():
            mask = sweep.masks(values, [None] * len(jaxpr.outvars))(target)
        return broadcast(materialize(mask, shape_of(target)), shape_of(target))

    avals = [jaxpr.invars[j].aval for j in outside]
    try:
        program = jax.make_jaxpr(step)(*avals)
    except _ReadsCarry:
        return None
    return program if _batches(program, avals, n_consts) else None


def _batches(program: ClosedJaxpr, avals: list, n_consts: int) -> bool:
    """Whether the step's mask program can run for every step at once (`jax.vmap`): not one
    with effects, or a primitive JAX cannot batch (a `pure_callback` without a
    `vmap_method`). The loop runs it step by step; the input then stays as it was."""
    if program.effects:
        return False
    consts, stacked = avals[:n_consts], avals[n_consts:]
    if not stacked:  # one program for every step
        return True
    try:
        jax.eval_shape(lambda *xs: _over_steps(program, xs[:n_consts], xs[n_consts:]),
                       *consts, *[jax.ShapeDtypeStruct((2, *a.shape), a.dtype)
                                  for a in stacked])
    except Exception:  # noqa: BLE001 - any reason it does not batch: not hoisted
        return False
    return True


def _over_steps(program: ClosedJaxpr, consts: Sequence[Any], stacked: Sequence[Any]) -> Any:
    """The step's mask program run for every step: the constants shared, the stacked inputs
    sliced along their first axis."""
    def one_step(*xs: Any) -> Any:
        return eval_jaxpr(program.jaxpr, program.consts, *consts, *xs)[0]
    return jax.vmap(one_step)(*stacked)


def hoisted_mask(eqn: JaxprEqn, k: int, structural: bool, invals: Any) -> Mask:
    """The mask of the scan's stacked input `k` that its body computes at every step, or of
    its constant `k`, the OR over the steps of the body's masks (None: not known before the
    loop)."""
    program = step_mask_program(eqn, k, structural)
    if program is None:
        return None
    n_consts, n_carry = scan_counts(eqn.params)
    n_lead = n_consts + n_carry
    consts = [invals[j] for j in range(n_consts)]
    stacked = [invals[j] for j in range(n_lead, len(eqn.invars))]
    with staged():  # the step's values as the program computes them, bit for bit
        if k >= n_lead:
            return _over_steps(program, consts, stacked)
        if not stacked:  # every step computes the same mask
            return eval_jaxpr(program.jaxpr, program.consts, *consts)[0]
        return reduce_any(_over_steps(program, consts, stacked), [0])
