"""Replaying a program in the caller's trace as fast as JAX traces the user's own code.

A call that is differentiated while a program is staged (`jax.jit(jax.grad(nan_safe(f)))`, the
common case) emits the rewritten program into the caller's trace. Bound there one primitive at a
time, each equation costs JAX a fresh linearization (its fallback rule traces the primitive's
jvp and partially evaluates it, every time); the user's own code reaches the same primitives
through `jax.numpy`'s jitted functions, whose linearizations JAX caches per program. `replay`
does what `jax.numpy` does: a plain primitive (JAX's own, no body, no effect, parameters that
are plain data, no named axes) is bound through an inlined `jax.jit` of that one primitive,
cached by the primitive, its arity, its parameters and its literal operands, so JAX linearizes
(and transposes) each kind of equation once. The equations that reach the caller's trace are
the same ones: the jit is inlined, under the equation's own source line, name stack and
context; anything else is bound as `jax.core.eval_jaxpr` binds it.
"""

from __future__ import annotations

import collections
import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._compat import AXIS_PRIMITIVES, Jaxpr, JaxprEqn, Literal, bind_eqn, eqn_context
from ._rules import JAX_PRIMITIVES

CACHE_SIZE = 4096
"""Single-primitive functions remembered (LRU): parameters that hold shapes make new entries."""

_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, np.dtype, np.generic, enum.Enum,
                 jax.sharding.Sharding)


def _plain(value: Any) -> bool:
    """Whether a parameter is plain data (no jaxpr, no function): safe to close a jit over."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, tuple | frozenset):  # NamedTuples (dimension numbers) included
            todo.extend(v)
        elif not isinstance(v, _PLAIN_LEAVES):
            return False
    return True


class _Functions:
    """The cache of single-primitive jits, keyed by (primitive, arity, parameters, literals)."""

    def __init__(self, size: int):
        self._size = size
        self._store: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, eqn: JaxprEqn) -> Callable | None:
        """The inlined jit that binds `eqn`'s primitive on its variable operands, or None when
        `eqn` is not plain (it is then bound as it is)."""
        if (eqn.primitive not in JAX_PRIMITIVES or eqn.primitive in AXIS_PRIMITIVES
                or eqn.effects or not all(_plain(v) for v in eqn.params.values())):
            return None
        try:
            literals = tuple((i, v.aval, type(v.val), *_value_key(v.val))
                             for i, v in enumerate(eqn.invars) if isinstance(v, Literal))
            key = (eqn.primitive, len(eqn.invars), tuple(sorted(eqn.params.items())), literals)
            with self._lock:
                found = self._store.get(key)
                if found is not None:
                    self._store.move_to_end(key)
                    return found
        except (TypeError, ValueError):  # not hashable after all, or not a numpy value
            return None
        found = _single(eqn.primitive, dict(eqn.params), len(eqn.invars),
                        {i: v.val for i, v in enumerate(eqn.invars) if isinstance(v, Literal)})
        with self._lock:
            self._store[key] = found
            while len(self._store) > self._size:
                self._store.popitem(last=False)
        return found


def _value_key(value: Any) -> tuple[np.dtype, bytes]:
    """A literal by its dtype and bits (a 0-d array is not hashable; NaN is not equal to
    itself; `dtype.str` is `<V1` for every 1-byte `ml_dtypes` type)."""
    array = np.asarray(value)
    return array.dtype, array.tobytes()


def _single(primitive: Any, params: dict, arity: int, literals: dict[int, Any]) -> Callable:
    def one(*operands):
        if len(operands) + len(literals) != arity:  # the key holds the arity: never taken
            raise TypeError(f"{primitive}: {len(operands)} operands and {len(literals)} "
                            f"literals for an equation of {arity}")
        it = iter(operands)
        args = [literals[i] if i in literals else next(it) for i in range(arity)]
        out = primitive.bind(*args, **params)
        return list(out) if primitive.multiple_results else [out]
    return jax.jit(one, inline=True)


FUNCTIONS = _Functions(CACHE_SIZE)


def replay(jaxpr: Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    """`jax.core.eval_jaxpr(jaxpr, consts, *args)`, with plain equations bound through cached
    single-primitive jits (see the module docstring)."""
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        single = FUNCTIONS.get(eqn)
        if single is None:
            outs = bind_eqn(eqn, [read(v) for v in eqn.invars])
        else:
            with eqn_context(eqn):
                outs = single(*[env[v] for v in eqn.invars if not isinstance(v, Literal)])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]
