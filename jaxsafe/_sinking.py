"""The sinking pass: elementwise work on a scan's stacked operand, done before the loop, is
moved into the loop's body when the body drops lanes of that operand's slices.

A scan's body gets one slice of each stacked operand per step. A drop in the body (a padded
step's `jnp.where(t < length, c + l, c)`) is a drop of that slice's lanes, decided step by step,
often on the carry: no mask of the whole stacked operand exists before the loop, where work
done on all steps at once (`l = jnp.log(x)`) would need one. So that work is done in the body
instead, on each step's slice, where the body's own guard reaches it: the program
`scan(body, c, (t, log(x)))` becomes `scan(log-then-body, c, (t, x))`. Only where it helps: a
stacked input the body drops in some lanes (its static liveness, `Kind.MAYBE`), computed by a
chain of elementwise equations (`PrimitiveRule.elementwise`) of which one is not linear (a
linear chain puts no operand value into a cotangent). Operands of the chain of rank 0 become
the loop's constants, the others stacked operands; literals stay literals.

Values do not change: each lane is computed by the same primitive on the same operands, one
step's slice at a time (an elementwise primitive computes a lane from that lane alone). An
equation whose result the program also reads elsewhere stays there too, computed twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._atoms import shape_of
from ._compat import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    scan_counts,
    scan_params_with,
    step_aval,
    with_arg_names,
)
from ._liveness import Sweeps
from ._rules import Kind, Steps, rule_for


class ScanSteps:
    """`scan`: its operands are constants, carries, then stacked inputs, as its body's inputs."""

    def layout(self, eqn: JaxprEqn) -> tuple[ClosedJaxpr, int, int] | None:
        n_consts, n_carry = scan_counts(eqn.params)
        return eqn.params["jaxpr"], n_consts, n_consts + n_carry

    def params_with(self, eqn: JaxprEqn, body: ClosedJaxpr, new_consts: int,
                    stacked_kept: Sequence[bool], new_stacked: int) -> dict | None:
        return scan_params_with(eqn.params, body, new_consts, stacked_kept, new_stacked)


def sink_into_scans(closed: ClosedJaxpr, sweeps: Sweeps) -> ClosedJaxpr:
    """`closed` with the elementwise work on each scan's dropped stacked operands moved into
    the scan's body; `closed` itself where there is none. The equations moved stay where they
    were, for a dead-code pass to remove where nothing else reads them."""
    jaxpr = closed.jaxpr
    producer = {e.outvars[0]: (i, e) for i, e in enumerate(jaxpr.eqns) if len(e.outvars) == 1}
    replaced: dict[int, JaxprEqn] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        steps = rule_for(eqn.primitive).steps
        if steps is not None:
            new = _sunk(eqn, steps, producer, sweeps)
            if new is not None:
                replaced[i] = new
    if not replaced:
        return closed
    eqns = [replaced.get(i, e) for i, e in enumerate(jaxpr.eqns)]
    return ClosedJaxpr(jaxpr.replace(eqns=eqns), closed.consts)


def _sinkable(eqn: JaxprEqn, shape: tuple) -> bool:
    """Computes a value of `shape` lane to lane from operands of that shape, rank-0 ones and
    literals, with no effect."""
    return (rule_for(eqn.primitive).elementwise and len(eqn.outvars) == 1 and not eqn.effects
            and tuple(shape_of(eqn.outvars[0])) == shape
            and all(isinstance(a, Literal) or tuple(shape_of(a)) in ((), shape)
                    for a in eqn.invars))


def _chain(v: Var, producer: dict, shape: tuple) -> list[tuple[int, JaxprEqn]]:
    """The elementwise equations that compute `v` from values not computed so (its leaves),
    from its first non-linear ones on: a linear equation that reads leaves alone stays
    where it is (it puts no operand value into a cotangent), so that no more is moved than
    the body's guard needs. Empty where all of them are linear."""
    found: dict[int, JaxprEqn] = {}
    todo = [v]
    while todo:
        hit = producer.get(todo.pop())
        if hit is None or hit[0] in found or not _sinkable(hit[1], shape):
            continue
        found[hit[0]] = hit[1]
        todo.extend(a for a in hit[1].invars
                    if isinstance(a, Var) and tuple(shape_of(a)) == shape)
    moved: list[tuple[int, JaxprEqn]] = []
    results: set = set()
    for i, e in sorted(found.items()):
        if not rule_for(e.primitive).linear or any(a in results for a in e.invars
                                                   if isinstance(a, Var)):
            moved.append((i, e))
            results.add(e.outvars[0])
    return moved


def _sunk(eqn: JaxprEqn, steps: Steps, producer: dict, sweeps: Sweeps) -> JaxprEqn | None:
    """The loop equation with its dropped stacked operands' elementwise chains in its body;
    None where none is moved."""
    layout = steps.layout(eqn)
    if layout is None:
        return None
    body, _, first = layout
    sweep = sweeps.get(body.jaxpr, [Kind.LIVE] * len(body.jaxpr.outvars), False)
    chains: dict[int, list[tuple[int, JaxprEqn]]] = {}
    for k in range(first, len(eqn.invars)):
        v = eqn.invars[k]
        if not isinstance(v, Var) or sweep.kind(body.jaxpr.invars[k]) != Kind.MAYBE:
            continue
        chain = _chain(v, producer, tuple(shape_of(v)))
        if chain and chain[-1][1].outvars[0] is v:
            chains[k] = chain
    if not chains:
        return None
    return _staged(eqn, steps, body, first, chains)


def _staged(eqn: JaxprEqn, steps: Steps, body: ClosedJaxpr, first: int,
            chains: dict[int, list[tuple[int, JaxprEqn]]]) -> JaxprEqn | None:
    """The loop equation again, each chain of `chains` (stacked operand index -> its chain)
    computed at the start of its body."""
    inner = body.jaxpr
    moved = dict(pair for chain in chains.values() for pair in chain)
    defines: dict[Any, Var] = {}  # a moved result -> the body variable that holds it
    renamed: dict[Var, Var] = {}  # a body input now computed by another moved result
    for k in chains:
        held = inner.invars[k]
        if eqn.invars[k] in defines:
            renamed[held] = defines[eqn.invars[k]]
        else:
            defines[eqn.invars[k]] = held
    const_leaves: list[Var] = []
    stacked_leaves: list[Var] = []
    sub: dict[Any, Var] = {}

    def in_body(a: Any) -> Any:
        if isinstance(a, Literal) or a in sub:  # a moved result is computed before it is read
            return a if isinstance(a, Literal) else sub[a]
        leaf = sub[a] = Var(a.aval if not shape_of(a) else step_aval(a.aval))
        (const_leaves if not shape_of(a) else stacked_leaves).append(a)
        return leaf

    copies = []
    for _, e in sorted(moved.items()):
        invars = [in_body(a) for a in e.invars]
        out = e.outvars[0]
        sub[out] = defines[out] if out in defines else Var(step_aval(out.aval))
        copies.append(e.replace(invars=invars, outvars=[sub[out]]))
    kept = [k not in chains for k in range(first, len(eqn.invars))]
    old_eqns = inner.eqns if not renamed else [_renamed(e, renamed) for e in inner.eqns]
    invars = ([sub[a] for a in const_leaves] + list(inner.invars[:first])
              + [v for k, v in enumerate(inner.invars[first:], first) if k not in chains]
              + [sub[a] for a in stacked_leaves])
    outvars = [renamed.get(v, v) if isinstance(v, Var) else v for v in inner.outvars]
    names = getattr(inner.debug_info, "arg_names", None)
    info = inner.debug_info if names is None else with_arg_names(
        inner.debug_info, ["" for _ in const_leaves] + list(names[:first])
        + [n for k, n in enumerate(names[first:], first) if k not in chains]
        + ["" for _ in stacked_leaves])
    new_body = ClosedJaxpr(Jaxpr(inner.constvars, invars, outvars, copies + list(old_eqns),
                                 inner.effects, info), body.consts)
    params = steps.params_with(eqn, new_body, len(const_leaves), kept, len(stacked_leaves))
    if params is None:
        return None
    operands = (const_leaves + list(eqn.invars[:first])
                + [a for k, a in enumerate(eqn.invars[first:], first) if k not in chains]
                + stacked_leaves)
    return eqn.replace(invars=operands, params=params)


def _renamed(eqn: JaxprEqn, renamed: dict) -> JaxprEqn:
    return eqn.replace(invars=[renamed.get(a, a) if isinstance(a, Var) else a
                               for a in eqn.invars])
