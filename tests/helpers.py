"""Shared oracles for the tests, and `structure`: programs compared as data, not as text."""

import enum
import functools
import re
from typing import Any

import chex
import jax
import numpy as np
from jax.extend import core as jex

from jaxsafe._compat import DropVar  # jax.extend.core has it from JAX 0.10 on


def assert_bitwise(a, b):
    """Equal bit for bit, NaN positions included.

    Stricter than `chex.assert_trees_all_equal`, which is what the contract's forward point
    needs: chex compares values (`-0. == 0.`, any NaN equals any NaN); here the bytes, so a sign
    of zero or a NaN payload that the rewrite changed fails.
    """
    chex.assert_trees_all_equal_structs(a, b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def assert_close(a, b, rtol: float = 1e-6, atol: float = 0.0):
    """Equal up to rounding, NaN where NaN; structures must match (chex's check)."""
    chex.assert_trees_all_close(a, b, rtol=rtol, atol=atol)


assert_finite = chex.assert_tree_all_finite


# --------------------------------------------------------------------------- program structure

Structure = tuple  # nested tuples of hashable values


def structure(closed: jex.ClosedJaxpr | jex.Jaxpr) -> Structure:
    """The program as nested tuples, equal exactly when two programs are the same program.

    Printed jaxpr text is not that: it names primitives by `.name` (names drift, and two
    primitives may share one), custom printers leave params out and constants are not printed.
    Here: the primitive objects, every param, the wiring (variables numbered by first
    appearance), the avals, and literals and constants by their bytes (a NaN equals itself).
    """
    if isinstance(closed, jex.ClosedJaxpr):
        return ("closed_jaxpr", _jaxpr(closed.jaxpr), tuple(map(_const, closed.consts)))
    return ("jaxpr", _jaxpr(closed))


def _jaxpr(jaxpr: jex.Jaxpr) -> Structure:
    number: dict[jex.Var, int] = {}

    def bind(v: jex.Var) -> Structure:
        if isinstance(v, DropVar):
            return ("drop", _aval(v.aval))
        number[v] = len(number)
        return ("var", number[v], _aval(v.aval))

    def use(v: jex.Var | jex.Literal) -> Structure:
        if isinstance(v, jex.Literal):
            return _literal(v)
        return ("var", number[v]) if v in number else bind(v)  # free: numbered where first seen

    def eqn(e: jex.JaxprEqn) -> Structure:
        invars = tuple(map(use, e.invars))  # before the outputs are bound: they may shadow
        params = tuple((k, _param(e.params[k])) for k in sorted(e.params))
        return (e.primitive, invars, params, tuple(map(bind, e.outvars)), _param(e.effects))

    constvars = tuple(map(bind, jaxpr.constvars))
    invars = tuple(map(bind, jaxpr.invars))
    eqns = tuple(map(eqn, jaxpr.eqns))
    return (constvars, invars, eqns, tuple(map(use, jaxpr.outvars)), _param(jaxpr.effects))


def _aval(aval: Any) -> Structure:
    if hasattr(aval, "shape") and hasattr(aval, "dtype"):
        # str_short adds what the printed aval shows beyond these (sharding, memory space)
        return (type(aval).__name__, tuple(aval.shape), aval.dtype,
                bool(getattr(aval, "weak_type", False)), aval.str_short())
    return (type(aval).__name__, _masked(aval))


def _literal(lit: jex.Literal) -> Structure:
    value = np.asarray(lit.val, dtype=lit.aval.dtype)
    return ("literal", _aval(lit.aval), value.dtype, value.tobytes())  # NaN equals its own bytes


def _array(x: Any) -> Structure:
    if isinstance(x, jax.core.Tracer):
        return ("tracer", _aval(x.aval))
    a = np.asarray(x)
    return ("array", a.dtype, a.shape, a.tobytes())


def _const(c: Any) -> Structure:
    if isinstance(c, jax.core.Tracer | jax.Array | np.ndarray | np.generic | int | float | complex):
        return _array(c)
    return _param(c)


_PLAIN = (int, str, bytes, type(None), np.dtype, enum.Enum, jex.Primitive)


def _param(v: Any) -> Any:
    """An equation param (or a piece of one) as a hashable value that compares by content."""
    if isinstance(v, jex.ClosedJaxpr | jex.Jaxpr):
        return structure(v)
    if isinstance(v, bool):
        return ("bool", v)  # True == 1 in a tuple; the program differs
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, float):
        return ("float", v.hex())  # nan == nan, 0. != -0.
    if isinstance(v, complex):
        return ("complex", v.real.hex(), v.imag.hex())
    if isinstance(v, jax.core.Tracer | jax.Array | np.ndarray | np.generic):
        return _array(v)
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple
        fields = tuple(map(_param, v))
        return v if fields == tuple(v) else (type(v).__qualname__, fields)
    if isinstance(v, tuple | list):
        return (type(v).__name__, tuple(map(_param, v)))
    if isinstance(v, set | frozenset):  # effects: sorted, as JAX prints them
        return ("set", tuple(sorted(map(_param, v), key=repr)))
    if isinstance(v, dict):
        return ("dict", tuple((_param(k), _param(v[k])) for k in sorted(v, key=repr)))
    if isinstance(v, functools.partial):
        return ("partial", _param(v.func), _param(v.args), _param(v.keywords))
    if hasattr(v, "transforms") and hasattr(v, "f"):  # a linear_util.WrappedFun (custom_jvp's jvp)
        name = getattr(getattr(v, "debug_info", None), "func_name", None)
        return ("wrapped", name, _param(v.f), tuple(_param(t) for t, _ in v.transforms))
    if hasattr(v, "__qualname__"):  # a function or a class: by its name, never by its address
        return ("function", getattr(v, "__module__", None), v.__qualname__)
    return (type(v).__qualname__, _masked(v))


def _masked(v: Any) -> str:
    """`str(v)` without memory addresses (what JAX's printer shows of an opaque param)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", " at 0x...", str(v))
