"""What a value holds on the diagonal of two of its axes, known when the rewrite is planned.

Pair programs compute every ordered pair, a particle with itself included, and drop the
diagonal afterwards: jax-md's `smap` multiplies the pair energies by `1 - eye(n)`
(`eq(iota_0, iota_1)` in the jaxpr). A guard for the dropped diagonal is not needed where the
program itself makes the diagonal harmless, and that needs its values there: `x[None] - x[:,
None]` is exactly 0 on the diagonal of its first two axes (`x_i - x_i`, for a finite `x`),
`0 ** 2` is 0, a sum of zeros over other axes is 0, so `r2 > 0` fails on the diagonal, and the
lanes that `1 - eye` drops are lanes a `jnp.where(r2 > 0, ...)` has already filled with its
constant (`_by_hand.py`).

A diagonal `(a, b)` names two axes of a value, `a < b`, of the same size; its lanes are those
whose index along `a` equals the index along `b`. Each primitive's `PrimitiveRule.diagonal`
says how its output's diagonal comes from its operands' (a generator, run by `demand`: it
yields `(operand, diagonal)` and receives the scalar that operand holds there, or None).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol

import numpy as np

from ._atoms import dtype_of, literal_value, shape_of
from ._compat import JaxprEqn, Literal, Var
from ._constants import fold, fold_chain, lane_chain
from ._rules import rule_for
from ._walk import demand

Diagonal = tuple[int, int]
Scalar = np.ndarray | None


class DiagonalContext(Protocol):
    """What the rules ask of the program around an equation."""

    def finite(self, v: Any) -> bool:
        """Whether `v` is finite in every lane of the original program."""
        ...

    def same_as(self, v: Var) -> Var:
        ...

    def constant(self, v: Any) -> Any:
        """The value of `v` where the program computes it from literals alone, else None."""
        ...

    def producer_of(self, v: Any) -> JaxprEqn | None:
        ...


DiagonalRule = Callable[[JaxprEqn, Diagonal, DiagonalContext], Generator[Any, Scalar, Scalar]]


class DiagonalValues:
    """The scalars that the values of one program hold on diagonals, computed on demand."""

    def __init__(self, ctx: DiagonalContext):
        self.ctx = ctx
        self.memo: dict[tuple[Any, Diagonal], Scalar] = {}

    def holds(self, v: Any, diagonal: Diagonal) -> Scalar:
        """The scalar `v` holds in every lane of `diagonal` (its own axes), or None."""
        if isinstance(v, Literal):
            value = np.asarray(literal_value(v))
            return value if value.ndim == 0 else None
        return demand((v, _ordered(diagonal)), self.memo, self._compute)

    def _compute(self, key: tuple[Any, Diagonal]) -> Generator[Any, Scalar, Scalar]:
        v, diagonal = key
        eqn = self.ctx.producer_of(v)
        if eqn is None or len(eqn.outvars) != 1 or eqn.effects or not _valid(v, diagonal):
            return None
        rule = rule_for(eqn.primitive).diagonal
        if rule is None:
            return None
        return (yield from rule(eqn, diagonal, self.ctx))

    def of_predicate(self, key: Any, embed: tuple | None) -> Diagonal | None:
        """The diagonal, in the frame `embed` maps `key`'s axes to, on which the predicate `key`
        holds and nowhere else: `key` is `f(iota_a) == g(iota_b)` for indices along two axes of
        the same size n, with `f` and `g` elementwise chains equal and one to one on range(n)
        (evaluated there: `iota + 0`, `eye`'s `convert`s); None for any other predicate."""
        eqn = self.ctx.producer_of(key) if isinstance(key, Var) else None
        if eqn is None or embed is None or len(eqn.invars) != 2 \
                or not rule_for(eqn.primitive).equality:
            return None
        side_a, side_b = (_index_values(u, self.ctx) for u in eqn.invars)
        if side_a is None or side_b is None:
            return None
        (a, values_a), (b, values_b) = side_a, side_b
        if a == b or shape_of(key)[a] != shape_of(key)[b] or embed[a] is None \
                or embed[b] is None or not np.array_equal(values_a, values_b) \
                or len(np.unique(values_a)) != len(values_a):
            return None
        return _ordered((embed[a], embed[b]))

    def in_frame(self, diagonal: Diagonal, embed: tuple | None) -> Diagonal | None:
        """`diagonal` (axes of a value) in the frame of a literal's key that `embed` maps to that
        value: the key's axes running along both, or None if it runs along one or neither."""
        if embed is None:
            return None
        axes = [embed.index(d) if d in embed else None for d in diagonal]
        if axes[0] is None or axes[1] is None:
            return None
        return _ordered((axes[0], axes[1]))


def _ordered(diagonal: Diagonal) -> Diagonal:
    a, b = diagonal
    return (a, b) if a < b else (b, a)


def _valid(v: Any, diagonal: Diagonal) -> bool:
    shape = shape_of(v)
    a, b = diagonal
    return a != b and max(a, b) < len(shape) and shape[a] == shape[b] and shape[a] > 1


def _index_values(atom: Any, ctx: DiagonalContext) -> tuple[int, np.ndarray] | None:
    """(axis, values): `atom` is an elementwise function of `iota` along `axis` alone
    (`lane_chain`), and `values` that function on range(n), n the axis size."""
    def is_iota(v: Any) -> bool:
        eqn = ctx.producer_of(v)
        return eqn is not None and rule_for(eqn.primitive).iota_axis is not None

    found = lane_chain(atom, ctx.producer_of, is_iota)
    if found is None:
        return None
    chain, index = found
    iota = ctx.producer_of(index)
    axis = rule_for(iota.primitive).iota_axis(iota)  # type: ignore[union-attr,misc]
    if axis is None:
        return None
    values = fold_chain(chain, np.arange(shape_of(index)[axis], dtype=dtype_of(index)))
    return (axis, values) if values.shape == (shape_of(index)[axis],) else None


# --------------------------------------------------------------------------- the rules
# `PrimitiveRule.diagonal`: the scalar an output holds on a diagonal, from its operands'.


def elementwise_diagonal(eqn: JaxprEqn, diagonal: Diagonal,
                         ctx: DiagonalContext) -> Generator[Any, Scalar, Scalar]:
    """Lane to lane: the operation on the operands' scalars there. An operand of rank 0 is its
    own scalar, when it is a literal or computed from literals; one that is constant along an
    axis of the diagonal (size 1) is not asked."""
    out_shape = shape_of(eqn.outvars[0])
    values = []
    for u in eqn.invars:
        if isinstance(u, Literal):
            value = np.asarray(literal_value(u))
            if value.ndim != 0:
                return None
        elif shape_of(u) == out_shape:
            value = yield (u, diagonal)
        else:  # a scalar the program computes from literals (`-alpha`)
            value = ctx.constant(u)
            if value is None or np.ndim(value) != 0:
                return None
        if value is None:
            return None
        values.append(value)
    return np.asarray(fold(eqn, values)[0]).reshape(())


def difference_diagonal(eqn: JaxprEqn, diagonal: Diagonal,
                        ctx: DiagonalContext) -> Generator[Any, Scalar, Scalar]:
    """`x - y`: 0 where both read the same lane of one finite array, mirrored across the
    diagonal (`x[None] - x[:, None]`); else lane to lane."""
    views = [_view(u, ctx) for u in eqn.invars]
    if views[0] is not None and views[1] is not None and views[0][0] is views[1][0] \
            and ctx.finite(views[0][0]) and _mirrored(views[0][1], views[1][1], diagonal):
        return np.zeros((), dtype_of(eqn.outvars[0]))
    return (yield from elementwise_diagonal(eqn, diagonal, ctx))


def selected_diagonal(eqn: JaxprEqn, diagonal: Diagonal,
                      ctx: DiagonalContext) -> Generator[Any, Scalar, Scalar]:
    """`select_n`: the case its predicate's scalar there takes (`safe_mask`'s placeholder where
    `r2 > 0` fails on the diagonal)."""
    out_shape = shape_of(eqn.outvars[0])
    predicate = eqn.invars[0]
    if isinstance(predicate, Literal) or shape_of(predicate) != out_shape:
        return None
    which = yield (predicate, diagonal)
    if which is None or np.size(which) != 1:
        return None
    case = eqn.invars[1 + int(np.asarray(which).reshape(()))]
    if isinstance(case, Literal):
        value = np.asarray(literal_value(case))
        return value if value.ndim == 0 else None
    if shape_of(case) != out_shape:
        return None
    return (yield (case, diagonal))


def broadcast_diagonal(eqn: JaxprEqn, diagonal: Diagonal,
                       ctx: DiagonalContext) -> Generator[Any, Scalar, Scalar]:
    """`broadcast_in_dim`: the operand's diagonal where both axes come from it; a scalar
    everywhere (`safe_mask`'s placeholder: a literal, or one computed from literals and
    broadcast in steps)."""
    dims = list(eqn.params["broadcast_dimensions"])
    if diagonal[0] in dims and diagonal[1] in dims:
        return (yield (eqn.invars[0], (dims.index(diagonal[0]), dims.index(diagonal[1]))))
    return _scalar_everywhere(eqn.invars[0], ctx)


def _scalar_everywhere(atom: Any, ctx: DiagonalContext) -> Scalar:
    """The one value `atom` holds in every lane: a scalar (a literal, or computed from literals)
    broadcast, in any number of steps; else None. Only the scalar is evaluated, never the
    broadcast array."""
    for _ in range(64):
        if isinstance(atom, Literal):
            value = np.asarray(literal_value(atom))
            return value.reshape(()) if value.size == 1 else None
        if not shape_of(atom):
            value = ctx.constant(atom)
            return None if value is None else np.asarray(value).reshape(())
        eqn = ctx.producer_of(atom)
        if eqn is None or not rule_for(eqn.primitive).broadcast or len(eqn.invars) != 1:
            return None
        atom = eqn.invars[0]
    return None


def reduced_diagonal(eqn: JaxprEqn, diagonal: Diagonal,
                     ctx: DiagonalContext) -> Generator[Any, Scalar, Scalar]:
    """A reduction over other axes: every lane it reduces is on the diagonal too, so it reduces
    one scalar (`PrimitiveRule.scalar_move`: a sum of zeros is 0)."""
    axes = set(eqn.params["axes"])
    kept = [d for d in range(len(shape_of(eqn.invars[0]))) if d not in axes]
    scalar_move = rule_for(eqn.primitive).scalar_move
    if scalar_move is None or not isinstance(eqn.invars[0], Var):
        return None
    value = yield (eqn.invars[0], (kept[diagonal[0]], kept[diagonal[1]]))
    return None if value is None else scalar_move(eqn, np.asarray(value))


def _view(atom: Any, ctx: DiagonalContext) -> tuple[Any, tuple] | None:
    """(source, axes): `atom` is `source` broadcast, source axis j running along axis
    `axes[j]` of `atom` (None where the source has size 1)."""
    if not isinstance(atom, Var):
        return None
    eqn = ctx.producer_of(atom)
    if eqn is None or not rule_for(eqn.primitive).broadcast or len(eqn.invars) != 1:
        return None
    source = eqn.invars[0]
    if not isinstance(source, Var):
        return None
    src_shape = shape_of(source)
    axes = tuple(d if src_shape[j] != 1 else None
                 for j, d in enumerate(eqn.params["broadcast_dimensions"]))
    return ctx.same_as(source), axes


def _mirrored(axes_x: tuple, axes_y: tuple, diagonal: Diagonal) -> bool:
    """Whether two views of one source read the same source lane on every lane of `diagonal`:
    each source axis runs along the same axis in both, or along the diagonal's two axes."""
    if len(axes_x) != len(axes_y):
        return False
    pair = set(diagonal)
    return all(p == q or {p, q} == pair for p, q in zip(axes_x, axes_y, strict=True))
