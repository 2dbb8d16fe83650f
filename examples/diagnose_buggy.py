"""Diagnostics on a buggy function: which `where` leaks, and which NaN is real.

Run with `.venv/bin/python examples/diagnose_buggy.py`.

`normalize` divides by a norm that is 0 for an all-zero row (a real singularity of the branch
that is taken), and takes a `log` that only a `where` guards (a leak). `jaxsafe.explain` names
the guards and their drops, `jaxsafe.diagnose` tells the two NaN apart, and
`jaxsafe.testing.assert_no_leaks` fails until the `where` is doubled by hand.
"""

import jax.numpy as jnp

import jaxsafe
from jaxsafe.testing import assert_no_leaks

ROWS = jnp.array([[3.0, 4.0], [0.0, 0.0], [0.0, 2.0]])  # row 1: all zero; row 2: a zero


def normalize(rows):
    norm = jnp.sqrt(jnp.sum(rows ** 2, axis=-1, keepdims=True))
    unit = rows / norm                                       # row 1: 0 / 0, taken
    score = jnp.where(rows > 0, jnp.log(rows), 0.0)          # log(<= 0), dropped
    return jnp.sum(unit) + jnp.sum(score)


def normalize_fixed(rows):
    norm = jnp.sqrt(jnp.sum(rows ** 2, axis=-1, keepdims=True))
    unit = rows / norm
    positive = rows > 0
    score = jnp.where(positive, jnp.log(jnp.where(positive, rows, 1.0)), 0.0)
    return jnp.sum(unit) + jnp.sum(score)


def main() -> None:
    print("== explain")
    print(jaxsafe.explain(normalize)(ROWS))
    print("== diagnose")
    print(jaxsafe.diagnose(normalize)(ROWS))
    print("== assert_no_leaks")
    for f in (normalize, normalize_fixed):
        try:
            assert_no_leaks(f, ROWS)
            print(f.__name__, "passes")
        except AssertionError as e:
            print(f.__name__, "fails:", str(e).splitlines()[0])


if __name__ == "__main__":
    main()
