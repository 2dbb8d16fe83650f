"""Symbolic masks: which lanes of a value are live (or changed), as a formula the rewrite can
reason with before anything runs.

A mask is a boolean formula in disjunctive normal form: a set of terms, each a set of literals.
A literal is `(key, positive, embed)`: `key` is a boolean predicate variable of the program (a
`jnp.where` condition) or an `Unknown` (a mask the static pass cannot name, e.g. what a slice or a
comparison of values leaves live); `embed[j]` is the value axis along which the key's axis j
runs (None where the key has size 1 and is broadcast). A literal depends on the axes it embeds
and on no other, so a mask whose literals avoid an axis is the same along that axis.

That is what lets masks cross reductions, broadcasts, transposes and matmuls (`move`): the
softmax of a row that a `where` drops is dropped as a whole row, and a decision computed over the
row (`stop_gradient(max(x))`) can be proven to affect dropped lanes only (`disjoint`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Iterable, Sequence

import numpy as np

from ._atoms import dtype_of, shape_of
from ._compat import JaxprEqn, Literal, Var

Lit = tuple  # (key, positive, embed: tuple[int | None, ...], or None for "every axis")
Term = frozenset
Sym = frozenset

TRUE: Sym = frozenset({frozenset()})
FALSE: Sym = frozenset()
MAX_TERMS = 16


class Unknown:
    """A mask nobody can name: equal only to itself.

    One made by `move` knows the literals an OR over axes collapsed into it (`parts`) and, where
    it can name it, the frame of the value they came from (`embed`: the axes of that value it
    runs along). Where both meet again in one value's mask (a row's `logsumexp` and the lanes a
    gather picks from it), each lane of the conjunction implies the OR over its row: the term is
    absorbed (`_simplify`, through `reduced`).

    `static`: the mask depends on shapes only (what a `slice` or a `pad` keeps). A mask made of
    static ones and of predicates computed from constants costs nothing at run time (it is
    computed when jaxsafe traces, `_masks.at_trace_time`).

    `reads`: the mask of an operand whose equation's results are all live: it only says which
    lanes the equation reads (a diagonal), the same in every batch element.

    `lanes`: where a static mask is known as an array (the rows a `slice` keeps), its value
    over the literal's axes, in the order it embeds them: a coarse guard may read it as it
    reads a predicate (`named_along`).

    `output`: the mask a loop's body is given for one of its outputs (a scan's carry, the same
    at every step), as (its index, the output's shape, the axes the mask runs along): a coarse
    guard in that body reads it as it reads a predicate, from the mask (`_emit.py`). Foreign to
    a body nested in it (`foreign_keys_unknown`).

    `wins`: the mask of an operand of a `max` or `min` that holds where the operand wins or
    ties, as (the equation, the operand's index): where it fails, the other operand beats it
    strictly, and neither is NaN (`_by_hand.HandGuards.finite_where_dropped`)."""
    __slots__ = ("parts", "embed", "static", "reads", "lanes", "output", "wins")

    def __init__(self, parts: frozenset | None = None, embed: tuple | None = None,
                 static: bool = False, reads: bool = False, lanes: np.ndarray | None = None,
                 output: tuple | None = None, wins: tuple | None = None):
        self.parts, self.embed, self.static, self.reads = parts, embed, static, reads
        self.lanes, self.output, self.wins = lanes, output, wins

    @property
    def reduced(self) -> frozenset | None:
        """The conjunction an OR collapsed, where its frame is known (else None)."""
        return self.parts if self.embed is not None else None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"?{id(self) % 10000}"


def unknown(axes: Iterable[int] | None, static: bool = False,
            lanes: np.ndarray | None = None, wins: tuple | None = None) -> Lit:
    """A fresh unknown mask over `axes` of a value (None: every axis); `static`: it depends on
    shapes only; `lanes`: its value over `axes` (sorted), where known (`Unknown.lanes`);
    `wins`: the `max`/`min` operand it is the winning lanes of (`Unknown.wins`)."""
    return (Unknown(static=static or lanes is not None, lanes=lanes, wins=wins), True,
            None if axes is None else tuple(sorted(set(axes))))


def named_key(key: object) -> bool:
    """Whether a coarse guard can read the literals of `key` as it runs: a predicate of the
    program, a static mask known as an array (`Unknown.lanes`), or the mask a body is given for
    an output (`Unknown.output`)."""
    return isinstance(key, Var) or isinstance(key, Unknown) and (
        key.lanes is not None or key.output is not None)


def output_mask_literal(index: int, shape: Sequence[int], axes: Sequence[int]) -> Lit:
    """The literal of the mask a body is given for its output `index` (of `shape`), along
    `axes` of it (`Unknown.output`)."""
    axes = tuple(sorted(axes))
    return (Unknown(output=(index, tuple(shape), axes)), True, axes)


def made_of(sym: Sym, constant: Callable[[object], bool]) -> bool:
    """Whether every literal of `sym` is a static mask, a key `constant` accepts, or an OR over
    axes of such literals (iterative)."""
    pending = [lit for term in sym for lit in term]
    while pending:
        key = pending.pop()[0]
        if isinstance(key, Unknown):
            if key.static:
                continue
            if key.parts is None:
                return False
            pending.extend(key.parts)
        elif not constant(key):
            return False
    return True


def opaque(reads: bool = False) -> Sym:
    """A fresh unknown mask that may depend on every axis (`reads`: `Unknown.reads`)."""
    return frozenset({frozenset({(Unknown(reads=reads), True, None)})})


def given_mask(sym: Sym, index: int, shape: Sequence[int]) -> Sym:
    """The formula of a body's output `index` (of `shape`) whose mask the body is given (a
    loop's, a `cond`'s, a checkpoint's): `sym` where a coarse guard there can read every
    literal of it; otherwise one literal naming the given mask, along the axes `sym` runs
    along (`output_mask_literal`: a ReLU after a matmul in the body drops lanes by value, and
    the row mask the body is given still names its padded rows)."""
    if sym in (TRUE, FALSE) or all(named_key(lit[0]) for term in sym for lit in term):
        return sym
    axes = set()
    for term in sym:
        for lit in term:
            axes |= set(range(len(shape))) if lit[2] is None else \
                {e for e in lit[2] if e is not None}
    return frozenset({frozenset({output_mask_literal(index, shape, sorted(axes))})})


def foreign_keys_unknown(sym: Sym, own: Container, outputs: bool = True) -> Sym:
    """`sym` with each literal whose key is a variable not in `own` (another program's
    predicate), or the mask a body is given for an output unless `outputs` (the formulas of
    a body nested in it: it is given other masks), made a fresh unknown on the same axes:
    coarser, never finer."""
    def local(lit: Lit) -> Lit:
        key, _, embed = lit
        if isinstance(key, Unknown) and (key.output is None or outputs) or \
                not isinstance(key, Unknown) and key in own:
            return lit
        return (Unknown(), True, None if embed is None else
                tuple(sorted({e for e in embed if e is not None})))
    if sym in (TRUE, FALSE):
        return sym
    return _simplify({frozenset(local(lit) for lit in term) for term in sym})


def one_step(sym: Sym) -> Sym:
    """The formula of one step of a stacked value whose formula is `sym` (axis 0 the step): each
    literal an unknown over the other axes, moved down one (a literal along the steps is a
    different mask at each step, still the same along the axes it does not run along)."""
    def step(lit: Lit) -> Lit:
        embed = lit[2]
        return (Unknown(), True,
                None if embed is None else tuple(e - 1 for e in embed if e is not None and e != 0))
    if sym in (TRUE, FALSE):
        return sym
    return _simplify({frozenset(step(lit) for lit in term) for term in sym})


def negate(lit: Lit) -> Lit:
    return (lit[0], not lit[1], lit[2])


def _contradicts(term: Term) -> bool:
    return any(negate(lit) in term for lit in term)


def _implied_by_reduction(t: Term, u: Term) -> bool:
    """Whether `u` holds wherever `t` does because `u` is `t`'s own OR over some axes: `u` has
    an unknown that an OR collapsed from literals that `t` holds, in the same frame (`t`'s
    embedding of them, which only a value of that frame can carry: a literal on every axis
    never crosses a move), and `t` holds the rest of `u`."""
    for lit in u:
        key, positive, embed = lit
        if positive and isinstance(key, Unknown) and key.reduced is not None and \
                embed == key.embed and key.reduced <= t and (u - {lit}) <= t:
            return True
    return False


def _absorbed_by_reductions(terms: set) -> set:
    """The terms that imply a term no other term implies (`_implied_by_reduction`). Defined on
    the set, not on an order of visiting it, so that every process (and every trace) simplifies
    a mask to the same formula; a cycle of terms implying each other has no such term and stays
    as it is."""
    implied = {t: {u for u in terms if u != t and _implied_by_reduction(t, u)} for t in terms}
    final = {t for t in terms if not implied[t]}
    return {t for t in terms if implied[t] & final}


def _simplify(terms: set) -> Sym:
    terms = {t for t in terms if not _contradicts(t)}
    changed = True
    while changed:
        changed = False
        for t in list(terms):  # absorption: a & b | a == a
            if any(u < t for u in terms):
                terms.discard(t)
                changed = True
        absorbed = _absorbed_by_reductions(terms) if any(
            isinstance(lit[0], Unknown) and lit[0].reduced is not None
            for t in terms for lit in t) else set()
        if absorbed:
            terms -= absorbed
            changed = True
        for t in list(terms):  # a & p | a & ~p == a
            for lit in t:
                other = (t - {lit}) | {negate(lit)}
                if other in terms:
                    terms.discard(t)
                    terms.discard(other)
                    terms.add(t - {lit})
                    changed = True
                    break
            if changed:
                break
        if len(terms) > MAX_TERMS:
            return opaque()
    return frozenset(terms)


def sym_or(a: Sym, b: Sym) -> Sym:
    if not a or b == TRUE:
        return b
    if not b or a == TRUE:
        return a
    return _simplify(set(a) | set(b))


def sym_and(a: Sym, b: Sym) -> Sym | None:
    """a & b, or None when the product has too many terms to track."""
    if a == TRUE or not b:
        return b
    if b == TRUE or not a:
        return a
    if len(a) * len(b) > 4 * MAX_TERMS:
        return None
    out = _simplify({ta | tb for ta in a for tb in b})
    return None if len(out) > MAX_TERMS else out


def sym_and_literal(a: Sym, lit: Lit) -> Sym:
    negated = negate(lit)
    return _simplify({t | {lit} for t in a if negated not in t})


def split_on(sym: Sym, lit: Lit) -> tuple[Sym, Sym]:
    """`sym`'s lanes where `lit` fails and where it holds: what a boolean `select_n`'s output
    lanes `sym` ask of its two cases."""
    return sym_and_literal(sym, negate(lit)), sym_and_literal(sym, lit)


def join_on(lit: Lit, when_false: Sym, when_true: Sym) -> Sym:
    """A boolean `select_n`'s output lanes from its cases': `when_false` where `lit` fails,
    `when_true` where it holds."""
    return sym_or(sym_and_literal(when_false, negate(lit)), sym_and_literal(when_true, lit))


def sym_not(a: Sym) -> Sym | None:
    """The complement, or None when it has too many terms to track."""
    out: Sym | None = TRUE
    for term in a:
        if not term:
            return FALSE
        out = sym_and(out, frozenset(frozenset({negate(lit)}) for lit in term))
        if out is None:
            return None
    return out


def disjoint(a: Sym, b: Sym) -> bool:
    """Whether no lane can satisfy both: every pair of terms holds a literal and its negation."""
    return all(any(negate(lit) in tb for lit in ta) for ta in a for tb in b)


def implies(a: Sym, b: Sym) -> bool:
    """Whether every lane in `a` is in `b`: each term of `a` holds every literal of some term of
    `b`, itself or through a predicate it forces in every lane (`forced_everywhere`); a
    conservative test: False when it cannot tell."""
    for ta in a:
        forced = forced_everywhere(ta)
        if not any(tb <= ta or forced and all(lit in ta or forced.get(lit[0]) is lit[1]
                                              for lit in tb) for tb in b):
            return False
    return True


def forced_everywhere(term: Term) -> dict:
    """The predicates `term` decides in every lane of every frame, with their values: where an
    OR of one literal over every lane of a value fails (`not any(p)`: the negated unknown of a
    full reduction, whose frame is `()`), that literal fails in every lane, and a literal is
    carried only along axes kept whole, so it covers every lane of its predicate."""
    forced: dict = {}
    for key, positive, embed in term:
        if positive or not isinstance(key, Unknown) or embed != () or key.embed != () \
                or key.parts is None or len(key.parts) != 1:
            continue
        (part_key, part_positive, _), = key.parts
        if not isinstance(part_key, Unknown):
            forced[part_key] = not part_positive
    return forced


def runs_only_along(sym: Sym, axes: Iterable[int]) -> bool:
    """Whether every literal of `sym` runs along `axes` only: the mask is the same along every
    other axis, so an OR over those axes costs nothing at run time."""
    axes = set(axes)
    return all(embed is not None and all(e is None or e in axes for e in embed)
               for term in sym for _, _, embed in term)


def named_along(sym: Sym, axes: Iterable[int],
                known: Callable[[object], np.ndarray | None] | None = None) -> Sym:
    """A coarser mask (more lanes live) that runs along `axes` only and that the program's
    predicates and known static masks alone name (`named_key`): each term keeps its literals
    keyed by those on those axes and drops the rest (unknowns, literals on other axes). A
    predicate whose value `known` gives (a dense padding mask closed over) is ORed over the
    other axes instead, into a static mask known lane by lane: a row it drops whole stays
    dropped. TRUE where a term keeps nothing."""
    axes = set(axes)
    terms = set()
    for term in sym:
        kept, holds = set(), True
        for lit in term:
            key, positive, embed = lit
            if named_key(key) and embed is not None and all(e is None or e in axes
                                                            for e in embed):
                kept.add(lit)
                continue
            reduced = _or_off_axes(lit, axes, known)
            if reduced is True or reduced is None:
                continue
            if reduced is False:
                holds = False
                break
            kept.add(reduced)
        if not holds:
            continue
        if not kept:
            return TRUE
        terms.add(frozenset(kept))
    out = _simplify(terms)
    return out if all(named_key(lit[0]) for term in out for lit in term) else TRUE


def _or_off_axes(lit: Lit, axes: set, known: Callable[[object], np.ndarray | None] | None
                 ) -> Lit | bool | None:
    """A literal whose key's value is known, ORed over its axes outside `axes`: a static
    literal known lane by lane on the others, or a constant (True where some lane holds); None
    where its value is not known."""
    key, positive, embed = lit
    if embed is None:
        return None
    value = _key_value(key, known)
    if value is None or np.ndim(value) != len(embed):
        return None
    held = np.asarray(value).astype(bool) == positive
    off = tuple(j for j, e in enumerate(embed) if e is None or e not in axes)
    reduced = held.any(axis=off) if off else held
    on = [j for j, e in enumerate(embed) if e is not None and e in axes]
    if not on:
        return bool(reduced)
    return (Unknown(static=True, lanes=np.asarray(reduced)), True,
            tuple(embed[j] for j in on))


def _key_value(key: object, known: Callable[[object], np.ndarray | None] | None
               ) -> np.ndarray | None:
    """A literal key's value over its axes where known now: a static mask known as an array
    (`Unknown.lanes`), read as a predicate whose value `known` gives is; else None."""
    if isinstance(key, Unknown):
        return key.lanes
    return known(key) if known is not None and isinstance(key, Var) else None


def key_layout(key_shape: Sequence[int], embed: Sequence[int | None]
               ) -> tuple[tuple[int, ...], list[int], list[int]]:
    """How a literal's key lies on a value: the sizes of the key's axes that embed somewhere
    (the others have size 1), the transpose that puts them in the value's order, and the
    value's axes they then run along, in order. One answer for the mask computed now
    (`known_lanes`) and the one emitted (`_masks.of_predicates`)."""
    placed = [(j, e) for j, e in enumerate(embed) if e is not None]
    order = sorted(range(len(placed)), key=lambda i: placed[i][1])
    return (tuple(key_shape[j] for j, _ in placed), order, [placed[i][1] for i in order])


def known_lanes(sym: Sym, shape: Sequence[int]) -> np.ndarray | None:
    """The value over a value of `shape` of a formula of static masks known as arrays
    (`Unknown.lanes`) alone, computed now; None where it has another literal."""
    out = np.zeros(tuple(shape), bool)
    for term in sym:
        held = np.ones(tuple(shape), bool)
        for key, positive, embed in term:
            if not isinstance(key, Unknown) or key.lanes is None or embed is None:
                return None
            held &= _placed(np.asarray(key.lanes), embed, shape) == positive
        out |= held
    return out


def relaxed_lanes(sym: Sym, shape: Sequence[int],
                  known: Callable[[object], np.ndarray | None]) -> np.ndarray:
    """A mask over a value of `shape` that holds wherever `sym` may: its literals known now (a
    static mask known as an array, a predicate whose value `known` gives) evaluated, every
    other literal taken to hold, whichever its sign (a choice made at run time)."""
    out = np.zeros(tuple(shape), bool)
    for term in sym:
        held = np.ones(tuple(shape), bool)
        for lit in term:
            key, _, embed = lit
            value = _key_value(key, known)
            if value is None or embed is None or np.ndim(value) != len(embed):
                continue
            held &= held_lanes(lit, value, shape)
        out |= held
    return out


def held_lanes(lit: Lit, value: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Where the literal `lit`, whose key holds `value` (over the key's axes), holds on a value
    of `shape`: a boolean array of that shape."""
    _, positive, embed = lit
    assert embed is not None
    placed = _placed(np.asarray(value).astype(bool), embed, shape) == positive
    return np.broadcast_to(placed, tuple(shape))


def _placed(lanes: np.ndarray, embed: Sequence[int | None], shape: Sequence[int]) -> np.ndarray:
    """A literal's key value (over the key's axes) laid on a value of `shape`, broadcastable."""
    sizes, order, axes = key_layout(lanes.shape, embed)
    core = np.transpose(np.reshape(lanes, sizes), order)
    place = [1] * len(shape)
    for axis, size in zip(axes, core.shape, strict=True):
        place[axis] = size
    return np.reshape(core, place)


class Connective(enum.Enum):
    """The boolean operation that computes a predicate from others (`m_i[:, None] & m_j`)."""
    AND = "and"
    OR = "or"
    NOT = "not"


Expansion = Callable[[Var], "tuple[Connective, list[Lit]] | None"]
"""A predicate's connective and its operands' literals (each over the predicate's own axes),
where the program computes it from other predicates; None otherwise."""


def _expanded(lit: Lit, expansion: Expansion) -> Sym | None:
    """The formula of one literal over the predicates its key is computed from, or None."""
    key, positive, embed = lit
    if not isinstance(key, Var) or embed is None:
        return None
    found = expansion(key)
    if found is None:
        return None
    connective, parts = found
    parts = [(k, p, tuple(None if e is None else embed[e] for e in part_embed))
             for k, p, part_embed in parts]
    if connective is Connective.NOT:
        return frozenset({frozenset({parts[0] if not positive else negate(parts[0])})})
    conjunction = (connective is Connective.AND) == positive
    parts = parts if positive else [negate(q) for q in parts]
    if conjunction:
        return frozenset({frozenset(parts)})
    return frozenset(frozenset({q}) for q in parts)


def expand_connectives(sym: Sym, expansion: Expansion, rounds: int = 4) -> Sym:
    """`sym` over the predicates that its predicates are computed from by `and`, `or` and `not`
    (`m[:, None] & m[None, :]` as its two row literals), so that a literal over several axes may
    split into literals over fewer (`named_along`). The same lanes; `sym` itself where the
    formula would grow past `MAX_TERMS`."""
    for _ in range(rounds):
        terms: set = set()
        grew = False
        for term in sym:
            product: Sym | None = TRUE
            for lit in term:
                part = _expanded(lit, expansion)
                grew = grew or part is not None
                product = sym_and(product, part if part is not None else
                                  frozenset({frozenset({lit})}))
                if product is None:
                    return sym
            terms |= product
            if len(terms) > MAX_TERMS:
                return sym
        if not grew:
            return sym
        simplified = _simplify(terms)
        if len(simplified) > MAX_TERMS or any(  # `_simplify` gave up: an opaque mask
                isinstance(lit[0], Unknown) and lit[2] is None for t in simplified for lit in t):
            return sym
        sym = simplified
    return sym


# --------------------------------------------------------------------------- moving masks

_MISSING = object()


def move(sym: Sym, mapping: dict[int, int]) -> Sym:
    """The mask of a value whose lanes read (or are read by) the lanes of another along
    `mapping` (the other's axis -> this value's axis): an OR over the other's axes that are not
    in `mapping`. Literals on those axes become one fresh unknown, on the axes they also
    embedded; the literals that avoid them carry over exactly."""
    if sym in (TRUE, FALSE):
        return sym
    targets = set(mapping.values())
    inverse = {t: a for a, t in mapping.items()}
    terms = set()
    for term in sym:
        kept, touched, gone = [], set(), []
        for lit in term:
            key, positive, embed = lit
            if embed is None:
                gone.append(lit)
                touched |= targets
                continue
            new = tuple(None if e is None else mapping.get(e, _MISSING) for e in embed)
            if any(e is _MISSING for e in new):
                gone.append(lit)
                touched.update(e for e in new if e is not None and e is not _MISSING)
            else:
                kept.append((key, positive, new))
        gone, holds = _or_known(gone, mapping)
        if not holds:
            continue
        if gone:
            axes = tuple(sorted(touched))
            # the frame of the collapsed literals, where this value's axes are that frame's
            # own (not two axes onto one, not a transpose: `_implied_by_reduction` compares)
            source = axes if len(inverse) == len(mapping) and \
                all(inverse[a] == a for a in axes) else None
            kept.append((Unknown(frozenset(gone), source), True, axes))
        terms.add(frozenset(kept))
    return _simplify(terms)


def _or_known(gone: list[Lit], mapping: dict[int, int]) -> tuple[list[Lit], bool]:
    """The OR over the axes `move` collapses of a term's literals on them: a static literal
    known lane by lane (`Unknown.lanes`: the stretch of a split), on collapsed axes alone that
    no other literal shares, ORs on its own into a constant: it goes where some lane holds; the
    term is false (False) where none does. The other literals, for an unknown."""
    left, holds = [], True
    for i, lit in enumerate(gone):
        key, positive, embed = lit
        axes = set() if embed is None else {e for e in embed if e is not None}
        alone = embed is not None and not axes & set(mapping) and not any(
            other[2] is None or axes & set(other[2]) for j, other in enumerate(gone) if j != i)
        if alone and isinstance(key, Unknown) and key.lanes is not None:
            holds = holds and bool((np.asarray(key.lanes) == positive).any())
        else:
            left.append(lit)
    return left, holds


def backward_mapping(align: Sequence[int | None]) -> dict[int, int]:
    """`align[i]`: the output axis that operand axis i runs along (None: none does)."""
    return {o: i for i, o in enumerate(align) if o is not None}


def forward_mapping(align: Sequence[int | None]) -> dict[int, int]:
    return {i: o for i, o in enumerate(align) if o is not None}


def predicate_literal(pred: Var, positive: bool,
                      broadcast_of: Callable[[Var], JaxprEqn | None],
                      same_as: Callable[[Var], Var] | None = None) -> Lit:
    """The literal `pred` (or its negation) over a value of `pred`'s shape (or any shape, for a
    scalar `pred`), followed back through broadcasts (`broadcast_of` gives the broadcast that
    computes a variable, if one does), so that a row mask broadcast over a row stays a literal
    on the row's axes only; `same_as` names a predicate the program computes twice by its
    first copy."""
    shape = shape_of(pred)
    embed = tuple(i if n != 1 else None for i, n in enumerate(shape))
    key = pred
    while True:
        if same_as is not None:
            twin = same_as(key)
            if shape_of(twin) != shape_of(key):  # the same lanes, with other size-1 axes
                embed = _reembed(embed, shape_of(key), shape_of(twin))
            key = twin
        eqn = broadcast_of(key)
        if eqn is None:
            break
        src = eqn.invars[0]
        if isinstance(src, Literal) or dtype_of(src) != dtype_of(key):
            break
        in_shape, out_shape = shape_of(src), shape_of(key)
        embed = tuple(embed[d] if in_shape[j] == out_shape[d] and in_shape[j] != 1 else None
                      for j, d in enumerate(eqn.params["broadcast_dimensions"]))
        key = src
    return (key, positive, embed)


def _reembed(embed: tuple, shape: tuple, twin_shape: tuple) -> tuple:
    """`embed` of a key of `shape` for its twin of `twin_shape` (the same axes of size above 1,
    in order; its size-1 axes embed nowhere)."""
    big = iter(e for e, n in zip(embed, shape, strict=True) if n != 1)
    return tuple(next(big) if n != 1 else None for n in twin_shape)
