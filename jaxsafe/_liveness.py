"""The liveness pass: which lanes of each intermediate value can reach an output.

A lane (element) of a value is *live* when a change to it can change an output or an output's
derivative; otherwise it is *dropped*. Dropped lanes come from selections: the unselected side of
`select_n`, the losing operand of `max`/`min`/`clamp`, lanes that `slice`, `dynamic_slice`,
`gather` or `pad` leave out, and everything that feeds only such lanes.

Predicates are data, so liveness is a boolean *mask* computed at run time, walking the program
backward from its outputs (which are live), with the rules of the primitive table (`_rules.py`,
`_liveness_rules.py`). Before anything runs, the same walk gives each value a static formula over
the program's predicates (`_symbolic.py`) and its summary `Kind`: LIVE (no mask needed), MAYBE (a
run-time mask) or DEAD (no lane reaches an output), so masks are only built on the paths where
selections happen.

Only *differentiable edges* carry liveness: a comparison, a predicate, an index or a
zero-derivative primitive (`floor`, `stop_gradient`, ...) reads the original value and passes no
tangent, so it never makes a lane live (`jnp.where(jnp.isnan(y), 0., y)` drops the NaN lanes of
`y`). The rewrite makes every such use read the original, unguarded value, so a guard can never
flip a decision.

In *structural* mode (used inside `custom_jvp`/`custom_vjp`, checkpoints and cond branches, which
run again as one unit) value-based selections are treated as elementwise: only lanes that the
primal provably never reads are dropped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Container, Generator, Mapping, Sequence
from typing import Any

import numpy as np

from ._atoms import MAX_WEIGHT, dtype_of, is_float, literal_value, shape_of
from ._bounds import Bounds, never_loses
from ._carries import Carry, carry_classes, carrying_lanes
from ._compat import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    bind_eqn,
    varies_over_manual_axes,
)
from ._constants import small_constant
from ._free import FreeValues
from ._masks import (
    TOO_LARGE,
    any_of,
    at_trace_time,
    broadcast,
    emitted,
    reduce_any,
    register_broadcast,
    scoped_memo,
    staged,
    zeros,
)
from ._report import note_failure
from ._rules import Kind, Mask, alignment, may_drop, rule_for
from ._symbolic import (
    FALSE,
    TRUE,
    Connective,
    Lit,
    Sym,
    foreign_keys_unknown,
    opaque,
    predicate_literal,
    sym_or,
)
from ._walk import demand


def differentiable_operands(eqn: JaxprEqn, structural: bool = False) -> list[bool]:
    """Which operands of `eqn` pass a tangent to a floating-point output.

    In structural mode every read counts, comparisons and indices included: a body that is
    re-run on guarded operands (a cond branch, a checkpoint, a custom rule's primal) decides on
    what it reads, so nothing it reads may change under it.
    """
    if structural:
        return [isinstance(v, Var) for v in eqn.invars]
    if not any(is_float(v) for v in eqn.outvars):
        return [False] * len(eqn.invars)
    if rule_for(eqn.primitive).zero_derivative:
        return [False] * len(eqn.invars)
    return [not isinstance(v, Literal) and is_float(v) for v in eqn.invars]


# --------------------------------------------------------------------------- one equation


def operand_kinds(eqn: JaxprEqn, out_kinds: Sequence[Kind], ctx: Any) -> list[Kind]:
    """Static liveness each operand receives from `eqn`, given its outputs' kinds."""
    n = len(eqn.invars)
    if all(k == Kind.DEAD for k in out_kinds):
        return [Kind.DEAD] * n
    rule = rule_for(eqn.primitive)
    if rule.masks is None:
        return [Kind.LIVE] * n
    if rule.kinds is not None:
        return list(rule.kinds(eqn, list(out_kinds), ctx))
    all_live = all(k == Kind.LIVE for k in out_kinds)
    return [Kind.LIVE if all_live and not may_drop(eqn, ctx.structural) else Kind.MAYBE] * n


def operand_masks(eqn: JaxprEqn, out_masks: Sequence[Mask], invals: Sequence[Any],
                  ctx: Any) -> list[Mask]:
    """Run-time liveness each operand receives from `eqn`."""
    rule = rule_for(eqn.primitive)
    if rule.masks is None:  # the conservative default: live where any output lane is
        if all(m is None for m in out_masks):
            return [None] * len(eqn.invars)
        live = any_of([reduce_any(m, range(m.ndim)) for m in out_masks])
        return [None if live is None else broadcast(live, shape_of(v)) for v in eqn.invars]
    return rule.masks(eqn, list(out_masks), invals, ctx)


def operand_syms(eqn: JaxprEqn, out_syms: Sequence[Sym], ctx: Any) -> list[Sym]:
    """Symbolic liveness of each operand: the row's static rule, else from the kinds."""
    if all(not m for m in out_syms):
        return [FALSE] * len(eqn.invars)
    rule = rule_for(eqn.primitive)
    if rule.static is not None:
        syms = rule.static(eqn, out_syms, ctx)
        if syms is not None:
            return syms
    kinds = operand_kinds(eqn, [kind_of_sym(m) for m in out_syms], ctx)
    reads = all(m == TRUE for m in out_syms)  # what is unknown is only which lanes it reads
    return [sym_of_kind(k, reads) for k in kinds]


def sym_of_kind(kind: Kind, reads: bool = False) -> Sym:
    return TRUE if kind == Kind.LIVE else FALSE if kind == Kind.DEAD else opaque(reads)


def kind_of_sym(sym: Sym) -> Kind:
    if frozenset() in sym:
        return Kind.LIVE
    return Kind.MAYBE if sym else Kind.DEAD


# --------------------------------------------------------------------------- values


def _lookup(env: Any, atom: Any) -> Any:
    return literal_value(atom) if isinstance(atom, Literal) else env[atom]


def read(env: Any, atom: Any) -> Any:
    if isinstance(atom, Literal):
        return literal_value(atom)
    with staged():  # an original value is the program's, whatever the masks' region
        return env[atom]


class Values:
    """The original value of every variable of a jaxpr, each computed (emitted on the current
    trace) when first read: a mask rule of a nested call reads its predicates, and an input it
    never reads is never asked for (`_hoisted.py` reads a loop body's step this way, where
    reading a carry is an error). `args` may be lazy (`LazyOperands`)."""

    def __init__(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]):
        self.memo: dict = dict(zip(jaxpr.constvars, consts, strict=True))
        self.inputs = {v: k for k, v in enumerate(jaxpr.invars)}
        self.args = args
        self.producer = {o: (e, j) for e in jaxpr.eqns for j, o in enumerate(e.outvars)}

    def __getitem__(self, v: Any) -> Any:
        return demand(v, self.memo, self._rule)

    def _rule(self, v: Any) -> Generator[Any, Any, Any]:
        if v in self.inputs:
            return self.args[self.inputs[v]]
        eqn, j = self.producer[v]
        vals = []
        for u in eqn.invars:
            vals.append(literal_value(u) if isinstance(u, Literal) else (yield u))
        with staged():
            outs = bind_eqn(eqn, vals)
        for o, value in zip(eqn.outvars, outs, strict=True):
            self.memo.setdefault(o, value)
        return outs[j]


class LazyOperands(Sequence):
    """An equation's operands from `env`, each read only if a rule asks for it (reading an
    original value may compute it)."""

    def __init__(self, env: Any, atoms: Sequence[Any]):
        self.env, self.atoms = env, atoms

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):  # lazy too: a cond's operands past its index
            part = copy.copy(self)
            part.atoms = self.atoms[k]
            return part
        return self._read(self.atoms[k])

    def __len__(self) -> int:
        return len(self.atoms)

    def _read(self, atom: Any) -> Any:
        return read(self.env, atom)


class KnownOperands(LazyOperands):
    """`LazyOperands` that gives an integer operand the program computes from literals and its
    constants (a gather's indices held in a constant array) as its value, so that a mask rule
    reading it runs at trace time (`_masks.at_trace_time`) and XLA is handed a constant mask,
    or none: integers only, whose value is exact however it is computed."""

    def __init__(self, env: Any, atoms: Sequence[Any], constant: Callable[[Any], Any]):
        super().__init__(env, atoms)
        self.constant = constant

    def _read(self, atom: Any) -> Any:
        if np.issubdtype(np.dtype(dtype_of(atom)), np.integer):
            value = self.constant(atom)
            if value is not None:
                return value
        return read(self.env, atom)


# --------------------------------------------------------------------------- the pass


class Sweeps:
    """The sweeps of one rewrite, shared by its nested bodies; dropped with the rewrite, so no
    jaxpr outlives it (keys hold `id(jaxpr)`, and the value keeps that jaxpr alive)."""

    def __init__(self) -> None:
        self._sweeps: dict[tuple, Sweep] = {}
        # the backward rules whose call had a hazard before DCE (`_rewrite.rules_with_hazards`);
        # None until a top-level rewrite has looked
        self.hazardous_rules: dict[int, object] | None = None

    def get(self, jaxpr: Jaxpr, out_kinds: Sequence[Kind], structural: bool,
            consts: Mapping[Var, Any] | None = None,
            out_syms: Sequence[Sym] | None = None,
            known_inputs: Mapping[Var, Any] | None = None,
            weights: Mapping[Var, Any] | None = None,
            masks: Mapping[Var, Any] | None = None) -> Sweep:
        """`consts`: the values of constants the rules may read (`Sweep.constant`);
        `weights`: concrete float constants (`Sweep.weight`); `masks`: concrete boolean ones
        (`Sweep.known_mask`);
        `out_syms`: the outputs' formulas, where they are known (else from `out_kinds`);
        `known_inputs`: inputs that carry no derivative in the program around, with what they
        hold (`FreeValues.held`)."""
        # a body called at two sites sees two sets of constants and inputs: two sweeps
        known = (tuple(sorted((id(v), id(c)) for v, c in (consts or {}).items())),
                 tuple(sorted((id(v), repr(c)) for v, c in (known_inputs or {}).items())),
                 tuple(sorted((id(v), id(c)) for v, c in (weights or {}).items())),
                 tuple(sorted((id(v), id(c)) for v, c in (masks or {}).items())))
        key = (id(jaxpr), tuple(out_kinds), structural, None if out_syms is None else
               tuple(out_syms), known)
        hit = self._sweeps.get(key)
        if hit is None:
            hit = self._sweeps[key] = Sweep(jaxpr, out_kinds, structural, self, consts, out_syms,
                                            known_inputs, weights, masks)
        assert hit.jaxpr is jaxpr
        return hit


class Sweep:
    """Static liveness of one jaxpr, and the run-time masks on demand.

    Built once per (jaxpr, output kinds, mode) and rewrite; `masks` emits the mask computation
    for the values that are asked for, walking the equations backward. A sweep is also the
    `Context` its rules see.
    """

    def __init__(self, jaxpr: Jaxpr, out_kinds: Sequence[Kind], structural: bool,
                 sweeps: Sweeps, consts: Mapping[Var, Any] | None = None,
                 out_syms: Sequence[Sym] | None = None,
                 known_inputs: Mapping[Var, Any] | None = None,
                 weights: Mapping[Var, Any] | None = None,
                 masks: Mapping[Var, Any] | None = None):
        self.jaxpr = jaxpr
        # concrete boolean constants (a dense padding mask closed over): a coarse guard ORs
        # them over the axes it does not run along (`known_mask`)
        self.bool_constants = dict(masks or {})
        # concrete float constants (closed-over weights): a contraction's mask rule reads which
        # lanes their zeros mask (`weight`); set before the static liveness that asks
        self.weights = dict(weights or {})
        self._weight_values: dict = {}  # folded from them on a contraction's demand
        self.structural = structural
        self.sweeps = sweeps
        self._known = dict(consts or {})
        # a body's inputs that carry no derivative outside, with what they hold (`Sweeps.get`)
        self.known_inputs = dict(known_inputs or {})
        self.diff = [differentiable_operands(e, structural) for e in jaxpr.eqns]
        self.producer = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
        self._constants: dict = {}
        self._from_literals: set | None = None
        self._dropped_whole: set | None = None
        self._carries: dict | None = None  # carry classes and producers: on a product's demand
        self._masking_carries: dict | None = None  # the same, as a product's masks see them
        self._producer_eqns: dict = {}
        self._numbering: dict | None = None  # same_as: on a predicate's demand
        self._free_values: FreeValues | None = None  # what lanes carrying nothing hold
        self._bounds: Bounds | None = None  # lower bounds and ranges: on a `max`'s demand
        self._own: set | None = None  # this program's variables: on a body's formulas' demand
        self._varying: bool | None = None  # over a shard_map's manual axes (`masks`)
        # per equation, the formula each operand receives from it (the guard pass reads them)
        self.operand_syms: list[list[Sym]] = [[] for _ in jaxpr.eqns]
        self.syms = self._static_liveness(
            [sym_of_kind(k) for k in out_kinds] if out_syms is None else out_syms)
        self.kinds = {v: kind_of_sym(m) for v, m in self.syms.items()}
        self.consumers: dict[Any, list[tuple[int, int]]] = {}
        for i, (eqn, diff) in enumerate(zip(jaxpr.eqns, self.diff, strict=True)):
            for k, (v, d) in enumerate(zip(eqn.invars, diff, strict=True)):
                if d:
                    self.consumers.setdefault(v, []).append((i, k))

    def _static_liveness(self, out_syms: Sequence[Sym]) -> dict[Any, Sym]:
        """Every value's static formula, walking the equations backward from the outputs."""
        jaxpr = self.jaxpr
        syms: dict[Any, Sym] = {}
        for v, m in zip(jaxpr.outvars, out_syms, strict=True):
            if not isinstance(v, Literal):
                syms[v] = sym_or(syms.get(v, FALSE), m)
        i = len(jaxpr.eqns) - 1
        try:
            for i in range(len(jaxpr.eqns) - 1, -1, -1):
                eqn, diff = jaxpr.eqns[i], self.diff[i]
                # a value with no lanes (`x[1:]` of one row) reads nothing
                out_syms = [FALSE if 0 in shape_of(o) else syms.get(o, FALSE)
                            for o in eqn.outvars]
                self.operand_syms[i] = operand_syms(eqn, out_syms, self)
                for v, m, d in zip(eqn.invars, self.operand_syms[i], diff, strict=True):
                    if d:
                        syms[v] = sym_or(syms.get(v, FALSE), m)
        except Exception as e:
            note_failure(e, jaxpr.eqns[i], "liveness")
            raise
        return syms

    @property
    def ctx(self) -> Sweep:
        """The context the rules of this sweep's equations see."""
        return self

    # -- the Context protocol --------------------------------------------------------------

    def producer_of(self, v: Any) -> JaxprEqn | None:
        i = self.producer.get(v)
        return None if i is None else self.jaxpr.eqns[i]

    def same_as(self, var: Var) -> Var:
        """The first variable the program computes exactly as it computes `var` (the same
        lane-to-lane equation on the same operands): `x > 0` written twice, by a hand-written
        double where, is one predicate."""
        if self._numbering is None:
            self._numbering = _value_numbers(self.jaxpr)
        return self._numbering.get(var, var)

    def broadcast_of(self, var: Var) -> JaxprEqn | None:
        eqn = self.producer_of(var)
        if eqn is None or not rule_for(eqn.primitive).broadcast or len(eqn.invars) != 1:
            return None
        return eqn

    def connective_of(self, key: Var) -> tuple[Connective, list[Lit]] | None:
        """The `and`, `or` or `not` that computes the predicate `key` from other predicates
        (not from a literal), with their literals over `key`'s axes (`expand_connectives`)."""
        eqn = self.producer_of(key)
        connective = None if eqn is None else rule_for(eqn.primitive).connective
        if eqn is None or connective is None:
            return None
        rank = len(shape_of(key))
        operands = [u for u in eqn.invars if isinstance(u, Var)
                    and dtype_of(u) == np.bool_ and len(shape_of(u)) in (0, rank)]
        if dtype_of(key) != np.bool_ or len(operands) != len(eqn.invars):
            return None
        return connective, [predicate_literal(u, True, self.broadcast_of, self.same_as)
                            for u in operands]

    def maybe_after(self, starts: Sequence[Any], known: Container) -> list:
        """The MAYBE values reached forward from `starts` through their readers' outputs, up to
        values that are LIVE or DEAD or in `known` (what a run-time mask of `starts` is built
        from: `RuntimeMasks`, and the guard pass's `_PaidMasks`)."""
        region, seen, stack = [], set(), list(starts)
        while stack:
            u = stack.pop()
            if isinstance(u, Literal) or u in seen or u in known or self.kind(u) != Kind.MAYBE:
                continue
            seen.add(u)
            region.append(u)
            for i, _ in self.consumers.get(u, ()):
                stack.extend(self.jaxpr.eqns[i].outvars)
        return region

    def constant(self, atom: Any) -> Any:
        """The value of a small atom that the program computes from literals and the constants
        it was given alone, else None (asked for select predicates and scatter indices only, so
        programs without such pay nothing)."""
        if isinstance(atom, Literal):
            return np.asarray(literal_value(atom))
        if self._from_literals is None:  # one forward pass: what is computed from literals only
            self._from_literals = found = set(self._known)
            for eqn in self.jaxpr.eqns:
                if all(isinstance(u, Literal) or u in found for u in eqn.invars):
                    found.update(eqn.outvars)
        if atom not in self._from_literals:
            return None
        return demand(atom, self._constants, self._fold)

    def known_mask(self, atom: Any) -> np.ndarray | None:
        """The value of a boolean the program closes over (`bool_constants`), or computes from
        literals and small constants alone, or from its float constants (`W > 0` of a padding
        weight, `weight`), known when jaxsafe plans; else None."""
        if isinstance(atom, Var) and atom in self.bool_constants:
            value = self.bool_constants[atom] = np.asarray(self.bool_constants[atom])  # once
            return value
        value = self.constant(atom)
        if value is None and dtype_of(atom) == np.bool_:
            value = self.weight(atom)
        return None if value is None else np.asarray(value)

    def inner_masks(self, closed: ClosedJaxpr, invals: Sequence[Any],
                    out_masks: Sequence[Mask], structural: bool,
                    out_syms: Sequence[Sym] | None = None) -> list[Mask]:
        """Masks of a sub-jaxpr's inputs, given its outputs' masks (and their formulas, where
        known: the static formulas that the rule of the equation gave, `inner_syms`)."""
        out_kinds = [Kind.LIVE if m is None else Kind.MAYBE for m in out_masks]
        if out_syms is not None and any(kind_of_sym(m) != k
                                        for m, k in zip(out_syms, out_kinds, strict=True)):
            out_syms = None  # a mask narrower than its formula's kind: by the kinds
        sweep = self.sweeps.get(closed.jaxpr, out_kinds, structural, out_syms=out_syms)
        invars = closed.jaxpr.invars
        if all(sweep.kind(v) == Kind.LIVE for v in invars):
            return [None] * len(invars)
        env = Values(closed.jaxpr, closed.consts, invals)
        mask_of = sweep.masks(env, out_masks)
        return [mask_of(v) for v in invars]

    def inner_syms(self, closed: ClosedJaxpr, out_syms: Sequence[Sym],
                   structural: bool) -> list[Sym]:
        """Static formulas of a sub-jaxpr's inputs, given its outputs' formulas. A predicate
        of the sub-jaxpr's own becomes an unknown on the same axes here: this program cannot
        read it (a coarse guard names predicates it reads)."""
        sweep = self.sweeps.get(closed.jaxpr, [kind_of_sym(m) for m in out_syms], structural,
                                out_syms=out_syms)
        if self._own is None:
            self._own = {*self.jaxpr.invars, *self.jaxpr.constvars, *self.producer}
        return [foreign_keys_unknown(sweep.sym(v), self._own) for v in closed.jaxpr.invars]

    def inner_kinds(self, closed: ClosedJaxpr, out_kinds: Sequence[Kind],
                    structural: bool) -> list[Kind]:
        sweep = self.sweeps.get(closed.jaxpr, out_kinds, structural)
        return [sweep.kind(v) for v in closed.jaxpr.invars]

    def held(self, atom: Any) -> Any:
        """What the lanes of `atom` that carry no derivative hold (`FreeValues.held`)."""
        if self._free_values is None:  # a constant's values: those of the weights it knows
            self._free_values = FreeValues(None, self, consts=self.weights)
        return self._free_values.held(atom)

    def may_mask(self, atom: Any) -> bool:
        """Whether some lane of `atom` may carry no derivative and hold 0 there (a 0/1 mask;
        not `jnp.where(p, x, 1.)`)."""
        if self._carry_classes(masking=True).get(atom, Carry.NONE) == Carry.ALL:
            return False
        held = self.held(atom)
        return held is None or any(h == 0 for h in held)

    def weight(self, atom: Any) -> Any:
        """The value of a concrete float constant of the program, or of a value it computes
        from such constants and literals alone (`w.T`, `w.astype(jnp.bfloat16)`, a one-hot
        cast to complex), else None."""
        if not isinstance(atom, Var) or not self.weights:
            return None
        return demand(atom, self._weight_values, self._fold_weight)

    def _fold_weight(self, v: Any) -> Generator[Any, Any, Any]:
        if v in self.weights:
            return _known_value(self.weights[v])
        if v in self._known:
            return _known_value(self._known[v])
        return small_constant(self.producer_of(v), limit=MAX_WEIGHT)

    def carries_nothing(self, atom: Any) -> bool:
        if isinstance(atom, Literal):
            return True
        return self._carry_classes(masking=True).get(atom, Carry.NONE) == Carry.NONE

    def operand_never_loses(self, eqn: JaxprEqn, k: int) -> bool:
        if self._bounds is None:  # the literals' values only: a sweep sees no constants
            self._bounds = Bounds(self.jaxpr.eqns, self.producer, {})
        return never_loses(eqn, k, self._bounds)

    def carry_mask(self, atom: Any, env: Any, masking: bool = False) -> Mask:
        memo = scoped_memo("masking carries" if masking else "carries", id(self), id(env))
        memo.setdefault("env", env)  # held while the scope lives, so its id is not reused
        return carrying_lanes(atom, self._carry_classes(masking), self._producer_eqns, memo,
                              lambda v: read(env, v))

    def carry_classes(self) -> dict:
        """Each variable's `Carry` class (one forward pass, on first demand)."""
        return self._carry_classes()

    def _carry_classes(self, masking: bool = False) -> dict:
        if self._carries is None:  # one forward pass, the first time a product asks
            self._carries = carry_classes(self.jaxpr, self.diff, self.known_inputs)
            self._producer_eqns = {o: self.jaxpr.eqns[i] for o, i in self.producer.items()}
            if all(_masks_products(e) for e in self.jaxpr.eqns):
                self._masking_carries = self._carries  # the same classes
        if not masking:
            return self._carries
        if self._masking_carries is None:
            self._masking_carries = carry_classes(self.jaxpr, self.diff, self.known_inputs,
                                                  masking=True)
        return self._masking_carries

    # -- constants --------------------------------------------------------------------------

    def _fold(self, v: Any) -> Generator[Any, Any, Any]:
        """The rule `demand` runs: yields each operand whose value it needs."""
        if v in self._known:
            return _known_value(self._known[v])
        return small_constant(self.producer_of(v))

    # -- kinds and masks ----------------------------------------------------------------------

    def sym(self, atom: Any) -> Sym:
        """The static mask of a value (FALSE for literals and values no output reads)."""
        return FALSE if isinstance(atom, Literal) else self.syms.get(atom, FALSE)

    def kind(self, atom: Any) -> Kind:
        if isinstance(atom, Literal):
            return Kind.DEAD
        return self.kinds.get(atom, Kind.DEAD)

    def reached_by_derivative(self, atom: Any) -> bool:
        """Whether derivatives of the outputs reach `atom`: it has a live lane, or it is dropped
        in every lane by an equation JAX still differentiates, which hands it a zero cotangent
        (the unselected side of `lax.select(False, b * x, 1.)`)."""
        if self.kind(atom) != Kind.DEAD:
            return True
        if self._dropped_whole is None:  # one backward pass, the first time it is asked
            found: set = set()
            for i in range(len(self.jaxpr.eqns) - 1, -1, -1):
                eqn = self.jaxpr.eqns[i]
                if all(self.kind(o) == Kind.DEAD and o not in found for o in eqn.outvars):
                    continue
                found.update(v for v, d in zip(eqn.invars, self.diff[i], strict=True)
                             if d and self.kind(v) == Kind.DEAD)
            self._dropped_whole = found
        return atom in self._dropped_whole

    def note_broadcasts(self, env: Any, atom: Any) -> None:
        """Tell the mask algebra that a predicate the program broadcasts is a smaller core."""
        chain = []
        while isinstance(atom, Var):
            eqn = self.broadcast_of(atom)
            if eqn is None or isinstance(eqn.invars[0], Literal):
                break
            chain.append(eqn)
            atom = eqn.invars[0]
        for eqn in reversed(chain):  # the innermost first: its core composes into the next
            register_broadcast(read(env, eqn.outvars[0]), read(env, eqn.invars[0]),
                               eqn.params["broadcast_dimensions"])

    def masks(self, env: Any, out_masks: Sequence[Mask]) -> RuntimeMasks:
        """The run-time masks of this jaxpr's values, emitted on first demand. `env` maps a
        variable to its original value (it may compute values on demand). Staged, not
        computed at trace time, in a `shard_map` body whose values vary over its axes."""
        if self._varying is None:
            self._varying = varies_over_manual_axes(
                v.aval for v in (*self.jaxpr.invars, *self.jaxpr.constvars))
        return RuntimeMasks(self, env, out_masks, early=not self._varying)


class RuntimeMasks:
    """`mask_of(var)`: a variable's run-time mask, emitted on the current trace when first asked.

    A demand walks only the region that the mask depends on: forward from the variable through
    its consumers, up to values that are statically LIVE or DEAD, then backward over that region
    with the rules of the table.
    """

    def __init__(self, sweep: Sweep, env: Any, out_masks: Sequence[Mask],
                 early: bool = True):
        self.sweep, self.env, self.out_masks, self.early = sweep, env, out_masks, early
        self.given: dict[Var, list[Mask]] = {}
        for v, m in zip(sweep.jaxpr.outvars, out_masks, strict=True):
            if not isinstance(v, Literal):
                self.given.setdefault(v, []).append(m)
        self.memo: dict[Var, Mask] = {}
        self.eqn_masks: dict[int, list[Mask]] = {}
        self._staged: RuntimeMasks | None = None

    def __call__(self, v: Any) -> Mask:
        return self._at_boundary(lambda masks: [masks._demand(v)])[0]

    def operand_masks(self, i: int) -> list[Mask]:
        """The masks equation `i`'s operands receive from it, computed once (a guard site and
        a chooser emitted again both read them)."""
        return self._at_boundary(lambda masks: masks._settled_operand_masks(i))

    def _at_boundary(self, demand: Callable[[RuntimeMasks], list]) -> list:
        """`demand(self)`, with masks known at trace time where enabled; the outermost demand
        hands them to the program (`emitted`), or asks the all-staged twin again where one is
        too large to be a constant."""
        with at_trace_time(self.early) as outermost:
            masks = demand(self)
        if not outermost:
            return masks
        out = [emitted(m) for m in masks]
        if any(m is TOO_LARGE for m in out):
            return self._all_staged()._at_boundary(demand)
        return out

    def _all_staged(self) -> RuntimeMasks:
        """The same masks, every one staged: for one too large to emit as a constant."""
        if self._staged is None:
            self._staged = RuntimeMasks(self.sweep, self.env, self.out_masks, early=False)
        return self._staged

    def _settled_operand_masks(self, i: int) -> list[Mask]:
        for o in self.sweep.jaxpr.eqns[i].outvars:
            self._demand(o)  # settled first
        return self._operand_masks(i)

    def _demand(self, v: Any) -> Mask:
        if self.sweep.kind(v) == Kind.MAYBE and v not in self.memo:
            for u in self._region(v):  # consumers' outputs first
                contribs = list(self.given.get(u, ()))
                contribs.extend(self._operand_masks(i)[k]
                                for i, k in self.sweep.consumers.get(u, ()))
                self.memo[u] = any_of(contribs) if contribs else zeros(shape_of(u))
        return self._settled(v)

    def _settled(self, v: Any) -> Mask:
        kind = self.sweep.kind(v)
        if kind == Kind.LIVE:
            return None
        if kind == Kind.DEAD:
            return zeros(shape_of(v))
        return self.memo[v]

    def _region(self, v: Any) -> list:
        """The MAYBE values `v`'s mask depends on and that have none yet, consumers first."""
        sweep = self.sweep
        region = sweep.maybe_after([v], self.memo)
        region.sort(key=lambda u: sweep.producer.get(u, -1), reverse=True)
        return region

    def _operand_masks(self, i: int) -> list[Mask]:
        if i not in self.eqn_masks:
            eqn = self.sweep.jaxpr.eqns[i]
            selection = rule_for(eqn.primitive).selection
            if selection is not None and selection.by_predicate:
                self.sweep.note_broadcasts(self.env, eqn.invars[0])
            operands = KnownOperands(self.env, eqn.invars, self.sweep.constant) \
                if self.early else LazyOperands(self.env, eqn.invars)
            self.eqn_masks[i] = operand_masks(eqn, [self._settled(o) for o in eqn.outvars],
                                              operands, self.sweep)
        return self.eqn_masks[i]


def _masks_products(eqn: JaxprEqn) -> bool:
    """Whether `eqn`'s lanes that carry nothing count as masks too (`Carries.masks_products`)."""
    carries = rule_for(eqn.primitive).carries
    return carries is None or carries.masks_products


def _value_numbers(jaxpr: Jaxpr) -> dict:
    """Variable -> the first variable computed by the same equation (the same primitive and
    parameters, no effects, a function of its operands alone: elementwise or evaluable on
    constants, never `rng_uniform`) on the same operands, for the variables that have an
    earlier twin: `x[0] > 0` written twice is one
    predicate. Size-1 axes do not count: a reshape, squeeze or broadcast that only adds or
    removes them is its operand, so `le(x, eps)` for x of shape (n, 1) and `le(squeeze(x),
    eps)` are one predicate (the twin may have another shape, with the same axes of size above
    1, in order)."""
    first: dict = {}
    same: dict = {}
    producer: dict = {}
    for eqn in jaxpr.eqns:
        rule = rule_for(eqn.primitive)
        if eqn.effects or len(eqn.outvars) != 1:
            continue
        out = eqn.outvars[0]
        if _only_size_one_axes_move(eqn):
            same[out] = same.get(eqn.invars[0], eqn.invars[0])
            continue
        held = _predicate_held(eqn, same, producer)
        producer[out] = eqn
        if held is not None:
            same[out] = held
            continue
        if not (rule.foldable or rule.elementwise or rule.broadcast):
            continue  # a value made anew at each call (`rng_uniform`), a body, an unknown
        try:
            key = (eqn.primitive, tuple(sorted(eqn.params.items())), _sizes(out),
                   tuple(_operand_key(v, same) for v in eqn.invars))
            hash(key)
        except TypeError:  # a parameter that cannot be compared
            continue
        twin = first.setdefault(key, out)
        if twin is not out:
            same[out] = twin
    return same


def _predicate_held(eqn: JaxprEqn, same: dict, producer: dict) -> Any:
    """The predicate a boolean equation holds unchanged, else None: `stop_gradient(p)`, a
    `select_n` whose cases are all one predicate (a batched `cond` hands each branch
    `select_n(taken, stop_gradient(p), p)`, which is `p`), and `int(p) == 1` (its `taken`)."""
    out = eqn.outvars[0]
    if dtype_of(out) != np.bool_:
        return None
    rule = rule_for(eqn.primitive)
    source = eqn.invars[0]
    if not isinstance(source, Var) or shape_of(source) != shape_of(out):
        return None
    if rule.holds_operand:
        return same.get(source, source)
    if rule.equality:
        cast = producer.get(source)
        one = eqn.invars[1]
        if cast is not None and rule_for(cast.primitive).casts and \
                isinstance(cast.invars[0], Var) and dtype_of(cast.invars[0]) == np.bool_ and \
                shape_of(cast.invars[0]) == shape_of(out) and isinstance(one, Literal) and \
                np.asarray(one.val).shape == () and np.asarray(one.val) == 1:
            return same.get(cast.invars[0], cast.invars[0])
        return None
    if rule.selection is None or not rule.selection.by_predicate:
        return None
    cases = {_operand_key(v, same) for v in eqn.invars[1:]}
    case = eqn.invars[1]
    if len(cases) != 1 or not isinstance(case, Var) or shape_of(case) != shape_of(out):
        return None
    return same.get(case, case)


def _sizes(atom: Any) -> tuple[int, ...]:
    """The axes of size above 1, in order."""
    return tuple(n for n in shape_of(atom) if n != 1)


def _only_size_one_axes_move(eqn: JaxprEqn) -> bool:
    """A layout equation (reshape, squeeze, broadcast, ...) that keeps every lane where it was:
    its operand's axes of size above 1, in order, are its output's."""
    if len(eqn.invars) != 1 or not isinstance(eqn.invars[0], Var):
        return False
    rule = rule_for(eqn.primitive)
    if not rule.moves_only or rule.align is None:  # `neg`, a cast: other values (hunt AG)
        return False
    u, v = eqn.invars[0], eqn.outvars[0]
    if _sizes(u) != _sizes(v):
        return False
    align = alignment(eqn, 0)
    if align is None:
        return False
    kept = [a for a, n in zip(align, shape_of(u), strict=True) if n != 1]
    axes = [a for a in kept if a is not None]
    return len(axes) == len(kept) and axes == sorted(axes)


def _operand_key(atom: Any, same: dict) -> Any:
    if isinstance(atom, Literal):
        value = np.asarray(atom.val)
        return ("literal", value.dtype, value.tobytes(), getattr(atom.aval, "weak_type", None))
    return same.get(atom, atom)


def _known_value(value: Any) -> Generator[Any, Any, Any]:
    """A `demand` rule that needs nothing: a constant's value, read from the device once."""
    return np.asarray(value)
    yield  # pragma: no cover - a generator that asks for nothing
