"""jax issue 19089, before and after `jaxsafe.nan_safe`.

Run with `make demo`.
"""

import jax
import jax.numpy as jnp

import jaxsafe


def f(x, pre_filter=False):
    delta = jnp.array((0, 1)) * x
    if pre_filter:
        return jnp.sum(jnp.where(delta > 0, delta, 0) ** 0.5)  # the hand-written fix
    return jnp.sum(jnp.where(delta > 0, delta ** 0.5, 0))       # the natural way to write it


def f_indexed(x):
    """The reporter's own form: a boolean mask index, whose shape depends on the data."""
    delta = jnp.array((0, 1)) * x
    return jnp.sum((delta ** 0.5)[delta > 0])


def main() -> None:
    print(f"jax {jax.__version__}, jaxsafe {jaxsafe.__version__}\n")
    print("grad(f)(1.)                   =", jax.grad(f)(1.), "  <- NaN: the untaken sqrt(0) leaks")
    print("grad(f, pre_filter=True)(1.)  =", jax.grad(lambda x: f(x, True))(1.),
          "  <- the hand-written double where")
    safe_f = jaxsafe.nan_safe(f, static_argnames="pre_filter")
    print("grad(nan_safe(f))(1.)         =", jax.grad(safe_f)(1.), "  <- jaxsafe, automatically")
    print("\nforward values agree:", bool(safe_f(1.) == jax.jit(f)(1.)))
    print("\nthe original jaxpr:")
    print(jax.make_jaxpr(f)(1.))
    print("\nthe rewritten jaxpr (the guard is the select_n in front of pow):")
    print(jaxsafe.make_jaxpr(f)(1.))
    print("\nwhat was guarded, and where:")
    print(jaxsafe.explain(f)(1.))
    print("\nthe reporter's own form, `(delta ** 0.5)[delta > 0]`:")
    print("grad(f_indexed)(1.)           =", jax.grad(f_indexed)(1.))
    print("grad(nan_safe(f_indexed))(1.) =", jax.grad(jaxsafe.nan_safe(f_indexed))(1.),
          "  <- eager: traced at the values, its shape is known")
    try:
        jax.jit(jax.grad(jaxsafe.nan_safe(f_indexed)))(1.)
    except jaxsafe.DataDependentShapeError as e:  # under jit the shape depends on the data
        print("under jax.jit it raises DataDependentShapeError, with the two ways out:")
        print("   ", str(e).splitlines()[-1][:100], "...")


if __name__ == "__main__":
    main()
