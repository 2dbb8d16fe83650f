"""A Flax NNX model with a `nan_safe` loss: `nnx.value_and_grad` and an `nnx.jit` train step.

Run with `.venv/bin/python examples/flax_nnx.py` (Flax is in the `libs` extra:
`make test-libs` installs it).

A classifier trained on a batch padded to a fixed size: the padding rows hold NaN features and
their loss is dropped with `jnp.where`. The NaN reaches the logits of the dropped rows, and the
derivative of the log-softmax there multiplies the zero cotangent by NaN: plain JAX's gradient
is NaN in every weight. `nan_safe` gives the hand-written double where's gradient, and the same
training steps.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxsafe

X = jnp.concatenate([jax.random.normal(jax.random.key(0), (6, 3)), jnp.full((2, 3), jnp.nan)])
LABELS = jnp.array([0, 1, 2, 1, 0, 2, 0, 0])
VALID = jnp.arange(8) < 6  # the last two rows are padding


def make_model():
    return nnx.Linear(3, 3, rngs=nnx.Rngs(0))


def loss(model, x, labels, valid):
    logp = jax.nn.log_softmax(model(x))
    nll = -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.sum(valid)


def loss_by_hand(model, x, labels, valid):
    x = jnp.where(valid[:, None], x, 0.0)  # the double where, on the padding's features
    logp = jax.nn.log_softmax(model(x))
    nll = -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.sum(valid)


def gradient(loss_fn):
    return nnx.value_and_grad(loss_fn)(make_model(), X, LABELS, VALID)[1]["kernel"][...]


def train(loss_fn, steps=20):
    model = make_model()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        value, grads = nnx.value_and_grad(loss_fn)(model, X, LABELS, VALID)
        optimizer.update(model, grads)
        return value

    for _ in range(steps):
        value = step(model, optimizer)
    return model.kernel[...], value


def main() -> None:
    plain, safe, hand = (gradient(f) for f in (loss, jaxsafe.nan_safe(loss), loss_by_hand))
    print("kernel gradient, plain JAX\n", plain)
    print("kernel gradient, nan_safe\n", safe)
    print("kernel gradient, by hand\n", hand)
    trained_safe, value = train(jaxsafe.nan_safe(loss))
    trained_hand, _ = train(loss_by_hand)
    print(f"after 20 nnx.jit steps: loss {float(value):.4f}; kernels equal:",
          bool(jnp.allclose(trained_safe, trained_hand, rtol=1e-5)))
    print("nan_safe equals the hand-written fix:", bool(jnp.allclose(safe, hand, rtol=1e-6)))


if __name__ == "__main__":
    main()
