"""Diagnostics: what a rewrite guarded, the drops that made its lanes dead, and where in the
user's source each one is.

A guard's *drops* are the equations whose selection makes lanes of the guarded value reach no
output: the `where` (`select_n`), `max`/`min`, slice, gather, reduction or masked product that
the value flows into. They are found by following the guarded equation's outputs forward along
differentiable edges, to the nearest equations that drop lanes of what they read (the liveness
rules' own verdict: `operand_kinds` with live outputs). A guard inside a body whose drops are
outside it (a `scan` whose outputs a `where` drops) names the enclosing equation's drops.

Source locations are the innermost user frame of an equation's traceback: JAX's frames and
jaxsafe's own are skipped (`_compat.py` registers jaxsafe's directory with JAX's exclusions).
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import linecache
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from ._compat import JaxprEqn, Var, user_frame
from ._liveness import Sweep, operand_kinds
from ._report import Report, Site
from ._rules import Kind, rule_for

MAX_DROPS = 3
"""Drops named per guard, the nearest first (a long program has many wheres downstream)."""
MAX_READS = 4096
"""Equation reads the forward search of one guard's drops looks at, at most."""


@dataclasses.dataclass(frozen=True)
class Location:
    """A line of the user's source: `file:line:column (function)`; columns are 1-based.

    Example:

        report = jaxsafe.explain(f)(x)
        report.guards[0].location.line  # the line of the guarded call in f's file
    """

    file: str
    line: int
    function: str
    column: int | None = None
    end_column: int | None = None

    @property
    def source(self) -> str:
        """The line itself, as the file holds it now ('' when it cannot be read)."""
        return linecache.getline(self.file, self.line).rstrip("\n")

    @property
    def shown_file(self) -> str:
        """The file as the text shows it: relative to the working directory when inside it
        (as compilers print it), else as it is."""
        path = pathlib.Path(self.file)
        try:
            return str(path.relative_to(pathlib.Path.cwd())) if path.is_absolute() else self.file
        except ValueError:
            return self.file

    def __str__(self) -> str:
        column = f":{self.column}" if self.column is not None else ""
        return f"{self.shown_file}:{self.line}{column} ({self.function})"


@dataclasses.dataclass(frozen=True)
class Drop:
    """An equation that drops lanes of a guarded value: the reason they are dead.

    Example:

        report.guards[0].drops[0].primitive  # "select_n": a jnp.where
    """

    primitive: str
    location: Location | None


@dataclasses.dataclass(frozen=True)
class GuardedOperand:
    """One operand of a guarded equation and what it takes in the lanes that need it.

    `kind`: "value" (it takes `safe_value` in the dropped lanes), "stop-gradient" (it keeps its
    value but passes no derivative there), or the forward-mode versions of both ("forward-mode
    value", "forward-mode stop-gradient": lanes that carry no derivative, `_free.py`).

    Example:

        op = report.guards[0].operands[0]
        op.index, op.kind, op.safe_value  # (0, "value", 1.0): sqrt's operand takes 1 where dropped
    """

    index: int | None  # None: the output (a forward-mode cut)
    kind: str
    safe_value: float | None
    reason: str


@dataclasses.dataclass(frozen=True)
class Guard:
    """A guarded equation: the primitive, where the user wrote it, what each operand takes,
    and the drops that make the guarded lanes dead. `inside`: the bodies around it, the
    outermost first (`"scan at model.py:30:11 (loss)"`).

    Example:

        guard, = jaxsafe.explain(lambda x: jnp.where(x > 0, jnp.log(x), 0.))(1.).guards
        guard.primitive, guard.kind, guard.safe_values  # ("log", "value", {0: 1.0})
    """

    primitive: str
    location: Location | None
    operands: tuple[GuardedOperand, ...]
    drops: tuple[Drop, ...]
    inside: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """"value" when some operand takes a safe value, else "stop-gradient"."""
        return ("value" if any(o.kind.endswith("value") for o in self.operands)
                else "stop-gradient")

    @property
    def safe_values(self) -> dict[int | None, float | None]:
        return {o.index: o.safe_value for o in self.operands}


def location_of(eqn: JaxprEqn) -> Location | None:
    """The innermost user frame of `eqn`'s traceback (None: only JAX's and jaxsafe's)."""
    frame = user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    one_line = frame.end_line == frame.start_line and frame.end_column >= frame.start_column
    column = frame.start_column + 1 if frame.start_column >= 0 else None
    return Location(frame.file_name, frame.start_line, frame.function_name, column,
                    frame.end_column + 1 if one_line and column is not None else None)


# --------------------------------------------------------------------------- drops


def drops_from(sweep: Sweep, eqn: JaxprEqn) -> tuple[JaxprEqn, ...]:
    """The nearest equations that drop lanes of what `eqn` computes, in program order."""
    queue = collections.deque(o for o in eqn.outvars if isinstance(o, Var))
    seen = set(queue)
    found: dict[int, None] = {}
    reads = 0
    while queue and len(found) < MAX_DROPS and reads < MAX_READS:
        v = queue.popleft()
        for j, k in sweep.consumers.get(v, ()):
            reads += 1
            reader = sweep.jaxpr.eqns[j]
            live = [Kind.LIVE] * len(reader.outvars)
            if j not in found and operand_kinds(reader, live, sweep)[k] != Kind.LIVE:
                found[j] = None
            for o in reader.outvars:
                if o not in seen:
                    seen.add(o)
                    queue.append(o)
    if not found:  # lanes that carry no derivative: the selection that filled the operand
        for v in eqn.invars:  # (`sqrt(jnp.where(x > 0, x, 0.))`, a forward-mode guard)
            i = sweep.producer.get(v) if isinstance(v, Var) else None
            if i is not None and rule_for(sweep.jaxpr.eqns[i].primitive).selection is not None:
                found[i] = None
    return tuple(sweep.jaxpr.eqns[j] for j in sorted(found))


def _operands(site: Site) -> tuple[GuardedOperand, ...]:
    ops = [GuardedOperand(k, "value", float(v), site.reasons.get(k, ""))
           for k, v in sorted(site.replace.items())]
    ops += [GuardedOperand(k, "stop-gradient", None, site.reasons.get(k, ""))
            for k in sorted(site.cut)]
    if site.cut_output:
        ops.append(GuardedOperand(None, "stop-gradient", None,
                                  "a custom rule's tangent there" if rule_for(
                                      site.eqn.primitive).custom_rule else
                                  "a dropped pooled result would pick them"))
    if site.free_cut:
        ops.append(GuardedOperand(None, "forward-mode stop-gradient", None,
                                  "no derivative where it carries none"))
    else:
        ops += [GuardedOperand(k, "forward-mode value", float(v),
                               "no derivative where it carries none")
                for k, v in sorted(site.free.items())]
    ops += [GuardedOperand(k, "forward-mode stop-gradient", None,
                           "no derivative where it carries none, beside operands that carry one")
            for k in sorted(site.free_operands)]
    return tuple(ops)


def _drops(eqns: Sequence[JaxprEqn]) -> tuple[Drop, ...]:
    return tuple(Drop(e.primitive.name, location_of(e)) for e in eqns)


def guards_of(report: Report) -> tuple[Guard, ...]:
    """Every guard of `report` and of its nested bodies' reports, outer program first."""
    guards: list[Guard] = []
    # (report, the bodies around it, the drops of the equation that holds it)
    stack: list[tuple[Report, tuple[str, ...], tuple[JaxprEqn, ...]]] = [(report, (), ())]
    while stack:
        current, inside, around = stack.pop()
        for site in current.sites:
            if not (site.replace or site.cut or site.free or site.free_cut
                    or site.free_operands):
                continue
            drops = current.drops_of(site.eqn) if current.drops_of is not None else ()
            guards.append(Guard(site.eqn.primitive.name, location_of(site.eqn),
                                _operands(site), _drops(drops or around), inside))
        for eqn, sub in reversed(current.nested):
            enclosing = current.drops_of(eqn) if current.drops_of is not None else ()
            where = location_of(eqn)
            stack.append((sub, inside + (f"{eqn.primitive.name} at {where}"
                                         if where else eqn.primitive.name,),
                          enclosing or around))
    return tuple(guards)


# --------------------------------------------------------------------------- the text


def _quote(location: Location | None, indent: str) -> list[str]:
    """The user's line, with a marker under the call, as compilers print it."""
    if location is None:
        return []
    text = location.source
    if not text.strip():
        return []
    stripped = text.lstrip()
    cut = len(text) - len(stripped)
    number = str(location.line)
    lines = [f"{indent}{number} | {stripped}"]
    if location.column is not None and location.column - 1 >= cut:
        start = location.column - 1 - cut
        end = (location.end_column - 1 - cut if location.end_column is not None
               else start + 1)
        lines.append(f"{indent}{' ' * len(number)} | {' ' * start}{'^' * max(1, end - start)}")
    return lines


def _where(location: Location | None) -> str:
    return str(location) if location is not None else "(no user frame: inside JAX)"


def _operand_text(op: GuardedOperand) -> str:
    target = "output" if op.index is None else f"operand {op.index}"
    if op.kind == "value":
        return f"{target} -> {op.safe_value!r} ({op.reason})"
    if op.kind == "stop-gradient":
        return f"{target}: no derivative in dropped lanes ({op.reason})"
    if op.kind == "forward-mode value":
        return f"{target} -> {op.safe_value!r} where it carries no derivative (forward mode)"
    return f"{target}: {op.reason} (forward mode)"


def _guard_block(guard: Guard, indent: str) -> list[str]:
    ops = ", ".join(_operand_text(o) for o in guard.operands)
    lines = [f"{indent}{_where(guard.location)}: guarded {guard.primitive} "
             f"({guard.kind} guard): {ops}"]
    lines += _quote(guard.location, indent + "    ")
    quoted = {_line_of(guard.location)}
    for drop in guard.drops:
        same = _line_of(drop.location) in quoted
        lines.append(f"{indent}  its lanes are dropped by {drop.primitive} at "
                     f"{_where(drop.location)}{' (same line)' if same else ''}")
        if not same:
            lines += _quote(drop.location, indent + "    ")
            quoted.add(_line_of(drop.location))
    return lines


def _line_of(location: Location | None) -> tuple | None:
    return None if location is None else (location.file, location.line)


def _note(eqn: JaxprEqn, text: str, indent: str) -> list[str]:
    location = location_of(eqn)
    return [f"{indent}{_where(location)}: {text}"] + _quote(location, indent + "    ")


def format_report(report: Report) -> str:
    """`str(report)`: one block per guard, then what was re-decided, left unguarded, or could
    not be seen through, then the equation counts."""
    if report.failure is not None:
        return ("the analysis failed (a bug in jaxsafe; please report it): the original "
                "program runs unchanged, its dropped lanes unguarded\n" + report.failure)
    guards = report.guards
    lines: list[str] = []
    by_body: dict[tuple[str, ...], list[Guard]] = {}
    for guard in guards:
        by_body.setdefault(guard.inside, []).append(guard)
    for inside, members in by_body.items():
        lines += [f"{'  ' * depth}inside {body}:" for depth, body in enumerate(inside)]
        for guard in members:
            lines += _guard_block(guard, "  " * len(inside))
    lines += _notes(report)
    if not lines:
        return "nothing to guard: the program runs unchanged"
    counts = report.equations
    if counts is not None:
        n, k = len(guards), _selections(report)
        chosen = f", {k} re-decided selection{'s' if k != 1 else ''}" if k else ""
        lines.append(f"{n} guard{'s' if n != 1 else ''}{chosen}; equations: {counts[0]} "
                     f"before, {counts[1]} after")
    return "\n".join(lines)


def _selections(report: Report) -> int:
    """The equations re-decided on original values, nested bodies' included: a program with
    no guard can change for them alone."""
    count, stack = 0, [report]
    while stack:
        current = stack.pop()
        count += len(current.selections)
        stack.extend(sub for _, sub in current.nested)
    return count


def _notes(report: Report) -> list[str]:
    """What was re-decided, could not be seen through, or was left, nested bodies' too."""
    lines: list[str] = []
    stack: list[tuple[Report, str]] = [(report, "")]
    while stack:
        current, indent = stack.pop()
        for eqn in current.selections:
            lines += _note(eqn, f"re-decided {eqn.primitive.name} on original values", indent)
        for eqn in current.unknown:
            lines += _note(eqn, f"unknown primitive {eqn.primitive.name}: passed through "
                                f"unguarded (treated as live, outputs treated as possibly "
                                f"non-finite)", indent)
        for eqn in current.conservative:
            lines += _note(eqn, f"liveness not followed through {eqn.primitive.name} (no rule): "
                                f"its operand lanes are taken as live where any output lane "
                                f"is, so a drop after it does not reach before it", indent)
        for eqn in current.backward_rules:
            lines += _note(eqn, f"guarded the backward rule of {eqn.primitive.name}: a "
                                f"cotangent lane that a drop made zero stays zero through its "
                                f"products", indent)
        for eqn, reason in current.skipped:
            lines += _note(eqn, f"left {eqn.primitive.name} {reason}", indent)
        stack.extend((sub, indent) for _, sub in reversed(current.nested))
    return lines


def jaxpr_diff(report: Report, context: int = 3) -> str:
    """The unified diff of the original and rewritten jaxprs; each added line that applies a
    guarded primitive is marked with the guard's source line."""
    if report.original is None or report.rewritten is None:
        return ""
    marks: dict[str, str] = {}
    for guard in report.guards:
        marks.setdefault(guard.primitive, f"guarded {guard.primitive} "
                                          f"({_where(guard.location)})")
    pattern = re.compile(r"= (" + "|".join(re.escape(p) for p in marks) + r")\b") \
        if marks else None
    lines = []
    for line in difflib.unified_diff(str(report.original).splitlines(),
                                     str(report.rewritten).splitlines(),
                                     "original", "rewritten", n=context, lineterm=""):
        match = pattern.search(line) if pattern is not None and line.startswith("+") else None
        lines.append(f"{line}    # <- {marks[match.group(1)]}" if match else line)
    return "\n".join(lines) if lines else "(no difference: the program runs unchanged)"


# --------------------------------------------------------------------------- the entry


def explain(fun: Callable, *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (),
            finite_args: Any = False) -> Callable[..., Report]:
    """`explain(f)(*args)`: the `Report` of what `nan_safe(f)` guards for these arguments.
    `print` it for one block per guard, naming the user's source line and the drop that made
    its lanes dead; `report.guards` holds the same as data, `report.diff()` the jaxprs' diff.

    Example:

        print(jaxsafe.explain(lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.))(1.))
        # <file>:<line>:<col> (<lambda>): guarded sqrt (value guard): operand 0 -> 1.0 (table) ...
    """
    from ._api import NanSafeFunction
    if not callable(fun):
        raise TypeError(f"explain: `fun` must be callable, got {type(fun).__name__}: {fun!r}.")
    safe_fun = NanSafeFunction(fun, static_argnums, static_argnames, True, 0, finite_args)

    def run(*args, **kwargs) -> Report:
        return safe_fun.trace(*args, **kwargs)[1]
    return run
