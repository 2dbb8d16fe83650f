"""Fewer garbage collections while a rewrite runs, and nothing else changed.

A rewrite allocates many small objects (equations, tracers, formulas) and frees few until it
ends. CPython's collector scans the heap again and again as they pile up: a quarter of the
rewrite time of a 25,000-equation program (`make bench`, "Collector during the rewrite").
`fewer_collections` raises the collection thresholds for the duration of the outermost rewrite
and puts the user's back afterwards, also on error. The collector is never turned off: garbage
that other threads make meanwhile is still collected, less often. A user who disabled automatic
collection (`gc.disable()`, or a threshold of 0) is left alone. A call differentiated under
`jit` holds them through its trace, rewrite and replay (`_api`), which allocate the same way.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

THRESHOLDS = (100_000, 50, 50)
"""Young collections every 100,000 allocations instead of 700; older generations rarely."""

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Raise the collector's thresholds while the outermost rewrite (of any thread) runs."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            current = gc.get_threshold()
            _saved = current if gc.isenabled() and current[0] > 0 else None
            if _saved is not None:
                gc.set_threshold(*THRESHOLDS)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None
