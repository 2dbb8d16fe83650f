"""Run-time masks, kept at the size of what they depend on.

A liveness mask is a boolean array of a value's shape, but it rarely varies along every axis: the
mask of a softmax row, of a layer norm, of every lane of a matmul's output row depends on the row
alone. Within one trace (`mask_scope`) this module remembers each mask that is a broadcast as a
*core* (the small array) and the output *axes* it runs along, and does the mask algebra on cores:

- `all_of` / `any_of` combine cores at the union of their axes, then broadcast once;
- `reduce_any` reduces the core along the reduced axes it has, and drops the others;
- `pad_mask`, `slice_mask`, `concat_masks`, `move_axes`, `reshape_mask`, `place` move the
  core's axes;
- a concatenation remembers its parts, so an any-reduction across it ors the parts' reductions;
- `within(mask, upper)` records that a mask is a subset of another (a gather's lanes lie in the
  rows it reads from), so `any_of` drops it where the bound is already in the union.

Masks that depend on shapes only (a crop's, a pad's, the windows a convolution reads for them) are
computed at trace time (`at_trace_time`) and reach the program as small constants (`emitted`):
staged, XLA would compute them at every run or fold them at compile time, slowly when large.

A broadcast in the original program is registered too (`register_broadcast`): a `jnp.where`
predicate of shape (b, 1, q, 1) that the program broadcasts to (b, h, q, k) is a (b, q) core. XLA
then compiles a few small boolean fusions instead of one per op at the full shape.

Masks are built with raw lax calls: jnp functions are jitted wrappers, and their dispatch
dominated the rewrite time of long programs. The table holds tracers, which must not outlive their
trace: it lives only inside `mask_scope` (per thread). Outside a scope every helper still works,
on full arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._compat import Tracer, eager_constant_folding, sharded_like
from ._symbolic import Unknown, key_layout
from ._walk import demand

Mask = jax.Array | None
"""A boolean array of the value's shape, or None for "every lane live"."""


@dataclasses.dataclass
class _Fact:
    mask: Any                           # the tracer the facts are about (identity checked)
    core: Any = None                    # mask == broadcast of core along `axes`
    axes: tuple | None = None
    false: bool = False                 # every lane is dropped
    parts: tuple | None = None       # mask == concatenate(parts, concat_axis)
    concat_axis: int = -1
    upper: Any = None                   # mask is a subset of this mask


_SCOPE = threading.local()


@contextlib.contextmanager
def mask_scope():
    saved = getattr(_SCOPE, "table", None), getattr(_SCOPE, "early", False)
    _SCOPE.table, _SCOPE.early = {}, False
    try:
        with eager_constant_folding(False):  # a nested emission stages its program
            yield
    finally:
        _SCOPE.table, _SCOPE.early = saved


def _table() -> dict | None:
    return getattr(_SCOPE, "table", None)


def scoped_memo(*key: Any) -> dict:
    """A memo that lives as long as the current mask scope (one trace), for values that are
    tracers of it; outside a scope, a fresh one."""
    table = _table()
    if table is None:
        return {}
    return table.setdefault(("memo", *key), {})


def _fact(mask) -> _Fact | None:
    table = _table()
    hit = None if table is None else table.get(id(mask))
    return hit if hit is not None and hit.mask is mask else None


def _remember(mask, **fields) -> None:
    table = _table()
    if table is None:
        return
    fact = _fact(mask)
    if fact is None:
        fact = table[id(mask)] = _Fact(mask)
    for k, v in fields.items():
        setattr(fact, k, v)


def _shape(x) -> tuple:
    return tuple(np.shape(x))


# --------------------------------------------------------------------------- cores

def ones(shape) -> jax.Array:
    shape = tuple(shape)
    if _table() is None or not shape:
        return lax.full(shape, True, jnp.bool_)
    return broadcast_mask(_true_scalar(), shape, ())


def _true_scalar() -> jax.Array:
    key = ("true",)
    table = _table()
    assert table is not None
    hit = table.get(key)
    if hit is None:
        hit = table[key] = lax.full((), True, jnp.bool_)
    return hit


def zeros(shape) -> jax.Array:
    out = lax.full(tuple(shape), False, jnp.bool_)
    _remember(out, false=True)
    return out


def known_false(mask) -> bool:
    fact = _fact(mask)
    return fact is not None and fact.false


def factor(mask) -> tuple[Any, tuple]:
    """(core, axes) with `mask == broadcast_in_dim(core, mask.shape, axes)`; a mask that is not a
    known broadcast is its own core, along every axis."""
    fact = _fact(mask)
    if fact is not None and fact.axes is not None:
        return fact.core, fact.axes
    return mask, tuple(range(np.ndim(mask)))


def _canonical(src, shape: tuple, dims: tuple) -> tuple[Any, tuple]:
    """The core and axes of `broadcast_in_dim(src, shape, dims)`: src's own core, without the
    size-1 axes that the broadcast widens."""
    core, axes = factor(src)
    axes = tuple(dims[a] for a in axes)
    wide = tuple(i for i, a in enumerate(axes) if np.shape(core)[i] == 1 and shape[a] != 1)
    if wide:
        core = _squeeze(core, wide)
        axes = tuple(a for i, a in enumerate(axes) if i not in wide)
    if list(axes) != sorted(axes):  # pragma: no cover - broadcast_in_dim keeps axes in order
        order = tuple(int(i) for i in np.argsort(axes))
        core, axes = lax.transpose(core, order), tuple(sorted(axes))
    return core, axes


def _squeeze(core, dims: tuple):
    table = _table()
    key = ("squeeze", id(core), dims)
    hit = None if table is None else table.get(key)
    if hit is not None and hit[1] is core:
        return hit[0]
    out = lax.squeeze(core, dims)
    if table is not None:
        table[key] = (out, core)
    return out


def broadcast_mask(src, shape, dims: Sequence[int]) -> jax.Array:
    """`lax.broadcast_in_dim(src, shape, dims)`, remembered as a core within a mask scope."""
    shape, dims = tuple(shape), tuple(dims)
    if _shape(src) == shape and dims == tuple(range(len(shape))):
        return src
    table = _table()
    if table is None:
        return lax.broadcast_in_dim(src, shape, dims)
    if known_false(src):
        return zeros(shape)
    core, axes = _canonical(src, shape, dims)
    if axes == tuple(range(len(shape))) and _shape(core) == shape:
        return core
    key = ("broadcast", id(core), shape, axes)  # the same broadcast twice: one tracer, one op
    hit = table.get(key)
    if hit is not None and hit[1] is core:
        return hit[0]
    out = lax.broadcast_in_dim(core, shape, axes)
    table[key] = (out, core)
    _remember(out, core=core, axes=axes)
    return out


@dataclasses.dataclass(frozen=True)
class Placed:
    """A mask to be made in the trace that reads it (a loop's body): `core` broadcast to
    `shape` along `axes`, remembered there as a broadcast, so that what reduces it reduces the
    core (a carry's row mask, not an OR over each row's features at every step)."""

    core: Any
    shape: tuple
    axes: tuple

    def made(self) -> jax.Array:
        return broadcast_mask(self.core, self.shape, self.axes)


def selecting(mask, like) -> jax.Array:
    """`mask` at the shape of `like`, the value one `select_n` selects: a broadcast is emitted
    afresh for each select that reads it, so that XLA's sharding propagation can place each one
    as the value it selects (a broadcast mask shared by values sharded differently makes it
    gather one of them); under `Explicit` mesh axes it is placed as `like` is."""
    shape = np.shape(like)
    mask = materialize(mask, shape)
    core, axes = factor(mask)
    if core is not mask and _shape(core) != tuple(shape):
        mask = lax.broadcast_in_dim(core, tuple(shape), axes)
    return sharded_like(mask, like)


def decided_per_lane(live, like, decisions: Iterable[tuple[Any, Any]]) -> list:
    """Each `(original, on_guarded)` pair as one decision: `original` in `live`'s lanes,
    `on_guarded` in the others, at the shape of `like`. A decision made again after a guard
    changed its operands holds the guarded values' choice only where the result is dropped (so
    a bound a later hazard relied on holds there); live lanes decide as the original program
    did. One placed mask serves all pairs (they select values placed as `like`)."""
    placed = selecting(live, like)
    return [lax.select_n(placed, on_guarded, original) for original, on_guarded in decisions]


def register_broadcast(out, src, dims: Sequence[int]) -> None:
    """Record that `out`, a value of the original program, is `broadcast_in_dim(src, ..., dims)`."""
    table = _table()
    if table is None or _fact(out) is not None or not isinstance(out, jax.Array):
        return
    shape = _shape(out)
    core, axes = _canonical(src, shape, tuple(dims))
    if axes == tuple(range(len(shape))):
        return
    table.setdefault(("broadcast", id(core), shape, axes), (out, core))
    _remember(out, core=core, axes=axes)


def _expand(core, axes: tuple, to: tuple, shape: tuple):
    """A core along `axes` as a core along `to` (a superset of the axes)."""
    if axes == to:
        return core
    return broadcast_mask(core, tuple(shape[a] for a in to), tuple(to.index(a) for a in axes))


# --------------------------------------------------------------------------- algebra

def _key(mask) -> tuple:
    core, axes = factor(mask)
    return id(core), axes


def _unique(masks: Sequence[Any]) -> list:
    """The masks without repeats (`x * x` reads one mask twice; equal broadcasts of one core)."""
    out, seen = [], set()
    for m in masks:
        key = _key(m)
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def _combine(masks: list, op, shape: tuple) -> jax.Array:
    factored = [factor(m) for m in masks]
    union = tuple(sorted(set().union(*(set(a) for _, a in factored))))
    cores = [_expand(c, a, union, shape) for c, a in factored]
    out = cores[0]
    for c in cores[1:]:
        out = op(out, c)
    return broadcast_mask(out, shape, union)


def any_of(masks: Sequence[Mask]) -> Mask:
    """The union of masks of one shape (None: every lane live)."""
    if any(m is None for m in masks):
        return None
    unique = [m for m in _unique(masks) if not known_false(m)]
    if not unique:
        return masks[0]
    keys = [_key(m) for m in unique]
    bounded = []
    # a mask inside another member of the union adds nothing
    for m, key in zip(unique, keys, strict=True):
        fact = _fact(m)
        if fact is not None and fact.upper is not None:
            upper = _key(fact.upper)
            if upper != key and upper in keys:
                continue
        bounded.append(m)
    if len(bounded) == 1:
        return bounded[0]
    return _combine(bounded, lax.bitwise_or, _shape(bounded[0]))


def all_of(masks: Sequence[Mask]) -> Mask:
    """The intersection of masks of one shape (None: every lane live)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    if any(known_false(m) for m in present):
        return zeros(_shape(present[0]))
    unique = _unique(present)
    if len(unique) == 1:
        return unique[0]
    return _combine(unique, lax.bitwise_and, _shape(unique[0]))


def not_mask(mask) -> jax.Array:
    """The complement, computed on the core."""
    core, axes = factor(mask)
    table = _table()
    key = ("not", id(core))
    hit = None if table is None else table.get(key)
    if hit is not None and hit[1] is core:
        flipped = hit[0]
    else:
        flipped = lax.bitwise_not(core)
        if table is not None:
            table[key] = (flipped, core)
    return broadcast_mask(flipped, _shape(mask), axes)


def of_predicates(sym: Any, value_of: Callable[[Any], Any], shape) -> Mask:
    """The mask of a formula made of the program's predicates alone (`_symbolic.named_along`),
    over a value of `shape`; `value_of(key)` gives a predicate's value. A literal's key axes
    that embed nowhere have size 1. A static mask known as an array (`Unknown.lanes`) is read
    as a constant predicate; `value_of` reads a body's output mask (`Unknown.output`)."""
    terms = []
    for term in sym:
        lits = []
        for key, positive, embed in term:
            value = jnp.asarray(key.lanes) if isinstance(key, Unknown) and \
                key.lanes is not None else value_of(key)
            sizes, order, axes = key_layout(np.shape(value), embed)
            core = lax.reshape(value, sizes)
            if order != list(range(len(order))):
                core = lax.transpose(core, order)
            m = broadcast_mask(core, shape, axes)
            lits.append(m if positive else not_mask(m))
        terms.append(all_of(lits))
    return any_of(terms)


def reduce_any(mask, axes: Sequence[int], keepdims: bool = False) -> jax.Array:
    """Any-reduction along `axes`: on the core's own axes only, the others are dropped. A
    concatenation along a reduced axis is the or of its parts' reductions (parts of parts too,
    walked without recursion: a program can split a value again and again)."""
    axes = tuple(sorted({int(a) for a in axes}))
    if not axes:
        return mask
    by_id = {id(mask): mask}  # keeps every part alive while its id is a key

    def rule(key: int) -> Generator[int, jax.Array, jax.Array]:
        m = by_id[key]
        fact = _fact(m)
        if fact is None or fact.parts is None or fact.concat_axis not in axes or \
                known_false(m) or any(_shape(m)[a] == 0 for a in axes):
            return _reduce_core(m, axes, keepdims)
        reduced = []
        for part in fact.parts:
            by_id[id(part)] = part
            reduced.append((yield id(part)))
        out = any_of(reduced)
        assert out is not None  # the parts are arrays
        return out

    return demand(id(mask), {}, rule)


def _reduce_core(mask, axes: tuple[int, ...], keepdims: bool) -> jax.Array:
    shape = _shape(mask)
    kept_axes = [a for a in range(len(shape)) if a not in axes]
    if keepdims:
        out_shape = tuple(1 if a in axes else n for a, n in enumerate(shape))
        place = {a: a for a in kept_axes}
    else:
        out_shape = tuple(shape[a] for a in kept_axes)
        place = {a: i for i, a in enumerate(kept_axes)}
    if known_false(mask) or any(shape[a] == 0 for a in axes):
        return zeros(out_shape)
    core, core_axes = factor(mask)
    inside = tuple(i for i, a in enumerate(core_axes) if a in axes)
    if inside:
        core = lax.reduce_or(core, inside)
    left = tuple(place[a] for a in core_axes if a not in axes)
    if _table() is None and keepdims:
        return lax.expand_dims(core, axes)
    return broadcast_mask(core, out_shape, left)


# --------------------------------------------------------------------------- moving lanes

def place(core, axes: Sequence[int], shape) -> jax.Array:
    """The mask of `shape` whose lanes are `core`'s, core axis j running along axis axes[j] (in
    any order), the same along the other axes."""
    axes = [int(a) for a in axes]
    order = tuple(int(j) for j in np.argsort(axes))
    if order != tuple(range(len(order))):
        core = lax.transpose(core, order)
    return broadcast_mask(core, tuple(shape), sorted(axes))


def move_axes(mask, permutation: Sequence[int], shape) -> jax.Array:
    """The mask of a transpose's operand: output axis d is operand axis permutation[d]."""
    core, axes = factor(mask)
    return place(core, [permutation[a] for a in axes], shape)


def reshape_mask(mask, shape) -> jax.Array:
    """The mask reshaped to `shape`; a core survives reshapes that insert or remove size-1 axes,
    or that keep every axis up to its last one."""
    shape, old = tuple(shape), _shape(mask)
    if old == shape:
        return mask
    if _table() is None:
        return lax.reshape(mask, shape)
    core, axes = factor(mask)
    big_old = [a for a, n in enumerate(old) if n != 1]
    big_new = [a for a, n in enumerate(shape) if n != 1]
    if [old[a] for a in big_old] == [shape[a] for a in big_new]:
        to_new = dict(zip(big_old, big_new, strict=True))
        small = tuple(i for i, a in enumerate(axes) if a not in to_new)
        if small:
            core = _squeeze(core, small)
        return broadcast_mask(core, shape, [to_new[a] for a in axes if a in to_new])
    lead = max(axes) + 1 if axes else 0
    if lead < len(old) and old[:lead] == shape[:lead]:
        return broadcast_mask(core, shape, axes)
    return lax.reshape(mask, shape)


def pad_mask(mask, config: Sequence[tuple[int, int, int]], shape) -> jax.Array:
    """`lax.pad(mask, False, config)` (the lanes a slice reads, in its operand), on the core."""
    core, axes = factor(mask)
    changed = {a for a, c in enumerate(config) if tuple(c) != (0, 0, 0)}
    union = tuple(sorted(set(axes) | changed))
    core = _expand(core, axes, union, _shape(mask))
    core = lax.pad(core, np.bool_(False), [(lo, hi, mid) for lo, hi, mid in
                                           (config[a] for a in union)])
    return broadcast_mask(core, tuple(shape), union)


def slice_mask(mask, axis: int, start: int, stop: int) -> jax.Array:
    """Lanes start:stop of `axis`."""
    shape = list(_shape(mask))
    shape[axis] = stop - start
    core, axes = factor(mask)
    if axis in axes:
        core = lax.slice_in_dim(core, start, stop, axis=axes.index(axis))
    return broadcast_mask(core, tuple(shape), axes)


def concat_masks(masks: Sequence[Mask], shapes: Sequence[tuple], axis: int) -> jax.Array:
    """The masks concatenated along `axis`; the parts are remembered (see `reduce_any`)."""
    parts = [materialize(m, s) for m, s in zip(masks, shapes, strict=True)]
    if len(parts) == 1:  # `lax.split(x, (n,))`, as `ravel_pytree` emits: not a part of itself
        return parts[0]
    shape = list(shapes[0])
    shape[axis] = sum(s[axis] for s in shapes)
    shape = tuple(shape)
    factored = [factor(p) for p in parts]
    if axis not in factored[0][1] and all(f[0] is factored[0][0] and f[1] == factored[0][1]
                                          for f in factored):
        return broadcast_mask(factored[0][0], shape, factored[0][1])  # one core, all parts
    union = tuple(sorted(set().union(*[set(a) for _, a in factored]) | {axis}))
    cores = [_expand(c, a, union, _shape(p)) for (c, a), p in zip(factored, parts, strict=True)]
    out = broadcast_mask(lax.concatenate(cores, union.index(axis)), shape, union)
    _remember(out, parts=tuple(parts), concat_axis=axis)
    return out


def within(mask, upper) -> None:
    """Record that `mask` is a subset of `upper` (used by `any_of`)."""
    if upper is not None and mask is not upper:
        _remember(mask, upper=upper)


# --------------------------------------------------------------------------- shapes

def broadcast(x, shape) -> jax.Array:
    """numpy-style broadcast of x (rank 0, or same rank with size-1 axes) to `shape`."""
    shape = tuple(shape)
    if _shape(x) == shape:
        return x
    x = jnp.asarray(x) if not isinstance(x, jax.Array) and not hasattr(x, "aval") else x
    lead = len(shape) - np.ndim(x)
    return broadcast_mask(x, shape, tuple(range(lead, len(shape))))


def materialize(mask: Mask, shape) -> jax.Array:
    return ones(shape) if mask is None else mask


def fit(mask: Mask, shape) -> Mask:
    """A mask over an output, as seen by an operand of `shape` that the op broadcasts (a rank-0
    scalar, or size-1 axes): a lane is live if any output lane it is broadcast to is."""
    shape = tuple(shape)
    if mask is None or _shape(mask) == shape:
        return mask
    lead = np.ndim(mask) - len(shape)
    if lead < 0:
        return None  # pragma: no cover - shapes that do not line up: conservative
    mask = reduce_any(mask, range(lead))
    size_one = tuple(d for d, n in enumerate(shape) if n == 1 and _shape(mask)[d] != 1)
    return reduce_any(mask, size_one, keepdims=True)


# --------------------------------------------------------------------------- trace time

STATIC_CORE_LIMIT = 1 << 16
"""The most lanes a mask known at trace time is emitted with as a constant (its core, or the
sides of a box); a larger one is staged as before."""


@contextlib.contextmanager
def at_trace_time(enabled: bool = True) -> Generator[bool, None, None]:
    """A region where a mask operation whose operands are all concrete runs now, at trace time
    (`jax.ensure_compile_time_eval`), and any other is staged as usual. Values of the original
    program are read `staged()`, never folded here: only exact mask algebra (booleans, and
    counts of 0/1 lanes) runs early. Yields whether this is the outermost region, whose caller
    passes its results through `emitted`."""
    if not enabled or _table() is None or getattr(_SCOPE, "early", False) or \
            getattr(_SCOPE, "all_staged", False):
        yield False
        return
    _SCOPE.early = True
    try:
        with jax.transfer_guard("allow"), jax.ensure_compile_time_eval():
            yield True
    finally:
        _SCOPE.early = False


@contextlib.contextmanager
def all_staged() -> Generator[None, None, None]:
    """Every mask staged, none computed at trace time: for a body that can hold no constants
    (`remat`'s, `shard_map`'s open jaxpr), bodies within it included."""
    saved = getattr(_SCOPE, "all_staged", False)
    _SCOPE.all_staged = True
    try:
        yield
    finally:
        _SCOPE.all_staged = saved


@contextlib.contextmanager
def staged() -> Generator[None, None, None]:
    """Inside `at_trace_time`: bind as the program does, staged (an original value, a body's
    values for its masks): XLA computes them, bit for bit as in the program."""
    with eager_constant_folding(False):
        yield


def emitted(mask: Mask) -> Any:
    """A mask made in `at_trace_time`, as the staged program reads it: a tracer as it is; a
    concrete one as its smallest core (the axes it varies along), a constant, broadcast by the
    program; a box as its sides; `TOO_LARGE` when neither fits `STATIC_CORE_LIMIT` (the caller
    stages it)."""
    if mask is None or isinstance(mask, Tracer):
        return mask
    table = _table()
    memo = table.setdefault(("emitted",), {}) if table is not None else {}
    hit = memo.get(id(mask))
    if hit is not None and hit[1] is mask:
        return hit[0]
    out = _emitted(mask)
    memo[id(mask)] = (out, mask)
    return out


TOO_LARGE = object()
"""What `emitted` returns for a concrete mask too large to emit as a constant."""


def _emitted(mask: Any) -> Any:
    shape = _shape(mask)
    core, axes = factor(mask)
    core = np.asarray(core)
    if core.size == 0 or core.all():
        return None  # every lane live (or no lane)
    if not core.any():
        return zeros(shape)
    varying = [d for d in range(core.ndim)
               if not np.array_equal(core, np.take(core, [0] * core.shape[d], axis=d))]
    core = core[tuple(slice(None) if d in varying else 0 for d in range(core.ndim))]
    axes = tuple(axes[d] for d in varying)
    if core.size <= STATIC_CORE_LIMIT:
        return broadcast_mask(core, shape, axes)
    others = [tuple(e for e in range(core.ndim) if e != d) for d in range(core.ndim)]
    sides = [core.any(axis=o) for o in others]
    box = np.ones(core.shape, bool)
    for d, side in enumerate(sides):
        box &= np.expand_dims(side, others[d])
    if sum(side.size for side in sides) <= STATIC_CORE_LIMIT and np.array_equal(box, core):
        return all_of([broadcast_mask(side, shape, (a,)) for side, a in zip(sides, axes,
                                                                               strict=True)])
    return TOO_LARGE
