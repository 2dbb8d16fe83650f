"""An Equinox model whose loss is `nan_safe`: the module is a pytree argument.

Run with `.venv/bin/python examples/equinox_model.py`.

A regression with missing targets, marked NaN: the loss keeps the observed ones with
`jnp.where(observed, (pred - y) ** 2, 0.)`. The unobserved lanes compute `(pred - NaN) ** 2`,
whose derivative `2 * (pred - NaN)` meets the zero cotangent of the dropped lane: plain JAX's
gradient is NaN in every weight. The module's activation function is not an array: nan_safe
treats it as static, as `eqx.filter_jit` does, so `eqx.filter_grad(jaxsafe.nan_safe(loss))`
needs no partition by hand.
"""

import equinox as eqx
import jax
import jax.numpy as jnp

import jaxsafe


def make_model():
    return eqx.nn.MLP(in_size=3, out_size=1, width_size=8, depth=2,
                      activation=jax.nn.tanh, key=jax.random.key(0))


def data():
    x = jax.random.normal(jax.random.key(1), (6, 3))
    y = jnp.array([0.5, 1.0, jnp.nan, 2.0, jnp.nan, 0.1])  # NaN: not observed
    return x, y


def loss(model, x, y):
    pred = jax.vmap(model)(x)[:, 0]
    observed = ~jnp.isnan(y)
    return jnp.sum(jnp.where(observed, (pred - y) ** 2, 0.0))


def loss_by_hand(model, x, y):
    pred = jax.vmap(model)(x)[:, 0]
    observed = ~jnp.isnan(y)
    y_safe = jnp.where(observed, y, 0.0)  # the double where
    return jnp.sum(jnp.where(observed, (pred - y_safe) ** 2, 0.0))


def gradients():
    """The last layer's weight gradient: plain, nan_safe, and the hand-written fix."""
    model, (x, y) = make_model(), data()
    last = lambda g: g.layers[-1].weight  # noqa: E731
    plain = eqx.filter_jit(eqx.filter_grad(loss))(model, x, y)
    safe = eqx.filter_jit(eqx.filter_grad(jaxsafe.nan_safe(loss)))(model, x, y)
    hand = eqx.filter_jit(eqx.filter_grad(loss_by_hand))(model, x, y)
    return last(plain), last(safe), last(hand)


def main() -> None:
    plain, safe, hand = gradients()
    print("plain JAX   ", plain[0, :4])
    print("nan_safe    ", safe[0, :4])
    print("by hand     ", hand[0, :4])
    print("nan_safe equals the hand-written fix:", bool(jnp.allclose(safe, hand, rtol=1e-6)))


if __name__ == "__main__":
    main()
