"""Test helpers for libraries that guard their own `where`s: `assert_no_leaks`.

A library that hand-writes its double wheres (jax-md's `safe_mask`, optax's `safe_norm`) wants
a test that fails when one is missing. `assert_no_leaks(fun, *args)` runs jaxsafe's analysis on
`fun` at these arguments' shapes and fails if it would guard anything: a NaN-prone primitive
(or a custom rule over one) whose lanes some selection drops, and that no hand guard covers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._explain import explain

__all__ = ["assert_no_leaks"]


def assert_no_leaks(fun: Callable, *args: Any, static_argnums: int | Sequence[int] = (),
                    static_argnames: str | Sequence[str] = (), finite_args: Any = True,
                    **kwargs: Any) -> None:
    """Fail (`AssertionError`) when `fun(*args, **kwargs)` has a hazard whose dropped lanes
    would put inf or NaN into a derivative, listing each with its source line and the drop.

    `finite_args=True` (the default) takes the arguments as finite: only hazards `fun` itself
    computes count. Pass `finite_args=False` to also require that NaN or inf in the dropped
    lanes of an argument (padding, missing data) cannot leak.

    Example:

        def test_my_loss_guards_its_log():  # in a pytest suite
            assert_no_leaks(my_loss, jnp.ones(4))
    """
    if not callable(fun):
        raise TypeError(f"assert_no_leaks: `fun` must be callable, got {type(fun).__name__}: "
                        f"{fun!r}.")
    report = explain(fun, static_argnums=static_argnums, static_argnames=static_argnames,
                     finite_args=finite_args)(*args, **kwargs)
    guards = report.guards
    if not guards:
        return
    name = getattr(fun, "__qualname__", None) or repr(fun)
    n = len(guards)
    raise AssertionError(
        f"{name}: {n} hazard{'s' if n != 1 else ''} whose dropped lanes reach a derivative "
        f"(jaxsafe.nan_safe would guard {'them' if n != 1 else 'it'}):\n{report}\n"
        f"Guard each by hand (compute it on a safe value in the lanes the drop discards: the "
        f"double where), or wrap the function in jaxsafe.nan_safe.")
