"""Liveness: which lanes of each intermediate value can reach an output through a derivative.

A lane (element) of a value is *live* when a change to it can change an output or an output's
derivative; otherwise it is *dropped*. Dropped lanes come from selections: the unselected side of
`select_n`, the losing operand of `max`/`min`/`clamp`, lanes that `slice`, `dynamic_slice`,
`gather` or `pad` leave out, and everything that feeds only such lanes.

Predicates are data, so liveness is a boolean *mask* computed at run time, walking the program
backward from its outputs (which are live). Like JAX's own dead-code pass, each primitive has one
rule in `RULES`, keyed by the primitive object; a primitive without a rule takes the conservative
default (every input lane is live unless all outputs are dead). Next to the run-time masks there is
a static summary per value, `Kind`: LIVE (no mask needed), MAYBE (a run-time mask) or DEAD
(no lane reaches an output), so masks are only built on the paths where selections happen.

Only *differentiable edges* carry liveness: a comparison, a predicate, an index or a
zero-derivative primitive (`floor`, `stop_gradient`, ...) reads the original value and passes no
tangent, so it never makes a lane live (`jnp.where(jnp.isnan(y), 0., y)` drops the NaN lanes of
`y`). The rewrite makes every such use read the original, unguarded value, so a guard can never
flip a decision.

In *structural* mode (used inside `custom_jvp`/`custom_vjp`, whose derivative is the user's rule
and not the primal's) value-based selections are treated as elementwise: only lanes that the
primal provably never reads are dropped.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._compat import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var, bind_eqn
from ._compat import primitives as P

Mask = Optional[jax.Array]
"""A boolean array of a value's shape (True: live), or None when every lane is live."""


class Kind(enum.IntEnum):
    """Static summary of a value's liveness."""
    DEAD = 0   # no lane reaches an output
    MAYBE = 1  # a run-time mask decides
    LIVE = 2   # every lane may reach an output


def join(a: Kind, b: Kind) -> Kind:
    """Liveness of a value with two consumers."""
    if Kind.LIVE in (a, b):
        return Kind.LIVE
    return Kind.MAYBE if Kind.MAYBE in (a, b) else Kind.DEAD


def is_float(atom: Any) -> bool:
    dtype = atom.aval.dtype if hasattr(atom, "aval") else np.result_type(atom)
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:  # extended dtypes (PRNG keys, float0)
        return False


ZERO_DERIVATIVE: frozenset[Primitive] = frozenset({
    P.stop_gradient_p, P.floor_p, P.ceil_p, P.round_p, P.sign_p, P.is_finite_p,
})
"""Primitives whose derivative is zero: their inputs are read for the value only."""


def differentiable_operands(eqn: JaxprEqn, structural: bool = False) -> list[bool]:
    """Which operands of `eqn` pass a tangent to a floating-point output."""
    if not any(is_float(v) for v in eqn.outvars):
        return [False] * len(eqn.invars)
    if eqn.primitive in ZERO_DERIVATIVE and not structural:
        return [False] * len(eqn.invars)
    return [not isinstance(v, Literal) and is_float(v) for v in eqn.invars]


# --------------------------------------------------------------------------- the rule type

@dataclasses.dataclass(frozen=True)
class Context:
    """What a rule may need besides its equation: the mode and the recursion into sub-jaxprs."""
    structural: bool
    inner_masks: Callable[[ClosedJaxpr, Sequence[Any], Sequence[Mask], bool], list[Mask]]
    inner_kinds: Callable[[ClosedJaxpr, Sequence[Kind], bool], list[Kind]]


MaskRule = Callable[[JaxprEqn, list[Mask], list[Any], Context], list[Mask]]
"""(equation, output masks, original operand values, context) -> one mask per operand."""


@dataclasses.dataclass(frozen=True)
class LivenessRule:
    masks: MaskRule
    drops: Callable[[JaxprEqn], bool] = lambda eqn: False
    """Whether live outputs can leave some operand lanes dropped (a selection)."""
    decided_by_value: bool = False
    """The selection compares operand values (select_n, max, min, clamp): see `winner`."""
    kinds: Callable[[JaxprEqn, list[Kind], Context], list[Kind]] | None = None
    """Static rule for primitives that recurse into sub-jaxprs."""


RULES: dict[Primitive, LivenessRule] = {}


def register(*prims: Primitive, **rule_fields) -> Callable[[MaskRule], MaskRule]:
    def deco(masks: MaskRule) -> MaskRule:
        for prim in prims:
            RULES[prim] = LivenessRule(masks, **rule_fields)
        return masks
    return deco


# --------------------------------------------------------------------------- mask helpers

def ones(shape) -> jax.Array:
    return jnp.ones(shape, bool)


def zeros(shape) -> jax.Array:
    return jnp.zeros(shape, bool)


def materialize(mask: Mask, shape) -> jax.Array:
    return ones(shape) if mask is None else mask


def fit(mask: Mask, shape) -> Mask:
    """A mask over an output, as seen by an operand of `shape` that the op broadcasts (a rank-0
    scalar, or size-1 axes): a lane is live if any output lane it is broadcast to is."""
    shape = tuple(shape)
    if mask is None or tuple(mask.shape) == shape:
        return mask
    lead = mask.ndim - len(shape)
    if lead < 0:
        return None  # pragma: no cover - shapes that do not line up: conservative
    if lead:
        mask = jnp.any(mask, axis=tuple(range(lead)))
    size_one = tuple(d for d, n in enumerate(shape) if n == 1 and mask.shape[d] != 1)
    if size_one:
        mask = jnp.any(mask, axis=size_one, keepdims=True)
    return mask


def any_of(masks: Sequence[Mask]) -> Mask:
    if any(m is None for m in masks):
        return None
    out = masks[0]
    for m in masks[1:]:
        out = out | m
    return out


def _shape(atom) -> tuple[int, ...]:
    return tuple(atom.aval.shape)


# --------------------------------------------------------------------------- elementwise

def elementwise(eqn, outs, invals, ctx):
    return [fit(outs[0], _shape(v)) for v in eqn.invars]


ELEMENTWISE: tuple[Primitive, ...] = (
    P.neg_p, P.sign_p, P.floor_p, P.ceil_p, P.round_p, P.is_finite_p, P.exp_p, P.exp2_p,
    P.log_p, P.log1p_p, P.expm1_p, P.tanh_p, P.logistic_p, P.sin_p, P.cos_p, P.tan_p,
    P.asin_p, P.acos_p, P.atan_p, P.sinh_p, P.cosh_p, P.asinh_p, P.acosh_p, P.atanh_p,
    P.sqrt_p, P.rsqrt_p, P.cbrt_p, P.abs_p, P.square_p, P.integer_pow_p, P.add_p, P.sub_p,
    P.mul_p, P.div_p, P.rem_p, P.pow_p, P.atan2_p, P.nextafter_p, P.erf_p, P.erfc_p,
    P.erf_inv_p, P.lgamma_p, P.digamma_p, P.polygamma_p, P.igamma_p, P.igammac_p,
    P.igamma_grad_a_p, P.zeta_p, P.bessel_i0e_p, P.bessel_i1e_p,
    P.regularized_incomplete_beta_p, P.convert_element_type_p, P.reduce_precision_p,
    P.copy_p, P.real_p, P.imag_p, P.complex_p, P.conj_p, P.stop_gradient_p, P.add_jaxvals_p,
)
register(*ELEMENTWISE)(elementwise)


# --------------------------------------------------------------------------- selections by value

def _bcast(x, shape):
    return jnp.broadcast_to(x, shape)


def winner(eqn: JaxprEqn, invals: Sequence[Any]) -> jax.Array:
    """For a selection decided by value: int32 per output lane, k > 0 when operand k - 1 alone
    determines the output (and its derivative) there, 0 where several do (ties, NaN).

    Computed from the original operand values, so a guard cannot change the decision.
    """
    shape = _shape(eqn.outvars[0])
    prim = eqn.primitive
    if prim is P.select_n_p:
        pred = _bcast(invals[0], shape)
        return pred.astype(jnp.int32) + 1
    if prim in (P.max_p, P.min_p):
        a, b = (_bcast(x, shape) for x in invals)
        a_wins, b_wins = (a > b, b > a) if prim is P.max_p else (a < b, b < a)
        return a_wins.astype(jnp.int32) + 2 * b_wins.astype(jnp.int32)
    if prim is P.clamp_p:
        lo, x, hi = (_bcast(v, shape) for v in invals)
        lo_wins = (lo > x) & (lo < hi)
        x_wins = (x > lo) & (x < hi)
        hi_wins = hi < x
        return (lo_wins.astype(jnp.int32) + 2 * x_wins.astype(jnp.int32)
                + 3 * hi_wins.astype(jnp.int32))
    raise NotImplementedError(prim)  # pragma: no cover


def _decided_by_value(eqn, outs, invals, ctx):
    if ctx.structural:
        return elementwise(eqn, outs, invals, ctx)
    shape = _shape(eqn.outvars[0])
    win = None if eqn.primitive is P.select_n_p else winner(eqn, invals)
    first = 1 if eqn.primitive is P.select_n_p else 0  # select_n's predicate carries no lanes
    masks: list[Mask] = [None] * first
    pred = invals[0]
    for k, v in enumerate(eqn.invars[first:], start=first):
        operand = k - first + 1
        if eqn.primitive is P.select_n_p:
            if pred.dtype == jnp.bool_:
                live = _bcast(pred if operand == 2 else ~pred, shape)
            else:
                live = _bcast(pred == operand - 1, shape)
        else:
            live = (win == operand) | (win == 0)
        if outs[0] is not None:
            live = live & outs[0]
        masks.append(fit(live, _shape(v)))
    return masks


register(P.select_n_p, P.max_p, P.min_p, P.clamp_p, drops=lambda eqn: True,
         decided_by_value=True)(_decided_by_value)


# --------------------------------------------------------------------------- data movement

def _by_transpose(eqn, outs, invals, ctx):
    """Lanes that a linear data-movement op reads for live outputs: transpose it on the mask.

    The transpose of slice is pad, of gather is scatter-add, of dynamic_slice is
    dynamic_update_slice, ...: JAX already knows where every operand lane goes.
    """
    out_shape = _shape(eqn.outvars[0])
    ct = materialize(outs[0], out_shape).astype(jnp.float32)
    float_ix = [i for i, v in enumerate(eqn.invars) if is_float(v)]

    def op(*floats):
        vals = list(invals)
        for i, x in zip(float_ix, floats):
            vals[i] = x
        return bind_eqn(eqn, vals)[0]

    primals = [jnp.zeros(_shape(eqn.invars[i]), jnp.float32) for i in float_ix]
    _, vjp = jax.vjp(op, *primals)
    cts = vjp(ct)
    masks: list[Mask] = [None] * len(eqn.invars)
    for i, c in zip(float_ix, cts):
        masks[i] = c > 0
    return masks


register(P.slice_p, P.dynamic_slice_p, P.gather_p, P.dynamic_update_slice_p,
         drops=lambda eqn: True)(_by_transpose)
register(P.pad_p, drops=lambda eqn: any(lo < 0 or hi < 0 for lo, hi, _ in
                                        eqn.params["padding_config"]))(_by_transpose)
register(P.concatenate_p, P.reshape_p, P.squeeze_p, P.transpose_p, P.rev_p)(_by_transpose)


def _broadcast_in_dim(eqn, outs, invals, ctx):
    out = outs[0]
    masks: list[Mask] = [None] * len(eqn.invars)
    if out is None:
        return masks
    in_shape = _shape(eqn.invars[0])
    bdims = tuple(eqn.params["broadcast_dimensions"])
    others = tuple(d for d in range(out.ndim) if d not in bdims)
    m = jnp.any(out, axis=others) if others else out
    for k, size in enumerate(in_shape):
        if size == 1 and m.shape[k] != 1:
            m = jnp.any(m, axis=k, keepdims=True)
    masks[0] = m.reshape(in_shape)
    return masks


register(P.broadcast_in_dim_p)(_broadcast_in_dim)


def _reduction(eqn, outs, invals, ctx):
    """Every lane of a reduced row is live if the row's result is."""
    out = outs[0]
    if out is None:
        return [None] * len(eqn.invars)
    in_shape = _shape(eqn.invars[0])
    axes = tuple(eqn.params["axes"])
    kept = tuple(d for d in range(len(in_shape)) if d not in axes)
    m = lax.broadcast_in_dim(out, in_shape, kept)
    return [m] + [fit(out, _shape(v)) for v in eqn.invars[1:]]


register(P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p)(_reduction)


def _cumulative(eqn, outs, invals, ctx):
    """Lane j of a cumulative op feeds outputs j, j+1, ... (or j, j-1, ... when reversed)."""
    out = outs[0]
    if out is None:
        return [None]
    axis, reverse = eqn.params["axis"], eqn.params["reverse"]
    return [lax.cummax(out.astype(jnp.int32), axis=axis, reverse=not reverse) > 0]


register(P.cumsum_p, P.cumprod_p, P.cummax_p, P.cummin_p, P.cumlogsumexp_p)(_cumulative)


def _dot_general(eqn, outs, invals, ctx):
    """An operand lane is live if any output it is multiplied into is: an any-reduction over the
    other operand's free axes of the output mask, broadcast over the contracted axes."""
    out = outs[0]
    if out is None:
        return [None, None]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    a_shape, b_shape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    a_free = [d for d in range(len(a_shape)) if d not in lc and d not in lb]
    b_free = [d for d in range(len(b_shape)) if d not in rc and d not in rb]
    nb = len(lb)
    a_out_axes = tuple(range(nb + len(a_free), out.ndim))  # b's free axes in the output
    b_out_axes = tuple(range(nb, nb + len(a_free)))
    m_a = jnp.any(out, axis=a_out_axes) if a_out_axes else out
    m_b = jnp.any(out, axis=b_out_axes) if b_out_axes else out
    m_a = lax.broadcast_in_dim(m_a, a_shape, tuple(lb) + tuple(a_free))
    m_b = lax.broadcast_in_dim(m_b, b_shape, tuple(rb) + tuple(b_free))
    return [m_a, m_b]


register(P.dot_general_p)(_dot_general)


# --------------------------------------------------------------------------- nested jaxprs

def _call_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr:
    params = eqn.params
    inner = params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]
    return inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())


def _call_masks(eqn, outs, invals, ctx):
    structural = ctx.structural or eqn.primitive in CUSTOM_RULE_CALLS
    return ctx.inner_masks(_call_jaxpr(eqn), invals, outs, structural)


def _call_kinds(eqn, out_kinds, ctx):
    structural = ctx.structural or eqn.primitive in CUSTOM_RULE_CALLS
    return ctx.inner_kinds(_call_jaxpr(eqn), out_kinds, structural)


CUSTOM_RULE_CALLS: frozenset[Primitive] = frozenset({P.custom_jvp_call_p, P.custom_vjp_call_p})
"""Calls whose derivative is a user rule: liveness through them is structural only."""

register(P.jit_p, P.closed_call_p, P.remat_p, P.custom_jvp_call_p, P.custom_vjp_call_p,
         kinds=_call_kinds)(_call_masks)


def _cond_masks(eqn, outs, invals, ctx):
    index, operands = invals[0], invals[1:]
    per_branch = [ctx.inner_masks(br, operands, outs, ctx.structural)
                  for br in eqn.params["branches"]]
    masks: list[Mask] = [None]
    for k, v in enumerate(eqn.invars[1:]):
        branch_masks = [m[k] for m in per_branch]
        if all(m is None for m in branch_masks):
            masks.append(None)
            continue
        cases = [materialize(m, _shape(v)) for m in branch_masks]
        which = jnp.clip(index, 0, len(cases) - 1)
        masks.append(lax.select_n(which, *cases) if len(cases) > 1 else cases[0])
    return masks


def _cond_kinds(eqn, out_kinds, ctx):
    per_branch = [ctx.inner_kinds(br, out_kinds, ctx.structural)
                  for br in eqn.params["branches"]]
    kinds = [Kind.DEAD]
    for k in range(len(eqn.invars) - 1):
        ks = {m[k] for m in per_branch}
        kinds.append(ks.pop() if len(ks) == 1 else Kind.MAYBE)
    return kinds


register(P.cond_p, kinds=_cond_kinds)(_cond_masks)


# --------------------------------------------------------------------------- static kinds

def operand_kinds(eqn: JaxprEqn, out_kinds: Sequence[Kind], ctx: Context) -> list[Kind]:
    """Static liveness each operand receives from `eqn`, given its outputs' kinds."""
    n = len(eqn.invars)
    if all(k == Kind.DEAD for k in out_kinds):
        return [Kind.DEAD] * n
    rule = RULES.get(eqn.primitive)
    if rule is None:
        return [Kind.LIVE] * n
    if rule.kinds is not None:
        return list(rule.kinds(eqn, list(out_kinds), ctx))
    drops = rule.drops(eqn) and not (ctx.structural and rule.decided_by_value)
    all_live = all(k == Kind.LIVE for k in out_kinds)
    return [Kind.LIVE if all_live and not drops else Kind.MAYBE] * n


def operand_masks(eqn: JaxprEqn, out_masks: Sequence[Mask], invals: Sequence[Any],
                  ctx: Context) -> list[Mask]:
    """Run-time liveness each operand receives from `eqn`."""
    rule = RULES.get(eqn.primitive)
    if rule is None:
        if all(m is None for m in out_masks):
            return [None] * len(eqn.invars)
        live = any_of([jnp.any(m) for m in out_masks])
        return [None if live is None else jnp.broadcast_to(live, _shape(v))
                for v in eqn.invars]
    return rule.masks(eqn, list(out_masks), list(invals), ctx)


def has_rule(prim: Primitive) -> bool:
    return prim in RULES


# --------------------------------------------------------------------------- the backward pass

def read(env: dict, atom) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


def evaluate(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> dict:
    """The original value of every variable of `jaxpr` (emitted on the current trace)."""
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, bind_eqn(eqn, [read(env, v) for v in eqn.invars])))
    return env


class Sweep:
    """Static liveness of one jaxpr, and the run-time masks on demand.

    Built once per (jaxpr, output kinds, mode); `masks` emits the mask computation for the values
    that are asked for, walking the equations backward.
    """

    def __init__(self, jaxpr: Jaxpr, out_kinds: Sequence[Kind], structural: bool):
        self.jaxpr = jaxpr
        self.ctx = Context(structural, inner_masks, inner_kinds)
        self.diff = [differentiable_operands(e, structural) for e in jaxpr.eqns]
        kinds: dict[Var, Kind] = {}
        for v, k in zip(jaxpr.outvars, out_kinds):
            if not isinstance(v, Literal):
                kinds[v] = join(kinds.get(v, Kind.DEAD), k)
        for eqn, diff in zip(reversed(jaxpr.eqns), reversed(self.diff)):
            out_kinds_ = [kinds.get(o, Kind.DEAD) for o in eqn.outvars]
            for v, k, d in zip(eqn.invars, operand_kinds(eqn, out_kinds_, self.ctx), diff):
                if d:
                    kinds[v] = join(kinds.get(v, Kind.DEAD), k)
        self.kinds = kinds

    def kind(self, atom) -> Kind:
        if isinstance(atom, Literal):
            return Kind.DEAD
        return self.kinds.get(atom, Kind.DEAD)

    def masks(self, env: dict, out_masks: Sequence[Mask], needed) -> Callable[[Any], Mask]:
        """Emit the masks of the MAYBE variables in `needed`; returns `mask_of(var)`.

        `needed` must be closed under consumers: if a variable is needed, so are the outputs of
        every equation that reads it through a differentiable edge.
        """
        contribs: dict[Var, list[Mask]] = {}
        for v, m in zip(self.jaxpr.outvars, out_masks):
            if not isinstance(v, Literal):
                contribs.setdefault(v, []).append(m)
        cache: dict[Var, Mask] = {}

        def mask_of(v) -> Mask:
            kind = self.kind(v)
            if kind == Kind.LIVE:
                return None
            if kind == Kind.DEAD:
                return zeros(_shape(v))
            if v not in cache:
                cs = contribs.get(v, [])
                cache[v] = any_of(cs) if cs else zeros(_shape(v))
            return cache[v]

        for eqn, diff in zip(reversed(self.jaxpr.eqns), reversed(self.diff)):
            targets = [k for k, (v, d) in enumerate(zip(eqn.invars, diff))
                       if d and v in needed and self.kind(v) == Kind.MAYBE]
            if not targets:
                continue
            ins = operand_masks(eqn, [mask_of(o) for o in eqn.outvars],
                                [read(env, v) for v in eqn.invars], self.ctx)
            for k in targets:
                contribs.setdefault(eqn.invars[k], []).append(ins[k])
        return mask_of


_SWEEPS: dict = {}
_SWEEPS_MAX = 512


def sweep_for(jaxpr: Jaxpr, out_kinds: Sequence[Kind], structural: bool) -> Sweep:
    key = (id(jaxpr), tuple(out_kinds), structural)
    hit = _SWEEPS.get(key)
    if hit is not None and hit.jaxpr is jaxpr:
        return hit
    if len(_SWEEPS) >= _SWEEPS_MAX:
        _SWEEPS.clear()
    sweep = _SWEEPS[key] = Sweep(jaxpr, out_kinds, structural)
    return sweep


def inner_kinds(closed: ClosedJaxpr, out_kinds: Sequence[Kind], structural: bool) -> list[Kind]:
    sweep = sweep_for(closed.jaxpr, out_kinds, structural)
    return [sweep.kind(v) for v in closed.jaxpr.invars]


def inner_masks(closed: ClosedJaxpr, invals: Sequence[Any], out_masks: Sequence[Mask],
                structural: bool) -> list[Mask]:
    """Masks of a sub-jaxpr's inputs, given its outputs' masks (the recursion of nested rules)."""
    out_kinds = [Kind.LIVE if m is None else Kind.MAYBE for m in out_masks]
    sweep = sweep_for(closed.jaxpr, out_kinds, structural)
    invars = closed.jaxpr.invars
    if all(sweep.kind(v) == Kind.LIVE for v in invars):
        return [None] * len(invars)
    env = evaluate(closed.jaxpr, closed.consts, invals)
    needed = {v for v, k in sweep.kinds.items() if k == Kind.MAYBE}
    mask_of = sweep.masks(env, out_masks, needed)
    return [mask_of(v) for v in invars]
