"""The cost of the transformation itself: rewrite time against tracing, and per-call overhead.

- `rewrite_scaling`: generated programs of about 1k, 10k and 50k equations (counted after
  inlining, inner jaxprs included). For each, the time of `jax.make_jaxpr(f)(x)` (what tracing
  costs anyway) and of the rewrite of that jaxpr (`jaxsafe._rewrite.rewrite_with_report`, which
  is what `nan_safe` adds to the trace), interleaved. The slope of log(time) against log(size)
  says whether the rewrite is linear.
- `dispatch`: a cached call of `nan_safe(f)` against a cached call of `jax.jit(f)` on tiny inputs:
  the Python work per call (argument flattening, signature lookup) on top of jit's dispatch.
"""

from __future__ import annotations

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


def _timed(fn: Callable) -> tuple[float, object]:
    gc.collect()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def rewrite_scaling(sizes: list[tuple[int, int]], log=print) -> list[dict]:
    """`sizes`: (target number of equations, repeats) pairs."""
    x = jnp.linspace(-1., 2., 16, dtype=jnp.float32)
    probe = 200
    probe_jaxpr = jax.make_jaxpr(generated_program(probe))(x)
    _rewrite.rewrite_with_report(probe_jaxpr)   # warm-up: JAX's own caches (jnp.where's jit...)
    per_block = count_eqns(probe_jaxpr.jaxpr) / probe
    rows = []
    for target, repeats in sizes:
        f = generated_program(max(1, round(target / per_block)), seed=target)
        closed = jax.make_jaxpr(f)(x)   # the program that the timed rewrites rewrite
        n = count_eqns(closed.jaxpr)
        trace_s, rewrite_s = [], []
        rewritten = None
        for r in range(repeats):
            # a fresh function object each time: make_jaxpr caches traces per function
            steps = [("trace", lambda f=f: jax.make_jaxpr(lambda x: f(x))(x)),
                     ("rewrite", lambda closed=closed: _rewrite.rewrite_with_report(closed))]
            if r % 2:
                steps.reverse()
            for name, fn in steps:
                t, out = _timed(fn)
                if name == "trace":
                    trace_s.append(t)
                else:
                    rewrite_s.append(t)
                    rewritten = out
        new, report = rewritten
        row = {"target": target, "eqns": n, "eqns_rewritten": count_eqns(new.jaxpr),
               "guards": len(report.sites), "repeats": repeats,
               "trace_s": statistics.median(trace_s), "rewrite_s": statistics.median(rewrite_s),
               "trace_all_s": trace_s, "rewrite_all_s": rewrite_s,
               "ratio": ratio_stats(rewrite_s, trace_s)}
        log(f"  {n:>7} eqns ({row['guards']} guards): make_jaxpr {row['trace_s']:.3f} s, "
            f"rewrite {row['rewrite_s']:.3f} s, ratio {row['ratio']['median']:.2f}")
        rows.append(row)
    return rows


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
