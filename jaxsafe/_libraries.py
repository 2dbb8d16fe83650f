"""Primitives other libraries define: `register_rule` (public) and the rows jaxsafe ships.

JAX programs built with Equinox, diffrax, optimistix or lineax contain primitives JAX does not
know (`unvmap_any`, `nondifferentiable_backward`, `linear_solve`, ...). Without a row such a
primitive is *unknown*: every lane of its operands counts as live, its outputs as possibly
non-finite, and `explain` reports it. `register_rule` gives one a row from a few facts a library
author knows. The rows for the libraries listed in `KNOWN` are registered when jaxsafe first
meets a primitive it has no row for, from the modules already imported: jaxsafe imports none of
them.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ._compat import Primitive
from ._primitives import register_elementwise
from ._rules import JAX_PRIMITIVES, LIBRARY_ROWS, register


def register_rule(primitive: Primitive, *, elementwise: bool = False, linear: bool = False,
                  differentiable: bool = True, makes_nonfinite: bool = False) -> None:
    """Tell jaxsafe what it needs to know of a primitive that JAX does not define.

    **Arguments:**

    - `primitive`: a `jax.extend.core.Primitive` your library defines.
    - `elementwise`: each output lane is computed from the same lane of each operand (rank-0
      operands broadcast). Liveness then passes lane by lane; otherwise every operand lane
      counts as live wherever any output lane is.
    - `linear`: its derivative never multiplies a cotangent by an operand's value (an
      identity, a sum, a move of lanes), so a NaN in an operand's dropped lane cannot leak
      through it.
    - `differentiable`: False for a primitive that passes no derivative (a test, an integer
      result, a `stop_gradient`-like identity): its operands are read for their values only.
    - `makes_nonfinite`: it may make NaN or inf from finite operands (a solve with a singular
      operator); what reads its outputs is then treated as possibly non-finite. For a
      primitive with a safe value per operand, use `register_guard` instead.

    The facts replace any row the primitive had (rows of JAX's own primitives cannot be
    replaced). A primitive jaxsafe has no row for is never an error: it passes through, treated
    as live, and `explain` reports it.

    Example:

        jaxsafe.register_rule(my_library.all_finite_p, differentiable=False)
    """
    from . import _guards
    if not isinstance(primitive, Primitive):
        raise TypeError("register_rule: `primitive` must be a jax.extend.core.Primitive, got "
                        f"{primitive!r}.")
    if primitive in JAX_PRIMITIVES:
        raise ValueError(f"register_rule: {primitive} is one of JAX's own primitives, whose row "
                         "jaxsafe builds in; use register_guard to change its guard.")
    for name, value in (("elementwise", elementwise), ("linear", linear),
                        ("differentiable", differentiable), ("makes_nonfinite", makes_nonfinite)):
        if not isinstance(value, bool):
            raise TypeError(f"register_rule: `{name}` must be True or False, got {value!r}.")
    # repeatable=False: whether two calls give the same values is not among the facts asked
    # (a library primitive may count, draw or call out): `_repeats.py` never merges them
    facts: dict[str, Any] = dict(linear=linear, zero_derivative=not differentiable,
                                 makes_nonfinite=makes_nonfinite, repeatable=False)
    if elementwise:  # not evaluated at planning time: a library primitive need not run there
        register_elementwise(primitive, foldable=False, **facts)
    else:
        register(primitive, **facts)
    _guards.GENERATION += 1


_IDENTITY = dict(elementwise=True, linear=True)
_NO_DERIVATIVE = dict(differentiable=False)

KNOWN: tuple[tuple[str, str, dict[str, bool]], ...] = (
    # equinox: vmap-aware reductions (loop conditions, error checks) ...
    ("equinox._unvmap", "unvmap_all_p", _NO_DERIVATIVE),
    ("equinox._unvmap", "unvmap_any_p", _NO_DERIVATIVE),
    ("equinox._unvmap", "unvmap_max_p", _NO_DERIVATIVE),
    # ... identities that only check how they are transformed ...
    ("equinox.internal._nontraceable", "nondifferentiable_backward_p", _IDENTITY),
    ("equinox.internal._nontraceable", "nonbatchable_p", _IDENTITY),
    ("equinox.internal._nontraceable", "nontraceable_p", _IDENTITY),
    # ... a loop's select that only vmap makes real (every operand lane live), a buffer write
    ("equinox.internal._loop.common", "select_if_vmap_p", {}),
    ("equinox.internal._loop.common", "maybe_set_p", {}),
    # lineax: a linear solve, non-finite on a singular operator
    ("lineax._solve", "linear_solve_p", dict(makes_nonfinite=True)),
)
"""(module, attribute, `register_rule` facts) for the primitives of libraries jaxsafe knows."""

_loaded: set[str] = set()


def register_imported() -> bool:
    """Register the `KNOWN` rows of the modules imported since the last call; whether any was."""
    added = False
    for module, name, facts in KNOWN:
        key = f"{module}.{name}"
        if key in _loaded or module not in sys.modules:
            continue
        _loaded.add(key)
        primitive = getattr(importlib.import_module(module), name, None)
        if isinstance(primitive, Primitive):
            register_rule(primitive, **facts)
            added = True
    return added


LIBRARY_ROWS.append(register_imported)
