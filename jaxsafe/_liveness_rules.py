"""The liveness rules of the primitive table: how a primitive's operand lanes reach its outputs.

Three kinds of rule, each used by `_primitives.py` to fill rows:

- **run-time mask rules** (`MaskRule`): the boolean mask of each operand's live lanes, from the
  outputs' masks and the original operand values (a predicate, the operands of a `max`);
- **alignments** (`AlignRule`): which output axis each operand axis runs along, so the static
  formulas of `_symbolic.py` cross the equation;
- **static rules** (`StaticRule`) and **kinds rules** (`KindsRule`): the same, before anything
  runs, as formulas over the program's predicates or as a `Kind`.

Rules of primitives with bodies (calls, `cond`) recurse through the `Context`, which the liveness
pass (`_liveness.py`) provides.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._atoms import dtype_of, is_float, shape_of
from ._case_index import case_syms
from ._compat import JaxprEqn, Literal, Var, bind_eqn, sharded_like, varying_like
from ._constants import fold
from ._masks import (
    STATIC_CORE_LIMIT,
    all_of,
    any_of,
    broadcast,
    broadcast_mask,
    concat_masks,
    factor,
    fit,
    materialize,
    move_axes,
    not_mask,
    pad_mask,
    place,
    reduce_any,
    reshape_mask,
    slice_mask,
    within,
    zeros,
)
from ._nested import any_equation, call_jaxpr
from ._rules import AlignRule, Context, Kind, Mask, MaskRule, StaticRule, may_drop, rule_for
from ._symbolic import (
    FALSE,
    TRUE,
    Lit,
    Sym,
    Unknown,
    backward_mapping,
    expand_connectives,
    held_lanes,
    implies,
    move,
    opaque,
    predicate_literal,
    relaxed_lanes,
    split_on,
    sym_and_literal,
    sym_or,
    unknown,
)

# --------------------------------------------------------------------------- elementwise


def elementwise_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                      ctx: Context) -> list[Mask]:
    """Lane to lane; a broadcast operand is live where any lane it feeds is."""
    return [fit(outs[0], shape_of(v)) for v in eqn.invars]


def _retyped(eqn: JaxprEqn, i: int) -> bool:
    """Whether output i is operand i under another type: a `device_put` to another sharding of
    `Explicit` mesh axes, or to another memory space (a mask of the output's type cannot select
    the operand's lanes). Under `Auto` axes the types carry no partition (`P(None)` both)."""
    a, b = eqn.invars[i].aval, eqn.outvars[i].aval
    spec = lambda aval: getattr(getattr(aval, "sharding", None), "spec", None)  # noqa: E731
    space = lambda aval: getattr(aval, "memory_space", None)  # noqa: E731
    return spec(a) != spec(b) or space(a) != space(b)


def paired_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                 ctx: Context) -> list[Mask]:
    """Operand i is output i, placed or fenced (`device_put`, `optimization_barrier`); one
    placed under another type is live in every lane (as `reshard`'s)."""
    return [None if _retyped(eqn, i) else m for i, m in enumerate(outs)]


def same_rank_alignment(eqn: JaxprEqn, k: int) -> list[int | None] | None:
    """An operand of the output's rank runs along the output's axes (size-1 axes broadcast)."""
    ins, outs = shape_of(eqn.invars[k]), shape_of(eqn.outvars[0])
    if not ins:
        return []
    if len(ins) != len(outs):
        return None
    return [i if ins[i] == outs[i] else None for i in range(len(ins))]


# --------------------------------------------------------------------------- selections


def _max_min_wins(eqn: JaxprEqn, invals: Sequence[Any], beats) -> list[jax.Array]:
    shape = shape_of(eqn.outvars[0])
    a, b = (broadcast(x, shape) for x in invals)
    return [beats(a, b), beats(b, a)]


def max_wins(eqn: JaxprEqn, invals: Sequence[Any]) -> list[jax.Array]:
    """`max`: where each operand is the larger one (a tie, or NaN, is neither's win)."""
    return _max_min_wins(eqn, invals, lax.gt)


def min_wins(eqn: JaxprEqn, invals: Sequence[Any]) -> list[jax.Array]:
    """`min`: where each operand is the smaller one."""
    return _max_min_wins(eqn, invals, lax.lt)


def clamp_wins(eqn: JaxprEqn, invals: Sequence[Any]) -> list[jax.Array]:
    """`clamp(lo, x, hi)`: where each operand determines the output alone."""
    shape = shape_of(eqn.outvars[0])
    lo, x, hi = (broadcast(v, shape) for v in invals)
    return [lax.bitwise_and(lax.gt(lo, x), lax.lt(lo, hi)),
            lax.bitwise_and(lax.gt(x, lo), lax.lt(x, hi)), lax.lt(hi, x)]


def select_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                 ctx: Context) -> list[Mask]:
    """`select_n`: a case is live where the predicate picks it (and the output is live)."""
    if ctx.structural:
        return elementwise_masks(eqn, outs, invals, ctx)
    shape = shape_of(eqn.outvars[0])
    pred = invals[0]
    masks: list[Mask] = [None]  # the predicate carries no lanes
    for k, v in enumerate(eqn.invars[1:], start=1):
        if pred.dtype == jnp.bool_:
            picked = broadcast(pred, shape)
            live = picked if k == 2 else not_mask(picked)
        else:
            live = broadcast(lax.eq(pred, np.asarray(k - 1, pred.dtype)), shape)
        masks.append(fit(all_of([live, outs[0]]), shape_of(v)))
    return masks


def winner_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                 ctx: Context) -> list[Mask]:
    """`max`, `min`, `clamp`: an operand is live where it wins, or ties (original values)."""
    if ctx.structural:
        return elementwise_masks(eqn, outs, invals, ctx)
    selection = rule_for(eqn.primitive).selection
    assert selection is not None and selection.wins is not None
    wins = selection.wins(eqn, invals)
    shared = wins[0]  # where no operand wins alone: a tie, or NaN
    for w in wins[1:]:
        shared = lax.bitwise_or(shared, w)
    shared = lax.bitwise_not(shared)
    return [fit(all_of([lax.bitwise_or(w, shared), outs[0]]), shape_of(v))
            for w, v in zip(wins, eqn.invars, strict=True)]


# --------------------------------------------------------------------------- data movement


def pulled_back(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                primal: Callable[[Any, Any], Any]) -> list[Any]:
    """The vector-Jacobian product of `eqn` with each float output's mask (1 where live) as its
    cotangent, at `primal(value, var)` for each float operand (the others as they are): per
    float operand, the cotangent it receives; None for the others. Where it is nonzero, a live
    output's derivative reads that operand lane: JAX's own derivative says where lanes go."""
    float_ix = [i for i, v in enumerate(eqn.invars) if is_float(v)]

    def op(*floats):
        by_index = dict(zip(float_ix, floats, strict=True))  # indices are read as they are
        vals = [by_index[i] if i in by_index else invals[i] for i in range(len(eqn.invars))]
        results = bind_eqn(eqn, vals)
        return [r for r, o in zip(results, eqn.outvars, strict=True) if is_float(o)]

    results, vjp = jax.vjp(op, *[_typed_as(primal(invals[i], eqn.invars[i]), invals[i])
                                 for i in float_ix])
    float_outs = [m for m, o in zip(outs, eqn.outvars, strict=True) if is_float(o)]
    cts = [_typed_as(lax.convert_element_type(materialize(m, r.shape), r.dtype), r)
           for m, r in zip(float_outs, results, strict=True)]
    pulled: list[Any] = [None] * len(eqn.invars)
    for i, c in zip(float_ix, vjp(cts), strict=True):
        pulled[i] = c
    return pulled


def _typed_as(x: Any, like: Any) -> Any:
    """`x` typed as `like` is where types carry more than shape and dtype: varying over a
    `shard_map` body's manual axes, placed on `Explicit` mesh axes (`jax.vjp` checks the
    cotangent's type, `sort` its operands' shardings)."""
    return sharded_like(varying_like(x, like), like)


def by_transpose_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                       ctx: Context) -> list[Mask]:
    """Lanes that a linear data-movement op reads for live outputs: its transpose on the mask.

    The transpose of gather is scatter-add, of dynamic_slice is dynamic_update_slice, ...: JAX
    already knows where every operand lane goes (at zero, in the operand's dtype: the op is
    linear, and a scatter's combiner is typed in that dtype).
    """
    masks = pulled_back_nonzero(eqn, outs, invals,
                                lambda x, v: lax.full(shape_of(v), 0., dtype_of(v)))
    if not ctx.structural or any(m is None for m in outs):
        return masks
    # where every read counts: integer lanes move as float ones do (a sort's permutation
    # reversed, then a gather's index), and a start index is read by every lane it places
    if masks[0] is None and not is_float(eqn.invars[0]) and \
            not any(is_float(o) for o in eqn.outvars):
        masks[0] = _moved_as_float(eqn, outs, invals)
    for k, v in enumerate(eqn.invars):
        if masks[k] is None and not is_float(v) and shape_of(v) == ():
            masks[k] = any_of([reduce_any(m, range(np.ndim(m))) for m in outs])
    return masks


def scatter_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                  ctx: Context) -> list[Mask]:
    """A scatter's transpose on the mask (`by_transpose_masks`); where every read counts, its
    indices by their batch elements (`_scatter_index_mask`)."""
    masks = by_transpose_masks(eqn, outs, invals, ctx)
    if ctx.structural and outs[0] is not None and len(eqn.invars) == 3 and masks[1] is None:
        masks[1] = _scatter_index_mask(eqn, outs[0])
    return masks


def _scatter_batch_axes(eqn: JaxprEqn) -> dict[int, int]:
    """A scatter's operand batching axis -> the indices' axis that runs along it (a vmapped
    `x.at[i].set(u)`: row b's index writes into row b only)."""
    dn = eqn.params["dimension_numbers"]
    return dict(zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims, strict=True))


def _scatter_index_mask(eqn: JaxprEqn, out: jax.Array) -> jax.Array:
    """A scatter's index lanes that its live output lanes read, where every read counts: which
    lanes an index overwrites decides every lane of its batch element, so it is read where any
    of them is live."""
    mapping = _scatter_batch_axes(eqn)
    batch = sorted(mapping)
    rows = reduce_any(out, [d for d in range(np.ndim(out)) if d not in mapping])
    return place(rows, [mapping[d] for d in batch], shape_of(eqn.invars[1]))


def _moved_as_float(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any]) -> Mask:
    """The lanes of a movement's integer operand 0 that its live outputs read: the movement's
    transpose on the mask, with the operand taken as float32. None (every lane) where the
    movement takes other operands of that dtype with it (an integer scatter's updates, a
    pad's padding value): it does not bind on a float operand 0 alone."""
    if any(dtype_of(v) == dtype_of(eqn.invars[0]) and shape_of(v) != ()
           for v in eqn.invars[1:]) or eqn.params.get("update_jaxpr") is not None:
        return None

    def op(x: Any) -> list[Any]:
        return bind_eqn(eqn, [x, *invals[1:]])

    try:
        results, vjp = jax.vjp(op, lax.full(shape_of(eqn.invars[0]), 0., jnp.float32))
    except (TypeError, ValueError):  # a same-dtype scalar the movement places (`pad`)
        return None
    (pulled,) = vjp([lax.convert_element_type(materialize(m, r.shape), r.dtype)
                     for m, r in zip(outs, results, strict=True)])
    return lax.ne(pulled, lax.full_like(pulled, 0))


def _start_syms(eqn: JaxprEqn, out: Sym, ctx: Context, first: int) -> list[Sym]:
    """The formulas of a movement's start indices, operands `first` on: in a body that re-runs
    as one unit (`by_transpose_masks`), each is read where any output lane is (an OR over
    the output's axes); elsewhere, an unknown (not differentiated)."""
    return [move(out, {}) if ctx.structural and shape_of(v) == () else opaque()
            for v in eqn.invars[first:]]


def pulled_back_nonzero(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                        primal: Callable[[Any, Any], Any]) -> list[Mask]:
    """Per operand, the lanes whose `pulled_back` cotangent is nonzero (None for the others):
    with a mask of ones and zeros as the cotangent and operands that weigh by non-negative
    values, the lanes some live output reads."""
    return [None if c is None else lax.ne(c, lax.full_like(c, 0))
            for c in pulled_back(eqn, outs, invals, primal)]


# --------------------------------------------------------------------------- windows

WindowAxis = tuple[int, int, int, int, int, int, int, int]
"""One windowed axis: the operand's axis, its size, the window's size, the stride, padding low
and high, the operand's dilation (a convolution's `lhs_dilation`, a window sum's
`base_dilation`), the window's."""


def window_sum_axes(eqn: JaxprEqn) -> list[WindowAxis]:
    """`reduce_window_sum`: every axis is windowed."""
    p = eqn.params
    return [(a, n, k, s, lo, hi, b, d) for a, (n, k, s, (lo, hi), b, d) in enumerate(zip(
        shape_of(eqn.invars[0]), p["window_dimensions"], p["window_strides"], p["padding"],
        p["base_dilation"], p["window_dilation"], strict=True))]


def convolution_axes(eqn: JaxprEqn) -> list[WindowAxis]:
    """`conv_general_dilated`: the spatial axes (every feature and batch lane is read, in groups
    or not)."""
    p = eqn.params
    dims = p["dimension_numbers"]
    lhs, rhs = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    return [(a, lhs[a], rhs[b], s, lo, hi, bd, wd) for a, b, s, (lo, hi), bd, wd in zip(
        dims.lhs_spec[2:], dims.rhs_spec[2:], p["window_strides"], p["padding"],
        p["lhs_dilation"], p["rhs_dilation"], strict=True)]


WindowAxes = Callable[[JaxprEqn], list[WindowAxis]]


def _untouched(axis: WindowAxis) -> bool:
    """A windowed axis whose output lane i is operand lane i (a window of 1, no stride, padding
    or dilation: a pooling's batch and channels, a 1x1 convolution's spatial axes)."""
    return tuple(axis[2:]) == (1, 1, 0, 0, 1, 1)


def window_sum_pairs(eqn: JaxprEqn) -> tuple[dict[int, int], frozenset[int]]:
    """The output axes that are operand axes (output axis: operand axis), and the output axes
    along which every lane reads the same operand lanes (none for a window sum)."""
    return {axis[0]: axis[0] for axis in window_sum_axes(eqn) if _untouched(axis)}, frozenset()


def convolution_pairs(eqn: JaxprEqn) -> tuple[dict[int, int], frozenset[int]]:
    """A convolution's batch (without batch groups) and untouched spatial axes run along its
    operand's; each output feature reads every operand feature (of its group)."""
    dims = eqn.params["dimension_numbers"]
    pairs = {dims.out_spec[2 + j]: axis[0] for j, axis in enumerate(convolution_axes(eqn))
             if _untouched(axis)}
    if eqn.params["batch_group_count"] == 1:
        pairs[dims.out_spec[0]] = dims.lhs_spec[0]
    if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
        # a group's features read their group's only (features, or batches): `reads`
        return pairs, frozenset()
    return pairs, frozenset({dims.out_spec[1]})


def convolution_kernel_pairs(eqn: JaxprEqn) -> dict[int, int]:
    """Output feature o is computed with the kernel's output feature o alone (in groups or
    not): output axis -> kernel axis."""
    dims = eqn.params["dimension_numbers"]
    return {dims.out_spec[1]: dims.rhs_spec[0]}


def convolution_alignment(eqn: JaxprEqn, k: int) -> list[int | None]:
    """The input's axes that run along the output's lane for lane (`convolution_pairs`: the
    batch, the untouched spatial axes) and the kernel's output features (without batch groups):
    a `where` per image drops an image's lanes with no reduction over what it reads."""
    dims = eqn.params["dimension_numbers"]
    align: list[int | None] = [None] * len(shape_of(eqn.invars[k]))
    if k == 0:
        for out_axis, lhs_axis in convolution_pairs(eqn)[0].items():
            align[lhs_axis] = out_axis
    elif eqn.params["batch_group_count"] == 1:
        align[dims.rhs_spec[0]] = dims.out_spec[1]
    return align


_WINDOW_TAPS_CHECKED = 1 << 20
"""Windows times taps of one axis beyond which the lanes read are not listed (a moment of NumPy
per equation below it); the masks are then the derivative's, at run time."""


def _read_lanes(axis: WindowAxis) -> np.ndarray | None:
    """Which of an axis's operand lanes some window reads (a stride longer than the window,
    negative padding and dilated windows skip some); None: too many windows to list."""
    _, n, k, stride, lo, hi, base, dil = axis
    extent = lo + (n - 1) * base + 1 + hi
    span = (k - 1) * dil + 1
    windows = (extent - span) // stride + 1 if n > 0 and k > 0 and extent >= span else 0
    if windows * k > _WINDOW_TAPS_CHECKED:
        return None
    at = np.arange(windows)[:, None] * stride + np.arange(k)[None, :] * dil - lo
    read = np.zeros(n, bool)
    read[at[(at >= 0) & (at % base == 0) & (at <= (n - 1) * base)] // base] = True
    return read


@dataclasses.dataclass(frozen=True)
class Windows:
    """How a windowed primitive reads its first operand (a window sum, a convolution)."""

    axes: WindowAxes
    """Its windowed axes."""
    pairs: Callable[[JaxprEqn], tuple[dict[int, int], frozenset[int]]]
    """The output axes that are operand axes (output axis: operand axis), and the output axes
    along which every lane reads the same operand lanes."""
    reads: Callable[[JaxprEqn, list[Mask], Sequence[Any]], Mask]
    """The operand lanes live outputs read, at run time, for any mask."""
    kernel_pairs: Callable[[JaxprEqn], dict[int, int]] | None = None
    """The output axes along which each lane reads one lane of the kernel's (output axis:
    kernel axis); the kernel is live where any output is along the others."""


def window_drops(windows: Windows) -> Callable[[JaxprEqn], bool]:
    """A windowed primitive drops the operand lanes that no window reads."""
    def drops(eqn: JaxprEqn) -> bool:
        for axis in windows.axes(eqn):
            read = _read_lanes(axis)
            if read is None or not read.all():
                return True
        return False
    return drops


def windowed_masks(windows: Windows) -> MaskRule:
    """A window sum or a convolution: an operand lane is live where a live output's window reads
    it. Every output live: the lanes some window reads along each axis (constants); a mask that
    varies only along axes that run along the operand's (a batch, a 1x1 convolution's) or that
    read the same lanes (a convolution's features): those lanes, where the mask holds along the
    paired axes. Otherwise `windows.reads` (the derivative's, or a thinner one's: a kernel's zero or
    negative weights cancel nothing). A kernel is live where any output is (of its output
    feature, `Windows.kernel_pairs`): a weight that meets only padding still multiplies it (a
    NaN weight makes a NaN output)."""
    def masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
              ctx: Context) -> list[Mask]:
        shape = shape_of(eqn.invars[0])
        out = outs[0]
        kernels: list[Mask] = [None] * (len(eqn.invars) - 1)
        if out is not None:
            kernels = [_kernel_mask(windows, eqn, out, shape_of(v)) for v in eqn.invars[1:]]
        per_axis = [(axis[0], _read_lanes(axis)) for axis in windows.axes(eqn)]
        if all(read is not None for _, read in per_axis):
            read_any = all_of([place(read, (a,), shape) for a, read in per_axis
                               if read is not None and not read.all()])
            if out is None:
                return [read_any] + kernels
            paired, summed = windows.pairs(eqn)
            varying = factor(out)[1]
            if all(d in paired or d in summed for d in varying):
                # live along the axes that run along the operand's, whatever the window
                kept = sorted(paired)
                along = reduce_any(out, [d for d in range(out.ndim) if d not in paired])
                return [all_of([place(along, [paired[d] for d in kept], shape),
                                read_any])] + kernels
        return [windows.reads(eqn, outs, invals)] + kernels
    return masks


def _kernel_mask(windows: Windows, eqn: JaxprEqn, out: Any, shape: tuple) -> Mask:
    """A kernel's lanes that a live output multiplies: along `kernel_pairs`, those of the live
    output lanes; every lane where there is none."""
    pairs = windows.kernel_pairs(eqn) if windows.kernel_pairs is not None else {}
    kept = sorted(pairs)
    along = reduce_any(out, [d for d in range(out.ndim) if d not in pairs])
    if not kept:
        return broadcast(along, shape)
    return place(along, [pairs[d] for d in kept], shape)


def read_by_derivative(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any]) -> Mask:
    """The operand lanes a window op's live outputs read: the vector-Jacobian product of the
    mask at operands of ones (a lane's cotangent counts the live outputs that read it)."""
    ones = lambda x, v: lax.full(shape_of(v), 1, dtype_of(v))  # noqa: E731
    return pulled_back_nonzero(eqn, outs, invals, ones)[0]


def convolution_reads(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any]) -> Mask:
    """A convolution's live outputs read, in each feature of the operand, the pixels of their
    windows: the mask, reduced over the output features of each feature group, pulled back
    through a convolution of one feature per group by a kernel of ones (a few adds per pixel,
    where the operation's own derivative would cost a convolution's over every feature), and
    repeated over each group's operand features. With batch groups: the derivative."""
    p = eqn.params
    dims = p["dimension_numbers"]
    if p["batch_group_count"] != 1:
        return read_by_derivative(eqn, outs, invals)
    groups = p["feature_group_count"]
    out_shape, shape = shape_of(eqn.outvars[0]), shape_of(eqn.invars[0])
    o_axis, c_axis = dims.out_spec[1], dims.lhs_spec[1]
    out = materialize(outs[0], out_shape)
    split = (*out_shape[:o_axis], groups, out_shape[o_axis] // groups, *out_shape[o_axis + 1:])
    per_group = reduce_any(lax.reshape(out, split), [o_axis + 1])  # groups at o_axis
    lhs = list(shape)
    lhs[c_axis] = groups
    rhs = list(shape_of(eqn.invars[1]))
    rhs[dims.rhs_spec[0]], rhs[dims.rhs_spec[1]] = groups, 1
    kernel = lax.full(tuple(rhs), 1., jnp.float32)

    def one_feature(x: jax.Array) -> jax.Array:
        return lax.conv_general_dilated(x, kernel, p["window_strides"], p["padding"],
                                        p["lhs_dilation"], p["rhs_dilation"], dims,
                                        feature_group_count=groups)
    _, pull = jax.vjp(one_feature, lax.full(tuple(lhs), 0., jnp.float32))
    read = pull(lax.convert_element_type(per_group, jnp.float32))[0]
    read = lax.gt(read, lax.full_like(read, 0))
    # each group's reads, for each of its operand features
    wide = (*shape[:c_axis], groups, shape[c_axis] // groups, *shape[c_axis + 1:])
    kept = tuple(d for d in range(len(wide)) if d != c_axis + 1)
    return lax.reshape(lax.broadcast_in_dim(read, wide, kept), tuple(shape))


WINDOW_SUM = Windows(window_sum_axes, window_sum_pairs, read_by_derivative)
CONVOLUTION = Windows(convolution_axes, convolution_pairs, convolution_reads,
                      convolution_kernel_pairs)


def slice_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                ctx: Context) -> list[Mask]:
    """The lanes a static slice reads: its mask padded with False (the transpose of slice)."""
    shape, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    if outs[0] is None and shape == out_shape:
        return [None]
    out = materialize(outs[0], out_shape)
    starts = eqn.params["start_indices"]
    strides = eqn.params["strides"] or (1,) * len(shape)
    if 0 in out_shape:
        return [zeros(shape)]
    config = []
    for n, lo, k, step in zip(shape, starts, out_shape, strides, strict=True):
        last = lo + (k - 1) * step
        config.append((int(lo), int(n - 1 - last), int(step - 1)))
    return [pad_mask(out, config, shape)]


def gather_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                 ctx: Context) -> list[Mask]:
    """A gather reads, for each output lane, operand lanes at the same batching coordinates: the
    operand's mask (a scatter of the output's) lies inside the output mask's rows. In a body
    that re-runs as one unit (where an index's reads count, `argmax` then
    `take_along_axis`), an index is read by the output lanes it places: its own batch
    coordinates, across the offset axes."""
    masks = by_transpose_masks(_as_read(eqn), outs, invals, ctx)
    out = outs[0]
    if ctx.structural and len(eqn.invars) == 2:
        masks[1] = None if out is None else _index_mask(eqn, out)
    if out is None or masks[0] is None:
        return masks
    dn = eqn.params["dimension_numbers"]
    out_rank = len(shape_of(eqn.outvars[0]))
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    index_dims = range(len(shape_of(eqn.invars[1])) - 1)  # the last: the index vector
    to_operand = {}
    for o, i in zip(batch_out, index_dims, strict=False):
        if i in dn.start_indices_batching_dims:
            to_operand[o] = dn.operand_batching_dims[dn.start_indices_batching_dims.index(i)]
    core, axes = factor(out)
    if all(a in to_operand for a in axes):
        within(masks[0], place(core, [to_operand[a] for a in axes], shape_of(eqn.invars[0])))
    return masks


def _as_read(eqn: JaxprEqn) -> JaxprEqn:
    """A gather as XLA runs it, for the lanes it reads: an index out of bounds under
    `promise_in_bounds` (`x[jnp.array([0, 5])]`) is clamped, as `mode="clip"` does, where its
    transpose (a scatter-add) would drop it and call the lane it reads unread."""
    if eqn.params.get("mode") != lax.GatherScatterMode.PROMISE_IN_BOUNDS:
        return eqn
    return eqn.replace(params={**eqn.params, "mode": lax.GatherScatterMode.CLIP})


def _index_batch_axes(eqn: JaxprEqn) -> dict[int, int]:
    """A gather's output axis -> the indices' axis it runs along (the indices' last axis is the
    index vector)."""
    dn = eqn.params["dimension_numbers"]
    out_rank = len(shape_of(eqn.outvars[0]))
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    return dict(zip(batch_out, range(len(shape_of(eqn.invars[1])) - 1), strict=True))


def _index_mask(eqn: JaxprEqn, out: jax.Array) -> jax.Array:
    """The index lanes that the live lanes of a gather's output read (see `gather_masks`)."""
    mapping = _index_batch_axes(eqn)
    offset = [d for d in range(np.ndim(out)) if d not in mapping]
    rows = reduce_any(out, offset)
    shape = shape_of(eqn.invars[1])
    return broadcast_mask(rows, shape, tuple(range(len(shape) - 1)))


def gather_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym]:
    """The lanes a gather reads depend on its indices (an unknown), except along the operand
    axes it takes whole (a full slice: `jnp.diagonal`'s batch axis) or batches by (a vmapped
    gather): a formula along those carries over, so a `where` on each matrix of a batch reaches
    the matrices through `jnp.diagonal`."""
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    op_shape, out_rank = shape_of(eqn.invars[0]), len(shape_of(eqn.outvars[0]))
    to_operand: dict[int, int] = {}  # output axis -> the operand axis it runs along
    offset_axes = [d for d in range(len(op_shape))
                   if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for o, d in zip(dn.offset_dims, offset_axes, strict=True):
        if sizes[d] == op_shape[d]:
            to_operand[o] = d
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    for o, i in zip(batch_out, range(len(shape_of(eqn.invars[1])) - 1), strict=False):
        if i in dn.start_indices_batching_dims:
            to_operand[o] = dn.operand_batching_dims[dn.start_indices_batching_dims.index(i)]
    if not out_syms[0]:
        return [FALSE] * len(eqn.invars)
    # the lanes picked along the other axes differ from one batch to the next (a row's label
    # in `take_along_axis`): the unknown runs along the batching axes too. Indices the program
    # computes from literals pick the same lanes in every run: a static unknown.
    indices = [opaque() for _ in eqn.invars[1:]]
    if ctx.structural and len(indices) == 1:  # `gather_masks`: by the output lanes it places
        indices = [move(out_syms[0], _index_batch_axes(eqn))]
    static = _indices_known(eqn.invars[1:], ctx)
    sym = _kept_along(out_syms[0], to_operand, op_shape, varying=dn.operand_batching_dims,
                      static=static)
    rest = [d for d in range(len(op_shape)) if (d not in to_operand.values()
                                                 or d in dn.operand_batching_dims)
            and op_shape[d] != 1]
    # read only by the output lanes that may be live, as far as known now (a constant padding
    # mask after `(x @ x.T)[i, i]`, whatever a clamp decides at run time)
    small = max(int(np.prod(op_shape)), int(np.prod(shape_of(eqn.outvars[0])))) \
        <= STATIC_CORE_LIMIT
    by = relaxed_lanes(expand_connectives(out_syms[0], ctx.connective_of),
                       shape_of(eqn.outvars[0]), ctx.known_mask) \
        if static and rest and small else None
    lanes = _lanes_read(eqn, rest, ctx, gather=True, by=by) if static and rest else None
    if lanes is not None:  # the rows `x[jnp.array([0, 2])]` reads, as a slice's are known
        sym = _known_literal(move(out_syms[0], to_operand), rest, lanes)
    return [sym] + indices


def _known_literal(sym: Sym, axes: Sequence[int], lanes: np.ndarray) -> Sym:
    """`sym` and a static literal along `axes` known lane by lane (`lanes`, over `axes` in
    order), along only the axes where those lanes vary: rows kept whole stay a literal on the
    row axis, which a coarse guard can carry through a matmul (`named_along`)."""
    varying, kept = _varying_lanes(lanes)
    if not varying:
        return sym if lanes.all() else FALSE
    return sym_and_literal(sym, unknown([axes[j] for j in varying], static=True, lanes=kept))


def _lanes_read(eqn: JaxprEqn, axes: Sequence[int], ctx: Context,
                gather: bool, by: np.ndarray | None = None) -> np.ndarray | None:
    """The lanes along `axes` (sorted) of a movement's operand 0 that some output lane reads
    (a `gather`, as XLA runs it: `_as_read`) or that no update overwrites (a scatter), from
    indices known when jaxsafe plans: its transpose on ones, in every index mode as the
    equation has it, on float32 values whatever the operand's dtype. The indices are operand
    1; a scatter's updates, after them, are taken at 0 (the transpose does not read them).
    None for an operand of more than `STATIC_CORE_LIMIT` lanes, or indices not known. `by`:
    only the output lanes where it holds read (a gather's)."""
    shape = shape_of(eqn.invars[0])
    indices = ctx.constant(eqn.invars[1])
    if int(np.prod(shape)) > STATIC_CORE_LIMIT or indices is None:
        return None
    rest = [indices] + [jnp.zeros(shape_of(v), jnp.float32) for v in eqn.invars[2:]]
    moved = _as_read(eqn) if gather else eqn  # XLA drops a scatter's update out of bounds

    def move_lanes(operand: Any) -> Any:
        return bind_eqn(moved, [operand, *(jnp.asarray(r) for r in rest)])[0]
    with jax.ensure_compile_time_eval():
        _, pull = jax.vjp(move_lanes, jnp.zeros(shape, jnp.float32))
        reading = jnp.ones(shape_of(eqn.outvars[0]), jnp.float32) if by is None else \
            jnp.asarray(np.broadcast_to(by, shape_of(eqn.outvars[0])), jnp.float32)
        (pulled,) = pull(reading)
    others = tuple(d for d in range(len(shape)) if d not in axes)
    read = np.asarray(pulled) != 0
    return np.asarray(read.any(axis=others)) if others else read


def _indices_known(indices: Sequence[Any], ctx: Context) -> bool:
    """Whether `indices` (a gather's or scatter's, a dynamic slice's starts) are computed from
    literals alone: the lanes the equation moves depend on shapes only."""
    return all(ctx.constant(v) is not None for v in indices)


def _kept_along(out: Sym, to_operand: dict[int, int], op_shape: Sequence[int],
                dropping: Sequence[int] | None = None, static: bool = False,
                varying: Sequence[int] = (),
                lanes: Callable[[int], np.ndarray | None] | None = None,
                known: dict[int, int] | None = None) -> Sym:
    """An operand's formula from its output's, through a movement that keeps the lanes of the
    output axes in `to_operand` in place along those operand axes: a formula along them
    carries over; along the other axes lanes move (an unknown for what ran along them). Along
    the axes of `dropping`, each on its own (a slice keeps an interval of each axis: the lanes
    it keeps are their product), some lanes may be cut off: an unknown per axis, so that one
    along a batch axis reaches a batched decomposition (`chol[1:, 0, 0]` never reads matrix
    0). Without `dropping`, one unknown over every other axis (a gather picks lanes anywhere).
    `static`: what is cut off depends on shapes only (a `slice`, a `pad`). `varying`: axes kept
    in place along which what is picked on the other axes changes (a gather's batching axes).
    `lanes(d)`: the lanes kept along axis d, where known as an array (`Unknown.lanes`).
    `known`: more axes of `out` to move, that only literals already on the operand's lanes
    run along (`_known_lanes_moved`)."""
    sym = move(out, to_operand if known is None else {**to_operand, **known})
    if dropping is None:
        rest = [d for d in range(len(op_shape)) if (d not in to_operand.values() or d in varying)
                and op_shape[d] != 1]
        return sym_and_literal(sym, unknown(rest, static)) if rest else sym
    for d in dropping:
        if op_shape[d] != 1:
            sym = sym_and_literal(sym, unknown([d], static, None if lanes is None else lanes(d)))
    return sym


AxesRule = Callable[[JaxprEqn], tuple[list[bool], list[int]]]
"""(equation) -> which operand axes the output takes whole, lane for lane; which axes may cut
lanes off."""


Sources = Callable[[JaxprEqn, int], np.ndarray]
"""(equation, axis) -> for each output lane along that axis, the operand lane it takes (-1:
none, padding), from the equation's parameters alone."""


def _kept_lanes(sources: np.ndarray, size: int) -> np.ndarray:
    kept = np.zeros(size, bool)
    kept[sources[sources >= 0]] = True
    return kept


def _known_lanes(key: Any, ctx: Context) -> np.ndarray | None:
    """A literal key's lanes where they are known when jaxsafe plans: a static mask known as
    an array (`Unknown.lanes`), or a predicate closed over or computed from constants alone
    (`Context.known_mask`)."""
    if isinstance(key, Unknown):
        return key.lanes
    return ctx.known_mask(key) if isinstance(key, Var) else None


def _known_lanes_moved(out: Sym, moving: Sequence[int], sources: Callable[[int], np.ndarray],
                       op_shape: Sequence[int], ctx: Context) -> tuple[Sym, dict[int, int]]:
    """`out` with each literal along the axes of `moving` whose lanes are known when jaxsafe
    plans (a static mask known as an array, a predicate closed over) put on the operand's
    lanes, a lane no output lane takes false; such a literal is given axes `rank + d` for
    `d`, which the caller moves to `d` (`_kept_along`'s `known`): a slice of a slice, or a
    padding mask cut by a slice, stays known lane by lane instead of becoming an unknown."""
    rank, moved = len(op_shape), {}

    def on_operand(lit: Lit) -> Lit:
        key, positive, embed = lit
        if embed is None or not any(e in moving for e in embed):
            return lit
        value = _known_lanes(key, ctx)
        if value is None or np.ndim(value) != len(embed):
            return lit
        held = np.asarray(value, bool) == positive
        for j, e in enumerate(embed):
            if e in moving:
                src = sources(e)
                lanes = np.zeros(held.shape[:j] + (op_shape[e],) + held.shape[j + 1:], bool)
                taken = src >= 0
                np.moveaxis(lanes, j, 0)[src[taken]] = np.moveaxis(held, j, 0)[taken]
                held = lanes
                moved[rank + e] = e
        return (Unknown(static=True, lanes=held), True,
                tuple(rank + e if e in moving else e for e in embed))
    if out in (TRUE, FALSE):
        return out, moved
    return frozenset(frozenset(on_operand(lit) for lit in term) for term in out), moved


def _whole_axes_syms(axes: AxesRule, by_shape: bool = False,
                     sources: Sources | None = None,
                     known_sources: Callable[[JaxprEqn, Context], Sources | None] | None = None
                     ) -> StaticRule:
    """Static liveness of a slice-like movement (`slice`, `dynamic_slice`, `pad`, `rev`) whose
    output axis d runs along operand axis d, lane for lane where it takes the axis whole: a
    `where` per matrix on `chol[:, 1, 1]` drops whole matrices of `chol` (`batched_syms`), as it
    does on `chol` itself. Other operands (indices, the padding value): unknown. `by_shape`: the
    lanes cut off are known from the parameters (not a `dynamic_slice`'s index); `sources`
    names them, so that a coarse guard can read them (the rows `h[2:]` cuts off, before a
    matmul whose exact mask would need a run-time reduction), and moves the literals known
    lane by lane onto the operand's lanes (`_known_lanes_moved`). `known_sources`: the same
    where the operands say them, when they are known as jaxsafe plans (a `dynamic_slice` at
    literal starts)."""
    def static(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym]:
        if not out_syms[0]:
            return [FALSE] * len(eqn.invars)
        whole, dropping = axes(eqn)
        to_operand = {d: d for d, w in enumerate(whole) if w}
        op_shape = shape_of(eqn.invars[0])
        out, known, lanes = out_syms[0], None, None
        named = sources if known_sources is None else known_sources(eqn, ctx)
        if named is not None:
            from_output = functools.partial(named, eqn)
            moving = [d for d, w in enumerate(whole) if not w]
            out, known = _known_lanes_moved(out, moving, from_output, op_shape, ctx)
            lanes = lambda d: _kept_lanes(from_output(d), op_shape[d])  # noqa: E731
        return [_kept_along(out, to_operand, op_shape, dropping,
                            by_shape or _indices_known(eqn.invars[1:], ctx), lanes=lanes,
                            known=known)] + _start_syms(eqn, out_syms[0], ctx, 1)
    return static


def dynamic_update_slice_syms(eqn: JaxprEqn, out_syms: Sequence[Sym],
                              ctx: Context) -> list[Sym]:
    """The operand is live where the output is and the update does not overwrite it (an
    unknown over the axes the update does not cover whole); the update, where the output lanes
    it lands on are (in place along the axes it covers whole). Starts computed from literals
    (`x.at[0].set(u)` with a row `u`) make both unknowns static."""
    out = out_syms[0]
    if not out:
        return [FALSE] * len(eqn.invars)
    operand, update = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    whole = [u == n for u, n in zip(update, operand, strict=True)]
    partial = [d for d, w in enumerate(whole) if not w and operand[d] != 1]
    static = _indices_known(eqn.invars[2:], ctx)
    kept = sym_and_literal(out, unknown(partial, static)) if partial else FALSE
    return [kept, _kept_along(out, {d: d for d, w in enumerate(whole) if w}, update,
                              [d for d, w in enumerate(whole) if not w], static)] + \
        _start_syms(eqn, out, ctx, 2)


def scatter_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym]:
    """`x.at[i].set(u)`: the operand is live where the output is and no update overwrites it
    (an unknown, static for indices computed from literals); the updates: an unknown; the
    indices, where every read counts, by their batch elements (`_scatter_index_mask`)."""
    out = out_syms[0]
    if not out:
        return [FALSE] * len(eqn.invars)
    shape = shape_of(eqn.invars[0])
    axes = [d for d, n in enumerate(shape) if n != 1]
    static = _indices_known(eqn.invars[1:2], ctx)
    lanes = _lanes_read(eqn, axes, ctx, gather=False) if static and axes else None
    if lanes is not None:  # `x.at[rows].set(0.)` keeps the other rows: a literal along rows
        kept = _known_literal(out, axes, lanes)
    else:
        kept = sym_and_literal(out, unknown(axes, static)) if axes else out
    return [kept, _scatter_index_syms(eqn, out, ctx)] + [opaque() for _ in eqn.invars[2:]]


def _scatter_index_syms(eqn: JaxprEqn, out: Sym, ctx: Context) -> Sym:
    return move(out, _scatter_batch_axes(eqn)) if ctx.structural else opaque()


def _slice_axes(eqn: JaxprEqn) -> tuple[list[bool], list[int]]:
    shape = shape_of(eqn.invars[0])
    strides = eqn.params["strides"] or (1,) * len(shape)
    whole = [lo == 0 and hi == n and step == 1 for n, lo, hi, step in zip(
        shape, eqn.params["start_indices"], eqn.params["limit_indices"], strides, strict=True)]
    return whole, [d for d, w in enumerate(whole) if not w]


def _dynamic_slice_axes(eqn: JaxprEqn) -> tuple[list[bool], list[int]]:
    # as long as its axis, a slice starts at 0 whatever its index (JAX clamps it)
    whole = [k == n for k, n in zip(eqn.params["slice_sizes"], shape_of(eqn.invars[0]),
                                    strict=True)]
    return whole, [d for d, w in enumerate(whole) if not w]


def _pad_axes(eqn: JaxprEqn) -> tuple[list[bool], list[int]]:
    config = eqn.params["padding_config"]
    return ([tuple(c) == (0, 0, 0) for c in config],
            [d for d, (lo, hi, _) in enumerate(config) if lo < 0 or hi < 0])


def _slice_sources(eqn: JaxprEqn, d: int) -> np.ndarray:
    strides = eqn.params["strides"] or (1,) * len(shape_of(eqn.invars[0]))
    return np.arange(eqn.params["start_indices"][d], eqn.params["limit_indices"][d], strides[d])


def _pad_sources(eqn: JaxprEqn, d: int) -> np.ndarray:
    lo, _, interior = eqn.params["padding_config"][d]
    at = np.arange(shape_of(eqn.outvars[0])[d]) - lo
    src = at // (interior + 1)
    return np.where((at >= 0) & (at % (interior + 1) == 0) &
                    (src < shape_of(eqn.invars[0])[d]), src, -1)


def _dynamic_slice_sources(eqn: JaxprEqn, ctx: Context) -> Sources | None:
    """A `dynamic_slice`'s sources where its starts are known when jaxsafe plans: each start
    clamped into the axis, as `lax.dynamic_slice` does."""
    starts = [ctx.constant(v) for v in eqn.invars[1:]]
    if any(s is None or np.size(s) != 1 for s in starts):
        return None
    sizes = eqn.params["slice_sizes"]
    first = [min(max(int(np.asarray(s).reshape(())), 0), n - k)
             for s, n, k in zip(starts, shape_of(eqn.invars[0]), sizes, strict=True)]
    return lambda eqn, d: np.arange(first[d], first[d] + sizes[d])


def _rev_axes(eqn: JaxprEqn) -> tuple[list[bool], list[int]]:
    return [d not in eqn.params["dimensions"] for d in range(len(shape_of(eqn.invars[0])))], []


def _worked(whole_axes: Callable[[JaxprEqn], tuple[list[bool], list[int]]]
            ) -> Callable[[JaxprEqn], list[int]]:
    """The axes a movement does not keep whole (`PrimitiveRule.works_along`)."""
    def worked(eqn: JaxprEqn) -> list[int]:
        return [d for d, whole in enumerate(whole_axes(eqn)[0]) if not whole]
    return worked


sliced_axes = _worked(_slice_axes)
dynamic_sliced_axes = _worked(_dynamic_slice_axes)
padded_axes = _worked(_pad_axes)
reversed_axes = _worked(_rev_axes)


def updated_axes(eqn: JaxprEqn) -> list[int]:
    """The axes a `dynamic_update_slice`'s update does not cover whole."""
    return [d for d, (u, n) in enumerate(zip(shape_of(eqn.invars[1]), shape_of(eqn.invars[0]),
                                             strict=True)) if u != n]


def concatenated_axis(eqn: JaxprEqn) -> list[int]:
    return [eqn.params["dimension"]]


def split_axis(eqn: JaxprEqn) -> list[int]:
    return [eqn.params["axis"]]


slice_syms = _whole_axes_syms(_slice_axes, by_shape=True, sources=_slice_sources)
dynamic_slice_syms = _whole_axes_syms(_dynamic_slice_axes, known_sources=_dynamic_slice_sources)
pad_syms = _whole_axes_syms(_pad_axes, by_shape=True, sources=_pad_sources)
rev_syms = _whole_axes_syms(_rev_axes, by_shape=True,
                            sources=lambda eqn, d: np.arange(shape_of(eqn.invars[0])[d])[::-1])


def out_of_range_drops(eqn: JaxprEqn) -> bool:
    """A scatter-add drops the updates whose index is out of range in its default mode
    (`FILL_OR_DROP`: `.at[].add`, `jax.ops.segment_sum` with padding sent to segment
    `num_segments`); clipped or promised indices drop none."""
    return eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP


def scatter_add_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """Every update of a scatter-add into a value live everywhere is live when no index can be
    out of range: clipped or promised indices, or indices the program computes from literals
    that all fall in range (`x.at[1].add(u)`). Otherwise the operand has the output's formula,
    and the updates carry it along the axes they keep in place (`_scatter_in_place`: a
    vmapped `segment_sum`'s rows), the rest decided at run time (`out_of_range_drops`)."""
    out = out_syms[0]
    in_range = not out_of_range_drops(eqn)
    if not in_range:
        indices = ctx.constant(eqn.invars[1])
        in_range = indices is not None and _all_in_range(eqn, indices)
    if out == TRUE and in_range:
        return [TRUE] * len(eqn.invars)
    if len(eqn.invars) != 3 or not out:
        return None
    updates_shape = shape_of(eqn.invars[2])
    to_update = _scatter_in_place(eqn)
    known = _indices_known(eqn.invars[1:2], ctx)
    # at indices known when jaxsafe traces, a predicate known then moves to a known mask (a
    # padded graph's readout under jraph's empty-segment test, at constant segment ids)
    updates = _carried(out, to_update, len(updates_shape),
                       (lambda key: isinstance(key, Var) and ctx.constant(key) is not None)
                       if known else None)
    scattered = [a for a in range(len(updates_shape)) if a not in to_update.values()]
    if not in_range and updates:  # an update sent out of range is dropped
        updates = sym_and_literal(updates, unknown(scattered, known))
    return [out, _scatter_index_syms(eqn, out, ctx), updates]


def _scatter_in_place(eqn: JaxprEqn) -> dict[int, int]:
    """Output axis -> the updates' axis that runs along it lane for lane: a window axis the
    updates cover whole and no index addresses (a vmapped `segment_sum`'s rows), and a batching
    axis (`operand_batching_dims`)."""
    dn = eqn.params["dimension_numbers"]
    op_shape, updates_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[2])
    windows = [d for d in range(len(op_shape))
               if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    kept = {d: a for a, d in zip(dn.update_window_dims, windows, strict=True)
            if updates_shape[a] == op_shape[d] and d not in dn.scatter_dims_to_operand_dims}
    scatter_axes = [a for a in range(len(updates_shape)) if a not in dn.update_window_dims]
    for d, j in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims, strict=True):
        if j < len(scatter_axes):
            kept[d] = scatter_axes[j]
    return kept


def as_twin(primitive: Any, rule: Callable) -> Callable:
    """`rule` read off the linear `primitive` bound with the same parameters: a scatter that
    multiplies or keeps the larger (or smaller) value reads its operand and its updates where a
    scatter-add would (every update kept in range is live, one that loses too: conservative),
    and drops the updates it sends out of range."""
    def twin_rule(eqn: JaxprEqn, *args: Any) -> Any:
        return rule(eqn.replace(primitive=primitive), *args)
    return twin_rule


def _all_in_range(eqn: JaxprEqn, indices: Any) -> bool:
    """Whether the scatter-add keeps every update: ones scattered into zeros sum to their
    count."""
    operand, updates = eqn.invars[0], eqn.invars[2]
    dtype = dtype_of(operand)  # the equation's own types (a count a low precision cannot hold
    ones = np.ones(shape_of(updates), dtype)  # exactly only makes the answer no)
    out = fold(eqn, [np.zeros(shape_of(operand), dtype), np.asarray(indices), ones])[0]
    return float(np.sum(out, dtype=np.float64)) == float(ones.size)


def pad_drops(eqn: JaxprEqn) -> bool:
    """A pad drops lanes only with negative padding (it cuts them off)."""
    return any(lo < 0 or hi < 0 for lo, hi, _ in eqn.params["padding_config"])


def transpose_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                    ctx: Context) -> list[Mask]:
    """The mask moves as the values do."""
    out = outs[0]
    if out is None:
        return [None]
    return [move_axes(out, eqn.params["permutation"], shape_of(eqn.invars[0]))]


def transpose_alignment(eqn: JaxprEqn, k: int) -> list[int | None]:
    align: list[int | None] = [None] * len(shape_of(eqn.invars[k]))
    for j, d in enumerate(eqn.params["permutation"]):
        align[d] = j
    return align


def squeeze_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                  ctx: Context) -> list[Mask]:
    """Lanes keep their order: the mask is reshaped back (on its core, where it can be)."""
    out = outs[0]
    if out is None:
        return [None] * len(eqn.invars)
    return [reshape_mask(out, shape_of(eqn.invars[0]))]


def reshape_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                  ctx: Context) -> list[Mask]:
    """As `squeeze`; a reshape that transposes first (`dimensions`) or has dynamic shape
    operands goes through its transpose."""
    if outs[0] is not None and (eqn.params.get("dimensions") is not None
                                or len(eqn.invars) != 1):
        return by_transpose_masks(eqn, outs, invals, ctx)  # pragma: no cover - rare forms
    return squeeze_masks(eqn, outs, invals, ctx)


def squeeze_alignment(eqn: JaxprEqn, k: int) -> list[int | None] | None:
    """Only reshapes that insert or remove size-1 axes keep the other axes' lanes."""
    if k != 0:
        return None
    ins, outs = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    big_in = [i for i, n in enumerate(ins) if n != 1]
    big_out = [o for o, n in enumerate(outs) if n != 1]
    if [ins[i] for i in big_in] != [outs[o] for o in big_out]:
        return None
    align: list[int | None] = [None] * len(ins)
    for i, o in zip(big_in, big_out, strict=True):
        align[i] = o
    return align


def reshape_alignment(eqn: JaxprEqn, k: int) -> list[int | None] | None:
    """As `squeeze_alignment`, for a reshape that does not transpose first (`dimensions`)."""
    if eqn.params.get("dimensions") is not None:
        return None
    return squeeze_alignment(eqn, k)


def concatenate_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                      ctx: Context) -> list[Mask]:
    """Each operand reads its own stretch of the output along the axis."""
    out = outs[0]
    if out is None:
        return [None] * len(eqn.invars)
    axis, start, masks = eqn.params["dimension"], 0, []
    for v in eqn.invars:
        size = shape_of(v)[axis]
        masks.append(slice_mask(out, axis, start, start + size))
        start += size
    return masks


def _carried(sym: Sym, to_operand: dict[int, int], rank: int,
             known: Callable[[Any], bool] | None = None) -> Sym:
    """An operand's formula from its output's, through an equation that keeps lanes in place
    from output axis `o` to operand axis `to_operand[o]` (same size) and moves or mixes them
    along the other axes (a concatenation's or a cumulative sum's axis, the axes a reshape
    merges): a literal along kept axes only carries over; one along another axis becomes a
    fresh unknown, on its kept axes and every operand axis that is not kept (decided at run
    time; static where its key is, or where `known` says the key's value is known when
    jaxsafe traces and the equation moves lanes by shapes and constants alone). Exact or
    coarser, never finer: no OR is claimed (`move` claims one)."""
    loose = [d for d in range(rank) if d not in to_operand.values()]

    def carried(lit: Lit) -> Lit:
        key, positive, embed = lit
        static = isinstance(key, Unknown) and key.static or known is not None and known(key)
        if embed is None:
            return unknown(None, static)
        if all(e is None or e in to_operand for e in embed):
            return (key, positive, tuple(None if e is None else to_operand[e] for e in embed))
        return unknown([to_operand[e] for e in embed if e in to_operand] + loose, static)
    if sym in (TRUE, FALSE):
        return sym
    return frozenset(frozenset(carried(lit) for lit in term) for term in sym)


def _carried_known(sym: Sym, to_operand: dict[int, int], rank: int, ctx: Context,
                   out_shape: Sequence[int], move_lanes: Callable[[np.ndarray], np.ndarray]
                   ) -> Sym:
    """`_carried`, but a literal along an axis the equation moves lanes along whose value is
    known when jaxsafe plans (a padding mask closed over, `_known_lanes`) is moved with the
    lanes (`move_lanes`: the output's lanes onto the operand's, a stretch or a reshape) and
    becomes a static mask known lane by lane (`Unknown.lanes`), not a run-time unknown: a
    gather before a `concatenate` or a `reshape` still reads only the lanes that may be live.
    Only for values of at most `STATIC_CORE_LIMIT` lanes."""
    if sym in (TRUE, FALSE) or int(np.prod(out_shape)) > STATIC_CORE_LIMIT:
        return _carried(sym, to_operand, rank)
    out: Sym = FALSE
    for term in sym:
        moved: list[Lit] = []
        rest: list[Lit] = []
        for lit in term:
            key, _, embed = lit
            value = None if embed is None or all(e is None or e in to_operand for e in embed) \
                else _known_lanes(key, ctx)
            if value is None or embed is None or np.ndim(value) != len(embed):
                rest.append(lit)
                continue
            lanes = np.asarray(move_lanes(held_lanes(lit, value, out_shape)), bool)
            if not lanes.any():
                break  # the term never holds on the operand
            if not lanes.all():
                moved.append(_static_lanes_literal(lanes))
        else:
            carried = _carried(frozenset({frozenset(rest)}), to_operand, rank)
            out = sym_or(out, frozenset({next(iter(carried)) | frozenset(moved)}))
    return out


def _static_lanes_literal(lanes: np.ndarray) -> Lit:
    """A static mask known lane by lane over a value (`lanes`, of its shape), along only the
    axes where it varies."""
    varying, kept = _varying_lanes(lanes)
    return unknown(varying, lanes=kept)


def _varying_lanes(lanes: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The axes along which `lanes` varies, and `lanes` over only those (it is the same along
    the others)."""
    varying = [d for d in range(lanes.ndim)
               if not np.all(lanes == np.take(lanes, [0], axis=d))]
    others = tuple(d for d in range(lanes.ndim) if d not in varying)
    return varying, (np.asarray(lanes.any(axis=others)) if others else lanes)


def _in_place_but(axes: Iterable[int], rank: int, removed: bool = False) -> dict[int, int]:
    """Output axis -> operand axis for an equation that keeps lanes in place on every axis but
    `axes` (`removed`: the output has the one axis the operand lacks, `stack`'s new one)."""
    axes = set(axes)
    if removed:
        (axis,) = axes
        return {o: o - (o > axis) for o in range(rank) if o != axis}
    return {d: d for d in range(rank) if d not in axes}


def _known_parts(sym: Sym, axis: int, start: int, stop: int, ctx: Context) -> Sym:
    """`sym` for the stretch [start, stop) of `axis`, where a literal along `axis` whose lanes
    are known when jaxsafe plans (`_known_lanes`: a padding mask closed over) holds one value
    over the whole stretch: the literal is that value (a term it falsifies goes). The other literals
    stay, for the caller to carry (a part that mixes is decided at run time)."""
    if sym in (TRUE, FALSE):
        return sym
    out = FALSE
    for term in sym:
        kept, holds = [], True
        for lit in term:
            key, positive, embed = lit
            value = None if embed is None or axis not in embed else _known_lanes(key, ctx)
            if value is None or embed is None:
                kept.append(lit)
                continue
            part = np.take(np.asarray(value, bool), range(start, stop), axis=embed.index(axis))
            if not part.all() and part.any():
                kept.append(lit)
            elif bool(part.all()) != positive:
                holds = False
                break
        if holds:
            out = sym_or(out, frozenset({frozenset(kept)}))
    return out


def concatenate_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym]:
    """Each operand's lanes are the output's along every axis but the concatenated one: a
    formula along the others carries over (padded rows of features `concatenate`d along the
    feature axis), one along that axis is decided at run time, or when jaxsafe plans, for a
    predicate it knows (`_known_parts`)."""
    axis = eqn.params["dimension"]
    out_shape = shape_of(eqn.outvars[0])
    rank = len(out_shape)
    kept = _in_place_but([axis], rank)
    syms, start = [], 0
    for v in eqn.invars:
        size = shape_of(v)[axis]
        stretch = functools.partial(_stretch, axis=axis, start=start, stop=start + size)
        syms.append(FALSE if isinstance(v, Literal) else _carried_known(
            _known_parts(out_syms[0], axis, start, start + size, ctx), kept, rank, ctx,
            out_shape, stretch))
        start += size
    return syms


def _stretch(lanes: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    return np.take(lanes, range(start, stop), axis=axis)


def stack_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym]:
    """`jnp.stack`: operand k is the output's k-th entry along the new axis; a formula along
    the other axes carries over, one along the new axis is decided at run time, or when
    jaxsafe plans, for a predicate it knows (`_known_parts`)."""
    axis = eqn.params["axis"]
    out_shape = shape_of(eqn.outvars[0])
    rank = len(out_shape)
    kept = _in_place_but([axis], rank, removed=True)
    return [FALSE if isinstance(v, Literal) else _carried_known(
        _known_parts(out_syms[0], axis, k, k + 1, ctx), kept, rank - 1, ctx, out_shape,
        functools.partial(np.take, indices=k, axis=axis))
            for k, v in enumerate(eqn.invars)]


def split_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym]:
    """`jnp.split`: the operand's stretch k is output k, in place along the other axes. Each
    output's formula carries over on its stretch, named by a static mask known lane by lane
    (`unknown(lanes=...)`), so that an OR over the split axis (a matmul that computed the
    gates of an LSTM) reads the outputs' formulas, not an unknown."""
    if all(sym == TRUE for sym in out_syms):
        return [TRUE]
    axis = eqn.params["axis"]
    rank = len(shape_of(eqn.invars[0]))
    kept = _in_place_but([axis], rank)
    n = shape_of(eqn.invars[0])[axis]
    operand, start = FALSE, 0
    for out, sym in zip(eqn.outvars, out_syms, strict=True):
        size = shape_of(out)[axis]
        stretch = np.zeros(n, bool)
        stretch[start:start + size] = True
        start += size
        if sym:
            operand = sym_or(operand, sym_and_literal(_carried(sym, kept, rank),
                                                      unknown([axis], lanes=stretch)))
    return [operand]


def along_axes_syms(axes_of: Callable[[JaxprEqn], Iterable[int]]) -> StaticRule:
    """Static rule of an equation whose operands and outputs have one rank and that works along
    `axes_of(eqn)`, lane by lane in place on the others (a cumulative op, a sort, `top_k`, a
    window along the feature axis): the outputs' formulas (their union) along the other axes
    carry over to every operand, so a row that a `where` drops after a `cumsum` over features
    is dropped before it. Where the equation may drop lanes (`may_drop`: a running max,
    `top_k`, a window that skips lanes), which ones is decided at run time: an unknown on
    every axis besides."""
    def static(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
        rank = len(shape_of(eqn.outvars[0]))
        axes = set(axes_of(eqn))
        kept = _in_place_but(axes, rank)
        out_shape = shape_of(eqn.outvars[0])
        if any(len(shape_of(o)) != rank for o in eqn.outvars) or any(
                len(shape_of(v)) != rank or any(shape_of(v)[d] != out_shape[d] for d in kept)
                for v in eqn.invars):
            return None
        union = FALSE
        for sym in out_syms:
            union = sym_or(union, _carried(sym, kept, rank))
        if union and may_drop(eqn, ctx.structural):
            union = sym_and_literal(union, unknown(d for d, n in enumerate(out_shape) if n != 1))
        return [FALSE if isinstance(v, Literal) else union for v in eqn.invars]
    return static


def reshape_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """A reshape that only inserts or removes size-1 axes moves the formula axis for axis
    (`aligned_syms`); one that merges or splits axes keeps in place the leading and trailing
    axes it leaves alone (`x.reshape(rows, -1)` of a per-row stack), and decides the rest at
    run time."""
    if reshape_alignment(eqn, 0) is not None:
        return aligned_syms(eqn, out_syms, ctx)
    ins, outs = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    kept: dict[int, int] = {}
    for d in range(min(len(ins), len(outs))):  # leading axes
        if ins[d] != outs[d]:
            break
        kept[d] = d
    for d in range(1, min(len(ins), len(outs)) + 1):  # trailing axes
        if ins[-d] != outs[-d] or len(outs) - d in kept or len(ins) - d in kept.values():
            break
        kept[len(outs) - d] = len(ins) - d
    return [_carried_known(out_syms[0], kept, len(ins), ctx, outs,
                           lambda lanes: np.reshape(lanes, ins))] + \
        [opaque() for _ in eqn.invars[1:]]


def aligned_lanes_syms(eqn: JaxprEqn, out_syms: Sequence[Sym],
                       ctx: Context) -> list[Sym] | None:
    """Along the axes the equation's alignment keeps lane for lane (a convolution's batch and
    untouched spatial axes, its kernel's output features), the output's formula carries over;
    along the others, lanes are read by windows, not by whole rows: decided at run time (an OR
    over the axis, as `aligned_syms` claims for a matmul, would be coarser than the truth)."""
    align_rule = rule_for(eqn.primitive).align
    if align_rule is None or len(eqn.outvars) != 1:
        return None
    syms: list[Sym] = []
    for k, v in enumerate(eqn.invars):
        align = align_rule(eqn, k)
        if align is None:
            return None
        sym = FALSE if isinstance(v, Literal) else \
            _carried(out_syms[0], backward_mapping(align), len(align))
        if sym and may_drop(eqn, ctx.structural):  # lanes no window reads: at run time
            sym = sym_and_literal(sym, unknown(d for d, n in enumerate(shape_of(v)) if n != 1))
        syms.append(sym)
    return syms


def cumulative_axis(eqn: JaxprEqn) -> list[int]:
    return [eqn.params["axis"]]


def sort_axis(eqn: JaxprEqn) -> list[int]:
    return [eqn.params["dimension"]]


def tiled_axes(eqn: JaxprEqn) -> list[int]:
    """`jnp.tile`'s axes with more than one copy (the others keep lanes in place)."""
    return [d for d, r in enumerate(eqn.params["reps"]) if r != 1]


def top_k_axis(eqn: JaxprEqn) -> list[int]:
    """`top_k`'s axis (the last before JAX named it); `approx_top_k`'s `reduction_dimension`."""
    rank = len(shape_of(eqn.invars[0]))
    return [eqn.params.get("axis", eqn.params.get("reduction_dimension", -1)) % rank]


def window_axes(eqn: JaxprEqn) -> list[int]:
    """The axes along which a `reduce_window` reads more than its own lane."""
    p = eqn.params
    return [d for d, w in enumerate(p["window_dimensions"])
            if (w, p["window_strides"][d], tuple(p["padding"][d]), p["base_dilation"][d],
                p["window_dilation"][d]) != (1, 1, (0, 0), 1, 1)]


def split_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                ctx: Context) -> list[Mask]:
    """The outputs' masks, concatenated back."""
    if all(m is None for m in outs):
        return [None]
    return [concat_masks(outs, [shape_of(o) for o in eqn.outvars], eqn.params["axis"])]


def stack_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                ctx: Context) -> list[Mask]:
    """`jnp.stack` (a primitive of its own in newer JAX): operand k reads the output's k-th
    entry along the new axis."""
    out = outs[0]
    if out is None:
        return [None] * len(eqn.invars)
    axis = eqn.params["axis"]
    return [reshape_mask(slice_mask(out, axis, k, k + 1), shape_of(v))
            for k, v in enumerate(eqn.invars)]


def unstack_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                  ctx: Context) -> list[Mask]:
    """`jnp.unstack`: the outputs' masks, stacked back along the axis."""
    if all(m is None for m in outs):
        return [None]
    axis = eqn.params["axis"]
    shapes = []
    for o in eqn.outvars:
        shape = list(shape_of(o))
        shape.insert(axis, 1)
        shapes.append(tuple(shape))
    parts = [None if m is None else reshape_mask(m, s) for m, s in zip(outs, shapes, strict=True)]
    return [concat_masks(parts, shapes, axis)]


def tile_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
               ctx: Context) -> list[Mask]:
    """`jnp.tile`: an operand lane is live where any of its copies is (the output, axis by
    axis, is `reps` copies of the operand one after another)."""
    out = outs[0]
    shape = shape_of(eqn.invars[0])
    reps = tuple(eqn.params["reps"])
    if out is None:
        return [None]
    if len(reps) != len(shape):  # not the form JAX binds: live where any output lane is
        return [broadcast(reduce_any(out, range(out.ndim)), shape)]
    split = tuple(n for r, d in zip(reps, shape, strict=True) for n in (r, d))
    copies = reduce_any(reshape_mask(materialize(out, shape_of(eqn.outvars[0])), split),
                        range(0, 2 * len(shape), 2))
    return [reshape_mask(copies, shape)]


def broadcast_in_dim_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                           ctx: Context) -> list[Mask]:
    """An operand lane is live if any of its copies is."""
    out = outs[0]
    masks: list[Mask] = [None] * len(eqn.invars)
    if out is None:
        return masks
    in_shape = shape_of(eqn.invars[0])
    bdims = tuple(eqn.params["broadcast_dimensions"])
    others = tuple(d for d in range(out.ndim) if d not in bdims)
    m = reduce_any(out, others)
    size_one = tuple(k for k, size in enumerate(in_shape) if size == 1 and m.shape[k] != 1)
    m = reduce_any(m, size_one, keepdims=True)
    masks[0] = reshape_mask(m, in_shape)
    return masks


def broadcast_in_dim_alignment(eqn: JaxprEqn, k: int) -> list[int | None] | None:
    if k != 0:
        return None
    ins, outs = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    return [d if ins[j] == outs[d] else None
            for j, d in enumerate(eqn.params["broadcast_dimensions"])]


# --------------------------------------------------------------------------- reductions


def reduction_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                    ctx: Context) -> list[Mask]:
    """Every lane of a reduced row is live if the row's result is."""
    out = outs[0]
    if out is None:
        return [None] * len(eqn.invars)
    row = _row_mask(out, shape_of(eqn.invars[0]), eqn.params["axes"])
    return [row] + [fit(out, shape_of(v)) for v in eqn.invars[1:]]


def _row_mask(out: Mask, in_shape: tuple, reduced: Sequence[int]) -> Mask:
    """A reduction's result mask spread over the rows it reduced."""
    kept = tuple(d for d in range(len(in_shape)) if d not in reduced)
    return broadcast_mask(out, in_shape, kept)


def _kept_alignment(rank: int, reduced: Sequence[int]) -> list[int | None]:
    """A reduction's operand axes: a kept axis runs along the next output axis, a reduced one
    along none."""
    kept = [d for d in range(rank) if d not in reduced]
    align: list[int | None] = [None] * rank
    for j, d in enumerate(kept):
        align[d] = j
    return align


def reduction_alignment(eqn: JaxprEqn, k: int) -> list[int | None] | None:
    if k != 0:
        return None
    return _kept_alignment(len(shape_of(eqn.invars[0])), eqn.params["axes"])


def reduce_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                 ctx: Context) -> list[Mask]:
    """The generic `lax.reduce` of n operands with n initial values: a lane of a reduced row is
    live if any of the row's results is (its computation may mix the operands: `argmax` as a
    pair reduction), and an initial value is live if any result lane is."""
    n = len(eqn.outvars)
    out = any_of(outs)
    if out is None:
        return [None] * len(eqn.invars)
    row = _row_mask(out, shape_of(eqn.invars[0]), eqn.params["dimensions"])
    return [row] * n + [fit(out, shape_of(v)) for v in eqn.invars[n:]]


def reduce_alignment(eqn: JaxprEqn, k: int) -> list[int | None] | None:
    """A one-operand `lax.reduce`: the operand runs along the output on its kept axes, the
    initial value (a scalar) along none."""
    if len(eqn.invars) != 2:
        return None
    if k == 1:
        return []
    return _kept_alignment(len(shape_of(eqn.invars[0])), eqn.params["dimensions"])


def cumulative_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                     ctx: Context) -> list[Mask]:
    """Lane j of a cumulative op feeds outputs j, j+1, ... (or j, j-1, ... when reversed)."""
    out = outs[0]
    if out is None:
        return [None]
    axis, reverse = eqn.params["axis"], eqn.params["reverse"]
    counts = lax.cummax(lax.convert_element_type(out, jnp.int32), axis=axis,
                        reverse=not reverse)
    return [lax.gt(counts, np.int32(0))]


def dot_general_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                      ctx: Context) -> list[Mask]:
    """An operand lane is live if any output it is multiplied into is: an any-reduction over the
    other operand's free axes of the output mask, broadcast over the contracted axes."""
    out = outs[0]
    if out is None:
        return [None, None]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    a_shape, b_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
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


def dot_general_alignment(eqn: JaxprEqn, k: int) -> list[int | None]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ins = shape_of(eqn.invars[k])
    contract, batch = (lc, lb) if k == 0 else (rc, rb)
    free = [d for d in range(len(ins)) if d not in contract and d not in batch]
    n_lhs_free = len(shape_of(eqn.invars[0])) - len(lc) - len(lb)
    first = len(lb) + (0 if k == 0 else n_lhs_free)
    align: list[int | None] = [None] * len(ins)
    for j, d in enumerate(batch):
        align[d] = j
    for j, d in enumerate(free):
        align[d] = first + j
    return align


# --------------------------------------------------------------------------- batched linear algebra


Core = int | None | Callable[[JaxprEqn], int]
"""A batched primitive's trailing axes that make one element: a count, None (the value is one
whole), or read off the equation (an FFT's `fft_lengths`)."""


def batch_rank(eqn: JaxprEqn, core: Core) -> int:
    """The leading axes along which a linear-algebra primitive works matrix by matrix: those
    of its first output before its `core` trailing axes (None: none, the value is one whole)."""
    if callable(core):
        core = core(eqn)
    return 0 if core is None else len(shape_of(eqn.outvars[0])) - core


def batched_masks(core: Core) -> MaskRule:
    """Each matrix of a batch is computed on its own: its operand lanes are live where any lane
    of that batch element is, in any float output (`core`: the first output's matrix axes)."""
    def masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
              ctx: Context) -> list[Mask]:
        nb = batch_rank(eqn, core)
        per_batch = []
        for m, o in zip(outs, eqn.outvars, strict=True):
            if not is_float(o):
                continue  # pivots, permutations: read for their values only
            if m is None:
                return [None] * len(eqn.invars)
            per_batch.append(reduce_any(m, range(nb, len(shape_of(o)))))
        if not per_batch:
            return [None] * len(eqn.invars)
        live = any_of(per_batch)
        return [None if live is None else broadcast_mask(live, shape_of(v), tuple(range(nb)))
                for v in eqn.invars]
    return masks


def batched_syms(core: Core) -> StaticRule:
    """Static liveness of a batch element: the OR of its lanes in the float outputs
    (`batch_formula`), the same in every operand's leading axes."""
    def static(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym]:
        live = batch_formula(eqn, out_syms, range(batch_rank(eqn, core)))
        return [FALSE if isinstance(v, Literal) else live for v in eqn.invars]
    return static


def batch_formula(eqn: JaxprEqn, out_syms: Sequence[Sym], batch: Iterable[int]) -> Sym:
    """The formula of a batch element (along the outputs' `batch` axes): the OR of its lanes
    in the float outputs. A literal that runs along the batch axes only carries over (a `where`
    on a per-matrix predicate); one that runs along the matrix axes only is taken as live
    somewhere in each matrix (the lower triangle `jnp.linalg.cholesky` keeps), and so is a mask
    the static pass cannot name that runs along them or along every axis (the diagonal a gather
    reads for a log-determinant): live, as before, so such code is not changed. A predicate
    along both is decided at run time, and so is a mask the static pass cannot name that a call
    gives its operand for results that are not all live (`Unknown.reads` is False): the call
    may drop a matrix whole."""
    batch = frozenset(batch)
    live: Sym = FALSE
    for sym, o in zip(out_syms, eqn.outvars, strict=True):
        if not is_float(o):
            continue  # pivots, permutations: read for their values only
        terms = set()
        for term in sym:
            kept = set()
            for lit in term:
                embed = lit[2]
                axes = None if embed is None else {e for e in embed if e is not None}
                if axes is not None and axes <= batch:
                    kept.add(lit)  # along the batch axes only
                elif axes is None and isinstance(lit[0], Unknown) and not lit[0].reads:
                    # what a call reads for results a `where` drops in part (`slogdet`'s
                    # diagonal of `lu`): a matrix may be dropped whole, at run time
                    kept.add(unknown(batch))
                elif axes is None or isinstance(lit[0], Unknown) or not axes & batch:
                    continue  # live somewhere in each matrix, conservatively
                else:
                    kept.add(unknown(axes & batch))
            terms.add(frozenset(kept))
        live = sym_or(live, frozenset(terms))
    return live


# One key per set of batch axes: the same object in every check, so that `Sweeps` reuses each
# program's sweep within a rewrite.
_BATCH_KEYS: dict[tuple, Unknown] = {}


@dataclasses.dataclass(frozen=True)
class SolveBatch:
    """How a linear solve works batch element by batch element: its result's `axes`, and for
    each operand the axes they run along there (None: an index, no derivative)."""
    axes: tuple[int, ...]
    embeds: tuple[tuple[int, ...] | None, ...]


def solve_batch(eqn: JaxprEqn, ctx: Context) -> SolveBatch | None:
    """The batch axes along which a linear solve (`jnp.linalg.solve`, `inv` or `cho_solve` of a
    batch) works element by element, where shown: a formula along those axes of the result,
    given to the outputs of each of its programs (`matvec`, `vecmat`, `solve`,
    `transpose_solve`: their outputs and vector inputs are laid out as the result), reaches
    each float input as that formula along some of its axes (or not at all), and each vector
    input along the same axes. None: one whole (so is a right-hand side of several arrays)."""
    if len(eqn.outvars) != 1:
        return None
    rank = len(shape_of(eqn.outvars[0]))
    single = [d for d in range(rank) if _batch_embeds(eqn, (d,), ctx) is not None]
    for axes in (tuple(single), *((d,) for d in single)):
        if axes:
            embeds = _batch_embeds(eqn, axes, ctx)
            if embeds is not None:
                return SolveBatch(axes, embeds)
    return None


def _batch_embeds(eqn: JaxprEqn, axes: tuple[int, ...], ctx: Context
                  ) -> tuple[tuple[int, ...] | None, ...] | None:
    key = _BATCH_KEYS.setdefault(axes, Unknown())
    along = frozenset({frozenset({(key, True, axes)})})
    embeds: list[tuple[int, ...] | None] = []
    for program, n in zip(eqn.params["jaxprs"], eqn.params["const_lengths"], strict=True):
        if program is None:
            continue
        syms = ctx.inner_syms(program, [along] * len(program.out_avals), True)
        for k, (v, sym) in enumerate(zip(program.jaxpr.invars, syms, strict=True)):
            vector = k >= n
            embed = _embedding(sym, key)
            if not is_float(v) and not vector:
                embeds.append(None)  # pivots: an index, no derivative
            elif embed is None or vector and embed != axes:
                return None
            elif not vector:
                embeds.append(embed)
    return (*embeds, axes)  # the right-hand side, laid out as the result


def _embedding(sym: Sym, key: Unknown) -> tuple[int, ...] | None:
    """The axes along which `sym` is the batch literal `key` (or a part of it), else None."""
    found = {lit[2] for term in sym for lit in term if lit[0] is key and lit[1]}
    if len(found) != 1:
        return None
    embed = found.pop()
    if embed is None or None in embed or \
            not implies(sym, frozenset({frozenset({(key, True, embed)})})):
        return None
    return embed


def solve_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                ctx: Context) -> list[Mask]:
    """A batch element of a linear solve's operands is live where any lane of that element of
    its result is (`solve_batch`); the whole solve as one where no batch is shown."""
    batch = solve_batch(eqn, ctx)
    if batch is None:
        return batched_masks(None)(eqn, outs, invals, ctx)
    if outs[0] is None:
        return [None] * len(eqn.invars)
    rank = len(shape_of(eqn.outvars[0]))
    live = reduce_any(outs[0], [d for d in range(rank) if d not in batch.axes])
    return [None if embed is None else broadcast_mask(live, shape_of(v), embed)
            for v, embed in zip(eqn.invars, batch.embeds, strict=True)]


def solve_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """`solve_masks`, statically: the batch element's formula (`batch_formula`) moved onto each
    operand's batch axes."""
    if all(m == TRUE for m in out_syms):
        return [FALSE if isinstance(v, Literal) else TRUE for v in eqn.invars]
    batch = solve_batch(eqn, ctx)
    if batch is None:
        return batched_syms(None)(eqn, out_syms, ctx)
    live = batch_formula(eqn, out_syms, batch.axes)
    return [FALSE if isinstance(v, Literal) or embed is None else
            move(live, dict(zip(batch.axes, embed, strict=True)))
            for v, embed in zip(eqn.invars, batch.embeds, strict=True)]


def batched_alignment(core: Core) -> AlignRule:
    """A one-output primitive's batch axes run along its output's; its matrix axes along none."""
    def align(eqn: JaxprEqn, k: int) -> list[int | None]:
        nb = batch_rank(eqn, core)
        return [d if d < nb else None for d in range(len(shape_of(eqn.invars[k])))]
    return align


# --------------------------------------------------------------------------- bodies


def call_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
               ctx: Context) -> list[Mask]:
    """Through the body (`jit`, `closed_call`), read with the outputs' formulas, as
    `call_syms` reads it."""
    return ctx.inner_masks(call_jaxpr(eqn), invals, outs, ctx.structural,
                           [ctx.sym(o) for o in eqn.outvars])


def call_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym]:
    """Through the body: its inputs' formulas are the operands'."""
    return ctx.inner_syms(call_jaxpr(eqn), out_syms, ctx.structural)


def call_kinds(eqn: JaxprEqn, out_kinds: list[Kind], ctx: Context) -> list[Kind]:
    return ctx.inner_kinds(call_jaxpr(eqn), out_kinds, ctx.structural)


def opaque_call_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                      ctx: Context) -> list[Mask]:
    """Through a body that runs again, as one unit, on guarded operands (a checkpoint, a custom
    rule's primal): structural only, so nothing it decides on can change under it."""
    return ctx.inner_masks(call_jaxpr(eqn), invals, outs, True)


def opaque_call_kinds(eqn: JaxprEqn, out_kinds: list[Kind], ctx: Context) -> list[Kind]:
    return ctx.inner_kinds(call_jaxpr(eqn), out_kinds, True)


def custom_rule_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
                      ctx: Context) -> list[Mask]:
    """Through the primal body of a custom derivative rule, and more: the rule may read what
    the body does not (`lax.custom_root`'s implicit derivative reads the parameter its solver
    only iterates on; a rule of an operand the primal ignores). A lane the body reads for no
    output is live wherever any output lane is; the lanes it reads follow the body."""
    read_kinds = ctx.inner_kinds(call_jaxpr(eqn), [Kind.LIVE] * len(outs), True)
    if all(k == Kind.LIVE for k in read_kinds):
        # as `custom_rule_syms` read the body: with the outputs' formulas
        return ctx.inner_masks(call_jaxpr(eqn), invals, outs, True,
                               [ctx.sym(o) for o in eqn.outvars])
    body = opaque_call_masks(eqn, outs, invals, ctx)
    # the lanes read in part only need the body's masks at run time; unread operands do not
    read = ctx.inner_masks(call_jaxpr(eqn), invals, [None] * len(outs), True) \
        if Kind.MAYBE in read_kinds else [None] * len(read_kinds)
    anywhere = any_of([None if m is None else reduce_any(m, range(m.ndim)) for m in outs])
    masks: list[Mask] = []
    for v, b, kind, r in zip(eqn.invars, body, read_kinds, read, strict=True):
        if kind == Kind.LIVE or b is None:
            masks.append(b)
            continue
        shape = shape_of(v)
        if kind == Kind.DEAD:
            unread = None
        elif r is None:  # the body reads every lane (an integer constant it moves)
            unread = zeros(shape)
        else:
            unread = not_mask(broadcast(r, shape))
        if anywhere is not None:
            anywhere_here = broadcast(anywhere, shape)
            unread = anywhere_here if unread is None else all_of([unread, anywhere_here])
        masks.append(None if unread is None else any_of([broadcast(b, shape), unread]))
    return masks


def custom_rule_kinds(eqn: JaxprEqn, out_kinds: list[Kind], ctx: Context) -> list[Kind]:
    """`custom_rule_masks`' kinds: every lane of an operand is live where every output is."""
    body = opaque_call_kinds(eqn, out_kinds, ctx)
    if all(k == Kind.LIVE for k in out_kinds):
        return [Kind.LIVE] * len(body)
    read = ctx.inner_kinds(call_jaxpr(eqn), [Kind.LIVE] * len(out_kinds), True)
    return [b if r == Kind.LIVE else Kind.MAYBE for b, r in zip(body, read, strict=True)]


def _lane_to_lane(eqn: JaxprEqn, rank: int) -> bool:
    """Whether `eqn` maps lanes to lanes of one rank (operands of rank 0 broadcast; size-1 axes
    too), makes a constant from literals alone, or is a call that is inlined (its body is read
    in turn)."""
    rule = rule_for(eqn.primitive)
    if rule.inline or all(isinstance(v, Literal) for v in eqn.invars):
        return True
    if not (rule.elementwise or rule.selection is not None) or len(eqn.outvars) != 1:
        return False
    return len(shape_of(eqn.outvars[0])) == rank and \
        all(len(shape_of(v)) in (0, rank) for v in eqn.invars)


def custom_rule_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """A custom rule whose primal body reads every operand (as the run-time rule,
    `custom_rule_masks`, then gives them): lane to lane (`jax.nn.relu`, `logaddexp`, a clamp
    with its own derivative), each operand has the output's formula along its axes; otherwise
    the formulas the body's own static rules give, structurally (`jnp.linalg.pinv`: a matrix
    of a batch that a `where` drops is dropped before its `svd`). Otherwise None: the kinds,
    every lane of a live operand as one unknown."""
    body = call_jaxpr(eqn)
    read = ctx.inner_kinds(body, [Kind.LIVE] * len(eqn.outvars), True)
    if any(k != Kind.LIVE for k in read):
        return None
    rank = len(shape_of(eqn.outvars[0]))
    if len(eqn.outvars) != 1 or any(len(shape_of(v)) not in (0, rank) for v in eqn.invars) or \
            any_equation(body, lambda e: not _lane_to_lane(e, rank)):
        return [FALSE if isinstance(v, Literal) else sym
                for v, sym in zip(eqn.invars, ctx.inner_syms(body, out_syms, True), strict=True)]
    out = out_syms[0]
    return [FALSE if isinstance(v, Literal) else
            move(out, backward_mapping(cast(list, same_rank_alignment(eqn, k))))
            for k, v in enumerate(eqn.invars)]


def cond_masks(eqn: JaxprEqn, outs: list[Mask], invals: Sequence[Any],
               ctx: Context) -> list[Mask]:
    """Per branch (structural: the branch is re-run on the guarded operands and decides on what
    it reads), selected by the branch index."""
    index, operands = invals[0], invals[1:]
    per_branch = [ctx.inner_masks(br, operands, outs, True) for br in eqn.params["branches"]]
    masks: list[Mask] = [None]
    for k, v in enumerate(eqn.invars[1:]):
        branch_masks = [m[k] for m in per_branch]
        if all(m is None for m in branch_masks):
            masks.append(None)
            continue
        cases = [materialize(m, shape_of(v)) for m in branch_masks]
        which = lax.clamp(np.int32(0), lax.convert_element_type(index, jnp.int32),
                          np.int32(len(cases) - 1))
        masks.append(lax.select_n(which, *cases) if len(cases) > 1 else cases[0])
    return masks


def cond_kinds(eqn: JaxprEqn, out_kinds: list[Kind], ctx: Context) -> list[Kind]:
    per_branch = [ctx.inner_kinds(br, out_kinds, True) for br in eqn.params["branches"]]
    kinds = [Kind.DEAD]
    for k in range(len(eqn.invars) - 1):
        ks = {m[k] for m in per_branch}
        kinds.append(ks.pop() if len(ks) == 1 else Kind.MAYBE)
    return kinds


# --------------------------------------------------------------------------- static rules


def _aligned(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context,
             by_value: bool) -> list[Sym] | None:
    if len(eqn.outvars) != 1:
        return None
    out = out_syms[0]
    identity = list(range(len(shape_of(eqn.outvars[0]))))
    align_rule = rule_for(eqn.primitive).align
    if align_rule is None:
        return None
    syms: list[Sym] = []
    for k, v in enumerate(eqn.invars):
        if isinstance(v, Literal):  # carries no liveness
            syms.append(FALSE)
            continue
        align = align_rule(eqn, k)
        if align is None:
            return None
        sym = out if align == identity else move(out, backward_mapping(align))
        if by_value and sym and not ctx.operand_never_loses(eqn, k):
            # which operand wins is decided by value, at run time
            shape = shape_of(v)
            sym = sym_and_literal(sym, unknown((i for i, n in enumerate(shape) if n != 1),
                                               wins=(eqn, k)))
        syms.append(sym)
    return syms


def aligned_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """The output's formula, moved along each operand's alignment."""
    return _aligned(eqn, out_syms, ctx, False)


def paired_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """Operand i has output i's formula; one placed under another type is live in every lane
    wherever its output has a live lane (`paired_masks`)."""
    return [(TRUE if s != FALSE else FALSE) if _retyped(eqn, i) else s
            for i, s in enumerate(out_syms)]


def selected_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """`max`, `min`, `clamp`: aligned, and an unknown (decided at run time) for each operand."""
    return _aligned(eqn, out_syms, ctx, not ctx.structural)


def select_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Context) -> list[Sym] | None:
    """`select_n` with a boolean predicate: `p & out` for the taken case, `~p & out` for the
    other. A predicate computed from literals that is all True or all False drops one case
    everywhere (`jnp.where(True, a, b)`)."""
    pred = eqn.invars[0]
    if (not ctx.structural and len(eqn.invars) == 3 and dtype_of(pred) == jnp.bool_
            and shape_of(pred) in (shape_of(eqn.outvars[0]), ())):
        out = out_syms[0]
        value = ctx.constant(pred)
        if value is not None and (bool(np.all(value)) or not np.any(value)):
            # dropped in every lane alike, yet differentiated (a zero cotangent): an unknown
            # along no axis (a run-time mask decides, at the size of a scalar)
            untaken = frozenset({frozenset({unknown(())})}) if out else FALSE
            return [FALSE, untaken, out] if np.all(value) else [FALSE, out, untaken]
        if not isinstance(pred, Literal):
            lit = predicate_literal(pred, True, ctx.broadcast_of, ctx.same_as)
            return [FALSE, *split_on(out, lit)]
    if not ctx.structural:
        by_index = case_syms(eqn, out_syms[0], ctx)  # `jnp.select`'s first True
        if by_index is not None:
            return by_index
    return selected_syms(eqn, out_syms, ctx)
