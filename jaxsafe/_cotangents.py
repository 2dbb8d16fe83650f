"""Values whose cotangent may be non-finite: the cotangent pass.

JAX differentiates `max`, `min` and `clamp` by multiplying the cotangent by a weight of 0, 1/2
or 1 (`max(x, 0.)`'s derivative is `g * (x > 0)`, with a balanced tie). Where the cotangent of a
lane is inf or NaN, the losing operand's dropped lane gets `0 * inf = NaN`, not the zero that the
drop promises: `jnp.sqrt(jnp.maximum(x, 0.))` at `x < 0` (the derivative of sqrt at 0 is inf,
and the 0 wins). A hand-written `where` selects the cotangent instead, and so does jaxsafe: such
an equation is emitted as a `select_n` on its decision (`Decisions.selections`), wherever its
output's cotangent may be non-finite.

A cotangent may be non-finite where a later equation's derivative may be: a NaN-prone primitive
(a singularity of a live lane, which the contract keeps), an unknown one, a body with either, a
product or quotient with a value that may hold NaN or inf in some lane (`nonfinite_anywhere`),
and everything the cotangent reaches from there, backwards. The outputs' own cotangents are
finite at the top of a program (`jax.grad` seeds 1); a body's are what the program around it
hands it (`body_cotangents`). Overflow of finite values is not counted, as in the taint pass.
A NaN-prone primitive whose operands are finite and proven inside its domain
(`_bounds.operand_in_domain`: `expm1(min(x, 0.))`, `exp(-r)` of a distance) has finite
derivatives, and makes no such cotangent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence, Set
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._atoms import dtype_of, float_info, is_float, literal_value
from ._bounds import Bounds, at_or_below, lower_end, operand_in_domain
from ._compat import ClosedJaxpr, JaxprEqn, Literal, Var
from ._liveness import Sweep
from ._nested import sub_jaxprs
from ._rules import Context, guard_for, rule_for
from ._taint import makes_nonfinite, may_produce_nonfinite, nan_prone


@dataclasses.dataclass
class Cotangents:
    """What the cotangent pass found."""

    bad: set
    """The variables whose cotangent may hold inf or NaN in some lane."""
    own: set
    """Those of `bad` whose cotangent may be non-finite only in lanes where their own value is
    (`sqrt(max(x, 1e-6))`: the `sqrt`'s derivative is finite wherever its operand is)."""
    anywhere: Set
    """The values that may hold NaN or inf in some lane (`nonfinite_anywhere`)."""

    def weighs_nonfinite(self, eqn: JaxprEqn, carrying: Sequence[bool]) -> bool:
        """Whether a selection by value (`max`, `min`, `clamp`) may weigh a non-finite
        cotangent by 0 for an operand that carries a derivative: not where its cotangent is
        non-finite only where its own value is, and only one operand carries while the others
        are finite. There the value is non-finite only where the carrying operand is: NaN,
        where no operand wins alone (the lane is live, and JAX's weights stand), or inf, where
        it wins; a finite winner makes a finite value and a finite cotangent."""
        outs = [o for o in eqn.outvars if o in self.bad]
        if not outs:
            return False
        selection = rule_for(eqn.primitive).selection
        if selection is None or selection.by_predicate or any(o not in self.own for o in outs):
            return True
        others = [v for v, c in zip(eqn.invars, carrying, strict=True) if not c]
        return sum(carrying) != 1 or not all(_finite(v, self.anywhere) for v in others)


def nonfinite_cotangents(closed: ClosedJaxpr, sweep: Sweep, anywhere: Set,
                         outputs: Sequence[bool], bounds: Bounds | None = None,
                         own_outputs: Sequence[bool] | None = None) -> Cotangents:
    """The variables whose cotangent may hold inf or NaN in some lane. `anywhere`: the values
    that may (`nonfinite_anywhere`); `outputs`: which outputs' cotangents may; `own_outputs`:
    which may only where the output's own value is (a loop's carry); `bounds`: the program's
    bounds and ranges, where known (`expm1(min(x, 0.))`: a finite derivative)."""
    jaxpr = closed.jaxpr
    loose: set = {v for v, b in zip(jaxpr.outvars, outputs, strict=True)
                  if b and isinstance(v, Var)}  # non-finite where their own value may be finite
    bad: set = loose | {v for v, b in zip(jaxpr.outvars, own_outputs or (), strict=False)
                        if b and isinstance(v, Var)}
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if rule_for(eqn.primitive).zero_derivative:
            continue
        flows = any(o in bad for o in eqn.outvars)
        flows_loose = any(o in loose for o in eqn.outvars)
        for k, (v, d) in enumerate(zip(eqn.invars, sweep.diff[i], strict=True)):
            if not (d and isinstance(v, Var) and is_float(v)) or v in loose:
                continue
            if not (flows or _partial_may_be_nonfinite(eqn, k, anywhere, bounds)):
                continue
            bad.add(v)
            if flows_loose or not _own_nonfinite_only(eqn, k, anywhere, bounds):
                loose.add(v)
    return Cotangents(bad, bad - loose, anywhere)


def _narrow(atom: Any) -> bool:
    """A float type narrower in range than float32 (float16, the float8s; not bfloat16, whose
    exponent is float32's): a finite cotangent times a finite derivative overflows there at
    ordinary values (a loss scale of 2 ** 15 times `sqrt`'s derivative at 0.01), so no
    cotangent is taken as non-finite only where its own value is. In float32 and wider that
    takes values near 1e37, as elsewhere in the analysis (overflow of finite values is not
    counted). `jnp.issubdtype`: NumPy's does not count the `ml_dtypes` floats as floats."""
    dtype = dtype_of(atom)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and \
        float_info(dtype).maxexp < float_info(np.float32).maxexp


def _finite(atom: Any, anywhere: Set) -> bool:
    if isinstance(atom, Literal):
        return bool(np.all(np.isfinite(np.asarray(literal_value(atom)))))
    return atom not in anywhere


class _Without(Set):
    """`anywhere` less one value."""

    def __init__(self, anywhere: Set, left_out: Any):
        self.anywhere, self.left_out = anywhere, left_out

    def __contains__(self, v: object) -> bool:
        return v is not self.left_out and v in self.anywhere

    def __iter__(self) -> Iterator[Any]:
        return (v for v in self.anywhere if v is not self.left_out)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _own_nonfinite_only(eqn: JaxprEqn, k: int, anywhere: Set, bounds: Bounds | None) -> bool:
    """Whether lane to lane `eqn` makes operand k's cotangent non-finite only in lanes where
    operand k itself is, given an output cotangent that is non-finite only where the output
    is: its other operands are finite, it is finite where they all are (a NaN-prone primitive
    proven inside its domain), and so is its derivative in operand k."""
    rule = rule_for(eqn.primitive)
    v = eqn.invars[k]
    if bounds is None or len(eqn.outvars) != 1 or not (
            rule.elementwise or rule.selection is not None) or _narrow(v):
        return False
    if not all(_finite(u, anywhere) for u in eqn.invars if u is not v):
        return False
    return not _partial_may_be_nonfinite(eqn, k, _Without(anywhere, v), bounds)


def _partial_may_be_nonfinite(eqn: JaxprEqn, k: int, anywhere: Set,
                              bounds: Bounds | None = None) -> bool:
    """Whether `eqn`'s derivative in operand k may be inf or NaN for a finite cotangent."""
    rule = rule_for(eqn.primitive)
    if rule.linear and rule.known and not rule.has_body and not nan_prone(eqn) \
            and not makes_nonfinite(eqn):
        return False  # a NaN literal (`where(c, x, nan)`) is a value: its derivative is 0 or 1
    if may_produce_nonfinite(eqn):  # a NaN-prone or unknown primitive, a hazardous body
        return bounds is None or not (_proven_in_domain(eqn, anywhere, bounds)
                                      or _over_bounded_divisor(eqn, k, anywhere, bounds))
    if rule.has_body:
        return any(isinstance(v, Var) and v in anywhere for v in eqn.invars)
    if rule.linear:
        return False
    reads = range(len(eqn.invars)) if rule.derivative_reads is None else \
        rule.derivative_reads[k]
    return any(isinstance(eqn.invars[j], Var) and eqn.invars[j] in anywhere for j in reads)


def _over_bounded_divisor(eqn: JaxprEqn, k: int, anywhere: Set, bounds: Bounds) -> bool:
    """Whether operand k is the numerator of a quotient whose divisor is finite and bounded
    away from 0 (`PrimitiveRule.divisor`): the derivative in the numerator is `1 / d`,
    whatever the numerator holds (a masked mean's `sum(x * m) / maximum(sum(m), 1)`)."""
    divisor = rule_for(eqn.primitive).divisor
    if divisor is None or divisor == k or len(eqn.invars) != 2 or len(eqn.outvars) != 1:
        return False
    d = eqn.invars[divisor]
    if not isinstance(d, Var) or d in anywhere or not jnp.issubdtype(dtype_of(d), jnp.floating) \
            or _narrow(d):
        return False
    lower = lower_end(d, bounds)
    dtype = dtype_of(d)
    # `1 / d` at most the square root of the dtype's largest value: a cotangent as large again
    # overflows, as elsewhere not counted (float16 has too little range for that: `_narrow`)
    return lower is not None and \
        float(at_or_below(lower, dtype)) >= 1.0 / float(np.sqrt(float_info(dtype).max))


def _proven_in_domain(eqn: JaxprEqn, anywhere: Set, bounds: Bounds) -> bool:
    """Whether a NaN-prone elementwise `eqn` reads only finite values, and each operand of its
    guard table is proven inside its domain (`_bounds.operand_in_domain`): its derivatives
    are finite in every lane."""
    guard = guard_for(eqn)
    if guard is None or not rule_for(eqn.primitive).elementwise or len(eqn.outvars) != 1 \
            or any(isinstance(v, Var) and v in anywhere for v in eqn.invars):
        return False
    return all(operand_in_domain(eqn, j, bounds, anywhere)
               for j in guard.safe if j < len(eqn.invars))


def body_cotangents(eqn: JaxprEqn, bad: Set, anywhere: Set) -> dict[int, list[bool]]:
    """id(body jaxpr) -> which of its outputs' cotangents may be non-finite: all of them where
    any output of `eqn` has such a cotangent, or where its derivative may make one and it is a
    loop (which hands its carries' cotangents back to the body), none otherwise. A body run
    once (a `cond`'s branch, `jax.checkpoint`'s) receives the equation's outputs' cotangents."""
    once = rule_for(eqn.primitive).runs_bodies_once
    any_bad = any(o in bad for o in eqn.outvars) or not once and any(
        _partial_may_be_nonfinite(eqn, k, anywhere) for k in range(len(eqn.invars)))
    out: dict[int, list[bool]] = {}
    for body in sub_jaxprs(eqn):
        out[id(body.jaxpr)] = [any_bad] * len(body.jaxpr.outvars)
    return out


def needs_cotangents(closed: ClosedJaxpr, ctx: Context) -> bool:
    """Whether the program has an equation the cotangent pass decides on: a chooser, or a body
    that may hold one."""
    return any(selects_by_value(e, ctx) or rule_for(e.primitive).has_body
               for e in closed.jaxpr.eqns)


def selects_by_value(eqn: JaxprEqn, ctx: Context) -> bool:
    """A chooser (`max`, `reduce_max`, `sort`, a product with a mask, ...): its derivative
    weighs the cotangent by a choice made on values, or moves it by one."""
    chooser = rule_for(eqn.primitive).chooser
    return chooser is not None and chooser.applies(eqn, ctx)
