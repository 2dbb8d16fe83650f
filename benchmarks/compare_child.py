"""One tree's side of `run.py --base REV`: a long-lived worker that times jaxsafe's rewrite.

Started by benchmarks/compare.py with `PYTHONPATH` set to one tree (the base worktree or the
current one), so `import jaxsafe` finds that tree's package, while the programs and workloads come
from the current tree's benchmarks/ (this directory), the same for both. It reads one JSON request
a line on stdin and answers one JSON line on stdout:

- `{"op": "prepare", "kind": "rewrite", "family": F, "size": N}`: trace the program of
  `cost.program(F, N)`; `{"op": "prepare", "kind": "lower", "workload": I, "mode": M}`: pick
  workload I of `workloads.workloads(quick)`. Either runs the measurement once (warm-up) and
  answers `{"eqns", "time_s", "hash"}`.
- `{"op": "time", "hash": bool}`: run it once more, timed; `{"time_s"}`, and the hash if asked.
- `{"op": "drop"}`, `{"op": "quit"}`.

A measurement: the rewrite of the traced program (`jaxsafe._rewrite.rewrite_with_report`), or
the trace and rewrite of the workload's nan_safe variant (`jax.jit(fn).lower(*args)` of a fresh
function). The hash: sha256 of the rewritten jaxpr's text, or of the lowered module's text: equal
hashes mean both trees emit the same program. A failure (e.g. RecursionError) is answered as
`{"error": "RecursionError: ..."}` and the worker goes on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import cost
import jax

import jaxsafe
from jaxsafe import _rewrite


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Worker:
    def __init__(self, quick: bool):
        self.quick = quick
        self._workloads = None
        self.measure: Callable[[], object] | None = None   # returns what the hash is taken of
        self.text_of: Callable[[object], str] = str

    def workloads(self):
        if self._workloads is None:
            import workloads as W
            self._workloads = W.workloads(self.quick)
        return self._workloads

    def prepare(self, req: dict) -> dict:
        self.measure = None
        if req["kind"] == "rewrite":
            f, x = cost.program(req["family"], req["size"])
            closed = jax.make_jaxpr(f)(x)
            eqns = cost.count_eqns(closed.jaxpr)
            self.measure = lambda: _rewrite.rewrite_with_report(closed)[0]
            self.text_of = str
        else:
            import workloads as W
            w = self.workloads()[req["workload"]]
            eqns = None

            def lower():
                fn, args = W.make(w, "nan_safe", req["mode"])   # fresh functions: no cache hits
                return fn.lower(*args)
            self.measure = lower
            self.text_of = lambda lowered: lowered.as_text()
        out = self.time(hash_it=True)
        out["eqns"] = eqns
        return out

    def time(self, hash_it: bool) -> dict:
        assert self.measure is not None, "prepare first"
        t, result = cost.timed(self.measure)
        out: dict = {"time_s": t}
        if hash_it:
            out["hash"] = sha(self.text_of(result))
        return out

    def handle(self, req: dict) -> dict:
        op = req["op"]
        if op == "prepare":
            return self.prepare(req)
        if op == "time":
            return self.time(bool(req.get("hash")))
        if op == "drop":
            self.measure = None
            return {}
        raise ValueError(f"unknown op {op!r}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    channel = sys.stdout
    sys.stdout = sys.stderr   # stray prints must not reach the protocol

    def answer(obj: dict) -> None:
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    answer({"jaxsafe": str(Path(jaxsafe.__file__).resolve().parent), "jax": jax.__version__})
    worker = Worker(opts.quick)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        try:
            answer(worker.handle(req))
        except Exception as e:  # noqa: BLE001 - a failing tree is a result, not a crash
            worker.measure = None
            message = str(e).splitlines()[0][:200] if str(e) else ""
            answer({"error": f"{type(e).__name__}: {message}",
                    "traceback": traceback.format_exc(limit=-3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
