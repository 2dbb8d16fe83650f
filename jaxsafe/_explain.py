"""Diagnostics: what a rewrite guarded, and where in the user's source."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._compat import source_summary
from ._report import Report


def format_report(report: Report, indent: str = "") -> str:
    lines: list[str] = []
    for site in report.sites:
        ops = ", ".join([f"operand {k} -> {v!r} ({site.reasons[k]})"
                         for k, v in sorted(site.replace.items())] +
                        [f"operand {k}: no derivative in dropped lanes ({site.reasons[k]})"
                         for k in sorted(site.cut)] +
                        (["output: no derivative where it carries none (forward mode)"]
                         if site.free_cut else
                         [f"operand {k} -> {v!r} where it carries no derivative (forward mode)"
                          for k, v in sorted(site.free.items())]))
        lines.append(f"{indent}guarded {site.eqn.primitive.name}: {ops}  at "
                     f"{source_summary(site.eqn)}")
    for eqn in report.selections:
        lines.append(f"{indent}re-decided {eqn.primitive.name} on original values  at "
                     f"{source_summary(eqn)}")
    for eqn in report.unknown:
        lines.append(f"{indent}unknown primitive {eqn.primitive.name}: passed through unguarded "
                     f"(treated as live, outputs treated as possibly non-finite)  at "
                     f"{source_summary(eqn)}")
    for eqn in report.backward_rules:
        lines.append(f"{indent}guarded the backward rule of {eqn.primitive.name}: a cotangent "
                     f"lane that a drop made zero stays zero through its products  at "
                     f"{source_summary(eqn)}")
    for eqn, reason in report.skipped:
        lines.append(f"{indent}left {eqn.primitive.name} {reason}  at "
                     f"{source_summary(eqn)}")
    for eqn, sub in report.nested:
        lines.append(f"{indent}inside {eqn.primitive.name} at {source_summary(eqn)}:")
        lines.append(format_report(sub, indent + "  "))
    if not lines:
        return f"{indent}nothing to guard: the program runs unchanged"
    return "\n".join(lines)


def explain(fun: Callable, *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (),
            finite_args: Any = False) -> Callable[..., str]:
    """`explain(f)(*args)`: a readable list of what `nan_safe(f)` guards for these arguments,
    each line naming the user's source line."""
    from ._api import NanSafeFunction
    if not callable(fun):
        raise TypeError(f"explain: `fun` must be callable, got {type(fun).__name__}: {fun!r}.")
    safe_fun = NanSafeFunction(fun, static_argnums, static_argnames, True, 0, finite_args)

    def run(*args, **kwargs) -> str:
        return format_report(safe_fun.trace(*args, **kwargs)[1])
    return run
