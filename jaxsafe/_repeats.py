"""The merging pass: an equation the rewritten program computes twice, on the same operands with
the same parameters, is computed once.

The guarded shadow re-emits comparisons the masks already made (a re-decided `max` compares the
original operands again; two guards read one predicate's mask): XLA merges them when it
compiles, but not before `jax.make_jaxpr`, `explain`'s equation count or the lowering read them,
and a long unrolled program pays for each in trace and compile time. An equation computed again
on the same values gives the same bits, so the program's values are unchanged.

Merged only where that holds by construction: no effects, no body of its own (a custom rule's
equation, a loop), every parameter hashable, and a row that says it computes the same values
each time (`PrimitiveRule.repeatable`: not XLA's stateful `rng_uniform`, not a primitive
jaxsafe has no row for). Broadcasts are not merged either: each `select_n` reads a mask
broadcast afresh (`_masks.selecting`) so that XLA's sharding propagation places each copy as the
value it selects; one broadcast shared by values sharded differently makes XLA gather one of
them (`tests/test_multidevice.py`: 6 all-gathers against the original's 2 on a 2x4 mesh). A
broadcast costs nothing once fused. Runs on the emitted program only: when nothing is guarded,
the original program is returned as it is (contract 4), repeats included.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._compat import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var
from ._rules import rule_for


def _atom_key(atom: Any) -> tuple | None:
    """What makes two operands the same: a variable by identity, a literal by type and bits."""
    if isinstance(atom, Var):
        return ("var", id(atom))
    if isinstance(atom, Literal):
        value, aval = np.asarray(atom.val), atom.aval
        return ("literal", getattr(aval, "dtype", None), getattr(aval, "shape", None),
                getattr(aval, "weak_type", False),
                getattr(aval, "sharding", None), value.dtype.str, value.shape, value.tobytes())
    return None


def _params_key(eqn: JaxprEqn) -> tuple | None:
    """The parameters as a hashable key; None when one holds a body, a function or an array
    (such an equation is not merged)."""
    items = tuple(sorted(eqn.params.items()))
    values = [w for _, v in items for w in (v if isinstance(v, tuple) else (v,))]
    if any(callable(v) or hasattr(v, "jaxpr") or hasattr(v, "eqns") for v in values):
        return None
    try:
        hash(items)
    except TypeError:
        return None
    return items


def _equation_key(eqn: JaxprEqn, operands: list) -> tuple | None:
    rule = rule_for(eqn.primitive)
    if eqn.effects or not rule.repeatable or rule.has_body or rule.broadcast:
        return None  # a broadcast: one copy per reader, placed as it (the module's docstring)
    atoms = [_atom_key(a) for a in operands]
    params = _params_key(eqn)
    if params is None or any(a is None for a in atoms):
        return None
    key = (eqn.primitive, tuple(atoms), params)
    try:
        hash(key)  # a literal's sharding, say
    except TypeError:
        return None
    return key


def _can_stand_for(earlier: JaxprEqn, eqn: JaxprEqn) -> bool:
    """Whether `earlier`'s results can replace `eqn`'s: each one `eqn`'s program reads exists."""
    return not any(isinstance(o, DropVar) and not isinstance(n, DropVar)
                   for o, n in zip(earlier.outvars, eqn.outvars, strict=True))


def merge_repeated_equations(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same program with each repeated equation replaced by its first occurrence's results
    (top level; nested bodies are rewritten, and merged, on their own); `closed` itself when
    nothing repeats."""
    jaxpr = closed.jaxpr
    renamed: dict[Var, Any] = {}
    first: dict[tuple, JaxprEqn] = {}
    eqns: list[JaxprEqn] = []
    for eqn in jaxpr.eqns:
        operands = [renamed.get(a, a) if isinstance(a, Var) else a for a in eqn.invars]
        key = _equation_key(eqn, operands)
        earlier = None if key is None else first.get(key)
        if earlier is not None and _can_stand_for(earlier, eqn):
            renamed.update((n, o) for n, o in zip(eqn.outvars, earlier.outvars, strict=True)
                           if not isinstance(n, DropVar))
            continue
        if renamed:
            eqn = eqn.replace(invars=operands)
        if key is not None:
            first[key] = eqn
        eqns.append(eqn)
    if len(eqns) == len(jaxpr.eqns):
        return closed
    outvars = [renamed.get(a, a) if isinstance(a, Var) else a for a in jaxpr.outvars]
    return ClosedJaxpr(Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, eqns, jaxpr.effects,
                             jaxpr.debug_info), closed.consts)
