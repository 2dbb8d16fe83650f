"""The primitive table: one typed row per primitive, holding everything the rewrite knows of it.

Every pass looks a primitive up here, with `rule_for(primitive)`, and never tests for a
particular primitive itself. A primitive without a row gets an explicit default:
`CONSERVATIVE` for JAX's own primitives (every operand lane is live where any output lane is,
nothing is guarded) and `UNKNOWN` for any other (the same, plus its outputs may be non-finite and
`explain` reports it).

The rows are filled in by `_primitives.py`, family by family; `register_guard` (`_guards.py`)
changes one row. This module holds only the types, the table and the lookup, so that every rule
module can import it without a cycle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np
from jax import lax

from ._compat import ClosedJaxpr, Jaxpr, JaxprEqn, Primitive, Var
from ._compat import primitives as prims
from ._symbolic import Connective

if TYPE_CHECKING:
    from ._symbolic import Sym

Mask = Any
"""A run-time liveness mask: a boolean array of the value's shape, or None for "every lane
live" (see `_masks.py`)."""


class Kind(enum.IntEnum):
    """Static summary of a value's liveness."""
    DEAD = 0   # no lane reaches an output
    MAYBE = 1  # a run-time mask decides
    LIVE = 2   # every lane may reach an output


class Context(Protocol):
    """What a rule may ask besides its own equation: the mode, the program around the equation
    (static rules), and the liveness of sub-jaxprs (rules of primitives with bodies)."""

    structural: bool
    """Inside a body that re-runs as one unit on guarded operands (a custom rule's primal, a
    checkpoint, a cond branch): every read counts, and no selection by value drops a lane."""

    def constant(self, atom: Any) -> np.ndarray | None:
        """The value of a small atom that the program computes from literals alone, else None."""
        ...

    def known_mask(self, atom: Any) -> np.ndarray | None:
        """The value of a boolean the program closes over or computes from literals, where it
        is known when jaxsafe plans (`constant`, and boolean constants of any size up to a
        bound), else None."""
        ...

    def same_as(self, var: Var) -> Var:
        """The first variable the program computes exactly as it computes `var`."""
        ...

    def connective_of(self, key: Var) -> Any:
        """The `and`, `or` or `not` that computes the predicate `key` from others, with their
        literals (`_symbolic.Expansion`), else None."""
        ...

    def broadcast_of(self, var: Var) -> JaxprEqn | None:
        """The equation that computes `var` as a broadcast of one operand, else None."""
        ...

    def producer_of(self, v: Any) -> JaxprEqn | None:
        """The equation that computes `v`, else None (an input, a constant)."""
        ...

    def inner_masks(self, closed: ClosedJaxpr, invals: Sequence[Any],
                    out_masks: Sequence[Mask], structural: bool,
                    out_syms: Sequence[Sym] | None = None) -> list[Mask]:
        """Run-time masks of a sub-jaxpr's inputs, given its outputs' masks (and their static
        formulas, where the equation's static rule read the body with them)."""
        ...

    def sym(self, atom: Any) -> Sym:
        """The static formula of a value of this program (FALSE for a literal)."""
        ...

    def inner_kinds(self, closed: ClosedJaxpr, out_kinds: Sequence[Kind],
                    structural: bool) -> list[Kind]:
        """Static liveness of a sub-jaxpr's inputs, given its outputs' kinds."""
        ...

    def inner_syms(self, closed: ClosedJaxpr, out_syms: Sequence[Sym],
                   structural: bool) -> list[Sym]:
        """Static formulas of a sub-jaxpr's inputs, given its outputs' formulas."""
        ...

    def may_mask(self, atom: Any) -> bool:
        """Whether some lane of `atom` may carry no derivative of the inputs and hold 0 there,
        as a factor that masks a product (`_carries.py`)."""
        ...

    def held(self, atom: Any) -> Any:
        """The values `atom` holds in its lanes that carry no derivative (`FreeValues.held`;
        None: unknown)."""
        ...

    def weight(self, atom: Any) -> Any:
        """The value of a concrete float constant of the program (a closed-over weight
        matrix), else None."""
        ...

    def carries_nothing(self, atom: Any) -> bool:
        """Whether no lane of `atom` carries a derivative of the inputs (a constant, a one-hot
        of integers), as a factor that masks a product sees it."""
        ...

    def operand_never_loses(self, eqn: JaxprEqn, k: int) -> bool:
        """Whether operand k of a selection by value (`max`, `min`) wins or ties in every lane,
        for every input (`_bounds.never_loses`): it drops none of its lanes."""
        ...

    def carry_mask(self, atom: Any, env: Any, masking: bool = False) -> Mask:
        """The lanes of `atom` that carry a derivative, at run time (None: all may); `env` maps a
        variable to its original value. `masking`: as a factor that masks a product sees them
        (`Carries.masks_products`)."""
        ...


MaskRule = Callable[[JaxprEqn, list, Sequence[Any], Context], list]
"""(equation, output masks, original operand values, context) -> a mask per operand."""

@dataclasses.dataclass(frozen=True)
class LoopLinks:
    """One body of a loop, as `_aligned.py` joins it: `inputs` and `outputs` pair an atom of
    the equation (an operand, a result) with a variable of the body and the number of leading
    axes the outer atom has besides (1 for a scan's stacked value: its steps, which the loop
    reads one by one); `loops` pairs each output the body hands back to itself (a carry) with
    the input it becomes."""

    body: Jaxpr
    inputs: tuple[tuple[Any, Any, int], ...]
    outputs: tuple[tuple[Any, Any, int], ...]
    loops: tuple[tuple[Any, Any], ...]


AlignRule = Callable[[JaxprEqn, int], "list[int | None] | None"]
"""(equation, operand k) -> for each axis of operand k, the output axis it runs along (None for
an axis that is reduced, contracted or broadcast); None when its lanes do not map to output
lanes axis by axis (slices, gathers, general reshapes)."""

StaticRule = Callable[[JaxprEqn, "Sequence[Sym]", Context], "list[Sym] | None"]
"""(equation, output formulas, context) -> a formula per operand (`_symbolic.py`), or None to
fall back to the kinds."""

KindsRule = Callable[[JaxprEqn, list, Context], list]
"""(equation, output kinds, context) -> a kind per operand: for primitives with bodies."""

WinsRule = Callable[[JaxprEqn, Sequence[Any]], list[jax.Array]]
"""(equation, original operand values) -> per operand, the output lanes where it alone determines
the output and its derivative (disjoint; where none does, a tie or NaN, every operand is live)."""

RechooseRule = Callable[[JaxprEqn, list, Sequence[Any], Callable[[], list], Callable[[], list]],
                        list]
"""(equation, guarded operands, original operands, operand masks, output masks) -> outputs: the
equation emitted again on guarded operands, choosing what the original operands choose, so the
forward value is the original's and a dropped lane gets a derivative of exactly zero. The masks
are thunks: asked for only by the rules that need them."""

BoundRule = Callable[[JaxprEqn, list, list], "float | None"]
"""(equation, operand lower bounds, operand constant values) -> lower bound of the output."""

RangeRule = Callable[[JaxprEqn, list, list], "tuple[float, float] | None"]
"""(equation, operand ranges, operand constant values) -> range of the output (`_ranges.py`)."""

PreimageRule = Callable[[JaxprEqn, float, list], "tuple[int, float] | None"]
"""(equation, a positive lower bound of its output, operand constant values) -> (the operand the
output grows with, a lower bound of that operand), else None (`_bounds.py`)."""

BodyInputs = Callable[[JaxprEqn, list], "dict[str, list[bool]]"]
"""(equation, which operands may be non-finite) -> body parameter -> which of its inputs may."""

ScalarMove = Callable[[JaxprEqn, np.ndarray], "np.ndarray | None"]
"""(equation, the one scalar its operand holds in dropped lanes) -> the scalar the output holds
in its dropped lanes, or None when unknown."""

DiagonalRule = Callable[[JaxprEqn, "tuple[int, int]", Any], Any]
"""(equation, a diagonal of its output, context) -> a generator that yields (operand, its
diagonal) and returns the scalar the output holds on the diagonal, or None (`_diagonal.py`)."""

IotaAxis = Callable[[JaxprEqn], "int | None"]
"""(equation) -> the axis along which an `iota` counts."""

NonfiniteTest = Callable[[JaxprEqn], "list[Var]"]
"""(equation) -> the variables it tests for NaN or inf (`is_finite(x)`, `x != x`, `x == inf`)."""


CarryClassRule = Callable[[JaxprEqn, list], "Any"]
"""(equation, each operand's carry class: NONE, PART, ALL, `_carries.Carry`) -> the class of its
outputs."""

CarryLanesRule = Callable[[JaxprEqn, list, Callable[[int], Any]], Mask]
"""(equation, each operand's carrying lanes (None: every lane may carry; a Literal's: all
False), operand k's original value) -> the output lanes that carry a derivative (None: all)."""


CarryHeldRule = Callable[[JaxprEqn, list, list], "tuple | None"]
"""(equation, each operand's carry class, the values each operand holds in its lanes that carry
nothing (None: unknown)) -> the values the output holds in its such lanes (`_free.py`)."""


class Steps(Protocol):
    """How a loop slices its stacked operands into its body, one slice per step, and how it
    is staged again with a body that takes other operands (`PrimitiveRule.steps`)."""

    def layout(self, eqn: JaxprEqn) -> tuple[ClosedJaxpr, int, int] | None:
        """(the body, the number of constants, the index of the first stacked operand); the
        body's inputs are the operands, in order, a stacked one sliced. None: not known."""
        ...

    def params_with(self, eqn: JaxprEqn, body: ClosedJaxpr, new_consts: int,
                    stacked_kept: Sequence[bool], new_stacked: int) -> dict | None:
        """The parameters for `body`, whose inputs are `new_consts` new constants first, then
        the old constants and carries, the stacked operands kept (`stacked_kept`) and
        `new_stacked` new ones last. None: it cannot be staged so."""
        ...


@dataclasses.dataclass(frozen=True)
class Carries:
    """How lanes that carry no derivative of the inputs pass through a primitive that is not
    lane to lane (`_carries.py`): a constant that `pad` adds, the lanes a `max` takes from a
    constant, a product's zero factor; and what those lanes hold (`_free.py`)."""

    static: CarryClassRule
    lanes: CarryLanesRule
    held: CarryHeldRule
    selects: bool | Callable[[JaxprEqn], bool] = True
    """Whether its derivative hands a lane that carries nothing a zero by selection, not by a
    zero weight: its transpose never reads the cotangent there (a pad, a scatter; a `max` that
    a constant wins, emitted as a `select_n`), so a NaN that reaches that lane's cotangent
    stops there. False for a product (`0 * NaN`); per call for a custom rule."""

    masks_products: bool = True
    """Whether a zero in its lanes that carry nothing masks a product (`m * v` drops `v`'s lane
    there). False for a custom rule read by value: relu's 0 carries nothing in forward mode,
    but `relu(h) * g(relu(h))` (a gate, a norm after a ReLU) would have `g` guarded where relu
    is 0, which `g` reads there itself (contract 4)."""

    def selects_at(self, eqn: JaxprEqn) -> bool:
        return self.selects(eqn) if callable(self.selects) else self.selects


ZeroRule = Callable[[JaxprEqn, list, list], list]
"""(equation, each operand's structural zeros (None: none known; True: every lane; else a boolean
array), operand values) -> the output's (`_zero_lanes.py`)."""


@dataclasses.dataclass(frozen=True)
class Zeros:
    """How the lanes of a backward program that hold 0 whatever cotangent it is handed pass
    through a primitive (`_zero_lanes.py`, used by the structural-zero pass, `_backward.py`)."""

    lanes: ZeroRule
    absorbs: frozenset[int] = frozenset()
    """Operands whose zero lane makes the output's lane zero whatever the others hold (a
    product's factors, a quotient's numerator): there `0 * inf` must read 0, and the pass
    selects 0."""


def _always(eqn: JaxprEqn) -> bool:
    return True


def _never(eqn: JaxprEqn) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Guard:
    """Safe values for some operands of one NaN-prone primitive.

    `safe` maps an operand index to the value that operand takes in dropped lanes. `applies`
    decides per equation whether the primitive is hazardous there at all (`integer_pow` only with
    a negative exponent, `abs` only on complex numbers).
    """

    safe: Mapping[int, float]
    applies: Callable[[JaxprEqn], bool] = _always
    finite_at_singularities: bool = True
    """Whether the value can be finite where the derivative is not (`sqrt` at 0). False for a
    primitive whose derivative is inf or NaN only where its value is too (`exp`'s overflow, `log`
    at 0, a pole): a live lane that carries no derivative needs no forward-mode guard there
    (`_free.py`), since the forward value itself shows the singularity."""
    apart: frozenset[int] = frozenset()
    """Operands whose partial derivative is the other operands' values times a factor of that
    operand alone (a divisor: `-x * y ** -2`): at finite other values it is finite where that
    factor is, read at 1 (`_free.FreeValues.operand_cuts`)."""
    overflows_through: frozenset[int] = frozenset()
    """Operands outside `safe` whose finite values alone can overflow the result (a power's
    exponent: `10. ** n` at n = 100): with one of them not a literal, the primitive is NaN-prone
    even where every operand in `safe` is a literal inside the domain."""


@dataclasses.dataclass(frozen=True)
class Selection:
    """A primitive that picks, lane by lane, the value of one operand."""

    by_predicate: bool
    """Decided by operand 0, a predicate (`select_n`). Otherwise decided by comparing the
    operands' values (`max`, `min`, `clamp`): once an operand is guarded the equation is
    re-emitted as a `select_n` on the decision taken from the original values."""
    wins: WinsRule | None = None
    """For a selection by value: where each operand wins alone (disjoint; ties and NaN are no
    one's win). The re-emitted equation selects each operand where it wins, itself elsewhere."""
    larger_wins: bool | None = None
    """True for `max` (the larger operand wins alone), False for `min`, None otherwise: an
    operand that another is always at least as large as (as small as) never wins alone
    (`_bounds.never_wins_alone`)."""


def _applies_everywhere(eqn: JaxprEqn, ctx: Context) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Chooser:
    """A primitive whose derivative chooses operand lanes by comparing values (`max`,
    `reduce_max`, `sort`, `top_k`, ...) or by a zero factor that carries no derivative (a 0/1
    mask in `m * v`). Once an operand is guarded, or where the output's cotangent may be
    non-finite (JAX weighs it by 0, not selects it), the equation is emitted again by `emit`."""

    emit: RechooseRule
    applies: Callable[[JaxprEqn, Context], bool] = _applies_everywhere
    """Whether this equation chooses at all (a product only with a factor that may mask)."""
    keeps_dropped_values: bool = True
    """Emitted on the original operands, every output lane holds the original value. False for
    a fill (`by_fill`): a dropped output row of a reduction holds the maximum of its guarded
    values, so what reads it is emitted again, and a chooser there is re-decided."""
    guarded_results: bool = True
    """Whether a result that only dropped lanes make is computed from the guarded operand, so
    that a guard of the operand makes it finite. False for `cummax` and pooling, whose dropped
    operand lanes hold their original values (a live window may read them): a result of dropped
    lanes alone is the original's, NaN or inf included, and what reads it there is guarded if
    its derivative would weigh it (`h @ w` for `w`'s)."""
    weighs: Callable[[JaxprEqn, Context], bool] | None = None
    """Whether this equation's derivative may weigh a cotangent by a zero it chooses, so that a
    non-finite cotangent makes `0 * inf` there and the equation is re-decided for it (None:
    wherever it chooses, unless it `picks`). A custom rule whose tangent is a selection
    (`jax.nn.relu`'s `select_n`) writes its zeros."""
    meets_nan_only: bool = False
    """Its derivative weighs a lane by whether it equals the result, over how many do: only a
    result that no lane equals (a NaN in the row: 0 / 0) makes it non-finite, never an inf
    (`reduce_max`). An operand shown free of NaN (`_taint.nan_free`) needs no guard."""
    picks: bool = False
    """Its derivative picks one operand lane per output lane (pooling's select-and-gather), never
    weighs lanes: whatever tangent a dropped lane holds never reaches an output, and its zero
    cotangent is written, not multiplied. A NaN-prone equation read by it alone, at live outputs
    only, can cut its dropped lanes instead of replacing them (`_sites.py`)."""


class MaskedBody(Protocol):
    """A primitive whose body is rewritten again when the program around it drops some of its
    output lanes (liveness flows in from outside): `remat`, `cond`, `scan`."""

    def outside_syms(self, eqn: JaxprEqn, syms: Sequence[Sym]) -> list[Sym | None]:
        """The static formulas the body's outputs get from the equation's outputs' `syms` (None:
        the formula of the output's kind). A checkpoint's or a cond branch's outputs are the
        equation's, lane for lane: the formulas outside carry in, as unknowns on the same axes;
        a scan's carries are the same along the axes its body does not keep aligned."""
        ...

    def plan(self, eqn: JaxprEqn, out_kinds: Sequence[Kind],
             plan_body: Callable[[ClosedJaxpr, list[Kind]], Any]) -> list | None:
        """The body plans (None where a body needs no change), or None when none does."""
        ...

    def emit(self, eqn: JaxprEqn, plans: list, invals: list, out_masks: list,
             params: dict, emit_body: Callable[[Any, Sequence[Mask], Sequence[Any]], list]
             ) -> list:
        """Stage the equation again on `invals`, each body given its output masks."""
        ...


@dataclasses.dataclass(frozen=True)
class PrimitiveRule:
    """Everything the rewrite knows about one primitive. A field left at its default says the
    conservative thing: no lane is dropped, nothing is guarded, nothing is known of values."""

    # -- liveness: which operand lanes reach an output (read backward) --------------------------
    masks: MaskRule | None = None
    """Run-time rule. None: every operand lane is live where any output lane is."""
    align: AlignRule | None = None
    """How operand axes run along output axes: lets static formulas cross the equation."""
    works_along: Callable[[JaxprEqn], Iterable[int]] | None = None
    """For a primitive whose operands and outputs have one rank and that computes, slices, pads
    or moves lanes only along these axes (a slice, a concatenation, a split, a sort, a cumsum):
    along every other axis, lane i of each operand reaches only lane i of each output. A scan's
    body keeps its rows through it (`_aligned.py`); operands of another rank (a pad's value, a
    dynamic slice's starts) share no axis with the outputs. None: not known."""
    static: StaticRule | None = None
    """Static rule; None: the operands' formulas follow from `operand_kinds`."""
    kinds: KindsRule | None = None
    """Static rule of a primitive with a body (its liveness is the body's)."""
    drops: Callable[[JaxprEqn], bool] = _never
    """Whether live outputs can leave some operand lanes dropped (slices, selections)."""

    # -- derivatives ------------------------------------------------------------------------------
    zero_derivative: bool = False
    """Passes no tangent (`floor`, `stop_gradient`): operands are read for their value only."""
    no_derivative: frozenset[int] = frozenset()
    """Operands JAX defines no derivative for (`zeta`, betainc's `a` and `b`): nothing is
    concluded from a derivative there."""
    linear: bool = False
    """A zero cotangent never meets an operand's value in a product, so a non-finite operand in
    a dropped lane cannot leak into another operand's derivative."""
    derivative_reads: tuple[frozenset[int], ...] | None = None
    """For each operand, the operands whose values its derivative reads (`mul`: the other one;
    `div`: the divisor, or both). None: every operand's derivative may read every operand. A
    possibly non-finite operand is a hazard only where a differentiated operand's derivative
    reads it."""
    selection: Selection | None = None
    chooser: Chooser | None = None
    carries: Carries | None = None
    """Which output lanes carry a derivative, for a primitive that is not lane to lane. None:
    every lane may, where any operand lane may (`_carries.py`)."""
    guard: Guard | None = None
    """NaN-prone: the in-domain value each listed operand takes in dropped lanes."""
    identity: float | None = None
    """A non-finite literal that is this primitive's identity and makes nothing non-finite
    (`max(-inf, x)`, the start of every softmax)."""
    tests_nonfinite: NonfiniteTest | None = None
    bounds_below: tuple[bool, int] | None = None
    """A comparison that, where it holds, bounds one operand from below by the other: (strict,
    which operand is bounded): `a > c` is (True, 0), `c <= a` is (False, 1) (`_by_hand.py`)."""

    # -- values known when the rewrite is planned ---------------------------------------------
    elementwise: bool = False
    """Lane to lane (operands of rank 0 or with size-1 axes broadcast)."""
    paired: bool = False
    """Output k is operand k, unchanged (`device_put`, `optimization_barrier`): lane to lane."""
    moves_only: bool = False
    """Moves lanes without computing on them (a reshape, a slice, a gather, a broadcast): every
    output lane holds an operand lane's value or a padding value, exactly (not `neg`, not a
    cast)."""
    foldable: bool = False
    """Evaluated at planning time on small constants (a predicate computed from literals)."""
    connective: Connective | None = None
    """A boolean `and`, `or` or `not`: a predicate it computes is read as its formula over its
    operands where a coarser mask needs fewer axes (`_symbolic.expand_connectives`)."""
    broadcast: bool = False
    """The output is operand 0 broadcast along `broadcast_dimensions` (predicates are followed
    back through it, to the axes they really run along)."""
    scalar_move: ScalarMove | None = None
    bound: BoundRule | None = None
    range: RangeRule | None = None
    ranged_operand: int | None = None
    """The operand over whose range, inside (0, inf), the value and each derivative in it are
    monotone when the other operands are constant (`pow`'s base): finite at both ends of the
    range is finite between (`_bounds.operand_in_domain`)."""
    preimage: PreimageRule | None = None
    """Increasing in one operand, the others constant: a lower bound of the output bounds that
    operand from below (`sqrt`, `x / c` for c > 0): a predicate on the result bounds the
    operand (`_by_hand.py`)."""
    diagonal: DiagonalRule | None = None
    """What the output holds on the diagonal of two of its axes, from the operands'
    (`_diagonal.py`: a pair program's `x[None] - x[:, None]` is 0 there)."""
    iota_axis: IotaAxis | None = None
    equality: bool = False
    """`a == b`, lane by lane (`_diagonal.py`: two indices compared make `eye`)."""
    decreasing: bool = False
    """Guarded operand 0 of a primitive whose value and derivative are finite for every operand
    at or above a point past `edge` where they are finite (`sqrt`, `log`; `log1p` past -1):
    bounded operands need no guard."""
    edge: float = 0.0
    """Where the domain of a `decreasing` primitive ends below (`log1p`: -1)."""
    divisor: int | None = None
    """A guarded operand that divides: where it is at or above a positive point where the
    value and derivatives are finite, they are finite for every finite other operand (a
    quotient's denominator, `x / jnp.maximum(norm, 1e-12)`)."""
    increasing: bool = False
    """Guarded operand 0 of a primitive whose value and derivatives are finite for every
    operand at or below a point where they are finite (`exp`'s overflow): an operand whose
    range ends below such a point needs no guard (`x - max(x)`, `-alpha * r` for r >= 0)."""

    # -- nested jaxprs --------------------------------------------------------------------------
    inline: bool = False
    """A call that changes no value (`jit`): inlined before the analysis."""
    case_body: Callable[[JaxprEqn, int], ClosedJaxpr] | None = None
    """The body a choice of a case by index runs for case `i` (a `cond`'s branch), on operands
    1 onwards: inlined where the index is `fixed_index`'s (`_flatten.py`)."""
    fixed_index: Callable[[JaxprEqn], int | None] | None = None
    """An integer that is one value wherever jaxsafe's program runs, else None: `platform_index`
    of a `lax.platform_dependent` whose other cases are for Pallas kernels only (`jnp.diagonal`'s
    Mosaic case) gives its default case on every XLA platform."""
    nested_params: tuple[str, ...] = ()
    """Parameters holding bodies that are rewritten on their own, keeping their signature."""
    body_inputs: BodyInputs | None = None
    """Given which operands may be non-finite, which inputs of each body in `nested_params`
    may be. None: all of them."""
    masked_body: MaskedBody | None = None
    body_context: Callable[[dict], contextlib.AbstractContextManager] | None = None
    """The context a body in `nested_params` is traced in, given the equation's parameters
    (`shard_map`: its mesh axes bound). None: none."""
    runs_bodies_once: bool = False
    """Its bodies take their inputs from its operands and give its outputs, run once, with no
    step of their own (a `cond`'s branches, a `jax.checkpoint`, a custom rule's primal body,
    `shard_map`'s per device): a body's outputs receive the equation's outputs' cotangents
    (`_cotangents.body_cotangents`), and its bodies' axes are joined to its operands' where a
    scan's body is read for aligned axes (`_aligned.py`: a `cond` on the step in a scan's
    body)."""
    cut_needless: Callable[[JaxprEqn], bool] | None = None
    """For a custom rule: whether this call's rule never weighs a zero cotangent by an
    operand's value and makes no NaN itself, so its dropped operand lanes need no cut (None:
    they do)."""
    custom_rule: bool = False
    """A call whose derivative is the user's rule (`custom_jvp`, `custom_vjp`): not rewritten;
    its dropped input lanes are cut from differentiation when its body is NaN-prone."""
    rule_program: Callable[[JaxprEqn], tuple[bool, ClosedJaxpr | None]] | None = None
    """For a custom rule: whether its derivative can be read as a program, (primals, tangents)
    -> tangents (a `custom_jvp`'s rule, traced once), and that program where it may mix lanes
    its primal body keeps apart (None: it is lane to lane, the body stands for it). A row
    without it (a `custom_vjp`, whose backward is a function) cannot be read."""

    loop_links: Callable[[JaxprEqn], Sequence[LoopLinks]] | None = None
    """For a loop (`scan`, `while_loop`): how each body's inputs and outputs run along the
    equation's operands and results, and which of its outputs come back as which inputs: a
    loop nested in a scan's body keeps that body's rows where its own body does
    (`_aligned.py`). None: a loop's operands keep no axis there."""

    steps: Steps | None = None
    """For a loop that hands its body one slice of each stacked operand per step (`scan`):
    where its body drops lanes of such a slice, elementwise work done on the whole operand
    before the loop is moved into the body, so that the body's guard reaches it
    (`_sinking.py`). None: operands are not sliced per step."""

    zeros: Zeros | None = None
    """How structural zeros of a backward program pass through it (None: no output lane is
    known to be zero)."""
    backward_param: str | None = None
    """The parameter holding a user's backward function (custom_vjp's `bwd`), which JAX calls
    when it transposes the program: wrapped so that the structural-zero pass runs on the
    program it makes (`_backward.py`)."""

    identity_param: str | None = None
    """A parameter that JAX's DCE keeps, the same object, when it removes the call's unread
    outputs from its body (custom_vjp's `out_trees`): how the backward-rule pass finds the call
    again after DCE (`_rewrite.rules_with_hazards`)."""

    forward_param: str | None = None
    """The parameter holding the thunk that makes a custom_vjp's forward program, which JAX
    evaluates when it differentiates the call (and a derivative of that derivative, reverse
    over reverse, differentiates as plain code): wrapped so that its derivative is its
    rewrite's (`_backward.guarded_forward`)."""

    at_least: frozenset[int] = frozenset()
    """Operands the output is at least, lane by lane along the alignment (`reduce_max`, `max`;
    a value moved unchanged: `broadcast_in_dim`, `stop_gradient`): `x - stop_gradient(max(x))`
    is at most 0 (`_maxima.maximum_of`)."""
    at_least_when: Callable[[JaxprEqn], frozenset[int]] | None = None
    """`at_least` for one equation, where it depends on the equation (a generic `lax.reduce`
    whose computation is a `max`)."""
    true_where_finite: bool = False
    """True exactly in the lanes where its operand is finite (`is_finite`): for finite values,
    `select_n(is_finite(m), 0., m)` is `m` (logsumexp's shift, `_maxima.maximum_of`)."""
    not_nan_where: Callable[[JaxprEqn], tuple[Any, bool] | None] | None = None
    """A test that shows a value is not NaN: (x, v) when x holds no NaN in the lanes where this
    boolean is v (`x != x`: (x, False); `x == x` and `is_finite(x)`: (x, True)). A selection of x
    there is NaN-free (`jnp.nanmax`'s `where(isnan(x), -inf, x)`, `_taint.nan_free`)."""
    stacked_rows: Callable[[JaxprEqn, int, Context], list[Any] | None] | None = None
    """Stacks values along an axis, each shaped as one slice of the output: (equation, axis)
    -> those values in order, or None where it does not stack along that axis (`stack`, a
    `concatenate` of size-1 broadcasts; `_case_index.py`)."""
    first_true: Callable[[JaxprEqn, Context], list[Any] | None] | None = None
    """The index of the first True among stacked booleans (`argmax`): the conditions, each of
    the index's shape, or None (`_case_index.py`: `jnp.select`'s case index)."""
    holds_operand: bool = False
    """Its output holds its operand's values, unchanged (`stop_gradient`): a boolean's is the
    same predicate (`Sweep.same_as`)."""
    casts: bool = False
    """Converts its operand's values to another dtype, lane by lane (`convert_element_type`): a
    boolean cast to an integer is 0 or 1 (`_case_index.py`: a batched `cond`'s index)."""
    keeps_nan_free: bool = False
    """Makes no NaN from operands without NaN, lane by lane (`neg`, a cast, `stop_gradient`; a
    move of lanes that fills nothing with NaN is such too): `_taint.nan_free` follows it."""
    difference: bool = False
    """Operand 0 minus operand 1 (`sub`): at most 0 where operand 1 is at least operand 0."""
    finite_where_finite: Callable[[JaxprEqn], frozenset[int]] | None = None
    """The operands that are finite wherever the output is, read lane by lane (an elementwise
    row) or in every lane (a sum, a move): an inf or NaN operand lane makes an inf or NaN
    output lane (`x + y`, `x * y`, `x ** 2`, `sqrt`, `log`; not `exp`, `x ** -1` or a divisor,
    which map inf to a finite value). `_by_hand.HandGuards.finite_where_dropped` follows it
    back from a value that a comparison shows finite."""
    sums: bool = False
    """Adds operand 0's lanes over its reduced axes (`reduce_sum`): at least its largest term
    where no term is negative (`_maxima.largest_term`)."""

    makes_nonfinite: bool = False
    """May make NaN or inf from finite operands, with no guard known (a library's linear solve on
    a singular operator): its outputs may be non-finite, as an unknown primitive's."""
    body_operands: Callable[[JaxprEqn], dict[str, list[tuple[int, bool] | None]]] | None = None
    """For a primitive with bodies: per body parameter, for each input of the body, the
    operand it reads and whether it receives it whole, unchanged in every run (a scan's
    slices of `xs`: not whole; None: a carry). An operand that carries no derivative carries
    none inside the body either, and holds the same values; a constant one received whole is
    known there (a 0/1 mask from outside a `jax.checkpoint` still masks the product in it)."""
    nonfinite_when: Callable[[JaxprEqn], bool] | None = None
    """May make NaN or inf from finite operands with these parameters (a gather that fills
    out-of-range lanes with NaN, a max pooling whose window may lie in the padding alone and
    give its -inf start): as `makes_nonfinite`, for such equations only."""
    finite_when: Callable[[JaxprEqn, Any], bool] | None = None
    """For a primitive that `makes_nonfinite`: a proof, from the equation and the program's
    `Bounds` (its producers and constants), that this one does not (a bitcast of integer bits
    whose exponent field is set: `jax.random.uniform`)."""
    cut_when_dropped: bool = False
    """Its derivative is singular at some finite operands (a matrix that is not positive definite,
    repeated eigenvalues) and no one safe value per lane is known (a safe matrix is not a lane's
    value): the dropped lanes of its differentiated operands are cut from differentiation, as a
    custom rule's are."""

    known: bool = True
    """False for a primitive jaxsafe knows nothing about: reported, outputs possibly non-finite."""
    repeatable: bool = True
    """Two equations of it on the same operands with the same parameters give the same values
    (`_repeats.py` merges them): not XLA's stateful `rng_uniform`, not a row a library
    registered (`register_rule` does not ask)."""

    @property
    def has_body(self) -> bool:
        """Whether the equation runs a body of its own (other than an inlined call)."""
        return bool(self.nested_params) or self.custom_rule


RULES: dict[Primitive, PrimitiveRule] = {}

CONSERVATIVE = PrimitiveRule(makes_nonfinite=True, repeatable=False)
"""The default for JAX's own primitives without a row (the generic `reduce_window`, ...): every
lane live, and outputs that may be non-finite (`bitcast_convert_type` makes any float from
integer bits; a generic reduction's body may divide)."""

UNKNOWN = PrimitiveRule(known=False, repeatable=False)
"""The default for any other primitive."""

JAX_PRIMITIVES: frozenset[Primitive] = frozenset(
    v for module in (prims, lax) for v in vars(module).values() if isinstance(v, Primitive))


LIBRARY_ROWS: list[Callable[[], bool]] = []
"""Loaders of the rows of other libraries' primitives (`_libraries.py`): each registers the rows
of the libraries imported since it last ran, and says whether it registered any."""


def rule_for(primitive: Primitive) -> PrimitiveRule:
    """The row of `primitive`, or the conservative default."""
    rule = RULES.get(primitive)
    if rule is not None:
        return rule
    if primitive in JAX_PRIMITIVES:
        return CONSERVATIVE
    if any([load() for load in LIBRARY_ROWS]) and primitive in RULES:
        return RULES[primitive]
    return UNKNOWN


def may_drop(eqn: JaxprEqn, structural: bool) -> bool:
    """Whether `eqn` may drop operand lanes of live outputs (`drops`), as the liveness pass
    reads it: a choice by value (a selection, a chooser) drops nothing in a structural
    sweep, where nothing is decided on values."""
    rule = rule_for(eqn.primitive)
    by_value = rule.selection is not None or rule.chooser is not None
    return rule.drops(eqn) and not (structural and by_value)


def register(*primitives: Primitive, **facts: Any) -> None:
    """Give each of `primitives` a row with these facts (replacing any row it had)."""
    for primitive in primitives:
        RULES[primitive] = PrimitiveRule(**facts)


def update(primitive: Primitive, **facts: Any) -> None:
    """Change some facts of `primitive`'s existing row."""
    RULES[primitive] = dataclasses.replace(RULES[primitive], **facts)


def guard_table() -> dict[Primitive, Guard]:
    """The NaN-prone primitives and their guards (a view of the rows)."""
    return {p: r.guard for p, r in RULES.items() if r.guard is not None}


class GuardMismatchError(ValueError):
    """A registered guard that does not fit an equation of its primitive (an operand index it
    does not have): the user's registration, not a failure of the analysis, so it is raised."""


@functools.lru_cache(maxsize=256)
def _finite_in(value: float, dtype: np.dtype) -> bool:
    """Whether a guard's safe value stays finite cast to an operand's dtype (`1e300` in
    float32 does not)."""
    if not np.issubdtype(dtype, np.inexact):
        return True
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.asarray(value).astype(dtype)))


def guard_for(eqn: JaxprEqn) -> Guard | None:
    """The guard that applies to `eqn`, or None."""
    guard = rule_for(eqn.primitive).guard
    if guard is None or not guard.applies(eqn):
        return None
    missing = sorted(k for k in guard.safe if k >= len(eqn.invars))
    if missing:
        raise GuardMismatchError(
            f"register_guard({eqn.primitive}): `safe` names operand(s) {missing}, but "
            f"{eqn.primitive} has {len(eqn.invars)} operand(s) here; register it again with "
            f"operand indices below {len(eqn.invars)}.")
    for k, value in guard.safe.items():
        dtype = getattr(eqn.invars[k].aval, "dtype", None)
        if dtype is not None and not _finite_in(value, np.dtype(dtype)):
            raise GuardMismatchError(
                f"register_guard({eqn.primitive}): the safe value {value!r} of operand {k} is "
                f"not finite in its dtype {np.dtype(dtype).name}; register a value inside that "
                f"dtype's range.")
    return guard


def alignment(eqn: JaxprEqn, k: int) -> list[int | None] | None:
    """For operand k of a one-output equation, the output axis each of its axes runs along (see
    `AlignRule`); None when the row has no such rule."""
    rule = rule_for(eqn.primitive)
    if rule.align is None or len(eqn.outvars) != 1:
        return None
    return rule.align(eqn, k)
