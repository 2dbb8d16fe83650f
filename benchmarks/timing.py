"""Timing helpers for the benchmark suite: interleaved, shuffled rounds after warm-up.

Every variant of a row (nan_safe, the hand-written double where, the unguarded program; or a
jaxsafe.nn candidate and its jax.nn reference) is compiled and run first, then timed for R rounds.
In each round every variant runs once, in a freshly shuffled order, and is blocked on
(`jax.block_until_ready`), so slow drifts of the machine (other processes, thermal state) hit all
variants alike. The ratio of two variants is computed per round, and reported as the median of the
per-round ratios with their min and max.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

Thunk = Callable[[], Any]


def as_thunk(variant: Any) -> Thunk:
    """A zero-argument callable from a callable or a `(fn, args)` pair."""
    if callable(variant):
        return variant
    fn, args = variant
    return lambda: fn(*args)


def time_once(thunk: Thunk) -> float:
    start = time.perf_counter()
    jax.block_until_ready(thunk())
    return time.perf_counter() - start


def choose_rounds(per_round_s: float, budget_s: float, min_rounds: int, max_rounds: int) -> int:
    """As many rounds as fit in `budget_s`, within [min_rounds, max_rounds]."""
    if per_round_s <= 0:
        return max_rounds
    return max(min_rounds, min(max_rounds, int(budget_s / per_round_s)))


def measure(variants: Mapping[str, Any], *, budget_s: float, min_rounds: int, max_rounds: int,
            warmup: int = 2, seed: int = 0) -> dict:
    """Warm up every variant, then time them in interleaved, shuffled rounds.

    Returns {"rounds": R, "times": {name: [seconds per round]}, "warmup_s": ...}. The number of
    rounds is chosen from the last warm-up round so that the row takes about `budget_s`.
    """
    thunks = {name: as_thunk(v) for name, v in variants.items()}
    names = list(thunks)
    start = time.perf_counter()
    last: dict[str, float] = {}
    for _ in range(max(1, warmup)):  # the first call compiles
        for name in names:
            last[name] = time_once(thunks[name])
    warmup_s = time.perf_counter() - start
    rounds = choose_rounds(sum(last.values()), budget_s, min_rounds, max_rounds)
    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            times[name].append(time_once(thunks[name]))
    return {"rounds": rounds, "times": times, "warmup_s": warmup_s}


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict:
    """Median, min and max of the per-round ratios num[i] / den[i]."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def per_call(fn: Callable[[], Any], calls: int) -> float:
    """Mean seconds per call of `fn` over `calls` back-to-back calls, each blocked on."""
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn())
    return (time.perf_counter() - start) / calls
