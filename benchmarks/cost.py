"""The cost of the transformation itself: rewrite time against tracing, and per-call overhead.

- `rewrite_scaling`: programs of growing size in two families. *Generated*: chains of
  elementwise blocks of about 1k to 100k equations (counted after inlining, inner jaxprs
  included). *Deep chain*: an unrolled explicit-Euler-like loop, one value carried through N
  multiply-adds between a `sqrt` and a guarded `log`, so the dataflow is as deep as the program is
  long. For each, the time of `jax.make_jaxpr(f)(x)` (what tracing costs anyway) and of the
  rewrite of that jaxpr (`jaxsafe._rewrite.rewrite_with_report`, which is what `nan_safe` adds to
  the trace), interleaved. The slope of log(time) against log(size) says whether the rewrite is
  linear.
- `collector_cost`: the rewrite with jaxsafe's raised collector thresholds (`rewrite_with_report`,
  jaxsafe/_collector.py) against the same rewrite with the collector left as it is.
- `dispatch`: a cached call of `nan_safe(f)` against a cached call of `jax.jit(f)` on tiny inputs:
  the Python work per call (argument flattening, signature lookup) on top of jit's dispatch.

Every timed call starts after a full collection and ends with a young one (`gc.collect(0)`), so
the collections that raised thresholds put off until after the rewrite are counted against it.
"""

from __future__ import annotations

import functools
import gc
import random
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from timing import per_call, ratio_stats

import jaxsafe
from jaxsafe import _rewrite

# --------------------------------------------------------------------------- generated programs

def generated_program(n_blocks: int, seed: int = 0) -> Callable:
    """A chain of `n_blocks` blocks of elementwise code, a third of them with a hazard under a
    `where` (sqrt, log, div, pow), the rest plain arithmetic and selections without hazards."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 6, n_blocks)
    consts = rng.uniform(0.1, 0.9, n_blocks).astype(np.float32)

    def f(x):
        for kind, c in zip(kinds, consts, strict=True):
            c = float(c)
            if kind == 0:
                x = jnp.where(x > c, jnp.sqrt(x - c), x * c) + 0.5 * jnp.sin(x)
            elif kind == 1:
                x = jnp.where(x > 0., jnp.log(x), c * x) - 0.25 * jnp.cos(x)
            elif kind == 2:
                x = jnp.where(jnp.abs(x) > c, c / x, x) + jnp.tanh(x)
            elif kind == 3:
                x = jnp.maximum(x * c, x - c) + 0.1 * x * x
            elif kind == 4:
                x = jnp.tanh(x * c + 0.5) * (1. + c) - x * 0.1
            else:
                x = jnp.where(x < c, x + c, x * x) * 0.5
        return x
    return f


def deep_chain(steps: int) -> Callable:
    """An unrolled explicit-Euler-like chain on a scalar: `y = sqrt(x)`, `steps` times
    `y = y * 1.0001 + 0.5` (two equations a step), then `where(x > 0, log(y), 0.)`. One hazard,
    but every value depends on the one before: the dataflow is as deep as the program is long."""
    def f(x):
        y = jnp.sqrt(x)
        for _ in range(steps):
            y = y * 1.0001 + 0.5
        return jnp.where(x > 0, jnp.log(y), 0.)
    return f


GENERATED, CHAIN = "generated", "deep chain"
FAMILIES = (GENERATED, CHAIN)


def count_eqns(jaxpr) -> int:
    """Equations of a jaxpr, the ones of inner jaxprs (jnp.where is a jit) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for v in eqn.params.values():
            for item in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    n += count_eqns(inner)
    return n


@functools.cache
def _eqns_per_block() -> float:
    probe = 200
    x = jnp.linspace(-1., 2., 16, dtype=jnp.float32)
    return count_eqns(jax.make_jaxpr(generated_program(probe))(x).jaxpr) / probe


def program(family: str, size: int) -> tuple[Callable, jax.Array]:
    """The function of a scaling row and its argument. `size`: the target number of equations of
    a generated program (its seed too), or the steps of a deep chain."""
    if family == GENERATED:
        x = jnp.linspace(-1., 2., 16, dtype=jnp.float32)
        return generated_program(max(1, round(size / _eqns_per_block())), seed=size), x
    if family == CHAIN:
        return deep_chain(size), jnp.float32(2.)
    raise ValueError(f"unknown program family {family!r}")


def _collections() -> list[int]:
    """Collections so far, per generation."""
    return [s["collections"] for s in gc.get_stats()]


def timed(fn: Callable) -> tuple[float, object]:
    """Seconds of `fn()`, after a full collection and up to the end of a young one (the one that
    raised thresholds put off), and its result."""
    gc.collect()
    start = time.perf_counter()
    out = fn()
    gc.collect(0)
    return time.perf_counter() - start, out


def rewrite_scaling(sizes: list[tuple[int, int]], family: str = GENERATED,
                    log=print) -> list[dict]:
    """`sizes`: (size, repeats) pairs; size as in `program`."""
    warm, x = program(family, 2000 if family == GENERATED else 100)
    _rewrite.rewrite_with_report(jax.make_jaxpr(warm)(x))   # JAX's own caches (jnp.where's jit)
    rows = []
    for size, repeats in sizes:
        f, x = program(family, size)
        closed = jax.make_jaxpr(f)(x)   # the program that the timed rewrites rewrite
        n = count_eqns(closed.jaxpr)
        trace_s, rewrite_s = [], []
        rewritten = None
        for r in range(repeats):
            # a fresh function object each time: make_jaxpr caches traces per function
            steps = [("trace", lambda f=f, x=x: jax.make_jaxpr(lambda x: f(x))(x)),
                     ("rewrite", lambda closed=closed: _rewrite.rewrite_with_report(closed))]
            if r % 2:
                steps.reverse()
            for name, fn in steps:
                t, out = timed(fn)
                if name == "trace":
                    trace_s.append(t)
                else:
                    rewrite_s.append(t)
                    rewritten = out
                del out
        new, report = rewritten
        row = {"family": family, "target": size, "eqns": n,
               "eqns_rewritten": count_eqns(new.jaxpr),
               "guards": len(report.sites), "repeats": repeats,
               "trace_s": statistics.median(trace_s), "rewrite_s": statistics.median(rewrite_s),
               "trace_all_s": trace_s, "rewrite_all_s": rewrite_s,
               "ratio": ratio_stats(rewrite_s, trace_s)}
        if family == CHAIN:
            row["steps"] = size
        del new, report, rewritten, closed
        log(f"  {family}: {n:>7} eqns ({row['guards']} guards): make_jaxpr "
            f"{row['trace_s']:.3f} s, rewrite {row['rewrite_s']:.3f} s, "
            f"ratio {row['ratio']['median']:.2f}")
        rows.append(row)
    return rows


def scaling_slope(rows: list[dict]) -> dict:
    """Log-log slopes of the rewrite and of make_jaxpr against the number of equations."""
    n = [r["eqns"] for r in rows]
    return {"rewrite": loglog_slope(n, [r["rewrite_s"] for r in rows]),
            "trace": loglog_slope(n, [r["trace_s"] for r in rows])}


# --------------------------------------------------------------------------- the collector

def collector_cost(cases: list[tuple[str, int]], rounds: int, seed: int = 0,
                   log=print) -> list[dict]:
    """The rewrite with jaxsafe's scoped collector thresholds (`rewrite_with_report`) against the
    same rewrite with the collector left as it is (`_rewrite._rewrite`, which skips
    `fewer_collections`), in interleaved rounds (shuffled order). `cases`: (family, size)."""
    rng = random.Random(seed)
    rows = []
    for family, size in cases:
        row = _collector_row(family, size, rounds, rng)
        log(f"  {family} {size}: {row['eqns']} eqns: scoped {row['median_s']['scoped']:.3f} s "
            f"(collections {fmt_collections(row['collections']['scoped'])}), as is "
            f"{row['median_s']['as_is']:.3f} s ({fmt_collections(row['collections']['as_is'])}), "
            f"ratio {row['ratio']['median']:.2f}")
        rows.append(row)
    return rows


def _collector_row(family: str, size: int, rounds: int, rng: random.Random) -> dict:
    from jaxsafe import _liveness

    f, x = program(family, size)
    closed = jax.make_jaxpr(f)(x)
    variants = {"scoped": lambda: _rewrite.rewrite_with_report(closed),
                "as_is": lambda: _rewrite._rewrite(closed, _liveness.Sweeps())}
    times: dict[str, list[float]] = {k: [] for k in variants}
    counts: dict[str, list[list[int]]] = {k: [] for k in variants}
    for fn in variants.values():   # warm-up
        timed(fn)
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for k in order:
            before = _collections()
            t, _ = timed(variants[k])
            # less timed()'s own: one full collection before, one young one after
            counts[k].append([b - a - own for a, b, own
                              in zip(before, _collections(), (1, 0, 1), strict=True)])
            times[k].append(t)
    return {"family": family, "size": size, "eqns": count_eqns(closed.jaxpr),
            "rounds": rounds, "thresholds": list(gc.get_threshold()),
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "times_s": times,
            "collections": {k: [statistics.median(g) for g in zip(*v, strict=True)]
                            for k, v in counts.items()},
            "ratio": ratio_stats(times["scoped"], times["as_is"])}


def fmt_collections(per_generation: list[float]) -> str:
    """Collections of generations 0/1/2, e.g. `3120/283/25`."""
    return "/".join(f"{c:.0f}" for c in per_generation)


def loglog_slope(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x): 1 is linear, 2 quadratic."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


# --------------------------------------------------------------------------- dispatch

def _guarded(x):
    return jnp.where(x > 0., jnp.sqrt(x), 0.)


def _unchanged(x):
    return jnp.sqrt(x) * 2.


def dispatch(rounds: int, calls: int, seed: int = 0, log=print) -> list[dict]:
    """Microseconds per cached call on f32[8]: nan_safe(f) against jax.jit(f)."""
    x = jnp.linspace(-1., 1., 8, dtype=jnp.float32)
    cases = []
    for label, f in (("f with a guard", _guarded), ("f with nothing to guard", _unchanged)):
        g, j = jaxsafe.nan_safe(f), jax.jit(f)
        cases.append((f"{label}: nan_safe(f)(x) vs jax.jit(f)(x)",
                      {"nan_safe": lambda g=g: g(x), "jit": lambda j=j: j(x)}))
    gs = jax.jit(jax.grad(lambda x: jnp.sum(jaxsafe.nan_safe(_guarded)(x))))
    gj = jax.jit(jax.grad(lambda x: jnp.sum(_guarded(x))))
    cases.append(("inside jit: jit(grad(nan_safe(f))) vs jit(grad(f))",
                  {"nan_safe": lambda: gs(x), "jit": lambda: gj(x)}))
    rng = random.Random(seed)
    rows = []
    for label, variants in cases:
        for fn in variants.values():   # warm-up: trace, rewrite, compile
            per_call(fn, 50)
        times = {k: [] for k in variants}
        for _ in range(rounds):
            order = list(variants)
            rng.shuffle(order)
            for k in order:
                times[k].append(per_call(variants[k], calls))
        row = {"case": label, "rounds": rounds, "calls": calls,
               "nan_safe_us": 1e6 * statistics.median(times["nan_safe"]),
               "jit_us": 1e6 * statistics.median(times["jit"]),
               "ratio": ratio_stats(times["nan_safe"], times["jit"])}
        log(f"  {label}: {row['nan_safe_us']:.1f} us vs {row['jit_us']:.1f} us, "
            f"ratio {row['ratio']['median']:.2f}")
        rows.append(row)
    return rows
