"""The rewrite: a program whose dropped lanes are safe to differentiate, as named passes.

    flatten -> sink -> dce -> liveness -> taint seeds -> nested bodies -> guards
            -> masked bodies -> decisions -> emission -> dce -> merge

1. `flatten` (`_flatten.py`): inline `jit` and `closed_call`, and scalar constants as literals.
   `sink` (`_sinking.py`): elementwise work on a scan's stacked operand that the scan's body
   drops lanes of is moved into the body, where the body's guard reaches it.
2. `dce`: drop unused results, so a guard only they would need is not planned.
3. liveness (`_liveness.py`): the static liveness of every value (`Sweep`).
4. taint seeds (`_taint.py`): values that may be non-finite without any NaN-prone primitive
   (arguments not promised finite, constants, values the program tests), and what a body
   receives that may be non-finite in any lane.
5. nested bodies (`rewrite_nested_bodies`, here): `scan`, `while`, `cond`, `remat` bodies are
   rewritten on their own, all their outputs live, keeping their signatures.
6. guards (`_sites.py`): which operands take a safe value (or are cut) in dropped lanes.
7. masked bodies (`plan_masked_bodies`, here): bodies whose outputs the program around them
   drops in places are planned again with those output masks.
8. decisions (`_decisions.py`): what is emitted again, and what decisions may read.
9. emission (`_emit.py`): the planned program traced with `jax.make_jaxpr`: the original
   program, the masks, and the guarded shadow.
10. `dce`: JAX's dead-code elimination removes what the shadow made unused; for
    `jnp.where(c, sqrt(x), 0)` the result is exactly the hand-written double where.
11. merge (`_repeats.py`): an equation the emitted program computes twice (a comparison the
    masks made, made again by a re-decided `max`) is computed once.

Passes 3 to 8 (`plan_program`) make the `Plan`; each reads what the passes before it produced.
When nothing needs a guard, the original ClosedJaxpr is returned as it is.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence, Set
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero as NoTangent  # custom_jvp's, not ad.Zero

from ._atoms import (
    MAX_WEIGHT,
    SMALL_CONSTANT,
    dtype_of,
    is_float,
    is_nonfinite_literal,
    readable_constant,
    shape_of,
)
from ._backward import guarded_backward, guarded_forward
from ._bounds import of_program
from ._carries import Carry
from ._collector import fewer_collections
from ._compat import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Tracer,
    Var,
    dce,
    eval_jaxpr,
    source_summary,
    trace_to_jaxpr,
)
from ._cotangents import (
    Cotangents,
    body_cotangents,
    needs_cotangents,
    nonfinite_cotangents,
)
from ._decisions import plan_decisions
from ._emit import emit
from ._explain import drops_from
from ._flatten import flatten, inline_scalar_constants, take_constant_selections
from ._liveness import Sweep, Sweeps, kind_of_sym, sym_of_kind
from ._masks import all_staged
from ._nested import any_equation, sub_jaxprs
from ._plan import Plan
from ._repeats import merge_repeated_equations
from ._report import AnalysisFailedWarning, Report, failure_text, note_failure, strict
from ._rules import GuardMismatchError, Kind, rule_for
from ._sinking import sink_into_scans
from ._sites import place_guards
from ._symbolic import Sym
from ._taint import contains_hazard, nonfinite_anywhere, nonfinite_seeds


def rewrite_with_report(closed: ClosedJaxpr, finite_invars: Sequence[bool] | None = None
                        ) -> tuple[ClosedJaxpr, Report]:
    """Rewrite `closed`; returns it unchanged (the same object) when nothing needs a guard.
    `finite_invars`: the arguments the caller promises are finite (default: none).

    A failure inside the analysis is a bug in jaxsafe. Unless `JAXSAFE_STRICT=1`, it does not
    stop the user's program: the original program runs (contract 5: what the analysis cannot
    see through is left as it is, never guessed), with an `AnalysisFailedWarning` that carries
    the error and the equation it was raised at."""
    assert finite_invars is None or len(finite_invars) == len(closed.jaxpr.invars)
    symbolic = _symbolic_dimensions(closed)
    if symbolic:
        return closed, _not_analysed(closed, symbolic)
    with fewer_collections(), _probes_unchecked():
        try:
            new, report = _rewrite(closed, Sweeps(), finite_invars)
        except Exception as error:
            if strict() or isinstance(error, GuardMismatchError):  # the user's to fix
                raise
            return closed, _failed(closed, error)
    # the diagnostics compare the flattened original (what was analysed) with the result
    report.rewritten = report.original if new is closed else new
    return new, report


@contextlib.contextmanager
def _probes_unchecked() -> Iterator[None]:
    """The analysis reads constants from the device: a transfer guard is the user's check of
    the user's program, which runs under it as it would without jaxsafe. (`jax_debug_nans` and
    `jax_debug_infs` stay on: JAX keeps an operation compiled with them off unchecked for the
    user's later eager calls; the probes that meet them answer conservatively instead,
    `_constants.py`.)"""
    with jax.transfer_guard("allow"):
        yield


def _rewrite(closed: ClosedJaxpr, sweeps: Sweeps, finite_invars: Sequence[bool] | None = None,
             bad_cotangents: Sequence[bool] | None = None, in_body: bool = False,
             known_inputs: BodyFacts | None = None,
             own_cotangents: Sequence[bool] | None = None) -> tuple[ClosedJaxpr, Report]:
    """A body's arguments come from the program around it: possibly non-finite. `in_body`:
    `closed` is the body of an equation (see `guard_backward_rules`). `known_inputs`: what
    that program knows of them (`_known_body_inputs`). `own_cotangents`: see
    `plan_program`."""
    flat = take_constant_selections(inline_scalar_constants(flatten(closed)))
    if not in_body:
        sweeps.hazardous_rules = rules_with_hazards(flat)
    flat = dce(sink_into_scans(flat, sweeps))
    plan = plan_program(flat, [Kind.LIVE] * len(flat.jaxpr.outvars), sweeps, finite_invars,
                        bad_cotangents, in_body, known_inputs, own_cotangents=own_cotangents)
    plan.report.original = flat
    if not plan.report.changed:
        return closed, plan.report
    avals = [v.aval for v in closed.jaxpr.invars]
    changed: list[bool] = []
    new = merge_repeated_equations(dce(trace_to_jaxpr(partial(emit, plan, changed), avals)))
    if not any(changed):  # every planned guard's lanes were live: contract 4, the original
        _unplace(plan.report)
        return closed, plan.report
    return new, plan.report


def _unplace(report: Report) -> None:
    """The sites of a plan that emitted no guard, moved to what was left, with why."""
    for site in report.sites:
        report.skipped.append((site.eqn, "unguarded: every lane it would guard is live (its "
                                         "masks, known when jaxsafe traced, hold everywhere)"))
    report.sites.clear()


def _symbolic_dimensions(closed: ClosedJaxpr) -> list[str]:
    """The symbolic dimensions of the program's arguments (`jax.export` shape polymorphism):
    the analysis computes masks from concrete shapes."""
    return sorted({str(d) for v in closed.jaxpr.invars for d in getattr(v.aval, "shape", ())
                   if not isinstance(d, int | np.integer)})


def _not_analysed(closed: ClosedJaxpr, symbolic: list[str]) -> Report:
    """A program over symbolic shapes runs as it is, with a warning that says what to do."""
    text = (f"jaxsafe does not analyse programs over symbolic shapes (jax.export shape "
            f"polymorphism: {', '.join(symbolic)}): the original program runs unchanged, its "
            f"dropped lanes unguarded. Export with concrete shapes to have them guarded.")
    warnings.warn(AnalysisFailedWarning(text), stacklevel=3)
    return Report(failure=text, original=closed, rewritten=closed)


def _failed(closed: ClosedJaxpr, error: Exception) -> Report:
    """The report of a program the analysis failed on, and the warning that says so."""
    text = failure_text(error)
    warnings.warn(AnalysisFailedWarning(
        f"jaxsafe could not analyse this program, a bug in jaxsafe (please report it with "
        f"this message): the original program runs unchanged, its dropped lanes unguarded. "
        f"Set JAXSAFE_STRICT=1 to raise instead.\n{text}"), stacklevel=2)
    return Report(failure=text, original=closed, rewritten=closed)


def values_of(original: ClosedJaxpr, rewritten: Callable[[], ClosedJaxpr],
              forward_mode: bool = False) -> Callable:
    """Original program for the values of a plain call, rewritten program under jvp/grad.

    A call that is not differentiated runs exactly `f`'s program: its values are bit for bit
    those of `jax.jit(f)` (a guarded program can fuse differently in XLA, which moves the last
    bit of e.g. igamma) and it costs exactly what `f` costs, the rewrite included: `rewritten`
    is asked for only when the rule is traced. Under differentiation the rule runs the rewritten
    program once, for the values and the tangents together. The rewritten program's constants
    are concrete (the original's are: see `_api._Traced`), so the rule closes over them. A
    program with a `custom_vjp` call in it (no forward mode in JAX) takes `_reverse_only`;
    with `forward_mode` (a call that a differentiating trace makes, which meets the rule at
    once), only where a differentiated argument reaches that call, so that forward mode in the
    others is JAX's, as for `f`. Elsewhere the custom_jvp would be wrong: under a `vmap`, outside
    a jit too, JAX batches a custom_jvp's rule as a forward-mode program, where a custom_vjp call
    raises.
    """
    backward_rules = has_backward_rules(original)
    if backward_rules and not forward_mode:
        return _reverse_only(original, rewritten)
    reverse = _reverse_only(original, rewritten) if backward_rules else None

    @jax.custom_jvp
    def run(orig_consts, *args):
        return eval_jaxpr(original.jaxpr, orig_consts, *args)

    def run_jvp(primals, tangents):
        _, *args = primals
        _, *t_args = tangents
        # Differentiated with respect to the arguments that have a tangent only: an argument
        # that is not differentiated (a symbolic zero) is held fixed, as JAX holds it, so its
        # lanes put nothing into the tangents (an instantiated zero tangent times an infinite
        # partial derivative would be NaN in a live lane: `w * sqrt(x)` at `x = 0`, forward mode
        # in `w`). The constants are not differentiated either: a custom_vjp call that reads a
        # constant would otherwise count as differentiated with respect to a closed-over value
        # (closed-over tracers are arguments: `_api._tracers_as_arguments`).
        moving = [i for i, t in enumerate(t_args) if not isinstance(t, NoTangent)]
        if reverse is not None and _reaches_backward_rule(original, moving):
            run_program: Callable = reverse
        else:
            program = rewritten()
            run_program = partial(eval_jaxpr, program.jaxpr, program.consts)

        def on_moving(*values):
            full = list(args)
            for i, value in zip(moving, values, strict=True):
                full[i] = value
            return run_program(*full)

        return jax.jvp(on_moving, tuple(args[i] for i in moving),
                       tuple(t_args[i] for i in moving))

    run.defjvp(run_jvp, symbolic_zeros=True)
    return functools.partial(run, list(original.consts))


def _has_backward_rule(eqn: JaxprEqn) -> bool:
    return rule_for(eqn.primitive).backward_param is not None


def has_backward_rules(closed: ClosedJaxpr) -> bool:
    """Whether `closed` calls a `custom_vjp` (at any depth): `values_of` then depends on
    `forward_mode`."""
    return any_equation(closed, _has_backward_rule)


def _reaches_backward_rule(closed: ClosedJaxpr, moving: Sequence[int]) -> bool:
    """Whether a value computed from the arguments `moving` reaches an equation with a
    `custom_vjp` call in it (at any depth), whose forward mode JAX refuses."""
    reached = {closed.jaxpr.invars[i] for i in moving}
    for eqn in closed.jaxpr.eqns:
        if not any(isinstance(v, Var) and v in reached for v in eqn.invars):
            continue
        if _has_backward_rule(eqn) or any(any_equation(sub, _has_backward_rule)
                                          for sub in sub_jaxprs(eqn)):
            return True
        reached.update(eqn.outvars)
    return False


def _reverse_only(original: ClosedJaxpr, rewritten: Callable[[], ClosedJaxpr]) -> Callable:
    """`values_of` for a program with a `custom_vjp` call in it, which has no forward mode: a
    custom_vjp, so that JAX never runs the rewritten program's forward mode (a custom_jvp's rule
    does, and under `vmap` JAX batches that forward mode, where a custom_vjp call raises:
    `grad(vmap(nan_safe(f)))`). The values are the original program's; the derivatives, the
    rewritten program's pullback, and its derivatives (`jax.hessian`) those of that pullback."""
    @jax.custom_vjp
    def run(*args):
        return eval_jaxpr(original.jaxpr, original.consts, *args)

    def run_fwd(*args):
        program = rewritten()
        return jax.vjp(partial(eval_jaxpr, program.jaxpr, program.consts), *args)

    def run_bwd(pullback, cotangents):
        return tuple(pullback(cotangents))

    run.defvjp(run_fwd, run_bwd)
    return run


def plan_program(closed: ClosedJaxpr, out_kinds: Sequence[Kind], sweeps: Sweeps,
                 finite_invars: Sequence[bool] | None = None,
                 bad_cotangents: Sequence[bool] | None = None, in_body: bool = False,
                 known_inputs: BodyFacts | None = None,
                 out_syms: Sequence[Sym] | None = None,
                 own_cotangents: Sequence[bool] | None = None) -> Plan:
    """The planning passes on a flattened program. `out_kinds`: the static liveness of its
    outputs (all LIVE at the top; MAYBE for a body the program around it drops in places).
    `finite_invars`: the arguments promised finite (None: none is). `bad_cotangents`: the
    outputs whose cotangent may be non-finite (None: none, as `jax.grad` seeds 1);
    `own_cotangents`: those whose cotangent may be non-finite only where their own value is
    (a loop's carry, `carried_cotangents`).
    `known_inputs`: what the program around a body knows of its arguments (`_rewrite`).
    `out_syms`: its outputs' formulas, where the program around a body knows them."""
    consts = _small_integer_constants(closed)
    exact, fixed = known_inputs or ({}, {})
    invars = closed.jaxpr.invars
    consts.update((invars[k], value) for k, value in exact.items())
    weights = {v: c for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)
               if readable_constant(c) and np.size(c) <= MAX_WEIGHT
               and jnp.issubdtype(dtype_of(v), np.floating)}
    masks = {v: c for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)
             if readable_constant(c) and np.size(c) <= MAX_WEIGHT
             and dtype_of(v) == np.bool_}
    sweep = sweeps.get(closed.jaxpr, out_kinds, False, consts, out_syms=out_syms,
                       known_inputs={invars[k]: held for k, held in fixed.items()},
                       weights=weights, masks=masks)
    report = Report(drops_of=functools.partial(drops_from, sweep))
    if finite_invars is None:
        finite_invars = [False] * len(closed.jaxpr.invars)
    seeds = nonfinite_seeds(closed, sweep, finite_invars)
    bounds = of_program(closed, sweep.producer)
    # what bodies receive, and what products multiply cotangents by: only asked for where a
    # row can judge its bodies' inputs, or a cotangent can meet a selection by value
    cotangents = needs_cotangents(closed, sweep)
    anywhere = nonfinite_anywhere(closed, seeds) if cotangents or any(
        rule_for(e.primitive).body_inputs is not None for e in closed.jaxpr.eqns) else set()
    bad: set = set()
    found: Cotangents | None = None
    if cotangents:
        outputs = bad_cotangents or [False] * len(closed.jaxpr.outvars)
        own_cotangents = own_cotangents or [False] * len(closed.jaxpr.outvars)
        found = nonfinite_cotangents(closed, sweep, anywhere, outputs, bounds,
                                     own_cotangents)
        bad = found.bad
        report.input_cotangents = tuple(v in bad for v in closed.jaxpr.invars)
        report.input_cotangents_own = tuple(v in found.own for v in closed.jaxpr.invars)
    nested = rewrite_nested_bodies(closed, sweep, report, sweeps, anywhere, bad)
    backward = guard_backward_rules(closed, sweep, report, anywhere, nested, in_body)
    nested.update(backward)
    sites = place_guards(closed, sweep, seeds, report, bounds)
    masked = plan_masked_bodies(closed, sweep, report, sweeps, anywhere, bad, set(backward))
    decisions = plan_decisions(closed, sweep, sites, masked, report, found, bounds)
    return Plan(closed, sweep, nested, sites, masked, decisions, report)


def _small_integer_constants(closed: ClosedJaxpr) -> dict:
    """The program's small integer and boolean constants (a `segment_sum`'s ids, `x.at[idx]`'s
    indices, a padding mask closed over), whose values the liveness rules may read: where such
    indices fall, and what a mask moved by them holds, is known when the rewrite is planned.
    Floats are left to the rules that read them elsewhere."""
    return {v: c for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)
            if readable_constant(c) and np.size(c) <= SMALL_CONSTANT
            and (jnp.issubdtype(dtype_of(v), np.integer) or dtype_of(v) == np.bool_)}


# --------------------------------------------------------------------------- nested bodies


def rewrite_nested_bodies(closed: ClosedJaxpr, sweep: Sweep, report: Report,
                          sweeps: Sweeps, nonfinite: Set, bad: Set) -> dict[int, dict]:
    """The nested-body pass: equation index -> its parameters with every body rewritten on its
    own (all its outputs live), for the equations whose bodies changed. Bodies nothing
    differentiates (read by comparisons only, say) are left as they are. `nonfinite`: the
    values that may hold NaN or inf in any lane; a body's inputs are judged by them
    (`PrimitiveRule.body_inputs`; without that rule, every input may). `bad`: the values
    whose cotangent may be non-finite (`_cotangents.py`)."""
    nested: dict[int, dict] = {}
    for i, eqn in enumerate(closed.jaxpr.eqns):
        rule = rule_for(eqn.primitive)
        names = rule.nested_params
        if not names or all(sweep.kind(o) == Kind.DEAD for o in eqn.outvars):
            continue
        new_params = dict(eqn.params)
        try:
            finite = _finite_body_inputs(eqn, nonfinite)
            cotangents = body_cotangents(eqn, bad, nonfinite)
            known = _known_body_inputs(eqn, closed, sweep)
            context = (rule.body_context(eqn.params) if rule.body_context is not None
                       else contextlib.nullcontext())
            with context:
                done: dict[int, tuple[ClosedJaxpr, Report]] = {}
                carried_cotangents(eqn, bad, sweeps, finite, known, done)
                for name in names:
                    new_params[name] = _rewrite_param(eqn, eqn.params[name], report, sweeps,
                                                      finite, cotangents, known, done)
        except Exception as e:
            note_failure(e, eqn, "nested-body")
            raise
        if any(new_params[n] is not eqn.params[n] for n in names):
            nested[i] = new_params
    return nested


def guard_backward_rules(closed: ClosedJaxpr, sweep: Sweep, report: Report, nonfinite: Set,
                         nested: dict[int, dict], in_body: bool = False) -> dict[int, dict]:
    """The backward-rule pass: equation index -> its parameters with the user's backward
    function wrapped by the structural-zero pass (`_backward.py`), for the custom_vjp calls
    whose body can make NaN or inf, or drops lanes of a value that may hold them: JAX calls
    that function when it transposes the program, which the guards of this one never reach (a
    rule that re-traces or differentiates its body meets the body's drops there)."""
    out: dict[int, dict] = {}
    for i, eqn in enumerate(closed.jaxpr.eqns):
        param = rule_for(eqn.primitive).backward_param
        if param is None or all(sweep.kind(o) == Kind.DEAD for o in eqn.outvars):
            continue
        bodies = sub_jaxprs(eqn)
        if not (_has_hazard(eqn, bodies, sweep.sweeps.hazardous_rules) or (
                any(isinstance(v, Var) and v in nonfinite for v in eqn.invars)
                and any(_contains_drop(sub) for sub in bodies))):
            continue
        params: dict[str, object] = {**eqn.params, **nested.get(i, {})}
        params[param] = guarded_backward(params[param], _rewrite_backward)
        forward = rule_for(eqn.primitive).forward_param
        if forward is not None:
            params[forward] = guarded_forward(
                params[forward], _rewritten_program if in_body else _rewritten_when_differentiated)
        out[i] = params
        report.backward_rules.append(eqn)
    return out


def rules_with_hazards(closed: ClosedJaxpr) -> dict[int, object]:
    """The calls with a backward rule, at any depth, whose body can make NaN or inf before dead
    code is removed, by their identity (`PrimitiveRule.identity_param`: `id` -> the object,
    kept alive): JAX's DCE removes a call's unread outputs from its body but not from its rule,
    which still differentiates them, on a zero cotangent (`f(x)[1]` of a rule whose `f(x)[0]`
    takes a `where`)."""
    found: dict[int, object] = {}
    stack = [closed]
    while stack:
        for eqn in stack.pop().jaxpr.eqns:
            bodies = sub_jaxprs(eqn)
            key = _identity(eqn)
            if key is not None and any(contains_hazard(sub) for sub in bodies):
                found[key] = eqn.params[rule_for(eqn.primitive).identity_param]
            stack.extend(bodies)
    return found


def _has_hazard(eqn: JaxprEqn, bodies: Sequence[ClosedJaxpr],
                hazardous: dict[int, object] | None) -> bool:
    """Whether a call's body could make NaN or inf before DCE: looked up in the top-level
    walk's answer (`rules_with_hazards`, which saw every depth), asked of the body where no
    such walk ran."""
    key = _identity(eqn)
    if hazardous is not None and key is not None:
        return key in hazardous
    return any(contains_hazard(sub) for sub in bodies)


def _identity(eqn: JaxprEqn) -> int | None:
    param = rule_for(eqn.primitive).identity_param
    return None if param is None else id(eqn.params[param])


def _contains_drop(closed: ClosedJaxpr) -> bool:
    """Whether a body drops lanes anywhere (a selection, a slice, a gather, `top_k`): what its
    derivative's transpose writes zeros for."""
    def drops(eqn: JaxprEqn) -> bool:
        rule = rule_for(eqn.primitive)
        return rule.selection is not None or rule.drops(eqn)
    return any_equation(closed, drops)


def _rewrite_backward(closed: ClosedJaxpr) -> Callable:
    """A backward rule's program as a function: its values, and the derivatives of its rewrite
    (reverse over reverse then drops the lanes its structural-zero guards drop). The values are
    the program's own: a rewrite may fuse differently in XLA, and a solver's step-size control
    turns a last bit into a different trajectory."""
    rewritten = rewrite_with_report(closed)[0]
    if rewritten is closed or any(isinstance(c, Tracer)
                                  for c in (*closed.consts, *rewritten.consts)):
        return partial(eval_jaxpr, rewritten.jaxpr, rewritten.consts)
    return values_of(closed, lambda: rewritten)


def _rewritten_when_differentiated(closed: ClosedJaxpr) -> Callable:
    """A custom_vjp's forward program: its values, and its rewrite's derivatives, rewritten only
    when a derivative of the derivative asks (a first derivative evaluates it, no more)."""
    return values_of(closed, functools.cache(lambda: rewrite_with_report(closed)[0]))


def _rewritten_program(closed: ClosedJaxpr) -> Callable:
    """A custom_vjp's forward program inside a body, as its rewrite, values included: JAX
    partially evaluates a differentiated body as a program, which replaces `values_of`'s
    custom_jvp by the original program it runs, so a derivative of the derivative (reverse over
    reverse) would differentiate the original. The guards change dropped lanes only (as on the
    replayed path, `_api`)."""
    rewritten = rewrite_with_report(closed)[0]
    return partial(eval_jaxpr, rewritten.jaxpr, rewritten.consts)


def _finite_body_inputs(eqn: JaxprEqn, nonfinite: Set) -> dict[int, list[bool]]:
    """id(body jaxpr) -> which of its inputs are finite in every lane, for the bodies of `eqn`
    its row knows how to judge (`PrimitiveRule.body_inputs`); the others are absent: every
    input may be non-finite."""
    rule = rule_for(eqn.primitive)
    if rule.body_inputs is None:
        return {}
    per_param = rule.body_inputs(eqn, [v in nonfinite if isinstance(v, Var)
                                       else is_nonfinite_literal(v) for v in eqn.invars])
    finite: dict[int, list[bool]] = {}
    for name, flags in per_param.items():
        value = eqn.params[name]
        for body in value if isinstance(value, tuple) else (value,):
            jaxpr = body.jaxpr if isinstance(body, ClosedJaxpr) else body
            finite[id(jaxpr)] = [not t for t in flags]
    return finite


BodyFacts = tuple[dict[int, Any], dict[int, Any]]
"""A body's inputs (by position) known whole, with their values; and those that carry no
derivative, with what they hold (`FreeValues.held`)."""


def _known_body_inputs(eqn: JaxprEqn, closed: ClosedJaxpr, sweep: Sweep
                       ) -> dict[int, BodyFacts]:
    """id(body jaxpr) -> what is known of its inputs from the program around it
    (`PrimitiveRule.body_operands`): a concrete constant of `closed` received whole (a 0/1
    mask closed over outside a `jax.checkpoint`) is known there; an operand that carries no
    derivative (a mask made from a predicate outside) carries none inside either, holding
    the same values."""
    rule = rule_for(eqn.primitive)
    if rule.body_operands is None:
        return {}
    values = {v: c for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)
              if readable_constant(c) and np.size(c) <= SMALL_CONSTANT}
    classes = sweep.carry_classes()
    known: dict[int, BodyFacts] = {}
    for name, operands in rule.body_operands(eqn).items():
        exact: dict[int, Any] = {}
        fixed: dict[int, Any] = {}
        for j, read in enumerate(operands):
            v = None if read is None else eqn.invars[read[0]]
            if not isinstance(v, Var) or not is_float(v):
                continue
            if read is not None and read[1] and v in values:
                exact[j] = values[v]
            if classes.get(v, Carry.NONE) == Carry.NONE:  # a constant: none
                fixed[j] = sweep.held(v)
        param = eqn.params[name]
        for body in param if isinstance(param, tuple) else (param,):
            known[id(body.jaxpr if isinstance(body, ClosedJaxpr) else body)] = (exact, fixed)
    return known


# a loop body is planned at most this many times for its carries' cotangents; past it, the
# conservative answer stands (`body_cotangents`: every carry may hand back a non-finite one)
MAX_CARRY_ROUNDS = 4


def carried_cotangents(eqn: JaxprEqn, bad: Set, sweeps: Sweeps,
                       finite: dict[int, list[bool]], known: dict[int, BodyFacts],
                       done: dict[int, tuple[ClosedJaxpr, Report]]) -> None:
    """A loop's bodies rewritten with what their outputs' cotangents may hold, into `done`
    (for `_rewrite_param`): a stacked or final output's is its result's (`bad`), a carry's
    also what the body itself makes of its carry input's cotangent, which the step before
    receives as that carry's output cotangent. A fixpoint over the body's own cotangent pass
    (`Report.input_cotangents`): `sqrt(maximum(t, 1e-6))` in a scan's body has a finite
    derivative, and its `maximum` is not re-decided for a cotangent that cannot be non-finite.
    A carry whose cotangent is non-finite only where its value is (`sqrt(maximum(c, 1e-6))`
    of a carry that may be NaN) hands back one that is non-finite only where the value the
    step before gave is. A body that has not settled in `MAX_CARRY_ROUNDS` is left out."""
    loop_links = rule_for(eqn.primitive).loop_links
    if loop_links is None:
        return
    bodies = {id(b.jaxpr): b for b in sub_jaxprs(eqn)}
    for links in loop_links(eqn):
        key = id(links.body)
        body = bodies.get(key)
        if not isinstance(body, ClosedJaxpr) or len(links.outputs) != len(links.body.outvars):
            continue
        loose = [isinstance(o, Var) and o in bad for o, _, _ in links.outputs]
        own = [False] * len(loose)
        # carry j: the body's output j comes back as its input k
        carries = [(j, links.body.invars.index(var)) for j, (_, var) in enumerate(links.loops)]
        for _ in range(MAX_CARRY_ROUNDS):
            new, sub = _rewrite(body, sweeps, finite.get(key), loose, in_body=True,
                                known_inputs=known.get(key), own_cotangents=own)
            grown = False
            for j, k in carries:
                if sub.input_cotangents is None or not sub.input_cotangents[k] or loose[j]:
                    continue
                own_only = sub.input_cotangents_own is not None and sub.input_cotangents_own[k]
                if not own_only:
                    loose[j], grown = True, True
                elif not own[j]:
                    own[j], grown = True, True
            if not grown:
                done[key] = (new, sub)
                break


def _rewrite_param(eqn: JaxprEqn, value: object, report: Report, sweeps: Sweeps,
                   finite: dict[int, list[bool]], cotangents: dict[int, list[bool]],
                   known: dict[int, BodyFacts],
                   done: dict[int, tuple[ClosedJaxpr, Report]] | None = None) -> object:
    """One body parameter, rewritten: a ClosedJaxpr, a tuple of them (branches), or an open
    Jaxpr (remat's, which can take no constants). `finite`: see `_finite_body_inputs`;
    `cotangents`: see `_cotangents.body_cotangents`; `known`: see `_known_body_inputs`;
    `done`: bodies already rewritten with these (`carried_cotangents`)."""
    if isinstance(value, tuple):
        return tuple(_rewrite_param(eqn, branch, report, sweeps, finite, cotangents, known,
                                    done)
                     for branch in value)
    if isinstance(value, Jaxpr):
        with all_staged():  # no mask as a constant (`_masks.at_trace_time`)
            new, sub = _rewrite(ClosedJaxpr(value, ()), sweeps, finite.get(id(value)),
                                cotangents.get(id(value)), in_body=True,
                                known_inputs=known.get(id(value)))
        if sub.changed and new.consts:
            report.skipped.append((eqn, "unchanged: its rewritten body needs constants"))
            return value
        _record_nested(eqn, ClosedJaxpr(value, ()), new, sub, report)
        return new.jaxpr
    assert isinstance(value, ClosedJaxpr), (eqn.primitive, type(value))
    key = id(value.jaxpr)
    new, sub = done[key] if done and key in done else _rewrite(
        value, sweeps, finite.get(key), cotangents.get(key), in_body=True,
        known_inputs=known.get(key))
    _record_nested(eqn, value, new, sub, report)
    return new


def _record_nested(eqn: JaxprEqn, old: ClosedJaxpr, new: ClosedJaxpr, sub: Report,
                   report: Report) -> None:
    if not sub.changed:
        return
    assert_same_signature(eqn, old, new)
    report.nested.append((eqn, sub))


def assert_same_signature(eqn: JaxprEqn, old: ClosedJaxpr, new: ClosedJaxpr) -> None:
    """A rewritten body must take and return what the original did: the equation around it
    (its in_shardings, donations, carries) is kept as it is."""
    def signature(c: ClosedJaxpr) -> tuple:
        return ([(shape_of(v), dtype_of(v)) for v in c.jaxpr.invars],
                [(shape_of(v), dtype_of(v)) for v in c.jaxpr.outvars])
    assert signature(old) == signature(new), (
        f"jaxsafe: the rewritten body of {eqn.primitive} at {source_summary(eqn)} changed its "
        f"signature: {signature(old)} -> {signature(new)}")


# --------------------------------------------------------------------------- masked bodies


def plan_masked_bodies(closed: ClosedJaxpr, sweep: Sweep, report: Report,
                       sweeps: Sweeps, nonfinite: Set, bad: Set,
                       backward: Set[int] = frozenset()) -> dict[int, list]:
    """The masked-body pass: equation index -> the plans of its bodies, for the equations with
    a body (`PrimitiveRule.masked_body`) whose outputs the program drops in places.
    `nonfinite`, `bad`: as for `rewrite_nested_bodies`. `backward`: the calls whose backward
    rule the backward-rule pass guards; a call with a backward rule is planned only then (its
    output masks seed the rule's structural zeros, `_backward.SeededBackward`)."""
    finite: dict[int, list[bool]] = {}
    cotangents: dict[int, list[bool]] = {}
    known: dict[int, BodyFacts] = {}
    outside: list[Sym | None] | None = None

    unchanged: list[Report] = []  # what a body that guards nothing left, for the diagnostics

    def plan_body(body: ClosedJaxpr, out_kinds: list[Kind]) -> Plan | None:
        out_syms = None if outside is None else [
            sym if sym is not None and kind_of_sym(sym) == kind else sym_of_kind(kind)
            for sym, kind in zip(outside, out_kinds, strict=True)]
        plan = plan_program(flatten(body), out_kinds, sweeps, finite.get(id(body.jaxpr)),
                            cotangents.get(id(body.jaxpr)), in_body=True,
                            known_inputs=known.get(id(body.jaxpr)), out_syms=out_syms)
        if plan.report.changed:
            return plan
        if plan.report.skipped:
            unchanged.append(plan.report)
        return None

    masked: dict[int, list] = {}
    for i, eqn in enumerate(closed.jaxpr.eqns):
        rule = rule_for(eqn.primitive)
        handler = rule.masked_body
        if handler is None or eqn.effects or (rule.backward_param is not None
                                              and i not in backward):
            continue
        out_kinds = [sweep.kind(o) for o in eqn.outvars]
        if not any(k == Kind.MAYBE and is_float(o)
                   for k, o in zip(out_kinds, eqn.outvars, strict=True)):
            continue
        unchanged.clear()
        try:
            finite = _finite_body_inputs(eqn, nonfinite)
            cotangents = body_cotangents(eqn, bad, nonfinite)
            known = _known_body_inputs(eqn, closed, sweep)
            # a row that a `where` drops after a checkpoint is a row inside it: a matmul's
            # operand there is guarded without a run-time reduction (the mask runs along rows)
            outside = handler.outside_syms(eqn, [sweep.sym(o) for o in eqn.outvars])
            plans = handler.plan(eqn, out_kinds, plan_body)
        except Exception as e:
            note_failure(e, eqn, "masked-body")
            raise
        if plans is not None:
            masked[i] = plans
            report.nested.extend((eqn, p.report) for p in plans if p is not None)
        # a body left as it is still says what it left unguarded (`explain`)
        report.nested.extend((eqn, r) for r in unchanged)
    return masked

