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
import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._compat import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var, bind_eqn
from ._compat import primitives as P
from ._masks import (Mask, all_of, any_of, broadcast, broadcast_mask, concat_masks, factor, fit,
                     materialize, move_axes, not_mask, pad_mask, place, reduce_any,
                     register_broadcast, reshape_mask, slice_mask, within, zeros)
from ._symbolic import FALSE, TRUE, Sym, opaque, sym_and_literal, sym_or
from ._walk import postorder
from . import _symbolic as S


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
    """Which operands of `eqn` pass a tangent to a floating-point output.

    In structural mode every read counts, comparisons and indices included: a body that is
    re-run on guarded operands (a cond branch, a checkpoint, a custom rule's primal) decides on
    what it reads, so nothing it reads may change under it.
    """
    if structural:
        return [isinstance(v, Var) for v in eqn.invars]
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
    # comparisons and logic: they pass no tangent, but in structural mode every read counts
    P.eq_p, P.ne_p, P.lt_p, P.le_p, P.gt_p, P.ge_p, P.and_p, P.or_p, P.not_p, P.xor_p,
)
register(*ELEMENTWISE)(elementwise)


# --------------------------------------------------------------------------- selections by value

def _bcast(x, shape):
    return broadcast(x, shape)


def winner(eqn: JaxprEqn, invals: Sequence[Any]) -> jax.Array:
    """For a selection decided by value: int32 per output lane, k > 0 when operand k - 1 alone
    determines the output (and its derivative) there, 0 where several do (ties, NaN).

    Computed from the original operand values, so a guard cannot change the decision.
    """
    shape = _shape(eqn.outvars[0])
    prim = eqn.primitive
    if prim is P.select_n_p:
        pred = _bcast(invals[0], shape)
        return lax.add(lax.convert_element_type(pred, jnp.int32), np.int32(1))
    if prim in (P.max_p, P.min_p):
        a, b = (_bcast(x, shape) for x in invals)
        a_wins, b_wins = (lax.gt(a, b), lax.gt(b, a)) if prim is P.max_p else \
            (lax.lt(a, b), lax.lt(b, a))
        return _index(a_wins, b_wins)
    if prim is P.clamp_p:
        lo, x, hi = (_bcast(v, shape) for v in invals)
        lo_wins = lax.bitwise_and(lax.gt(lo, x), lax.lt(lo, hi))
        x_wins = lax.bitwise_and(lax.gt(x, lo), lax.lt(x, hi))
        hi_wins = lax.lt(hi, x)
        return _index(lo_wins, x_wins, hi_wins)
    raise NotImplementedError(prim)  # pragma: no cover


def _index(*wins: jax.Array) -> jax.Array:
    """k where the k-th (1-based) of the disjoint conditions holds, 0 where none does."""
    out = None
    for k, w in enumerate(wins, start=1):
        term = lax.mul(lax.convert_element_type(w, jnp.int32), np.int32(k))
        out = term if out is None else lax.add(out, term)
    return out


def _decided_by_value(eqn, outs, invals, ctx):
    if ctx.structural:
        return elementwise(eqn, outs, invals, ctx)
    shape = _shape(eqn.outvars[0])
    win = None if eqn.primitive is P.select_n_p else winner(eqn, invals)
    first = 1 if eqn.primitive is P.select_n_p else 0  # select_n's predicate carries no lanes
    masks: list[Mask] = [None] * first
    pred = invals[0] if eqn.primitive is P.select_n_p else None
    for k, v in enumerate(eqn.invars[first:], start=first):
        operand = k - first + 1
        if eqn.primitive is P.select_n_p:
            if pred.dtype == jnp.bool_:
                picked = _bcast(pred, shape)
                live = picked if operand == 2 else not_mask(picked)
            else:
                live = _bcast(lax.eq(pred, np.asarray(operand - 1, pred.dtype)), shape)
        else:
            live = lax.bitwise_or(lax.eq(win, np.int32(operand)), lax.eq(win, np.int32(0)))
        masks.append(fit(all_of([live, outs[0]]), _shape(v)))
    return masks


register(P.select_n_p, P.max_p, P.min_p, P.clamp_p, drops=lambda eqn: True,
         decided_by_value=True)(_decided_by_value)


# --------------------------------------------------------------------------- data movement

def _by_transpose(eqn, outs, invals, ctx):
    """Lanes that a linear data-movement op reads for live outputs: transpose it on the mask.

    The transpose of slice is pad, of gather is scatter-add, of dynamic_slice is
    dynamic_update_slice, ...: JAX already knows where every operand lane goes.
    """
    cts_out = [lax.convert_element_type(materialize(m, _shape(o)), jnp.float32)
               for m, o in zip(outs, eqn.outvars)]
    float_ix = [i for i, v in enumerate(eqn.invars) if is_float(v)]

    def op(*floats):
        by_index = dict(zip(float_ix, floats))  # the other operands (indices) are read as is
        vals = [by_index[i] if i in by_index else invals[i] for i in range(len(eqn.invars))]
        return bind_eqn(eqn, vals)

    primals = [lax.full(_shape(eqn.invars[i]), 0., jnp.float32) for i in float_ix]
    _, vjp = jax.vjp(op, *primals)
    cts = vjp(cts_out)
    masks: list[Mask] = [None] * len(eqn.invars)
    for i, c in zip(float_ix, cts):
        masks[i] = lax.gt(c, np.float32(0))
    return masks


def _slice(eqn, outs, invals, ctx):
    """The lanes a static slice reads: its mask padded with False (the transpose of slice)."""
    shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if outs[0] is None and shape == out_shape:
        return [None]
    out = materialize(outs[0], out_shape)
    starts = eqn.params["start_indices"]
    strides = eqn.params["strides"] or (1,) * len(shape)
    if 0 in out_shape:
        return [zeros(shape)]
    config = []
    for n, lo, k, step in zip(shape, starts, out_shape, strides):
        last = lo + (k - 1) * step
        config.append((int(lo), int(n - 1 - last), int(step - 1)))
    return [pad_mask(out, config, shape)]


def _gather(eqn, outs, invals, ctx):
    """A gather reads, for each output lane, operand lanes at the same batching coordinates: the
    operand's mask (a scatter of the output's) lies inside the output mask's rows."""
    masks = _by_transpose(eqn, outs, invals, ctx)
    out = outs[0]
    if out is None or masks[0] is None:
        return masks
    dn = eqn.params["dimension_numbers"]
    out_rank = len(_shape(eqn.outvars[0]))
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    index_dims = range(len(_shape(eqn.invars[1])) - 1)  # the last: the index vector
    to_operand = {}
    for o, i in zip(batch_out, index_dims):
        if i in dn.start_indices_batching_dims:
            to_operand[o] = dn.operand_batching_dims[dn.start_indices_batching_dims.index(i)]
    core, axes = factor(out)
    if all(a in to_operand for a in axes):
        within(masks[0], place(core, [to_operand[a] for a in axes], _shape(eqn.invars[0])))
    return masks


register(P.slice_p, drops=lambda eqn: True)(_slice)
register(P.gather_p, drops=lambda eqn: True)(_gather)
register(P.dynamic_slice_p, P.dynamic_update_slice_p,
         drops=lambda eqn: True)(_by_transpose)
register(P.pad_p, drops=lambda eqn: any(lo < 0 or hi < 0 for lo, hi, _ in
                                        eqn.params["padding_config"]))(_by_transpose)
register(P.rev_p)(_by_transpose)


# Permutations of lanes: the mask moves as the values do (no float round trip through a vjp).

def _transpose(eqn, outs, invals, ctx):
    out = outs[0]
    if out is None:
        return [None]
    return [move_axes(out, eqn.params["permutation"], _shape(eqn.invars[0]))]


def _reshape(eqn, outs, invals, ctx):
    out = outs[0]
    if out is None:
        return [None] * len(eqn.invars)
    if eqn.primitive is P.reshape_p and (eqn.params.get("dimensions") is not None
                                         or len(eqn.invars) != 1):
        return _by_transpose(eqn, outs, invals, ctx)  # pragma: no cover - rare forms
    return [reshape_mask(out, _shape(eqn.invars[0]))]


def _concatenate(eqn, outs, invals, ctx):
    out = outs[0]
    if out is None:
        return [None] * len(eqn.invars)
    axis, start, masks = eqn.params["dimension"], 0, []
    for v in eqn.invars:
        size = _shape(v)[axis]
        masks.append(slice_mask(out, axis, start, start + size))
        start += size
    return masks


def _split(eqn, outs, invals, ctx):
    if all(m is None for m in outs):
        return [None]
    return [concat_masks(outs, [_shape(o) for o in eqn.outvars], eqn.params["axis"])]


register(P.transpose_p)(_transpose)
register(P.reshape_p, P.squeeze_p)(_reshape)
register(P.concatenate_p)(_concatenate)
register(*[p for p in [getattr(lax, "split_p", None)] if p is not None])(_split)


def _broadcast_in_dim(eqn, outs, invals, ctx):
    out = outs[0]
    masks: list[Mask] = [None] * len(eqn.invars)
    if out is None:
        return masks
    in_shape = _shape(eqn.invars[0])
    bdims = tuple(eqn.params["broadcast_dimensions"])
    others = tuple(d for d in range(out.ndim) if d not in bdims)
    m = reduce_any(out, others)
    size_one = tuple(k for k, size in enumerate(in_shape) if size == 1 and m.shape[k] != 1)
    m = reduce_any(m, size_one, keepdims=True)
    masks[0] = reshape_mask(m, in_shape)
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
    m = broadcast_mask(out, in_shape, kept)
    return [m] + [fit(out, _shape(v)) for v in eqn.invars[1:]]


register(P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p)(_reduction)


def _cumulative(eqn, outs, invals, ctx):
    """Lane j of a cumulative op feeds outputs j, j+1, ... (or j, j-1, ... when reversed)."""
    out = outs[0]
    if out is None:
        return [None]
    axis, reverse = eqn.params["axis"], eqn.params["reverse"]
    counts = lax.cummax(lax.convert_element_type(out, jnp.int32), axis=axis,
                        reverse=not reverse)
    return [lax.gt(counts, np.int32(0))]


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
    m_a = reduce_any(out, a_out_axes)
    m_b = reduce_any(out, b_out_axes)
    m_a = broadcast_mask(m_a, a_shape, tuple(lb) + tuple(a_free))
    m_b = broadcast_mask(m_b, b_shape, tuple(rb) + tuple(b_free))
    return [m_a, m_b]


register(P.dot_general_p)(_dot_general)


# --------------------------------------------------------------------------- nested jaxprs

def _call_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr:
    params = eqn.params
    inner = params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]
    return inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())


def _call_masks(eqn, outs, invals, ctx):
    structural = ctx.structural or eqn.primitive in OPAQUE_BODIES
    return ctx.inner_masks(_call_jaxpr(eqn), invals, outs, structural)


def _call_kinds(eqn, out_kinds, ctx):
    structural = ctx.structural or eqn.primitive in OPAQUE_BODIES
    return ctx.inner_kinds(_call_jaxpr(eqn), out_kinds, structural)


CUSTOM_RULE_CALLS: frozenset[Primitive] = frozenset({P.custom_jvp_call_p, P.custom_vjp_call_p})
"""Calls whose derivative is a user rule: liveness through them is structural only."""

OPAQUE_BODIES: frozenset[Primitive] = CUSTOM_RULE_CALLS | {P.remat_p}
"""Bodies that run again, as one unit, on guarded operands: liveness through them is structural
(jit bodies are inlined instead, so their decisions read the original values)."""

register(P.jit_p, P.closed_call_p, P.remat_p, P.custom_jvp_call_p, P.custom_vjp_call_p,
         kinds=_call_kinds)(_call_masks)


def _cond_masks(eqn, outs, invals, ctx):
    # structural: the branch is re-run on the guarded operands and decides on what it reads
    index, operands = invals[0], invals[1:]
    per_branch = [ctx.inner_masks(br, operands, outs, True) for br in eqn.params["branches"]]
    masks: list[Mask] = [None]
    for k, v in enumerate(eqn.invars[1:]):
        branch_masks = [m[k] for m in per_branch]
        if all(m is None for m in branch_masks):
            masks.append(None)
            continue
        cases = [materialize(m, _shape(v)) for m in branch_masks]
        which = lax.clamp(np.int32(0), lax.convert_element_type(index, jnp.int32),
                          np.int32(len(cases) - 1))
        masks.append(lax.select_n(which, *cases) if len(cases) > 1 else cases[0])
    return masks


def _cond_kinds(eqn, out_kinds, ctx):
    per_branch = [ctx.inner_kinds(br, out_kinds, True) for br in eqn.params["branches"]]
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
        live = any_of([reduce_any(m, range(m.ndim)) for m in out_masks])
        return [None if live is None else broadcast(live, _shape(v)) for v in eqn.invars]
    return rule.masks(eqn, list(out_masks), invals, ctx)


def has_rule(prim: Primitive) -> bool:
    return prim in RULES


# --------------------------------------------------------------------------- static masks
# The static pass tracks each mask as a boolean formula over the select predicates (see
# _symbolic.py). Then `jnp.where(x > 0, sqrt(x), x * 0.5)` gives x the masks `p & out` and
# `~p & out`, whose union simplifies to `out`: x is as live as the where's result (LIVE when that
# is), and nothing downstream of the guard counts as changed. Masks cross the ops whose operand
# lanes map to output lanes axis by axis (`alignment`); anything else is an unknown.

_SMALL_CONSTANT = 64  # predicates computed from literals are folded up to this many lanes


def sym_of_kind(kind: Kind) -> Sym:
    return TRUE if kind == Kind.LIVE else FALSE if kind == Kind.DEAD else opaque()


def kind_of_sym(sym: Sym) -> Kind:
    if frozenset() in sym:
        return Kind.LIVE
    return Kind.MAYBE if sym else Kind.DEAD


def _same_rank_alignment(ins: tuple, outs: tuple) -> Optional[list]:
    if not ins:
        return []
    if len(ins) != len(outs):
        return None
    return [i if ins[i] == outs[i] else None for i in range(len(ins))]


def _reshape_alignment(ins: tuple, outs: tuple) -> Optional[list]:
    """Only reshapes that insert or remove size-1 axes keep the other axes' lanes."""
    big_in = [i for i, n in enumerate(ins) if n != 1]
    big_out = [o for o, n in enumerate(outs) if n != 1]
    if [ins[i] for i in big_in] != [outs[o] for o in big_out]:
        return None
    align: list = [None] * len(ins)
    for i, o in zip(big_in, big_out):
        align[i] = o
    return align


def alignment(eqn: JaxprEqn, k: int) -> Optional[list]:
    """For operand k of a one-output equation: the output axis each of its axes runs along
    (None for an axis that is reduced, contracted or broadcast), or None when its lanes do not
    map to output lanes axis by axis (slices, gathers, general reshapes, ...)."""
    if len(eqn.outvars) != 1:
        return None
    prim = eqn.primitive
    ins, outs = _shape(eqn.invars[k]), _shape(eqn.outvars[0])
    rule = RULES.get(prim)
    if rule is not None and rule.masks in (elementwise, _decided_by_value):
        return _same_rank_alignment(ins, outs)
    if rule is not None and rule.masks is _reduction:
        if k != 0:
            return None
        kept = [d for d in range(len(ins)) if d not in eqn.params["axes"]]
        align = [None] * len(ins)
        for j, d in enumerate(kept):
            align[d] = j
        return align
    if prim is P.broadcast_in_dim_p and k == 0:
        return [d if ins[j] == outs[d] else None
                for j, d in enumerate(eqn.params["broadcast_dimensions"])]
    if prim is P.transpose_p:
        align = [None] * len(ins)
        for j, d in enumerate(eqn.params["permutation"]):
            align[d] = j
        return align
    if prim in (P.reshape_p, P.squeeze_p) and k == 0:
        return _reshape_alignment(ins, outs)
    if prim is P.dot_general_p:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        contract, batch = (lc, lb) if k == 0 else (rc, rb)
        free = [d for d in range(len(ins)) if d not in contract and d not in batch]
        a_shape = _shape(eqn.invars[0])
        n_lhs_free = len(a_shape) - len(lc) - len(lb)
        first = len(lb) + (0 if k == 0 else n_lhs_free)
        align = [None] * len(ins)
        for j, d in enumerate(batch):
            align[d] = j
        for j, d in enumerate(free):
            align[d] = first + j
        return align
    return None


def operand_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context,
                 constant: Callable[[Any], Any] = lambda atom: None,
                 producer_of: Callable[[Var], Optional[JaxprEqn]] = lambda v: None) -> list[Sym]:
    """The static pass's rule: symbolic liveness of each operand. `constant(atom)` is the
    atom's value when the program computes it from literals alone, else None; `producer_of`
    gives a variable's equation (predicates are followed back through broadcasts)."""
    n = len(eqn.invars)
    if all(not m for m in out_syms):
        return [FALSE] * n
    rule = RULES.get(eqn.primitive)
    out = out_syms[0]
    pred = eqn.invars[0] if n else None  # iota, platform_index, ...: no operand
    if (eqn.primitive is P.select_n_p and not ctx.structural and n == 3
            and pred.aval.dtype == jnp.bool_ and _shape(pred) in (_shape(eqn.outvars[0]), ())):
        value = constant(pred)  # `jnp.where(True, a, b)`: b's side is dropped everywhere
        if value is not None and (bool(np.all(value)) or not np.any(value)):
            untaken = opaque() if out else FALSE  # dropped, yet differentiated (a zero cotangent)
            return [FALSE, untaken, out] if np.all(value) else [FALSE, out, untaken]
        if isinstance(pred, Var):
            lit = S.predicate_literal(pred, True, producer_of)
            return [FALSE, sym_and_literal(out, S.negate(lit)), sym_and_literal(out, lit)]
    if len(eqn.outvars) == 1 and rule is not None and rule.kinds is None:
        decided = rule.decided_by_value and not ctx.structural
        identity = list(range(len(_shape(eqn.outvars[0]))))
        syms: list[Sym] = []
        for k, v in enumerate(eqn.invars):
            if isinstance(v, Literal):  # carries no liveness
                syms.append(FALSE)
                continue
            align = alignment(eqn, k)
            if align is None:
                break
            sym = out if align == identity else S.move(out, S.backward_mapping(align))
            if decided and sym:  # which operand wins is decided by value, at run time
                shape = _shape(v)
                sym = sym_and_literal(sym, S.unknown(i for i, n in enumerate(shape) if n != 1))
            syms.append(sym)
        else:
            return syms
    kinds = operand_kinds(eqn, [kind_of_sym(m) for m in out_syms], ctx)
    return [sym_of_kind(k) for k in kinds]


# --------------------------------------------------------------------------- the backward pass

def literal_value(atom: Literal) -> Any:
    """A literal's value with its dtype: a Python scalar (`jnp.where(True, ...)`) has none,
    and rules read `.dtype` of their operands."""
    val = atom.val
    if isinstance(val, (bool, int, float, complex)):
        return np.asarray(val, atom.aval.dtype)
    return val


def read(env: dict, atom) -> Any:
    return literal_value(atom) if isinstance(atom, Literal) else env[atom]


def evaluate(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> dict:
    """The original value of every variable of `jaxpr` (emitted on the current trace)."""
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, bind_eqn(eqn, [read(env, v) for v in eqn.invars])))
    return env


class LazyOperands(Sequence):
    """An equation's operands from `env`, each read only if a rule asks for it (reading an
    original value may compute it)."""

    def __init__(self, env, atoms: Sequence[Any]):
        self.env, self.atoms = env, atoms

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [read(self.env, a) for a in self.atoms[k]]
        return read(self.env, self.atoms[k])

    def __len__(self) -> int:
        return len(self.atoms)


class Sweep:
    """Static liveness of one jaxpr, and the run-time masks on demand.

    Built once per (jaxpr, output kinds, mode); `masks` emits the mask computation for the values
    that are asked for, walking the equations backward.
    """

    def __init__(self, jaxpr: Jaxpr, out_kinds: Sequence[Kind], structural: bool):
        self.jaxpr = jaxpr
        self.ctx = Context(structural, inner_masks, inner_kinds)
        self.diff = [differentiable_operands(e, structural) for e in jaxpr.eqns]
        self.producer = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
        self._constants: dict = {}
        self._from_literals: Optional[set] = None
        syms: dict[Var, Sym] = {}
        for v, k in zip(jaxpr.outvars, out_kinds):
            if not isinstance(v, Literal):
                syms[v] = sym_or(syms.get(v, FALSE), sym_of_kind(k))
        for eqn, diff in zip(reversed(jaxpr.eqns), reversed(self.diff)):
            out_syms = [syms.get(o, FALSE) for o in eqn.outvars]
            for v, m, d in zip(eqn.invars, operand_syms(eqn, out_syms, self.ctx, self.constant,
                                                        self.producer_of), diff):
                if d:
                    syms[v] = sym_or(syms.get(v, FALSE), m)
        self.syms = syms
        self.kinds = {v: kind_of_sym(m) for v, m in syms.items()}
        self.consumers: dict[Var, list[tuple[int, int]]] = {}
        for i, (eqn, diff) in enumerate(zip(jaxpr.eqns, self.diff)):
            for k, (v, d) in enumerate(zip(eqn.invars, diff)):
                if d:
                    self.consumers.setdefault(v, []).append((i, k))

    def producer_of(self, v: Var) -> Optional[JaxprEqn]:
        i = self.producer.get(v)
        return None if i is None else self.jaxpr.eqns[i]

    def sym(self, atom) -> Sym:
        """The static mask of a value (FALSE for literals and values no output reads)."""
        return FALSE if isinstance(atom, Literal) else self.syms.get(atom, FALSE)

    def constant(self, atom) -> Any:
        """The value of a small atom that the program computes from literals alone, else None
        (asked for select predicates only, so programs without such pay nothing)."""
        if isinstance(atom, Literal):
            return np.asarray(atom.val, atom.aval.dtype)
        if self._from_literals is None:  # one forward pass: what is computed from literals only
            self._from_literals = found = set()
            for eqn in self.jaxpr.eqns:
                if all(isinstance(u, Literal) or u in found for u in eqn.invars):
                    found.update(eqn.outvars)
        if atom not in self._from_literals:
            return None
        return postorder(atom, self._constants, self._constant_inputs, self._fold)

    def _foldable(self, v) -> Optional[JaxprEqn]:
        i = self.producer.get(v)
        eqn = None if i is None else self.jaxpr.eqns[i]
        if (eqn is None or len(eqn.outvars) != 1 or eqn.effects or eqn.primitive not in RULES
                or math.prod(_shape(v)) > _SMALL_CONSTANT
                or any(isinstance(p, (Jaxpr, ClosedJaxpr)) for p in eqn.params.values())):
            return None
        return eqn

    def _constant_inputs(self, v) -> list:
        eqn = self._foldable(v)
        return [] if eqn is None else [u for u in eqn.invars if isinstance(u, Var)]

    def _fold(self, v) -> Any:
        eqn = self._foldable(v)
        if eqn is None:
            return None
        args = [self._constants[u] if isinstance(u, Var) else np.asarray(u.val, u.aval.dtype)
                for u in eqn.invars]
        if any(a is None for a in args):
            return None
        try:
            with jax.ensure_compile_time_eval():  # a constant, even under an outer jit
                return np.asarray(bind_eqn(eqn, args)[0])
        except Exception:  # noqa: BLE001 - not foldable: unknown, as before
            return None

    def _note_broadcasts(self, env, atom) -> None:
        """Tell the mask algebra that a predicate the program broadcasts is a smaller core."""
        chain = []
        while isinstance(atom, Var):
            eqn = self.producer_of(atom)
            if eqn is None or eqn.primitive is not P.broadcast_in_dim_p or \
                    isinstance(eqn.invars[0], Literal) or len(eqn.invars) != 1:
                break
            chain.append(eqn)
            atom = eqn.invars[0]
        for eqn in reversed(chain):  # the innermost first: its core composes into the next
            register_broadcast(env[eqn.outvars[0]], env[eqn.invars[0]],
                               eqn.params["broadcast_dimensions"])

    def kind(self, atom) -> Kind:
        if isinstance(atom, Literal):
            return Kind.DEAD
        return self.kinds.get(atom, Kind.DEAD)

    def masks(self, env, out_masks: Sequence[Mask]) -> Callable[[Any], Mask]:
        """Returns `mask_of(var)`, which emits a variable's run-time mask on first demand.

        A demand walks only the region that the mask depends on: forward from the variable
        through its consumers, up to values that are statically LIVE or DEAD. `env` maps a
        variable to its original value (it may compute values on demand).
        """
        eqns, consumers, producer = self.jaxpr.eqns, self.consumers, self.producer
        given: dict[Var, list[Mask]] = {}
        for v, m in zip(self.jaxpr.outvars, out_masks):
            if not isinstance(v, Literal):
                given.setdefault(v, []).append(m)
        memo: dict[Var, Mask] = {}
        eqn_masks: dict[int, list[Mask]] = {}

        def settled(v) -> Mask:
            kind = self.kind(v)
            if kind == Kind.LIVE:
                return None
            if kind == Kind.DEAD:
                return zeros(_shape(v))
            return memo[v]

        def mask_of(v) -> Mask:
            if self.kind(v) != Kind.MAYBE or v in memo:
                return settled(v)
            region, seen, stack = [], set(), [v]
            while stack:
                u = stack.pop()
                if u in seen or u in memo or self.kind(u) != Kind.MAYBE:
                    continue
                seen.add(u)
                region.append(u)
                for i, _ in consumers.get(u, ()):
                    stack.extend(o for o in eqns[i].outvars if not isinstance(o, Literal))
            region.sort(key=lambda u: producer.get(u, -1), reverse=True)
            for u in region:  # consumers' outputs first
                contribs = list(given.get(u, ()))
                for i, k in consumers.get(u, ()):
                    if i not in eqn_masks:
                        eqn = eqns[i]
                        if eqn.primitive is P.select_n_p:
                            self._note_broadcasts(env, eqn.invars[0])
                        eqn_masks[i] = operand_masks(
                            eqn, [settled(o) for o in eqn.outvars],
                            LazyOperands(env, eqn.invars), self.ctx)
                    contribs.append(eqn_masks[i][k])
                memo[u] = any_of(contribs) if contribs else zeros(_shape(u))
            return memo[v]
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
    mask_of = sweep.masks(env, out_masks)
    return [mask_of(v) for v in invars]
