"""jaxsafe.nn against jax.nn: softmaxes, logsumexp, attention; forward and backward, under jit.

`workloads(quick)` lists the cases for the benchmark harness; run this file to time them alone:

    PYTHONPATH=. .venv/bin/python benchmarks/bench_nn.py [--quick] [--repeats N] [--only TEXT]

Each case times the candidate (jaxsafe.nn) and the reference (jax.nn, attention with
implementation='xla') in the same process, interleaved, and reports the ratio of the medians with
the min-max of the per-repeat ratios, and the ratio of XLA's own cost estimates (flops, bytes
accessed) of the two compiled programs. The masks leave some rows with no valid entry, the case
jaxsafe.nn exists for (jax.nn gives NaN there for softmax, uniform attention for attention).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxsafe.nn

Case = tuple[Callable, tuple]


def _forward(f: Callable) -> Callable:
    return jax.jit(f)


def _forward_backward(f: Callable) -> Callable:
    """Outputs and the vector-Jacobian product with a fixed cotangent (the last argument)."""
    def run(*args):
        *primals, ct = args
        out, vjp = jax.vjp(f, *primals)
        return out, vjp(ct)
    return jax.jit(run)


def _row_mask(key, shape: tuple[int, ...]) -> jax.Array:
    """A random mask where about one row in eight has no valid entry."""
    k1, k2 = jax.random.split(key)
    mask = jax.random.uniform(k1, shape) > 0.3
    empty_rows = jax.random.uniform(k2, shape[:-1] + (1,)) < 0.125
    return jnp.logical_and(mask, ~empty_rows)


def _softmax_cases(quick: bool) -> list[dict]:
    shape = (2, 2, 64, 64) if quick else (8, 8, 512, 512)
    kx, km, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, shape, jnp.float32)
    ct = jax.random.normal(kc, shape, jnp.float32)
    mask = _row_mask(km, shape)
    cases = []
    pairs = (("softmax", jaxsafe.nn.softmax, jax.nn.softmax),
             ("log_softmax", jaxsafe.nn.log_softmax, jax.nn.log_softmax),
             ("logsumexp", jaxsafe.nn.logsumexp, jax.nn.logsumexp))
    for (name, ours, theirs), (masked, where) in itertools.product(
            pairs, (("", None), (" where=mask", mask))):
        label = name + masked

        def cand(x, where=where, ours=ours):
            return ours(x, axis=-1, where=where)

        def ref(x, where=where, theirs=theirs):
            return theirs(x, axis=-1, where=where)
        out_shape = shape[:-1] if name == "logsumexp" else shape
        for mode, wrap, args in (("forward", _forward, (x,)),
                                 ("forward+backward", _forward_backward,
                                  (x, ct[..., 0] if out_shape != shape else ct))):
            cases.append({"name": label, "mode": mode, "shapes": "x".join(map(str, shape)),
                              "candidate": (wrap(cand), args), "reference": (wrap(ref), args)})
    return cases


def _attention_cases(quick: bool) -> list[dict]:
    B, T, N, H = (2, 64, 2, 16) if quick else (8, 512, 8, 64)
    kq, kk, kv, km, kc = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32)
    k = jax.random.normal(kk, (B, T, N, H), jnp.float32)
    v = jax.random.normal(kv, (B, T, N, H), jnp.float32)
    ct = jax.random.normal(kc, (B, T, N, H), jnp.float32)
    mask = _row_mask(km, (B, 1, T, T))
    shapes = f"B={B} T=S={T} N={N} H={H}"
    cases = []
    for label, kwargs in (("attention", {}), ("attention mask", {"mask": mask}),
                          ("attention causal", {"is_causal": True})):
        def cand(q, k, v, kwargs=kwargs):
            return jaxsafe.nn.dot_product_attention(q, k, v, **kwargs)

        def ref(q, k, v, kwargs=kwargs):
            return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
        for mode, wrap, args in (("forward", _forward, (q, k, v)),
                                 ("forward+backward", _forward_backward, (q, k, v, ct))):
            cases.append({"name": label, "mode": mode, "shapes": shapes,
                              "candidate": (wrap(cand), args), "reference": (wrap(ref), args)})
    return cases


def workloads(quick: bool) -> list[dict]:
    """The benchmark cases: dicts with `name`, `mode`, `shapes`, `candidate`, `reference`.

    `candidate` and `reference` are `(jitted_fn, args)` pairs; call `fn(*args)` and block.
    """
    return _softmax_cases(quick) + _attention_cases(quick)


def _time(case: Case) -> float:
    fn, args = case
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def measure(work: dict, repeats: int, warmup: int = 2) -> dict:
    """Interleaved timings (the order alternates each repeat); medians and the ratio spread."""
    for _ in range(warmup):
        _time(work["candidate"])
        _time(work["reference"])
    cand, ref = [], []
    for i in range(repeats):
        if i % 2:
            ref.append(_time(work["reference"]))
            cand.append(_time(work["candidate"]))
        else:
            cand.append(_time(work["candidate"]))
            ref.append(_time(work["reference"]))
    ratios = [c / r for c, r in zip(cand, ref, strict=True)]
    return {"candidate_s": statistics.median(cand), "reference_s": statistics.median(ref),
                "ratio": statistics.median(cand) / statistics.median(ref),
                "ratio_min": min(ratios), "ratio_max": max(ratios)}


def xla_cost_ratio(work: dict) -> tuple[float, float]:
    """Candidate / reference in XLA's cost model of the compiled programs: (flops, bytes).

    Machine-independent, unlike timings on a shared machine.
    """
    costs = []
    for key in ("candidate", "reference"):
        fn, args = work[key]
        cost = fn.lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        costs.append((cost.get("flops", float("nan")), cost.get("bytes accessed", float("nan"))))
    (fc, bc), (fr, br) = costs
    return fc / fr, bc / br


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per case")
    parser.add_argument("--only", default="", help="cases whose 'name mode' contains this")
    opts = parser.parse_args()
    repeats = opts.repeats or (20 if opts.quick else 7)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {repeats} repeats, medians")
    print(f"{'case':<20} {'mode':<17} {'shapes':<22} {'jaxsafe ms':>10} {'jax.nn ms':>10} "
          f"{'ratio':>6}  {'min-max':<11}  XLA cost ratio: flops, bytes")
    for work in workloads(opts.quick):
        if opts.only not in f"{work['name']} {work['mode']}":
            continue
        r = measure(work, repeats)
        flops, nbytes = xla_cost_ratio(work)
        print(f"{work['name']:<20} {work['mode']:<17} {work['shapes']:<22} "
              f"{1e3 * r['candidate_s']:>10.3f} {1e3 * r['reference_s']:>10.3f} "
              f"{r['ratio']:>6.3f}  {r['ratio_min']:.3f}-{r['ratio_max']:.3f}  "
              f"{flops:.4f}, {nbytes:.4f}", flush=True)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
