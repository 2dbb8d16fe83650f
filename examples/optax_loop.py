"""An Optax training loop on a `nan_safe` loss.

Run with `.venv/bin/python examples/optax_loop.py`.

A Poisson regression whose rate is `exp(x @ w)`; a missing count is NaN, and the loss of an
unobserved sample is dropped with `jnp.where`. The `count * log_rate` term is computed for every
sample, and its derivative with respect to `w` reads the count: NaN times the zero cotangent of
the dropped lane. One step of plain JAX turns every weight into NaN. With `nan_safe` the loop
trains, step for step as the hand-written double where does.
"""

import jax
import jax.numpy as jnp
import optax

import jaxsafe

X = jax.random.normal(jax.random.key(0), (32, 4))
COUNTS = jnp.where(jnp.arange(32) % 5 == 0, jnp.nan,  # NaN: not observed
                   jnp.round(jnp.exp(X @ jnp.array([0.3, -0.2, 0.1, 0.4]))))


def loss(w, x, counts):
    observed = ~jnp.isnan(counts)
    log_rate = x @ w
    nll = jnp.exp(log_rate) - counts * log_rate + jax.scipy.special.gammaln(counts + 1)
    return jnp.mean(jnp.where(observed, nll, 0.0))


def loss_by_hand(w, x, counts):
    observed = ~jnp.isnan(counts)
    counts_safe = jnp.where(observed, counts, 0.0)  # the double where
    log_rate = x @ w
    nll = jnp.exp(log_rate) - counts_safe * log_rate + jax.scipy.special.gammaln(counts_safe + 1)
    return jnp.mean(jnp.where(observed, nll, 0.0))


def train(loss_fn, steps=50):
    optimizer = optax.adam(0.05)
    w = jnp.zeros(4)
    state = optimizer.init(w)

    @jax.jit
    def step(w, state):
        value, grads = jax.value_and_grad(loss_fn)(w, X, COUNTS)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(w, updates), state, value

    for _ in range(steps):
        w, state, value = step(w, state)
    return w, value


def main() -> None:
    for name, fn in [("plain JAX", loss), ("nan_safe", jaxsafe.nan_safe(loss)),
                     ("by hand", loss_by_hand)]:
        w, value = train(fn)
        print(f"{name:10s} loss {float(value):.6f}  weights {w}")
    safe, hand = train(jaxsafe.nan_safe(loss))[0], train(loss_by_hand)[0]
    print("nan_safe equals the hand-written fix:", bool(jnp.allclose(safe, hand, rtol=1e-5)))


if __name__ == "__main__":
    main()
