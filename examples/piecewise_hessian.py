"""A Hessian through a piecewise function.

Run with `.venv/bin/python examples/piecewise_hessian.py`.

The Huber-like penalty `sqrt(1 + x**2) - 1` for |x| < 1, a log branch beyond, and 0 for
x <= -2 (where `log(x + 2)` is undefined). Every branch is computed for every lane, and the
untaken `log` of a non-positive number makes the gradient and the Hessian NaN. `nan_safe` gives
every order the hand-written fix's values: the guard is itself differentiated.
"""

import jax
import jax.numpy as jnp

import jaxsafe

X = jnp.array([-3.0, -2.0, -0.5, 0.0, 0.5, 2.0])


def penalty(x):
    inner = jnp.sqrt(1.0 + x ** 2) - 1.0
    outer = jnp.log(x + 2.0)
    return jnp.sum(jnp.where(x <= -2.0, 0.0, jnp.where(jnp.abs(x) < 1.0, inner, outer)))


def penalty_by_hand(x):
    inner = jnp.sqrt(1.0 + x ** 2) - 1.0
    outer = jnp.log(jnp.where(x <= -2.0, 1.0, x + 2.0))  # the double where
    return jnp.sum(jnp.where(x <= -2.0, 0.0, jnp.where(jnp.abs(x) < 1.0, inner, outer)))


def derivatives():
    safe = jaxsafe.nan_safe(penalty)
    return ((jax.grad(penalty)(X), jax.grad(safe)(X), jax.grad(penalty_by_hand)(X)),
            (jax.hessian(penalty)(X), jax.hessian(safe)(X), jax.hessian(penalty_by_hand)(X)))


def main() -> None:
    (g_plain, g_safe, g_hand), (h_plain, h_safe, h_hand) = derivatives()
    print("gradient, plain JAX ", g_plain)
    print("gradient, nan_safe  ", g_safe)
    print("gradient, by hand   ", g_hand)
    print("Hessian diagonal, plain JAX ", jnp.diag(h_plain))
    print("Hessian diagonal, nan_safe  ", jnp.diag(h_safe))
    print("Hessian diagonal, by hand   ", jnp.diag(h_hand))
    print("equal at every order:", bool(jnp.allclose(g_safe, g_hand) and
                                        jnp.allclose(h_safe, h_hand)))


if __name__ == "__main__":
    main()
