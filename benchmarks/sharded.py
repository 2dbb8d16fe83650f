"""Sharded rows: a masked-attention training step on a device mesh, nan_safe against the hand fix.

Run by `benchmarks/run.py` (section "sharded") in a child process, because the device count is
fixed when JAX starts: on CPU with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (8
simulated devices), on an accelerator with the devices it has. Prints one JSON object.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/sharded.py

Each mesh (data parallel, n x 1; data x model, 2 x n/2 with the weights split over `model`):
the jitted gradient of nan_safe(loss), of the hand-fixed loss and of the unguarded loss, each
lowered and compiled (timed), run once to compare nan_safe's gradient with the hand fix's, then
timed in interleaved rounds (timing.py); and the collectives of each compiled program, counted in
its HLO text.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import timing  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsafe  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
VARIANTS = ("nan_safe", "hand", "unguarded")


def collectives(hlo: str) -> dict[str, int]:
    """Each collective's count in a compiled program's HLO text (async pairs counted once)."""
    return {c: len(re.findall(rf"\b{c}(-start)?\(", hlo)) for c in COLLECTIVES}


def transformer_loss(hand: bool):
    """One masked-attention block: an RMS norm over token rows whose padded rows hold zeros (the
    norm's 0/0, dropped by the `where`, the classic leak) and attention masked to valid keys."""
    def loss(params, x, valid):
        h = x @ params["w_in"]
        ms = jnp.mean(h * h, axis=-1, keepdims=True)
        if hand:
            ms = jnp.where(valid[..., None], ms, 1.)
        h = jnp.where(valid[..., None], h / jnp.sqrt(ms), 0.)
        q, k, v = h @ params["wq"], h @ params["wk"], h @ params["wv"]
        s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(valid[:, None, :], s, -1e9)
        o = jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1), v) @ params["wo"]
        return jnp.mean(jnp.where(valid[..., None], o, 0.) ** 2)
    return loss


def inputs(mesh_shape: tuple[int, int], b: int, t: int, d: int):
    mesh = jax.make_mesh(mesh_shape, ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    keys = jax.random.split(jax.random.key(1), 6)

    def put(a, *spec):
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))
    params = {name: put(jax.random.normal(key, (d, d)) / np.sqrt(d), None, "model")
              for name, key in zip(("w_in", "wq", "wk", "wv"), keys, strict=False)}
    params["wo"] = put(jax.random.normal(keys[4], (d, d)) / np.sqrt(d), "model", None)
    lengths = (np.arange(b) * 7) % t + 1
    valid = put(jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None], "data")
    x = put(jnp.where(valid[..., None], jax.random.normal(keys[5], (b, t, d)), 0.), "data")
    return params, x, valid


def step(variant: str):
    loss = transformer_loss(hand=variant == "hand")
    if variant == "nan_safe":
        loss = jaxsafe.nan_safe(loss)
    return jax.jit(jax.grad(loss))


def row(name: str, mesh_shape: tuple[int, int], sizes: tuple[int, int, int], budget_s: float,
        rounds: tuple[int, int], compile_rounds: int) -> dict:
    args = inputs(mesh_shape, *sizes)
    compile_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    compiled, texts = {}, {}
    for _ in range(compile_rounds):
        for v in VARIANTS:
            fn = step(v)  # a fresh function: no cache hit
            t0 = time.perf_counter()
            c = fn.lower(*args).compile()
            compile_s[v].append(time.perf_counter() - t0)
            compiled[v], texts[v] = c, c.as_text()
    grads = {v: jax.block_until_ready(compiled[v](*args)) for v in VARIANTS}
    errs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / (np.max(np.abs(b)) + 1e-30))
            for a, b in zip(jax.tree.leaves(grads["nan_safe"]), jax.tree.leaves(grads["hand"]),
                            strict=True)]
    finite = all(bool(np.all(np.isfinite(np.asarray(g))))
                 for g in jax.tree.leaves(grads["nan_safe"]))
    m = timing.measure({v: (compiled[v], args) for v in VARIANTS}, budget_s=budget_s,
                       min_rounds=rounds[0], max_rounds=rounds[1])
    t = m["times"]
    return {
        "name": name, "mesh": list(mesh_shape), "sizes": list(sizes), "rounds": m["rounds"],
        "median_s": {v: timing.median(t[v]) for v in VARIANTS},
        "ratio": timing.ratio_stats(t["nan_safe"], t["hand"]),
        "compile_s": {v: timing.median(compile_s[v]) for v in VARIANTS},
        "compile_ratio": timing.ratio_stats(compile_s["nan_safe"], compile_s["hand"]),
        "collectives": {v: collectives(texts[v]) for v in VARIANTS},
        "check": {"max_rel_err": max(errs), "finite": finite,
                  "agree": finite and max(errs) < 1e-3,
                  "unguarded_has_nan": any(bool(np.isnan(np.asarray(g)).any())
                                           for g in jax.tree.leaves(grads["unguarded"]))},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args(argv)
    n = jax.device_count()
    sizes = (16, 32, 64) if opts.quick else (32, 128, 256)
    budget_s, rounds = (0.5, (3, 7)) if opts.quick else (6.0, (5, 30))
    compile_rounds = 1 if opts.quick else 3
    meshes = [(f"data parallel {n}x1", (n, 1))]
    if n >= 4 and n % 2 == 0:
        meshes.append((f"data x model 2x{n // 2}", (2, n // 2)))
    dev = jax.devices()[0]
    out = {"device_kind": dev.device_kind, "platform": dev.platform, "device_count": n,
           "rows": [row(name, shape, sizes, budget_s, rounds, compile_rounds)
                    for name, shape in meshes]}
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
