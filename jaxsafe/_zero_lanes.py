"""Structural zeros: the lanes of a value that hold 0 whatever the backward rule is handed.

In a backward program (a custom_vjp's `bwd`, as JAX traces it), a drop's transpose writes zeros:
`select_n(p, ct, zeros)` for a `where`, `pad`/`scatter-add` into zeros for a slice or a gather.
Those lanes are *structural zeros*: 0 for every cotangent the rule receives. These rules say how
they pass through a primitive (`Zeros.lanes`), and which operands make an output lane zero
whatever the others hold (`Zeros.absorbs`: a product's factors, a quotient's numerator), where
`0 * inf` must read 0 (`_backward.py`).

A zero mask is None (no lane known zero), True (every lane), or a boolean array of the value's
shape (or a rank-0 one, broadcast), computed in the backward program's own trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ._atoms import shape_of
from ._compat import JaxprEqn, bind_eqn

ZeroMask = Any
"""None: no lane is known to be zero; True: every lane is; else a boolean array."""


def as_array(mask: ZeroMask, shape: Sequence[int]) -> Any:
    """`mask` as a boolean array of `shape` (None: all False; True: all True)."""
    if mask is None or mask is True:
        return lax.full(tuple(shape), mask is True, np.bool_)
    if np.shape(mask) != tuple(shape):
        return lax.broadcast_in_dim(mask, tuple(shape),
                                    tuple(range(len(shape) - np.ndim(mask), len(shape))))
    return mask


def like_operand(k: int) -> Callable[[JaxprEqn, list, list], list]:
    """The output's zero lanes are operand k's (`neg`, `convert_element_type`, a quotient's
    numerator)."""
    def rule(eqn: JaxprEqn, masks: list, values: list) -> list:
        return [masks[k]]
    return rule


def every_operand(eqn: JaxprEqn, masks: list, values: list) -> list:
    """Zero where every operand is (`add`, `sub`, `add_any`)."""
    if any(m is None for m in masks):
        return [None]
    return [_folded(masks, shape_of(eqn.outvars[0]), lax.bitwise_and, all)]


def any_operand(eqn: JaxprEqn, masks: list, values: list) -> list:
    """Zero where any operand is (a product)."""
    known = [m for m in masks if m is not None]
    if not known:
        return [None]
    return [_folded(known, shape_of(eqn.outvars[0]), lax.bitwise_or, any)]


def union(masks: list, shape: Sequence[int]) -> Any:
    """The lanes where any of `masks` is zero, as a boolean array of `shape`."""
    return as_array(_folded(masks, shape, lax.bitwise_or, any), shape)


def _folded(masks: list, shape: Sequence[int], op: Callable, whole: Callable) -> ZeroMask:
    """`op` over the masks at `shape`; True where `whole` of them being True decides it."""
    if whole(m is True for m in masks):
        return True
    out = as_array(masks[0], shape)
    for m in masks[1:]:
        out = op(out, as_array(m, shape))
    return out


def selected(eqn: JaxprEqn, masks: list, values: list) -> list:
    """`select_n`: zero where the case it takes is."""
    cases = masks[1:]
    if all(m is None for m in cases):
        return [None]
    if all(m is True for m in cases):
        return [True]
    shape = shape_of(eqn.outvars[0])
    return [lax.select_n(values[0], *[as_array(m, shape) for m in cases])]


def moved(lanes: tuple[int, ...] | None = None) -> Callable[[JaxprEqn, list, list], list]:
    """A primitive that moves lanes (`broadcast_in_dim`, `reshape`, `pad`, `slice`, ...): the
    same equation applied to the masks of the operands in `lanes` (None: every operand; the
    others, indices, keep their values)."""
    def rule(eqn: JaxprEqn, masks: list, values: list) -> list:
        moving = range(len(masks)) if lanes is None else lanes
        picked = [masks[k] for k in moving]
        if all(m is None for m in picked):
            return [None]
        if all(m is True for m in picked):
            return [True]
        operands = list(values)
        for k in moving:
            operands[k] = as_array(masks[k], shape_of(eqn.invars[k]))
        return bind_eqn(eqn, operands)
    return rule


def summed(eqn: JaxprEqn, masks: list, values: list) -> list:
    """`reduce_sum`: zero where every lane it sums is."""
    mask = masks[0]
    if mask is None or mask is True:
        return [mask]
    return [jnp.all(as_array(mask, shape_of(eqn.invars[0])), axis=tuple(eqn.params["axes"]))]


def scattered(eqn: JaxprEqn, masks: list, values: list) -> list:
    """`scatter-add` (a gather's transpose writes into zeros): zero where the operand is and
    every update that lands there is (a minimum of the 0/1 masks)."""
    operand, updates = masks[0], masks[2]
    if operand is None:
        return [None]
    if operand is True and updates is True:
        return [True]
    dtype = np.uint8
    out = lax.scatter_min(
        lax.convert_element_type(as_array(operand, shape_of(eqn.invars[0])), dtype), values[1],
        lax.convert_element_type(as_array(updates, shape_of(eqn.invars[2])), dtype),
        eqn.params["dimension_numbers"], indices_are_sorted=eqn.params["indices_are_sorted"],
        unique_indices=eqn.params["unique_indices"], mode=eqn.params["mode"])
    return [lax.convert_element_type(out, np.bool_)]
