"""What a rewrite did: the record each pass adds to, read by `jaxsafe.explain` and the tests."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._compat import ClosedJaxpr, JaxprEqn, source_summary

if TYPE_CHECKING:
    from ._explain import Guard


@dataclasses.dataclass
class Site:
    """One guarded equation: which operands take which value in its dropped lanes, and why;
    `cut` operands keep their value but pass no derivative there (a custom rule's call); `free`
    operands take a value in the live lanes of its output that carry no derivative, where the
    output keeps its original value (`_free.py`)."""

    eqn: JaxprEqn
    replace: dict[int, float]
    reasons: dict[int, str]
    cut: frozenset[int] = frozenset()
    free: dict[int, float] = dataclasses.field(default_factory=dict)
    free_cut: bool = False
    """The lanes that carry no derivative are cut at the output instead (`_free.py`)."""
    cut_output: bool = False
    """Its output's dropped lanes are cut too (a cut before a pooling some of whose results are
    dropped: forward mode's `0 * inf` tangent in a dropped lane would reach them)."""
    coarse: dict = dataclasses.field(default_factory=dict)
    """Operands of `replace` guarded where a coarser mask drops them (`_symbolic.named_along`:
    the rows the program's predicates drop), not in every dropped lane: their exact mask would
    need a run-time reduction. Operand -> that mask's formula, over the operand's axes."""
    free_operands: dict[int, float] = dataclasses.field(default_factory=dict)
    """Operands whose lanes that carry no derivative meet an operand's that carry one, with
    their safe values: there the output is computed again with their derivative cut
    (`_free.FreeValues.operand_cuts`)."""


@dataclasses.dataclass(eq=False)
class Report:
    """What a rewrite did: what `jaxsafe.explain` and `nan_safe(f).trace` return.

    `str(report)` reads like a compiler's diagnostics (`_explain.py`), `report.guards` lists the
    guards with their drops and source lines, `report.diff()` the jaxprs' unified diff. The
    passes fill in:

    - `sites`: the guarded equations, in program order (the guard pass);
    - `selections`: `max`/`min`/`clamp` equations re-decided on original values (the decision
      pass);
    - `unknown`: equations of primitives jaxsafe knows nothing about (the guard pass);
    - `conservative`: equations of JAX's primitives without a liveness rule whose outputs a
      drop reaches: their operands were taken as live (the guard pass);
    - `nested`: the reports of rewritten bodies, with their equations (the nested-body pass and
      the masked-body pass);
    - `skipped`: equations (or operands) left unguarded although they could use a guard, with
      what was left and why (the guard pass and the nested-body pass);
    - `backward_rules`: custom_vjp calls whose backward rule runs through the structural-zero
      pass (`_backward.py`).

    Example:

        closed, report = jaxsafe.nan_safe(f).trace(x)   # or: report = jaxsafe.explain(f)(x)
        print(report)           # the diagnostics text
        report.guards           # the same as data
        print(report.diff())    # the original and the rewritten jaxpr
    """

    sites: list[Site] = dataclasses.field(default_factory=list)
    selections: list[JaxprEqn] = dataclasses.field(default_factory=list)
    unknown: list[JaxprEqn] = dataclasses.field(default_factory=list)
    conservative: list[JaxprEqn] = dataclasses.field(default_factory=list)
    nested: list[tuple[JaxprEqn, Report]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[JaxprEqn, str]] = dataclasses.field(default_factory=list)
    backward_rules: list[JaxprEqn] = dataclasses.field(default_factory=list)
    """Custom rules whose backward program runs through the structural-zero pass."""
    drops_of: Callable[[JaxprEqn], tuple[JaxprEqn, ...]] | None = None
    """The equations of this program that drop lanes of an equation's outputs (the guard
    pass's liveness, asked for by the diagnostics only)."""
    original: ClosedJaxpr | None = None
    rewritten: ClosedJaxpr | None = None
    """The programs before and after (the top-level report only)."""
    failure: str | None = None
    """Why the analysis failed, when it did: the original program then runs unchanged
    (`AnalysisFailedWarning`)."""
    input_cotangents: tuple[bool, ...] | None = None
    """Which arguments' cotangents the program may make non-finite (the cotangent pass); None
    where that pass did not run (nothing in the program reads them): how a loop's body learns
    what its carries hand back to the step before (`_rewrite.carried_cotangents`)."""
    input_cotangents_own: tuple[bool, ...] | None = None
    """Of those, the ones non-finite only in lanes where the argument's own value is."""

    @property
    def guards(self) -> tuple[Guard, ...]:
        """Every guard, nested bodies' included, in program order: empty when nothing needed
        one."""
        from ._explain import guards_of
        return guards_of(self)

    @property
    def equations(self) -> tuple[int, int] | None:
        """The equation counts of the program before and after the rewrite, bodies included."""
        from ._nested import count_equations
        if self.original is None or self.rewritten is None:
            return None
        return count_equations(self.original), count_equations(self.rewritten)

    def diff(self, context: int = 3) -> str:
        """The original and the rewritten jaxpr as a unified diff, guarded equations marked."""
        from ._explain import jaxpr_diff
        return jaxpr_diff(self, context)

    def __str__(self) -> str:
        from ._explain import format_report
        return format_report(self)

    def __repr__(self) -> str:
        n = len(self.guards)
        return f"<jaxsafe.Report: {n} guard{'s' if n != 1 else ''}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython shows the text
        printer.text(str(self))

    @property
    def changed(self) -> bool:
        """Whether the rewritten program differs from the original."""
        return bool(self.sites or self.selections or self.backward_rules
                    or any(r.changed for _, r in self.nested))


class AnalysisFailedWarning(RuntimeWarning):
    """jaxsafe's analysis raised on a program (a bug in jaxsafe): the original program runs
    unchanged, so its values and derivatives are JAX's and its dropped lanes are not guarded.
    The message carries the error, the pass and the equation it was raised at; please report
    it. Set `JAXSAFE_STRICT=1` to raise the error instead (jaxsafe's own tests do).

    Example:

        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error", jaxsafe.AnalysisFailedWarning)
            jax.grad(jaxsafe.nan_safe(f))(x)   # a failed analysis is now an error
    """


def strict() -> bool:
    """Whether an analysis failure raises (`JAXSAFE_STRICT=1`, as jaxsafe's own tests run)
    instead of running the original program with an `AnalysisFailedWarning`."""
    return os.environ.get("JAXSAFE_STRICT", "") not in ("", "0")


def failure_text(error: BaseException) -> str:
    """The error with the notes the passes added (the pass, the equation, the source line)."""
    notes = [n for n in getattr(error, "__notes__", []) if isinstance(n, str)]
    return "\n".join([f"{type(error).__name__}: {error}", *notes])


def note_failure(error: BaseException, eqn: JaxprEqn, pass_name: str) -> None:
    """Name the equation and the user's source line on an error raised while a pass handled it:
    a failure inside the analysis is a bug in jaxsafe, and the report needs the place."""
    error.add_note(f"jaxsafe: raised by the {pass_name} pass at `{eqn.primitive}` "
                   f"({source_summary(eqn)}). This is a bug in jaxsafe; please report it with "
                   f"this traceback (JAX_TRACEBACK_FILTERING=off shows jaxsafe's frames too).")
