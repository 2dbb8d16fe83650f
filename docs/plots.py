"""Figures the docs site shows, made by running jaxsafe at build time (`make docs`).

`docs/img/generated/` is not committed: every build draws it again from the code it documents.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import jaxsafe  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "img" / "generated"


def f(x):
    return jnp.where(x > 0, jnp.sqrt(x), 0.0)


def problem(path: pathlib.Path) -> None:
    """f, its gradient in plain JAX (NaN where x <= 0: no point is drawn) and under nan_safe."""
    x = jnp.linspace(-1.0, 2.0, 301)
    plain = jax.vmap(jax.grad(f))(x)
    safe = jax.vmap(jax.grad(jaxsafe.nan_safe(f)))(x)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), constrained_layout=True)
    axes[0].plot(x, f(x), color="black")
    axes[0].set_title("f(x) = where(x > 0, sqrt(x), 0)")
    axes[1].plot(x, safe, label="grad(nan_safe(f)): 0 where x <= 0", color="tab:blue", lw=3)
    axes[1].plot(x, plain, label="grad(f): NaN where x <= 0 (not drawn)", color="tab:red",
                 ls="--", lw=1.5)
    axes[1].set_ylim(-0.2, 3.0)
    axes[1].set_title("its gradient")
    axes[1].legend(loc="upper right", fontsize=8)
    for ax in axes:
        ax.axvline(0.0, color="grey", lw=0.5)
        ax.set_xlabel("x")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    problem(OUT / "problem.png")
    print(f"docs: figures in {OUT}")


if __name__ == "__main__":
    main()
