"""A pairwise energy with forces and a Hessian, in the style of jax-md, without jax-md.

Run with `.venv/bin/python examples/pair_energy.py`.

A soft-sphere energy over all pairs `i != j` within a cutoff. The distance matrix has zeros on
its diagonal (and for coincident particles), where `sqrt`'s derivative is infinite; the
diagonal and the pairs beyond the cutoff are dropped with `jnp.where`, yet plain JAX's forces
are NaN. jax-md writes the double where by hand (`safe_mask`); `nan_safe` does it for you, and
the forces and the Hessian equal the hand-written version's.
"""

import jax
import jax.numpy as jnp

import jaxsafe

SIGMA, CUTOFF = 1.0, 1.5
R = jnp.array([[0.0, 0.0], [0.8, 0.1], [0.3, 0.9], [3.0, 3.0]])  # the last one is far away


def energy(r):
    d2 = jnp.sum((r[:, None] - r[None, :]) ** 2, axis=-1)
    d = jnp.sqrt(d2)
    pair = jnp.where(d < SIGMA, (1.0 - d / SIGMA) ** 2, 0.0)
    keep = (~jnp.eye(len(r), dtype=bool)) & (d < CUTOFF)
    return 0.5 * jnp.sum(jnp.where(keep, pair, 0.0))


def energy_by_hand(r):
    d2 = jnp.sum((r[:, None] - r[None, :]) ** 2, axis=-1)
    keep = (~jnp.eye(len(r), dtype=bool)) & (d2 > 0)
    d = jnp.where(keep, jnp.sqrt(jnp.where(keep, d2, 1.0)), 0.0)  # jax-md's safe_mask
    keep = keep & (d < CUTOFF)
    pair = jnp.where(d < SIGMA, (1.0 - d / SIGMA) ** 2, 0.0)
    return 0.5 * jnp.sum(jnp.where(keep, pair, 0.0))


def forces_and_hessians():
    safe = jaxsafe.nan_safe(energy)
    return ((-jax.grad(energy)(R), -jax.grad(safe)(R), -jax.grad(energy_by_hand)(R)),
            (jax.hessian(safe)(R), jax.hessian(energy_by_hand)(R)))


def main() -> None:
    (plain, safe, hand), (h_safe, h_hand) = forces_and_hessians()
    print("energy (nan_safe, plain):", float(jaxsafe.nan_safe(energy)(R)), float(energy(R)))
    print("forces, plain JAX\n", plain)
    print("forces, nan_safe\n", safe)
    print("forces, by hand\n", hand)
    print("forces equal:", bool(jnp.allclose(safe, hand, rtol=1e-6)),
          " Hessians equal:", bool(jnp.allclose(h_safe, h_hand, rtol=1e-5, atol=1e-6)))


if __name__ == "__main__":
    main()
