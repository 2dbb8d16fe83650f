"""`diagnose`: is each NaN of a gradient a leak that nan_safe fixes, or a real singularity?

The gradient of `fun` and of `nan_safe(fun)` are computed at the given point. Every non-finite
entry of the plain gradient is then a *leak* (finite under nan_safe: a dropped lane's zero
cotangent met an infinite derivative) or *genuine* (still non-finite: the branch that is taken
is singular there).

Where each one comes from is found by running the gradient's program equation by equation on
the values (as `jax_debug_nans` does, without stopping): an *origin* is an equation that makes
inf or NaN from finite operands. An entry is attributed to the origins whose replacement (by 1,
inside every domain) makes it finite; the origin's source line names the user's primitive
there (`sqrt`, or "the derivative of `sqrt`" when the origin is its derivative). Leaks are
looked for in `fun`'s own gradient and named with the guards `explain` reports at the same
lines; genuine singularities in nan_safe's gradient, where no leak is left to hide them. The
forward pass is run the same way: a NaN it computes only in lanes that are dropped (replacing
it changes no output) is listed as *masked*, harmless.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._compat import ClosedJaxpr, JaxprEqn, Literal, Tracer, bind_eqn, user_frame
from ._explain import Guard, Location, explain, location_of
from ._flatten import flatten
from ._report import Report
from ._rules import guard_for

MAX_ORIGINS = 16
"""Origins tried one by one to attribute entries (each try runs the program again)."""
MAX_ENTRIES = 8
"""Entries named per finding in the text (all are in `Finding.entries`)."""


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where an inf or NaN is first made from finite values: the user's primitive at that line
    and whether it is that primitive's value or its derivative."""

    primitive: str
    location: Location | None
    derivative: bool

    def __str__(self) -> str:
        what = f"the derivative of {self.primitive}" if self.derivative else self.primitive
        return f"{what} at {self.location}" if self.location else what


@dataclasses.dataclass(frozen=True)
class Finding:
    """Entries of one argument's gradient (or one forward value) with the same verdict and
    the same origins. `kind`: "leak", "genuine", "left" or "masked"."""

    kind: str
    argument: str
    entries: tuple[tuple[int, ...], ...]
    values: tuple[float | complex, ...]
    origins: tuple[Origin, ...]
    guards: tuple[Guard, ...] = ()


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What `diagnose` found: `leaks` (nan_safe fixes them), `genuine` (real singularities),
    `masked` (NaN the forward pass computes only in dropped lanes) and `left` (non-finite under
    nan_safe from inf or NaN held only in dropped lanes: a path it does not guard).

    Example:

        found = jaxsafe.diagnose(f)(x)
        [(leak.entries, leak.origins[0].location) for leak in found.leaks]
    """

    leaks: tuple[Finding, ...]
    genuine: tuple[Finding, ...]
    masked: tuple[Finding, ...]
    left: tuple[Finding, ...] = ()
    """Still non-finite under nan_safe, from inf or NaN that an argument or a constant holds
    only in lanes the program drops: a path jaxsafe does not guard (not a singularity)."""
    plain_error: str | None = None
    """What plain `jax.grad` raised, where it did not run (a library's check that stops on a
    non-finite value, as equinox's in a diffrax solve, met the leak's NaN): no leak is listed
    then, and `genuine`/`left` describe nan_safe's gradient alone."""

    def __str__(self) -> str:
        return format_diagnosis(self)


# --------------------------------------------------------------------------- running


def _nonfinite(value: Any) -> np.ndarray | None:
    """Where a float value is inf or NaN; None for any other value (an integer, a PRNG key,
    which no NumPy array holds)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        dtype = np.result_type(value)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return None
    return ~np.isfinite(np.asarray(value))


def _inputs(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    """The values of the program's inputs: its constants, then its arguments (an input's
    origin index is `-1 - position` in this list)."""
    return [*closed.consts, *args]


def _held(closed: ClosedJaxpr, args: Sequence[Any]) -> dict[int, np.ndarray]:
    """The inputs that hold inf or NaN (origins that no equation makes), by origin index."""
    found = {}
    for j, value in enumerate(_inputs(closed, args)):
        bad = _nonfinite(value)
        if bad is not None and bad.any():
            found[-1 - j] = bad
    return found


def _run(closed: ClosedJaxpr, args: Sequence[Any], replaced: int | Collection[int] = (),
         value: float = 1.0) -> tuple[list[Any], dict[int, np.ndarray]]:
    """The outputs of `closed` on `args`, equation by equation, and its origins (equations
    making inf or NaN from finite operands), each with the non-finite lanes of its first
    output. `replaced`: equations whose non-finite outputs are replaced by `value` (negative:
    an input's non-finite lanes, `_held`)."""
    replaced = {replaced} if isinstance(replaced, int) else set(replaced)
    values = _inputs(closed, args)
    for o in replaced:
        if o < 0:
            held = np.asarray(values[-1 - o])
            values[-1 - o] = np.where(~np.isfinite(held), np.full((), value, held.dtype), held)
    env: dict = dict(zip([*closed.jaxpr.constvars, *closed.jaxpr.invars], values, strict=True))
    origins: dict[int, np.ndarray] = {}
    for i, eqn in enumerate(closed.jaxpr.eqns):
        invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
        outs = bind_eqn(eqn, invals)
        bad = [_nonfinite(o) for o in outs]
        if any(b is not None and b.any() for b in bad):
            if all(not (m := _nonfinite(v)) is not None or not m.any() for v in invals):
                origins[i] = bad[0] if bad[0] is not None else np.zeros((), bool)
            if i in replaced:
                outs = [o if b is None else np.where(b, np.full((), value, np.asarray(o).dtype), o)
                        for o, b in zip(outs, bad, strict=True)]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [v.val if isinstance(v, Literal) else env[v] for v in closed.jaxpr.outvars], origins


def _fixed_by(closed: ClosedJaxpr, args: Sequence[Any], origin: int | Collection[int]
              ) -> list[np.ndarray]:
    """Per output, the lanes that are finite once `origin`'s inf and NaN are replaced."""
    outs, _ = _run(closed, args, replaced=origin)
    return [np.zeros(np.shape(o), bool) if (m := _nonfinite(o)) is None else ~m for o in outs]


def _input_origin(closed: ClosedJaxpr, index: int, names: Sequence[str]) -> Origin:
    """An input that holds inf or NaN, named: an argument, or a closed-over constant."""
    j = -1 - index
    n_consts = len(closed.consts)
    what = (f"inf or NaN held by a closed-over constant of shape {np.shape(closed.consts[j])}"
            if j < n_consts else f"inf or NaN held by {_leaf_name(names, j - n_consts)}")
    return Origin(what, None, False)


def _leaf_name(names: Sequence[str], k: int) -> str:
    return names[k] if k < len(names) else f"argument leaf {k}"


def _origin(eqn: JaxprEqn, forward: ClosedJaxpr) -> Origin:
    """Name an origin by the user's primitive at its line: the equation of the forward
    program with the same frame (a NaN-prone one first)."""
    location = location_of(eqn)
    frame = user_frame(eqn.source_info.traceback)
    same = [e for e in forward.jaxpr.eqns
            if frame is not None and user_frame(e.source_info.traceback) == frame]
    same.sort(key=lambda e: guard_for(e) is None)
    if not same:
        return Origin(eqn.primitive.name, location, False)
    user = same[0]
    itself = user.primitive == eqn.primitive and user.params == eqn.params and [
        repr(v.val) if isinstance(v, Literal) else None for v in user.invars] == [
        repr(v.val) if isinstance(v, Literal) else None for v in eqn.invars]
    return Origin(user.primitive.name, location, not itself)


def _attribute(closed: ClosedJaxpr, args: Sequence[Any], origins: Iterable[int]
               ) -> dict[int, list[np.ndarray]]:
    """origin -> per output, the lanes that replacing it alone makes finite (one run of the
    program per origin, for every output at once)."""
    return {o: _fixed_by(closed, args, o) for o in list(origins)[:MAX_ORIGINS]}


# --------------------------------------------------------------------------- the verdicts


def _group(kind: str, argument: str, lanes: np.ndarray, values: np.ndarray,
           fixes: dict[int, np.ndarray], name: Callable[[int], Origin],
           guards_at: Callable[[Origin], tuple[Guard, ...]]) -> list[Finding]:
    """One finding per set of origins, over the entries of `lanes`."""
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for index in _indices(lanes):
        which = tuple(o for o, fixed in fixes.items() if fixed[index]) or tuple(fixes)
        groups.setdefault(which, []).append(index)
    found = []
    for which, entries in groups.items():
        origins = tuple(dict.fromkeys(name(o) for o in which))
        guards = tuple(dict.fromkeys(g for origin in origins for g in guards_at(origin)))
        scalar = complex if np.iscomplexobj(values) else float  # a complex gradient's entries
        found.append(Finding(kind, argument, tuple(entries),
                             tuple(scalar(values[e]) for e in entries), origins, guards))
    return found


def diagnose(fun: Callable, argnums: int | Sequence[int] = 0, *,
             static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
             finite_args: Any = False) -> Callable[..., Diagnosis]:
    """`diagnose(f)(*args)`: classify every non-finite entry of `jax.grad(f, argnums)` at
    `args` as a leak (nan_safe fixes it; the guard and the drop are named) or genuine (a real
    singularity; the primitive whose derivative made it is named), and list NaN the forward pass
    computes only in dropped lanes. `f` must return a scalar, as for `jax.grad`.

    Example:

        print(jaxsafe.diagnose(lambda x: jnp.sum(jnp.where(x > 0, jnp.log(x), 0.)))(jnp.zeros(2)))
        # leak: argument 0 entries [0], [1]: non-finite in jax.grad, finite under nan_safe ...
    """
    if not callable(fun):
        raise TypeError(f"diagnose: `fun` must be callable, got {type(fun).__name__}: {fun!r}.")
    if isinstance(argnums, bool) or not (isinstance(argnums, int) or (
            isinstance(argnums, Sequence) and not isinstance(argnums, str)
            and all(isinstance(n, int) and not isinstance(n, bool) for n in argnums))):
        raise TypeError(f"diagnose: `argnums` must be an int or a sequence of ints (positions of "
                        f"the arguments whose gradient is diagnosed), got {argnums!r}.")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    statics = {static_argnums} if isinstance(static_argnums, int) else set(static_argnums)

    def run(*args, **kwargs) -> Diagnosis:
        if any(isinstance(x, Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
            raise TypeError("diagnose: it runs the gradient on values; call it outside jit, "
                            "vmap and grad, on concrete arguments.")
        bad = [n for n in nums if n in statics or not 0 <= n < len(args)]
        if bad:
            raise ValueError(f"diagnose: argnums {bad} must name positional arguments that are "
                             f"not static (there are {len(args)}).")
        call = _Call(fun, nums, statics, args, kwargs)
        report = explain(fun, static_argnums=static_argnums, static_argnames=static_argnames,
                         finite_args=finite_args)(*args, **kwargs)
        # jit=False: the rewritten program runs equation by equation, and its derivative's
        # equations keep the user's source lines (under the jit front JAX's linearization of
        # the custom_jvp call gives them its own, which names no user line)
        from ._api import NanSafeFunction
        safe = NanSafeFunction(fun, static_argnums, static_argnames, False, 0, finite_args)
        return call.diagnosis(safe, report)
    return run


class _Call:
    """One call of `diagnose`: the function with its static arguments bound, its programs."""

    def __init__(self, fun: Callable, nums: tuple[int, ...], statics: set, args: tuple,
                 kwargs: dict):
        self.fun, self.args, self.kwargs = fun, args, kwargs
        self.dynamic = [i for i in range(len(args)) if i not in statics]
        self.grad_nums = tuple(self.dynamic.index(n) for n in nums)
        self.dyn_args = [args[i] for i in self.dynamic]
        self.leaves = jax.tree_util.tree_leaves(self.dyn_args)
        self.names = [f"argument {num}{jax.tree_util.keystr(path)}" for num in nums
                      for path, _ in jax.tree_util.tree_flatten_with_path(args[num])[0]]

    def bind(self, f: Callable) -> Callable:
        def call(*dyn):
            full = list(self.args)
            for i, d in zip(self.dynamic, dyn, strict=True):
                full[i] = d
            return f(*full, **self.kwargs)
        return call

    def program(self, f: Callable) -> ClosedJaxpr:
        return flatten(jax.make_jaxpr(f)(*self.dyn_args))

    def gradient_program(self, f: Callable) -> ClosedJaxpr:
        try:
            return self.program(jax.grad(self.bind(f), self.grad_nums))
        except TypeError as e:
            if "scalar" in str(e):
                raise TypeError(f"diagnose: `fun` must return a scalar, as for jax.grad ({e})"
                                ) from None
            raise

    def diagnosis(self, safe: Callable, report: Report) -> Diagnosis:
        plain_program = self.gradient_program(self.fun)
        safe_program = self.gradient_program(safe)
        forward = self.program(self.bind(self.fun))

        def guards_at(origin: Origin) -> tuple[Guard, ...]:
            at = origin.location
            return tuple(g for g in report.guards if at is not None and g.location is not None
                         and (g.location.file, g.location.line, g.location.column)
                         == (at.file, at.line, at.column))

        safe_outs, safe_origins = _run(safe_program, self.leaves)
        plain_error = None
        try:
            plain_outs, plain_origins = _run(plain_program, self.leaves)
        except Exception as e:  # the user's program stopped on a value (a library's check)
            lines = str(e).strip().splitlines()
            plain_error = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
            plain_outs, plain_origins = safe_outs, safe_origins  # classify nan_safe's alone
        names = (self.names if len(self.names) == len(plain_outs)
                 else [f"gradient leaf {k}" for k in range(len(plain_outs))])
        leaves = [f"argument leaf {k}" for k in range(len(self.leaves))]
        plain_name = self.namer(plain_program, forward, leaves)
        safe_name = self.namer(safe_program, forward, leaves)
        dropped = _dropped_inputs(safe_program, forward, self.leaves)
        leaks: list[Finding] = []
        genuine: list[Finding] = []
        left: list[Finding] = []
        plain_fixes = safe_fixes = None  # each program re-run once per origin, when needed
        all_dropped: list[np.ndarray] | None = None
        for k, (p, s) in enumerate(zip(plain_outs, safe_outs, strict=True)):
            p_bad, s_bad = _nonfinite(p), _nonfinite(s)
            if p_bad is None or s_bad is None or not p_bad.any():
                continue
            if (p_bad & ~s_bad).any():
                if plain_fixes is None:
                    plain_fixes = _attribute(plain_program, self.leaves,
                                             {**plain_origins, **_held(plain_program,
                                                                       self.leaves)})
                leaks += _group("leak", names[k], p_bad & ~s_bad, np.asarray(p),
                                {o: f[k] for o, f in plain_fixes.items()}, plain_name,
                                guards_at)
            if s_bad.any():
                if safe_fixes is None:
                    safe_fixes = _attribute(safe_program, self.leaves,
                                            {**safe_origins, **_held(safe_program, self.leaves)})
                fixes = {o: f[k] for o, f in safe_fixes.items()}
                # an entry that only inf or NaN held in dropped lanes makes (all of them
                # replaced at once: two such inputs may meet in it) is not a singularity of the
                # branch that is taken: a path jaxsafe did not guard
                if all_dropped is None:
                    all_dropped = _fixed_by(safe_program, self.leaves, dropped) if dropped \
                        else [np.zeros(np.shape(o), bool) for o in safe_outs]
                by_drops = s_bad & all_dropped[k]
                left += _group("left", names[k], by_drops, np.asarray(s),
                               {o: by_drops for o in sorted(dropped, reverse=True)},
                               safe_name, lambda o: ())
                genuine += _group("genuine", names[k], s_bad & ~by_drops, np.asarray(s),
                                  fixes, safe_name, lambda o: ())
        return Diagnosis(tuple(leaks), tuple(genuine), _masked(forward, self.leaves),
                         tuple(left), plain_error)

    @staticmethod
    def namer(program: ClosedJaxpr, forward: ClosedJaxpr, leaves: Sequence[str]
              ) -> Callable[[int], Origin]:
        def name(o: int) -> Origin:
            if o < 0:
                return _input_origin(program, o, leaves)
            return _origin(program.jaxpr.eqns[o], forward)
        return name


PROBES = (0.0, 1.0, -1.0)
"""The finite values an input's inf and NaN are replaced by to show that its lanes are dropped
(each must leave every output as it was: one value can saturate, `exp(-1e3 * x * x)` at 1)."""


def _dropped_inputs(program: ClosedJaxpr, forward: ClosedJaxpr, args: Sequence[Any]
                    ) -> set[int]:
    """The inputs of `program` (origin indices) that hold inf or NaN only in lanes the forward
    program drops: replacing them there by any of `PROBES` changes none of its outputs, which
    are finite (a non-finite output may hide a live lane: NaN whatever it holds)."""
    outs, _ = _run(forward, args)
    if any((m := _nonfinite(o)) is not None and m.any() for o in outs):
        return set()
    found = set()
    for o in list(_held(program, args))[:MAX_ORIGINS]:
        at = _same_input(program, forward, -1 - o)
        if at is not None and all(
                all(_same_bits(a, b) for a, b in zip(
                    outs, _run(forward, args, -1 - at, probe)[0], strict=True))
                for probe in PROBES):
            found.add(o)
    return found


def _same_input(program: ClosedJaxpr, forward: ClosedJaxpr, j: int) -> int | None:
    """The position in `forward`'s inputs (constants, then arguments) of `program`'s input j:
    the same argument, or a constant with the same value."""
    n, m = len(program.consts), len(forward.consts)
    if j >= n:
        return m + (j - n)
    value = program.consts[j]
    for i, c in enumerate(forward.consts):
        if c is value or (np.shape(c) == np.shape(value)
                          and np.asarray(c).dtype == np.asarray(value).dtype
                          and np.array_equal(np.asarray(c), np.asarray(value), equal_nan=True)):
            return i
    return None


def _same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _indices(lanes: np.ndarray) -> list[tuple[int, ...]]:
    """The indices of the true lanes (`()` for a true scalar)."""
    return [tuple(int(i) for i in index) for index in np.argwhere(lanes)]


def _masked(forward: ClosedJaxpr, leaves: list) -> tuple[Finding, ...]:
    """The forward pass's origins whose inf and NaN no output sees. None where an output is
    itself non-finite: another origin may then hide a live one's NaN."""
    outs, origins = _run(forward, leaves)
    before = [m for o in outs if (m := _nonfinite(o)) is not None]
    if any(m.any() for m in before):
        return ()
    found = []
    for o in list(origins)[:MAX_ORIGINS]:
        after, _ = _run(forward, leaves, replaced=o)
        now = [m for a in after if (m := _nonfinite(a)) is not None]
        if all(np.array_equal(b, a) for b, a in zip(before, now, strict=True)):
            eqn = forward.jaxpr.eqns[o]
            found.append(Finding("masked", eqn.primitive.name, tuple(_indices(origins[o])), (),
                                 (_origin(eqn, forward),)))
    return tuple(found)


# --------------------------------------------------------------------------- the text


def _entries(finding: Finding) -> str:
    """'argument 0 entries [1], [3]', or 'argument 0' for a scalar."""
    if finding.entries == ((),):
        return finding.argument
    shown = ", ".join(f"{list(e)}" for e in finding.entries[:MAX_ENTRIES])
    more = len(finding.entries) - MAX_ENTRIES
    return f"{finding.argument} entries {shown}" + (f" and {more} more" if more > 0 else "")


def format_diagnosis(diagnosis: Diagnosis) -> str:
    lines: list[str] = []
    if diagnosis.plain_error is not None:
        lines.append(f"jax.grad raised, and nan_safe's gradient ran: {diagnosis.plain_error} "
                     f"(a check in the program may have stopped on a leak's NaN; what follows "
                     f"is nan_safe's gradient alone)")
    for f in diagnosis.leaks:
        lines.append(f"leak: {_entries(f)}: non-finite in jax.grad, "
                     f"finite under nan_safe")
        for origin in f.origins:
            drops = [d for g in f.guards if g.location == origin.location for d in g.drops]
            fed = (f", fed a zero cotangent by the {drops[0].primitive} at {drops[0].location} "
                   f"that dropped the lane" if drops else "")
            lines.append(f"  NaN from {origin}{fed}: nan_safe fixes it, or guard the input by "
                         f"hand (the double where)")
    for f in diagnosis.genuine:
        lines.append(f"genuine: {_entries(f)}: non-finite under nan_safe "
                     f"too (a singularity of the branch that is taken)")
        lines += [f"  from {origin}" for origin in f.origins]
    for f in diagnosis.left:
        lines.append(f"left: {_entries(f)}: non-finite under nan_safe too, but not a "
                     f"singularity of the branch that is taken")
        lines += [f"  from {origin}, only in lanes the program drops, along a path nan_safe "
                  f"does not guard (how-it-works, Limitations): replace those lanes by a safe "
                  f"value before they are used (the double where)" for origin in f.origins]
    for f in diagnosis.masked:
        lines += [f"masked: {origin} computes inf or NaN only in lanes that are dropped "
                  f"(harmless)" for origin in f.origins]
    return "\n".join(lines) if lines else "the gradient is finite: nothing to diagnose"
