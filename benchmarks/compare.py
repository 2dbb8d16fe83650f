"""`run.py --base REV`: the rewrite's cost in the current tree against a previous commit, measured
in the same run.

REV is checked out into a temporary git worktree (`git worktree add --detach`), removed at the
end, also on error. Each tree gets one long-lived worker (benchmarks/compare_child.py) with
`PYTHONPATH` at that tree, so each imports its own `jaxsafe`; both run the programs and workloads
of the current benchmarks/. The current tree is the working tree, uncommitted changes included.

Per measurement, both workers prepare it (trace the program, one warm-up run that also hashes what
it emits), then time it in R rounds, base and current alternating, the one that goes first swapped
every round; while one runs, the other waits on its input. Reported: each tree's median, the
ratio current/base per round (median, min-max), and whether both emit the same program (the hash
of the rewritten jaxpr, or of the lowered module, taken at warm-up and again in the last round of
each tree, so that a hash that changes between two runs in one process shows too).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import cost
import timing
import workloads as W

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks"
TREES = ("base", "current")


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """REV checked out (detached) in a temporary directory, removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="jaxsafe-base-"))
    path = tmp / "tree"
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)   # so that `finally` runs
    try:
        git("worktree", "add", "--detach", str(path), rev)
        yield path
    finally:
        try:
            git("worktree", "remove", "--force", str(path))
        except subprocess.CalledProcessError:
            shutil.rmtree(path, ignore_errors=True)
            git("worktree", "prune")
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


class ChildError(RuntimeError):
    pass


class Child:
    """A compare_child.py worker importing the jaxsafe of `tree`."""

    def __init__(self, tree: Path, quick: bool, stderr_path: Path):
        self.tree, self.quick, self.stderr_path = tree, quick, stderr_path
        self.proc: subprocess.Popen | None = None
        self.jaxsafe: str | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(self.tree))
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "compare_child.py")] + (["--quick"] * self.quick),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env=env, cwd=str(self.stderr_path.parent))
        hello = self._read()
        self.jaxsafe = hello["jaxsafe"]
        if Path(self.jaxsafe) != (self.tree / "jaxsafe").resolve():
            raise ChildError(f"the worker for {self.tree} imported jaxsafe from {self.jaxsafe}")

    def request(self, **req) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        return self._read()

    def _read(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            self.proc = None
            tail = self.stderr_path.read_text(errors="replace")[-2000:]
            raise ChildError(f"worker exited ({rc})\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def measurements(quick: bool, generated: list[int], chain: list[int],
                 only: str | None = None) -> list[dict]:
    """What is compared: the rewrite of the generated programs and deep chains, and the trace and
    rewrite of every runtime workload's nan_safe variant, in each of its modes. `only` (run.py's
    `--only`): just the workloads whose name contains it, as the other sections do."""
    out = []
    if not only:
        out += [{"kind": "rewrite", "family": cost.GENERATED, "size": n} for n in generated]
        out += [{"kind": "rewrite", "family": cost.CHAIN, "size": n} for n in chain]
    for i, w in enumerate(W.workloads(quick)):
        if only and only.lower() not in w.name.lower():
            continue
        out += [{"kind": "lower", "workload": i, "mode": m, "name": w.name} for m in w.modes]
    return out


def label(m: dict) -> str:
    if m["kind"] == "rewrite":
        unit = "steps" if m["family"] == cost.CHAIN else "eqns (target)"
        return f"rewrite: {m['family']}, {m['size']} {unit}"
    return f"trace+rewrite: {m['name']} ({m['mode']})"


def against(rev: str, quick: bool, generated: list[int], chain: list[int], budget_s: float,
            min_rounds: int, max_rounds: int, log=print, only: str | None = None) -> dict:
    """Compare the current tree with `rev`; see the module docstring."""
    start = time.perf_counter()
    sha = git("rev-parse", "--short", f"{rev}^{{commit}}")
    head = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", "jaxsafe"))
    res = {"rev": rev, "sha": sha, "head": head, "dirty": dirty, "rows": []}
    log(f"  base {rev} ({sha}) against the current tree (HEAD {head}"
        + (", with uncommitted changes to jaxsafe/)" if dirty else ")"))
    with worktree(rev) as base_tree:
        logs = base_tree.parent
        children = {"base": Child(base_tree, quick, logs / "base.err"),
                    "current": Child(ROOT, quick, logs / "current.err")}
        try:
            for child in children.values():
                child.start()
            for m in measurements(quick, generated, chain, only):
                row = compare_one(children, m, budget_s, min_rounds, max_rounds)
                log("  " + "  ".join(row_cells(row)))
                res["rows"].append(row)
        finally:
            for child in children.values():
                child.close()
    res["wall_s"] = time.perf_counter() - start
    return res


def compare_one(children: dict[str, Child], m: dict, budget_s: float, min_rounds: int,
                max_rounds: int) -> dict:
    req = {k: v for k, v in m.items() if k != "name"}
    side: dict[str, dict] = {}
    for tree in TREES:
        side[tree] = _ask(children[tree], op="prepare", **req)
        side[tree]["times_s"] = []
    ok = [t for t in TREES if "error" not in side[t]]
    rounds = timing.choose_rounds(sum(side[t]["time_s"] for t in ok), budget_s, min_rounds,
                                  max_rounds) if ok else 0
    for r in range(rounds):
        order = TREES if r % 2 == 0 else TREES[::-1]
        for tree in order:
            if tree not in ok:
                continue
            got = _ask(children[tree], op="time", hash=r == rounds - 1)
            if "error" in got:
                side[tree]["error"] = got["error"]
                ok.remove(tree)
                continue
            side[tree]["times_s"].append(got["time_s"])
            if "hash" in got:
                side[tree]["hash_again"] = got["hash"]
    for tree in TREES:
        if "error" not in side[tree]:
            _ask(children[tree], op="drop")
    row = {**m, "label": label(m), "rounds": rounds,
           "eqns": next((side[t].get("eqns") for t in TREES if side[t].get("eqns")), None)}
    for tree in TREES:
        s = side[tree]
        row[tree] = {"error": s.get("error"), "times_s": s["times_s"],
                     "median_s": statistics.median(s["times_s"]) if s["times_s"] else None,
                     "hash": s.get("hash"),
                     "deterministic": s.get("hash") == s.get("hash_again")
                     if "hash_again" in s else None}
    both = all(row[t]["times_s"] and not row[t]["error"] for t in TREES)
    row["ratio"] = timing.ratio_stats(row["current"]["times_s"], row["base"]["times_s"]) \
        if both else None
    row["same_program"] = (row["base"]["hash"] == row["current"]["hash"]) if both else None
    return row


def _ask(child: Child, **req) -> dict:
    try:
        return child.request(**req)
    except ChildError as e:   # the worker died: a result for this tree; restarted on next use
        return {"error": str(e).splitlines()[0]}


HEAD = ["measurement", "eqns", "base ms", "current ms", "current/base", "min-max", "rounds",
        "same program"]


def _ms(side: dict) -> str:
    if side["error"]:
        return f"fails: {side['error'].split(':')[0]}"
    return f"{1e3 * side['median_s']:.2f}"


def row_cells(row: dict) -> list[str]:
    r = row["ratio"]
    same = {True: "yes", False: "**no**", None: "-"}[row["same_program"]]
    if any(row[t]["deterministic"] is False for t in TREES):
        same += " (hash not deterministic)"
    return [row["label"], str(row["eqns"] or "-"), _ms(row["base"]), _ms(row["current"]),
            f"{r['median']:.3f}" if r else "-", f"{r['min']:.2f}-{r['max']:.2f}" if r else "-",
            str(row["rounds"]), same]
