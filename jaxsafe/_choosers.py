"""Primitives that choose lanes by value: their liveness, and how they are emitted again.

A *chooser*'s derivative reaches only the operand lanes its original values choose: the maximum
of a `reduce_max` row (ties share it), the lanes a `cummax` or a max-pooling window picks, the
lanes that a `sort` or `top_k` moves to a live position, the lanes of `v` in `m * v` where a
factor `m` that carries no derivative is not zero. Every other lane is dropped.

**Liveness** is read off JAX's own derivative (`support_masks`): the vector-Jacobian product at
the original values, with the outputs' masks (1 where live) as the cotangent, is nonzero exactly
on the operand lanes some live output's derivative reads. So the rule follows JAX's definition
of each derivative (ties in `reduce_max` share, a pooling window gives its cotangent to one
lane), whatever its implementation.

**Emission** (`Chooser.emit`): once a guard changes an operand's dropped lanes, the choice is
made again on the original values, never on guarded ones, and a dropped lane gets a derivative
of exactly zero by a `select_n`, not by a zero weight that an infinite cotangent turns into NaN:

- `by_wins` (`max`, `min`, `clamp`): each operand where it wins alone, the operation on ties;
- `by_fill` (`reduce_max`, `cummax`, pooling): dropped lanes take their original values, cut
  from differentiation, so the choice is the original's; a result that only dropped lanes make
  holds the original value too (NaN or inf included: what reads it there is guarded if its
  derivative weighs it, `Chooser.guarded_results`);
- `by_permutation` (`sort`, `top_k`): the original permutation, gathered from guarded operands;
- `by_held` (`segment_max`, `x.at[i].max(u)`): every dropped lane holds its original value;
- `by_original` (`m * v`): where a factor drops an operand lane of a live output, the original
  product with its derivative cut (the forward value, NaN and the sign of zero included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._atoms import dtype_of, farthest, is_float, literal_value, shape_of
from ._compat import JaxprEqn, Literal, Var, bind_eqn, sharded_like, varying_like
from ._constants import fold_chain, lane_chain
from ._liveness_rules import (
    aligned_syms,
    dot_general_masks,
    elementwise_masks,
    pulled_back,
    top_k_axis,
)
from ._masks import (
    all_of,
    any_of,
    broadcast,
    broadcast_mask,
    decided_per_lane,
    fit,
    known_false,
    materialize,
    not_mask,
    reduce_any,
    selecting,
    zeros,
)
from ._rules import Context, Mask, MaskRule, StaticRule, rule_for
from ._symbolic import TRUE, Lit, Sym, known_lanes, predicate_literal, sym_and_literal, unknown

# --------------------------------------------------------------------------- liveness


def _rows_read(eqn: JaxprEqn, outs: list[Mask], axis: int) -> list[Mask]:
    """Every lane of a row along `axis` live where any output lane of that row is: a sort or
    `top_k` in a body that re-runs as one unit, which decides nothing on values (the other
    axes keep their masks: a batch of matrices sorts matrix by matrix)."""
    if any(m is None for m in outs):
        return [None] * len(eqn.invars)
    row = any_of([reduce_any(m, (axis,), keepdims=True) for m in outs])
    return [None if row is None else broadcast(row, shape_of(v)) for v in eqn.invars]


def _pulled_back(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                 widen: bool = False) -> list[Any]:
    """`pulled_back` at the original operands, their derivative cut. `widen`: in float32 at
    least, so that a tie's share (1 / count) does not round to zero; not for a scatter, whose
    combiner is typed in its operand's dtype (a narrow dtype's share is at least 2 ** -24 then,
    from a count below 2 ** 24)."""
    widen = widen and eqn.params.get("update_jaxpr") is None

    def primal(x: Any, var: Any) -> Any:
        x = lax.stop_gradient(jnp.asarray(x))
        if widen and jnp.finfo(x.dtype).bits < 32:
            return lax.convert_element_type(x, jnp.float32)
        return x
    return pulled_back(eqn, outs, invals, primal)


def _nonzero(x: Any) -> jax.Array:
    return lax.ne(x, lax.full_like(x, 0))


def _all_dropped(eqn: JaxprEqn, outs: list[Mask]) -> list[Mask] | None:
    """Every operand lane dropped when every output lane is (no mask is computed then)."""
    if all(m is not None and known_false(m) for m in outs):
        return [zeros(shape_of(v)) for v in eqn.invars]
    return None


def support_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                  ctx: Context) -> list[Mask]:
    """The operand lanes that a live output's derivative reads, by JAX's own derivative: a
    permutation (`sort`, `top_k`) moves the outputs' masks back to the lanes they came from."""
    if ctx.structural:
        return _rows_read(eqn, outs, top_k_axis(eqn)[0])
    return _supported(eqn, outs, invals)


def _supported(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
               widen: bool = False) -> list[Mask]:
    """Where JAX's derivative at the original values reads each float operand (`support_masks`;
    `widen`: as `_pulled_back`)."""
    dropped = _all_dropped(eqn, outs)
    if dropped is not None:
        return dropped
    return [None if c is None else _nonzero(c)
            for c in _pulled_back(eqn, outs, invals, widen=widen)]


ReadsRule = Callable[[JaxprEqn, jax.Array, Any], Mask]
"""(equation, a mask of its outputs, the operand) -> the operand lanes those outputs read,
whatever the values (the row, the prefix, the window)."""

ChosenRule = Callable[[JaxprEqn, list, Any, Any], jax.Array]
"""(equation, output masks, original operand, original output) -> the operand lanes that a live
output's derivative chooses."""


def row_reads(eqn: JaxprEqn, out: jax.Array, x: Any) -> jax.Array:
    """A reduction: its rows."""
    kept = tuple(d for d in range(np.ndim(x)) if d not in eqn.params["axes"])
    return broadcast_mask(out, np.shape(x), kept)


def reads_as(primitive: Any) -> ReadsRule:
    """Reads as the linear `primitive` with the same parameters does (by its transpose): a
    cumulative sum for `cummax`, a window sum for max pooling."""
    def reads(eqn: JaxprEqn, out: jax.Array, x: Any) -> Mask:
        if not is_float(eqn.invars[0]):
            return None  # an integer `cummax` (a constant in a body): every lane
        twin = eqn.replace(primitive=primitive)
        return _nonzero(_pulled_back(twin, [out], [lax.full_like(x, 0)])[0])
    return reads


def comparison_masks(reads: ReadsRule, chosen: ChosenRule | None = None) -> MaskRule:
    """`reduce_max`, `cummax`, max pooling (and min): the lanes JAX's derivative of a live output
    chooses (a tie's share counts; `chosen`, by default read off the derivative), and every lane
    a live output reads where that output or the lane is NaN: XLA's NaN handling in a reduction
    is its own, so a NaN never counts as lost."""
    choose = _chosen_by_derivative if chosen is None else chosen

    def masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
              ctx: Context) -> list[Mask]:
        return _comparison_masks(eqn, outs, invals, ctx, reads, choose)
    return masks


def _comparison_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any], ctx: Context,
                      reads: ReadsRule, choose: ChosenRule) -> list[Mask]:
    dropped = _all_dropped(eqn, outs)
    if dropped is not None:
        return dropped
    x = invals[0]
    if ctx.structural:  # a body re-run as one unit: every lane a live output reads (its row)
        return [None if outs[0] is None else reads(eqn, outs[0], x)]
    out = bind_eqn(eqn, [x])[0]  # the original output (XLA computes it once)
    chosen = choose(eqn, outs, x, out)
    live = materialize(outs[0], out.shape)
    nan_out = lax.bitwise_and(live, lax.ne(out, out))
    nan_read = lax.bitwise_or(reads(eqn, nan_out, x),
                              lax.bitwise_and(lax.ne(x, x), reads(eqn, live, x)))
    return [lax.bitwise_or(chosen, nan_read)]


def _chosen_by_derivative(eqn: JaxprEqn, outs: list[Mask], x: Any, out: Any) -> jax.Array:
    return _nonzero(_pulled_back(eqn, outs, [x], widen=True)[0])


def running_choice(nearest: Callable, far: int) -> ChosenRule:
    """`cummax` (`cummin`): a lane is chosen where it equals the running maximum at the nearest
    live output that reads it, since the running maximum only grows along the scan (JAX's
    derivative shares a tie). Two cumulative ops, where the derivative would be a scan tree.
    A lane that no live output reads is not chosen, whatever it holds (an inf equals the fill).
    `far`: the side (+1 or -1) of the fill that `nearest` never picks over a live output."""
    def chosen(eqn: JaxprEqn, outs: list[Mask], x: Any, out: Any) -> jax.Array:
        axis, reverse = eqn.params["axis"], eqn.params["reverse"]
        live = selecting(outs[0], out)
        at_live = lax.select_n(live, lax.full_like(out, farthest(out.dtype, far)), out)
        read = lax.cummax(lax.convert_element_type(live, np.int32), axis=axis,
                          reverse=not reverse) > 0
        return lax.bitwise_and(read, lax.eq(x, nearest(at_live, axis=axis, reverse=not reverse)))
    return chosen


def _tiling(eqn: JaxprEqn) -> tuple[int, ...] | None:
    """A pooling's window dimensions when its windows tile the operand (strides equal to the
    window, no padding, no dilation: each lane is in one window at most), else None."""
    p = eqn.params
    if (tuple(p["window_strides"]) != tuple(p["window_dimensions"])
            or any(lo or hi for lo, hi in p["padding"])
            or any(d != 1 for d in (*p["base_dilation"], *p["window_dilation"]))):
        return None
    return tuple(p["window_dimensions"])


def _tiled(x: Any, counts: Sequence[int], window: Sequence[int]) -> jax.Array:
    """`x` cut to whole windows, as (count0, window0, count1, window1, ...) (a bitcast)."""
    x = lax.slice(x, [0] * len(window), [n * w for n, w in zip(counts, window, strict=True)])
    return lax.reshape(x, [d for n, w in zip(counts, window, strict=True) for d in (n, w)])


def _untiled(t: jax.Array, shape: Sequence[int], counts: Sequence[int],
             window: Sequence[int]) -> jax.Array:
    """Back to the operand's shape; lanes after the last whole window are read by none."""
    t = lax.reshape(t, [n * w for n, w in zip(counts, window, strict=True)])
    return lax.pad(t, np.array(False), [(0, d - n * w, 0)
                                        for d, n, w in zip(shape, counts, window, strict=True)])


def _per_window(v: Any, counts: Sequence[int]) -> jax.Array:
    """An output-shaped value as (count0, 1, count1, 1, ...), to broadcast over its window."""
    return lax.reshape(v, [d for n in counts for d in (n, 1)])


def window_reads(window_sum: Any) -> ReadsRule:
    """A pooling: the lanes of the live windows. Windows that tile the operand: a broadcast;
    others: as `window_sum` (the window-sum primitive) reads, by its transpose."""
    by_transpose = reads_as(window_sum)

    def reads(eqn: JaxprEqn, out: jax.Array, x: Any) -> jax.Array:
        window = _tiling(eqn)
        if window is None:
            return by_transpose(eqn, out, x)
        counts = out.shape
        shape = [d for n, w in zip(counts, window, strict=True) for d in (n, w)]
        up = lax.broadcast_in_dim(_per_window(out, counts), shape, tuple(range(len(shape))))
        return _untiled(up, np.shape(x), counts, window)
    return reads


def window_choice(reads: ReadsRule) -> ChosenRule:
    """A pooling whose windows tile the operand: in each live window, the first lane (in
    row-major window order) equal to the window's result, the lane JAX's derivative
    (`select_and_scatter_add`, keeping the earlier lane on a tie) hands it to. Elementwise
    work, where the derivative would be a select-and-scatter; other windows: the derivative.
    Dilated windows, whose reverse-mode derivative JAX does not implement (their forward mode
    selects, it does not multiply): every lane a live window `reads` counts as chosen."""
    def chosen(eqn: JaxprEqn, outs: list[Mask], x: Any, out: Any) -> jax.Array:
        window = _tiling(eqn)
        if window is not None:
            return _tiled_choice(eqn, outs, x, out, window)
        p = eqn.params
        if any(d != 1 for d in (*p["base_dilation"], *p["window_dilation"])):
            return reads(eqn, materialize(outs[0], np.shape(out)), x)
        return _chosen_by_derivative(eqn, outs, x, out)
    return chosen


def _tiled_choice(eqn: JaxprEqn, outs: list[Mask], x: Any, out: Any,
                  window: tuple[int, ...]) -> jax.Array:
    counts = out.shape
    xt = _tiled(x, counts, window)
    shape = xt.shape
    every = tuple(range(len(shape)))
    at = lax.broadcast_in_dim(_per_window(out, counts), shape, every)
    live = lax.broadcast_in_dim(_per_window(materialize(outs[0], counts), counts), shape, every)
    position = np.zeros(shape, np.int32)  # each lane's place in its window, row-major
    stride = 1
    for axis in range(len(shape) - 1, 0, -2):
        position = position + stride * lax.broadcasted_iota(np.int32, shape, axis)
        stride *= shape[axis]
    equal = lax.eq(xt, at)
    first = lax.reduce_min(lax.select_n(equal, lax.full_like(position, stride), position),
                           tuple(range(1, len(shape), 2)))
    first = lax.broadcast_in_dim(_per_window(first, counts), shape, every)
    chosen = lax.bitwise_and(lax.bitwise_and(equal, lax.eq(position, first)), live)
    return _untiled(chosen, np.shape(x), counts, window)


def sort_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
               ctx: Context) -> list[Mask]:
    """A lane is live where its sorted position is (for each operand, its own output). An
    unstable sort with several operands may order ties differently when run again, and a
    structural sweep decides nothing on values: every lane of a row along the sort's axis then
    stays live where any output lane of that row is (`_rows_read`, as the static rule,
    `along_axes_syms`, carries the other axes)."""
    if ctx.structural or not eqn.params["is_stable"] and len(eqn.invars) > 1:
        return _rows_read(eqn, outs, eqn.params["dimension"])
    return _supported(eqn, outs, invals)


def scatter_choice_masks(twin: MaskRule) -> MaskRule:
    """`x.at[i].max(u)`, `segment_max` (and min): an operand or update lane is live where a
    live result's derivative reads it, by JAX's own derivative (the lanes equal to the
    result, ties sharing; an update sent out of range reads nothing), and where the scatter-add
    with the same parameters (`twin`) reads it from a live result that is NaN, or it is NaN
    itself: as for `reduce_max`, a NaN never counts as lost (JAX's derivative gives it no
    share, and plain JAX's `0 * NaN` stays). A loser in a live segment is dropped, and so is
    every lane of a segment a `where` drops. Structurally (a body re-run as one unit), where
    the twin reads it."""
    def masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
              ctx: Context) -> list[Mask]:
        if ctx.structural:
            return twin(eqn, outs, invals, ctx)
        chosen = _supported(eqn, outs, invals, widen=True)
        if _all_dropped(eqn, outs) is not None:
            return chosen
        operands = [invals[k] for k in range(len(eqn.invars))]
        out = bind_eqn(eqn, operands)[0]  # the original output (XLA computes it once)
        live = materialize(outs[0], np.shape(out))
        read_by_nan = twin(eqn, [lax.bitwise_and(live, lax.ne(out, out))], invals, ctx)
        read = twin(eqn, outs, invals, ctx)
        result: list[Mask] = []
        for k, (c, v) in enumerate(zip(chosen, eqn.invars, strict=True)):
            if c is None or not is_float(v):
                result.append(c)
                continue
            x = operands[k]
            by_nan = any_of([read_by_nan[k], all_of([lax.ne(x, x), read[k]])])
            result.append(any_of([c, materialize(by_nan, np.shape(x))]))
        return result
    return masks


def scatter_choice_syms(twin: StaticRule) -> StaticRule:
    """`scatter_choice_masks`, statically: where the scatter-add twin reads (a coarser formula
    than the run-time mask, which also drops the losers: a segment a `where` drops stays a row
    formula, which a guard before `x @ w` names), and where the twin reads every lane, which
    lanes win decided at run time (an unknown over every axis of the operand and the updates),
    so that the losers are guarded."""
    def static(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
        syms = twin(eqn, out_syms, ctx)
        if syms is None or ctx.structural:
            return syms
        every = out_syms[0] == TRUE
        return [sym_and_literal(m, unknown(i for i, n in enumerate(shape_of(v)) if n != 1))
                if is_float(v) and (m == TRUE or (every and m)) else m
                for m, v in zip(syms, eqn.invars, strict=True)]
    return static


def product_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                  ctx: Context) -> list[Mask]:
    """`a * b`: a lane of one factor is dropped where the other is zero and carries no
    derivative of the inputs (a 0/1 mask)."""
    masks = elementwise_masks(eqn, outs, invals, ctx)
    if ctx.structural:
        return masks
    shape = shape_of(eqn.outvars[0])
    for k, j in ((0, 1), (1, 0)):
        if not _masks_other(eqn, k, j, ctx):
            continue
        kept = _kept_factor(eqn.invars[j], invals, j, ctx)
        if kept is not None:
            masks[k] = fit(all_of([materialize(outs[0], shape), broadcast(kept, shape)]),
                           shape_of(eqn.invars[k]))
    return masks


def _kept_factor(factor: Any, invals: Sequence[Any], j: int, ctx: Context) -> Mask:
    """The lanes of a factor (operand j) that keep what they multiply: nonzero, or carrying a
    derivative. None where every lane may."""
    if isinstance(factor, Literal):
        carries: Mask = zeros(shape_of(factor))
    else:
        env = getattr(invals, "env", None)
        if env is None:  # pragma: no cover - every caller reads operands from an env
            return None
        carries = ctx.carry_mask(factor, env, masking=True)
        if carries is None:
            return None
    value = invals[j]
    return lax.bitwise_or(lax.ne(value, lax.full_like(value, 0)),
                          broadcast(carries, np.shape(value)))


def _may_mask(factor: Any, ctx: Context) -> bool:
    """Whether `factor` may be zero in a lane that carries no derivative."""
    if isinstance(factor, Literal):
        return bool(np.any(np.asarray(literal_value(factor)) == 0))
    value = ctx.constant(factor)
    if value is not None:
        return bool(np.any(value == 0))
    return ctx.may_mask(factor)


def _masks_other(eqn: JaxprEqn, k: int, j: int, ctx: Context) -> bool:
    """Whether factor j may drop lanes of factor k. Not in a square written `h * h`: where `h`
    is zero and carries no derivative, the lane it would drop is that same lane of `h`, which
    carries none (a cotangent that reaches it reaches no input)."""
    return (_maskable(eqn.invars[k]) and eqn.invars[k] is not eqn.invars[j]
            and _may_mask(eqn.invars[j], ctx))


def _maskable(atom: Any) -> bool:
    """A factor whose lanes a mask can drop: a floating-point variable (a literal passes no
    derivative: `0.05 * where(p, x, 0.)` drops nothing)."""
    return isinstance(atom, Var) and is_float(atom)


def product_applies(eqn: JaxprEqn, ctx: Context) -> bool:
    """A product chooses only with a factor that may mask the other."""
    return not ctx.structural and any(_masks_other(eqn, k, j, ctx) for k, j in ((0, 1), (1, 0)))


def product_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """Aligned, and decided at run time for a factor that another may mask; named where that
    factor is an indicator of a predicate (`1 - eye(n)`: the lanes where `eq(i, j)` fails)."""
    syms = aligned_syms(eqn, out_syms, ctx)
    if syms is None or ctx.structural:
        return syms
    for k, j in ((0, 1), (1, 0)):
        if syms[k] and _masks_other(eqn, k, j, ctx):
            shape = shape_of(eqn.invars[k])
            factor = eqn.invars[j]
            named = _indicator_literal(factor, shape, ctx)
            if named is not None:
                syms[k] = sym_and_literal(syms[k], named)
                continue
            selected = _selected_literal(factor, ctx)
            if selected is not None:
                syms[k] = sym_and_literal(syms[k], selected[0])
                if not selected[1]:
                    continue  # what it selects carries a derivative in every lane
            syms[k] = sym_and_literal(syms[k], unknown(_varying_axes(factor, ctx)))
    return syms


def _selected_literal(factor: Any, ctx: Context) -> tuple[Lit, bool] | None:
    """Where `factor` is `jnp.where(p, v, 0.)`, perhaps broadcast (`alpha[:, None]`) or through
    a lane-to-lane chain that makes the constant 0 (`exp(jnp.where(p, v, -inf))`), it masks at
    least where `p` takes the constant: the literal where `p` takes `v` (over the factor's
    axes), and whether `v` itself may mask (a 0/1 mask; not a value that carries a derivative
    in every lane, as `x @ w` does, which keeps every lane where it is selected). None
    otherwise."""
    if not isinstance(factor, Var):
        return None
    dims = tuple(range(len(shape_of(factor))))
    var = factor
    while (eqn := ctx.broadcast_of(var)) is not None and isinstance(eqn.invars[0], Var):
        dims = tuple(dims[d] for d in eqn.params["broadcast_dimensions"])
        var = eqn.invars[0]
    found = lane_chain(var, ctx.producer_of, lambda v: _selection_by_predicate(v, ctx) is not None)
    if found is None:
        return None
    chain, selected = found
    eqn = _selection_by_predicate(selected, ctx)
    assert eqn is not None
    pred, *cases = eqn.invars
    if not isinstance(pred, Var) or dtype_of(pred) != np.bool_ or \
            shape_of(pred) not in (shape_of(selected), ()):
        return None
    zero = [_made_zero(c, chain, ctx) for c in cases]
    if zero[0] == zero[1]:
        return None
    kept = cases[1] if zero[0] else cases[0]
    key, positive, embed = predicate_literal(pred, zero[0], ctx.broadcast_of, ctx.same_as)
    if embed is not None:
        embed = tuple(None if e is None else dims[e] for e in embed)
    return (key, positive, embed), _may_mask(kept, ctx)


def _selection_by_predicate(var: Any, ctx: Context) -> JaxprEqn | None:
    """The two-way `select_n` on a predicate that computes `var`, else None."""
    eqn = ctx.producer_of(var)
    if eqn is None or len(eqn.invars) != 3:
        return None
    selection = rule_for(eqn.primitive).selection
    return eqn if selection is not None and selection.by_predicate else None


def _made_zero(atom: Any, chain: Sequence[JaxprEqn], ctx: Context) -> bool:
    """A constant (carrying no derivative) that `chain` makes 0 in every lane."""
    value = np.asarray(literal_value(atom)) if isinstance(atom, Literal) else ctx.constant(atom)
    if value is None:
        return False
    with np.errstate(all="ignore"):
        return not np.any(fold_chain(chain, value))


def _varying_axes(factor: Any, ctx: Context) -> list[int]:
    """The axes along which `factor` may vary (followed back through broadcasts): `s[:, None]`
    against `(n, d)` lanes masks whole rows, so its mask crosses a matmul without a reduction."""
    if isinstance(factor, Literal):
        return [i for i, n in enumerate(shape_of(factor)) if n != 1]
    embed = predicate_literal(factor, True, ctx.broadcast_of)[2]
    return [d for d in embed if d is not None]


def _indicator_literal(factor: Any, shape: tuple, ctx: Context) -> Lit | None:
    """The literal that holds exactly where `factor` is not 0, when `factor` is computed lane by
    lane from one boolean predicate `p` of `shape` (`lane_chain`): evaluated at `p` False and
    True (`float(p)`, `1 - float(p)`), 0 at exactly one of them. None otherwise (the run-time
    mask `factor != 0` decides, an unknown literal)."""
    found = lane_chain(factor, ctx.producer_of, lambda v: np.dtype(dtype_of(v)) == np.bool_)
    if found is None:
        return None
    chain, p = found
    if not chain or any(shape_of(v) != shape for v in [p, *(e.outvars[0] for e in chain)]):
        return None
    zero_at = [bool(fold_chain(chain, np.asarray(held)) == 0) for held in (False, True)]
    if zero_at[0] == zero_at[1]:
        return None
    return predicate_literal(p, zero_at[0], ctx.broadcast_of, ctx.same_as)


# --------------------------------------------------------------------------- emission

OperandMasks = Callable[[], list]


def by_wins(eqn: JaxprEqn, guarded: list, originals: Sequence[Any], operand_masks: OperandMasks,
            out_masks: OperandMasks) -> list:
    """`max`, `min`, `clamp`: each operand where it wins alone on the original values. An
    unguarded operand whose rivals are all literals needs no select: where it wins, the
    operation is that operand, and its derivative hands the literals' share (0 * a non-finite
    cotangent) to nothing (`max(x, 0.)` before a `sqrt`).

    Where a guard changed an operand (in its dropped lanes: where it is guarded, or where it
    loses), the result's dropped lanes are decided on the guarded values: they hold the guarded
    operands' `max`, so a bound that let a later `sqrt` go unguarded holds there too (a guarded
    0 that won on the original values would sit below the clamp). Its live lanes are decided
    on the original values, as the original program decided them."""
    selection = rule_for(eqn.primitive).selection
    assert selection is not None and selection.wins is not None
    out = bind_eqn(eqn, guarded)[0]
    cases = [broadcast(lax.convert_element_type(x, out.dtype), out.shape) for x in guarded]
    wins = selection.wins(eqn, originals)
    if any(g is not originals[k] for k, g in enumerate(guarded)):
        live = out_masks()[0]
        if live is not None:
            wins = decided_per_lane(live, out, zip(wins, selection.wins(eqn, guarded), strict=True))
    for i, (win, case) in enumerate(zip(wins, cases, strict=True)):
        rivals = [v for j, v in enumerate(eqn.invars) if j != i]
        if guarded[i] is originals[i] and all(isinstance(v, Literal) for v in rivals):
            continue
        # a literal's broadcast is replicated: placed as `out` on `Explicit` mesh axes
        out = lax.select_n(sharded_like(win, out), out, sharded_like(case, out))
    return [out]


def by_fill(eqn: JaxprEqn, guarded: list, originals: Sequence[Any], operand_masks: OperandMasks,
            out_masks: OperandMasks) -> list:
    """`reduce_max`, `cummax`, pooling: the operand's dropped lanes take their original values,
    cut from differentiation, so a guarded value is never chosen and every result is the
    original's: a live one picks the lane it picked (a dropped lane never wins a live window,
    and a tie goes to the same lane, on the same values), and a result that only dropped lanes
    make holds the original value, not the identity (-inf read by a product's derivative, as
    `h @ w` reads `h` for `w`'s, made `0 * inf`). A reduction fills live rows only: a dropped
    row keeps its guarded values (`_dropped.py` may know what it holds)."""
    live = operand_masks()[0]
    x = guarded[0]
    if live is None:
        return bind_eqn(eqn, guarded)
    fill = not_mask(live)
    row = out_masks()[0]
    if "axes" in eqn.params and row is not None:
        kept = tuple(d for d in range(x.ndim) if d not in eqn.params["axes"])
        fill = all_of([fill, broadcast_mask(row, x.shape, kept)])
    held = lax.stop_gradient(originals[0])
    return bind_eqn(eqn, [lax.select_n(selecting(fill, x), x, held)])


def by_held(eqn: JaxprEqn, guarded: list, originals: Sequence[Any], operand_masks: OperandMasks,
            out_masks: OperandMasks) -> list:
    """`x.at[i].max(u)`, `segment_max` (and min): every dropped lane of the operand and the
    updates takes its original value, cut from differentiation, so the choice is the
    original's (a guarded loser, `sqrt(1.)` for `sqrt(0.)`, never wins) and every result is
    the original's; a losing lane's derivative is exactly zero."""
    ins = list(guarded)
    for k, (live, v) in enumerate(zip(operand_masks(), eqn.invars, strict=True)):
        if live is None or not is_float(v):
            continue
        x = guarded[k]
        held = lax.stop_gradient(jnp.asarray(originals[k], x.dtype))
        ins[k] = lax.select_n(selecting(live, x), held, x)
    return bind_eqn(eqn, ins)


def by_permutation(eqn: JaxprEqn, guarded: list, originals: Sequence[Any],
                   operand_masks: OperandMasks, out_masks: OperandMasks) -> list:
    """`sort`: the permutation of the original keys, gathered from the guarded operands."""
    if not eqn.params["is_stable"] and len(eqn.invars) > 1:
        return bind_eqn(eqn, guarded)
    dim = eqn.params["dimension"]
    first = originals[0]
    iota = lax.broadcasted_iota(jnp.int32, first.shape, dim)
    keys = [originals[i] for i in range(eqn.params["num_keys"])]
    perm = lax.sort([*keys, iota], dimension=dim, is_stable=eqn.params["is_stable"],
                    num_keys=len(keys))[-1]
    return [jnp.take_along_axis(x, perm, axis=dim) for x in guarded]


def by_top_k(eqn: JaxprEqn, guarded: list, originals: Sequence[Any], operand_masks: OperandMasks,
             out_masks: OperandMasks) -> list:
    """`top_k`, `approx_top_k`: the original indices, gathered from the guarded operand."""
    _, indices = bind_eqn(eqn, [originals[0]])
    return [jnp.take_along_axis(guarded[0], indices, axis=top_k_axis(eqn)[0]), indices]


def by_original(eqn: JaxprEqn, guarded: list, originals: Sequence[Any],
                operand_masks: OperandMasks, out_masks: OperandMasks) -> list:
    """`m * v`: where a factor drops an operand lane of a live output, the original product
    with its derivative cut; the product of the guarded operands elsewhere."""
    out = bind_eqn(eqn, guarded)[0]
    shape = out.shape
    dropped = [not_mask(broadcast(m, shape)) for m in operand_masks() if m is not None]
    if not dropped:
        return [out]
    cut = any_of(dropped)
    live_out = out_masks()[0]
    if live_out is not None:
        cut = all_of([cut, live_out])
    original = lax.stop_gradient(bind_eqn(eqn, list(originals))[0])
    return [lax.select_n(selecting(cut, out), out, original)]


# --------------------------------------------------------------------------- a masked contraction

def _contraction_may_mask(eqn: JaxprEqn, k: int, ctx: Context,
                          out_sym: Sym | None = None) -> bool:
    """Whether operand k of a `dot_general` may have a lane that every factor of the other
    operand it meets in a live output lane masks: the other operand carries no derivative at
    all (a constant 0/1 weight, a one-hot, an adjacency or selection matrix) and may be 0. A
    value that carries in part (`where(p, x, 0.)`, a padded row of queries) is left out: its
    zeros rarely cover a lane's whole contraction, and the mask would be a contraction at the
    full size of the product (an attention's logits). A constant known when the rewrite is
    planned masks a lane only where all of its factors for that lane in the live output lanes
    are 0 (`out_sym`, the output's formula; the sweep's by default): a pruned weight matrix
    with a zero here and there drops nothing, and costs nothing, unless the output's dropped
    lanes leave a lane only zeros (`(sqrt(x) @ w)[0]`, hunt AT)."""
    j = 1 - k
    factor = eqn.invars[j]
    if ctx.structural or not _maskable(eqn.invars[k]) or not ctx.carries_nothing(factor):
        return False
    if isinstance(factor, Literal):
        value = literal_value(factor)
    else:
        value = ctx.constant(factor)
        value = ctx.weight(factor) if value is None else value
    if value is None:
        # computed at run time: masks only where the program's structure puts zeros (a
        # one-hot, an indicator), not a weight matrix whose values are unknown here
        held = ctx.held(factor)
        return held is not None and any(h == 0 for h in held)
    keep = np.asarray(np.asarray(value) != 0)  # an array also for a 0-d weight (`jnp.dot(2., x)`)
    if not bool(np.all(_contracted_with(eqn, k, keep))):
        return True
    out_sym = ctx.sym(eqn.outvars[0]) if out_sym is None else out_sym
    if out_sym == TRUE or bool(np.all(keep)):
        return False
    live = known_lanes(out_sym, shape_of(eqn.outvars[0]))
    # decided at run time (a `where` after it): a dropped output lane may leave only zeros
    return live is None or not bool(np.all(_contracted_with(eqn, k, keep, live)))


def _contracted_with(eqn: JaxprEqn, k: int, keep: Any, live: Any = None) -> Any:
    """The lanes of operand k that meet a kept lane of the other operand (`keep`, booleans) in
    a live output lane (`live`; None: every one): the contraction's transpose in operand k, on
    0/1 values. NumPy for a known `keep` and `live`, else on the current trace."""
    shape = shape_of(eqn.outvars[0])
    if isinstance(keep, np.ndarray) and (live is None or isinstance(live, np.ndarray)):
        ones = np.ones(shape, np.float32) if live is None else \
            np.broadcast_to(live, shape).astype(np.float32)
        keep_f = keep.astype(np.float32)
    else:
        ones = lax.convert_element_type(materialize(live, shape), jnp.float32)
        keep_f = lax.convert_element_type(keep, jnp.float32)
    params = dict(eqn.params)
    if "preferred_element_type" in params:
        params["preferred_element_type"] = jnp.float32

    def op(x: Any) -> Any:
        return bind_eqn(eqn, [x, keep_f] if k == 0 else [keep_f, x], params)[0]

    with jax.ensure_compile_time_eval() if isinstance(keep_f, np.ndarray) else \
            contextlib.nullcontext():
        zero = jnp.zeros(shape_of(eqn.invars[k]), jnp.float32)
        if not isinstance(keep_f, np.ndarray):  # in a `shard_map` body: one varying type
            keep_f = varying_like(keep_f, ones)
            ones, zero = varying_like(ones, keep_f), varying_like(zero, keep_f)
        _, vjp = jax.vjp(op, zero)
        (pulled,) = vjp(jnp.asarray(ones))
    if isinstance(keep_f, np.ndarray):
        return np.asarray(pulled) != 0
    return lax.ne(pulled, lax.full_like(pulled, 0))


def contraction_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                      ctx: Context) -> list[Mask]:
    """`dot_general` (`w @ v`, `einsum`, a one-hot matmul): an operand lane is live where it
    meets, in a live output lane, a factor of the other operand that is not a zero carrying no
    derivative (`product_masks`, summed over the contraction)."""
    masks = dot_general_masks(eqn, outs, invals, ctx)
    if outs[0] is not None and known_false(outs[0]):
        return masks
    for k in (0, 1):
        if not _contraction_may_mask(eqn, k, ctx):
            continue
        kept = _kept_factor(eqn.invars[1 - k], invals, 1 - k, ctx)
        if kept is not None:
            masks[k] = _contracted_with(eqn, k, kept, outs[0])
    return masks


def contraction_applies(eqn: JaxprEqn, ctx: Context) -> bool:
    """A contraction chooses only with an operand that may mask the other's lanes."""
    return not ctx.structural and any(_contraction_may_mask(eqn, k, ctx) for k in (0, 1))


def by_original_contraction(eqn: JaxprEqn, guarded: list, originals: Sequence[Any],
                            operand_masks: OperandMasks, out_masks: OperandMasks) -> list:
    """`w @ v` with zero weights that drop lanes of `v`: a dropped lane's value still reaches
    every output lane it meets (`0 * nan` is NaN), so no output lane can be cut whole as a
    product's is (`by_original`): the live lanes take the guarded operands' derivative with the
    original value, `stop_gradient(original) - (stop_gradient(out) - out)`, where the values
    differ (bit for bit: that keeps a -0 too). And the operands' dropped lanes pass no
    derivative: a zero weight never meets their tangent or weighs an inf cotangent into them
    (`0 * inf`), at every order."""
    masks = operand_masks()
    cut = [x if m is None else lax.select_n(selecting(m, x), lax.stop_gradient(x), x)
           for x, m in zip(guarded, masks, strict=True)]
    out = bind_eqn(eqn, cut)[0]
    if not jnp.issubdtype(out.dtype, jnp.inexact) or all(
            g is o for g, o in zip(guarded, originals, strict=True)):
        return [out]
    original = lax.stop_gradient(bind_eqn(eqn, list(originals))[0])
    differ = _bits_differ(original, out)
    live_out = out_masks()[0]
    if live_out is not None:
        differ = lax.bitwise_and(differ, selecting(live_out, out))
    fixed = lax.sub(original, lax.sub(lax.stop_gradient(out), out))
    return [lax.select_n(differ, out, fixed)]


def _bits_differ(a: Any, b: Any) -> Any:
    """Lane by lane, whether two floating-point (or complex) values differ in any bit."""
    pairs = [(lax.real(a), lax.real(b)), (lax.imag(a), lax.imag(b))] \
        if jnp.issubdtype(a.dtype, jnp.complexfloating) else [(a, b)]
    differ = None
    for x, y in pairs:
        bits = jnp.dtype(f"uint{jnp.dtype(x.dtype).itemsize * 8}")
        ne = lax.ne(lax.bitcast_convert_type(x, bits), lax.bitcast_convert_type(y, bits))
        differ = ne if differ is None else lax.bitwise_or(differ, ne)
    return differ


def contraction_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """Aligned, and decided at run time for an operand that the other may mask."""
    syms = aligned_syms(eqn, out_syms, ctx)
    if syms is None:
        return syms
    for k in (0, 1):
        if syms[k] and _contraction_may_mask(eqn, k, ctx, out_syms[0]):
            axes = [i for i, n in enumerate(shape_of(eqn.invars[k])) if n != 1]
            syms[k] = sym_and_literal(syms[k], unknown(axes))
    return syms
