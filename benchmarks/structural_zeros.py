"""Could the structural-zero pass (`jaxsafe/_backward.py`) replace primal guards? A measurement.

The pass guards a backward program where a drop's transpose wrote zeros. Applied to a whole
program (as if its VJP were a custom rule: `backward_only` wraps `f` in a `jax.custom_vjp` whose
backward rule is `jax.vjp(f)`), it would fix the same leaks as the primal guards, in reverse
mode. This times `jax.grad` (jitted) of three variants, interleaved, as ratios to the
hand-written double where:

- `primal`: `nan_safe(f)`, the primal guards (what jaxsafe does);
- `backward`: `nan_safe(backward_only(f))`, the structural-zero pass alone;
- `hand`: the hand fix.

    .venv/bin/python benchmarks/structural_zeros.py [--quick]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import timing  # noqa: E402

import jaxsafe  # noqa: E402


def backward_only(f):
    """`f` whose VJP is a custom rule that differentiates `f` again: jaxsafe cannot rewrite
    inside it, so only the structural-zero pass guards it."""
    @jax.custom_vjp
    def g(*args):
        return f(*args)

    g.defvjp(lambda *args: (f(*args), args), lambda args, ct: jax.vjp(f, *args)[1](ct))
    return g


def sqrt_where(x, w):
    return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0) * w)


def sqrt_where_hand(x, w):
    return jnp.sum(jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.0)), 0.0) * w)


def masked_logsumexp(x, m):
    """A row-masked log-sum-exp: rows with no kept lane are dropped."""
    y = jnp.where(m, x, -jnp.inf)
    lse = jax.nn.logsumexp(y, axis=-1)
    return jnp.sum(jnp.where(jnp.any(m, axis=-1), lse, 0.0))


def masked_logsumexp_hand(x, m):
    keep = jnp.any(m, axis=-1, keepdims=True)
    y = jnp.where(m & keep, x, jnp.where(keep, -jnp.inf, 0.0))
    lse = jax.nn.logsumexp(y, axis=-1)
    return jnp.sum(jnp.where(keep[..., 0], lse, 0.0))


def rows(n: int) -> dict:
    key = jax.random.key(0)
    x = jax.random.normal(key, (n,))
    w = jnp.linspace(0.5, 1.5, n)
    xs = jax.random.normal(key, (n // 128, 128))
    m = jax.random.bernoulli(key, 0.5, xs.shape) & (jnp.arange(n // 128) % 4 != 0)[:, None]
    return {
        "sqrt(where)": ((sqrt_where, sqrt_where_hand), (x, w)),
        "masked logsumexp": ((masked_logsumexp, masked_logsumexp_hand), (xs, m)),
    }


def main(quick: bool) -> None:
    n = 1 << (16 if quick else 20)
    print(f"jax.grad, jitted; ratios to the hand fix (median [min, max]); "
          f"{jax.devices()[0].device_kind}")
    for name, ((f, hand), args) in rows(n).items():
        variants = {
            "primal": jax.jit(jax.grad(jaxsafe.nan_safe(f))),
            "backward": jax.jit(jax.grad(jaxsafe.nan_safe(backward_only(f)))),
            "hand": jax.jit(jax.grad(hand)),
        }
        grads = {k: v(*args) for k, v in variants.items()}
        for k in ("primal", "backward"):
            assert jnp.allclose(grads[k], grads["hand"], equal_nan=False), (name, k)
        out = timing.measure({k: (v, args) for k, v in variants.items()},
                             budget_s=2.0 if quick else 10.0, min_rounds=10, max_rounds=400)
        cells = []
        for k in ("primal", "backward"):
            s = timing.ratio_stats(out["times"][k], out["times"]["hand"])
            cells.append(f"{k} {s['median']:.3f}x [{s['min']:.2f}, {s['max']:.2f}]")
        print(f"{name:18s} " + "   ".join(cells) + f"   ({out['rounds']} rounds)")


if __name__ == "__main__":
    main("--quick" in sys.argv[1:])
