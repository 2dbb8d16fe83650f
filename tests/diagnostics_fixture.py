"""Functions whose line numbers tests/test_diagnostics.py checks: edit with care (the tests
name the lines through `LINES`, found by the marker comments, not by number)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def issue_19089(x):
    delta = jnp.array((0, 1)) * x
    return jnp.sum(jnp.where(delta > 0, delta ** 0.5, 0))  # mark: 19089


def _inner(x):
    return jnp.log(x)  # mark: inner log


def _outer(x):
    return _inner(x) * 2.0


@jax.jit
def _jitted(x):
    return _outer(x)


def two_calls_deep(x):
    y = _jitted(x)
    return jnp.sum(jnp.where(x > 0, y, 0.0))  # mark: deep where


def in_scan(xs):
    def body(carry, x):
        root = jnp.sqrt(x)  # mark: scan sqrt
        return carry + jnp.where(x > 0, root, 0.0), None  # mark: scan where
    return lax.scan(body, 0.0, xs)[0]


def sliced(x):
    y = jnp.log(x)  # mark: sliced log
    return jnp.sum(y[:2])  # mark: slice


def gathered(x, index):
    y = jnp.log(x)  # mark: gathered log
    return jnp.sum(y[index])  # mark: gather


def pooled(x):
    return jnp.max(jnp.log(x))  # mark: pooled


def nan_data(w, data, valid):
    return jnp.sum(jnp.where(valid, jax.nn.softplus(w * data), 0.0))  # mark: nan data


def in_shard_map(x):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("i",))
    spec = jax.sharding.PartitionSpec("i")

    def body(block):
        return jnp.where(block > 0, jnp.log(block), 0.0)  # mark: shard body
    return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x))


def leak_and_singularity(x):
    leak = jnp.where(x > 0, jnp.sqrt(x), 0.0)  # mark: leak
    real = jnp.sqrt(jnp.abs(x))  # mark: singularity
    return jnp.sum(leak + real)


def by_hand(x):
    safe = jnp.where(x > 0, x, 1.0)
    return jnp.sum(jnp.where(x > 0, jnp.log(safe), 0.0))


def leaky(x):
    return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0))  # mark: leaky


def _lines() -> dict[str, int]:
    marker = re.compile(r"# mark: ([a-z0-9 ]+)$")
    with open(__file__) as f:
        return {m.group(1): n for n, line in enumerate(f, 1)
                if (m := marker.search(line.rstrip())) is not None}


LINES = _lines()
