"""Evaluating equations while the rewrite is planned, on small concrete values.

The static passes fold predicates computed from literals (`_liveness.Sweep.constant`), compute
what a value holds in its dropped lanes (`_dropped.DroppedValues`) and check that a primitive and
its derivatives are finite at a point (`finite_with_derivatives`). All of them evaluate through
`fold`, on the host, even while an outer `jit` is tracing.

Both are memoized (`_Memo`): an unrolled program asks the same question of every step (is
`sqrt` finite at the safe value 1?), and each answer is an eager JAX call with its derivative.
A question is remembered only when it is plain data: a primitive without bodies, parameters of
plain types and small concrete operands.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._atoms import SMALL_CONSTANT, dtype_of, float_info, literal_value, shape_of
from ._compat import JaxprEqn, Literal, Tracer, Var, bind_eqn
from ._rules import rule_for

_PLAIN = (type(None), bool, int, float, complex, str, np.dtype, np.generic, enum.Enum)
_MEMO_BYTES = 1024  # operands larger than this are not remembered
_MEMO_ENTRIES = 4096


def _plain_params(params: dict) -> Hashable | None:
    """`params` as a hashable key, or None where a value is not plain data (a jaxpr, a
    sharding, a function): such an equation is evaluated every time."""
    items = tuple(sorted(params.items()))
    stack: list = [v for _, v in items]
    while stack:
        value = stack.pop()
        if isinstance(value, tuple):  # NamedTuples (dimension numbers) too
            stack.extend(value)
        elif not isinstance(value, _PLAIN):
            return None
    return items


def _operand_key(value: Any) -> Hashable | None:
    if isinstance(value, Tracer):
        return None
    array = np.asarray(value)
    if array.nbytes > _MEMO_BYTES or array.dtype == object:
        return None
    # the dtype itself: `.str` is `<V1` for every 1-byte `ml_dtypes` type
    return array.dtype, array.shape, array.tobytes()


class _Memo:
    """Answers by (question, primitive, parameters, operand values), bounded, thread-safe."""

    def __init__(self):
        self._answers: dict = {}
        self._lock = threading.Lock()

    def key(self, question: str, eqn: JaxprEqn, values: Sequence[Any]) -> Hashable | None:
        if rule_for(eqn.primitive).has_body:
            return None
        params = _plain_params(eqn.params)
        operands = [_operand_key(v) for v in values]
        if params is None or any(o is None for o in operands):
            return None
        return question, eqn.primitive, params, tuple(operands), jax.config.read("jax_enable_x64")

    def get(self, key: Hashable | None, compute: Callable[[], Any]) -> Any:
        if key is None:
            return compute()
        with self._lock:
            if key in self._answers:
                return self._answers[key]
        answer = compute()
        with self._lock:
            if len(self._answers) >= _MEMO_ENTRIES:
                self._answers.clear()
            self._answers[key] = answer
        return answer


_MEMO = _Memo()


def fold(eqn: JaxprEqn, values: Sequence[Any]) -> list[np.ndarray]:
    """`eqn`'s outputs on concrete operand values, as NumPy arrays (read-only: shared). Where
    the user's `jax_debug_nans` or `jax_debug_infs` stops it, the result holds NaN or inf in
    some lane: every lane reads as NaN (unknown, and possibly non-finite: no proof rests on it),
    and nothing is remembered."""
    try:
        return _MEMO.get(_MEMO.key("fold", eqn, values), lambda: _fold(eqn, values))
    except FloatingPointError:
        return [_unknown_float(o) for o in eqn.outvars]


def _unknown_float(var: Any) -> np.ndarray:
    dtype = dtype_of(var) if jnp.issubdtype(dtype_of(var), jnp.inexact) else np.float32
    out = np.full(shape_of(var), np.nan, dtype)
    out.setflags(write=False)
    return out


def _fold(eqn: JaxprEqn, values: Sequence[Any]) -> list[np.ndarray]:
    with jax.ensure_compile_time_eval():  # a constant, even while an outer jit traces
        outs = [np.array(out) for out in bind_eqn(eqn, list(values))]
    for out in outs:
        out.setflags(write=False)
    return outs


def small_constant(eqn: JaxprEqn | None,
                   limit: int = SMALL_CONSTANT) -> Generator[Any, Any, Any]:
    """The rule `demand` runs for a small value a program computes from literals alone (a
    selection's predicate): yields each variable operand of `eqn`, its producer, and receives
    its value; returns `eqn`'s folded output, or None where an operand is unknown or `eqn` does
    not fold here (not `foldable`, an effect, more than `limit` lanes, or a value bound to a
    sharding that refuses to fold outside its mesh)."""
    if (eqn is None or len(eqn.outvars) != 1 or eqn.effects
            or not rule_for(eqn.primitive).foldable
            or int(np.prod(shape_of(eqn.outvars[0]))) > limit):
        return None
    args = []
    for u in eqn.invars:
        value = (yield u) if isinstance(u, Var) else np.asarray(literal_value(u))
        if value is None:
            return None
        args.append(value)
    try:
        return fold(eqn, args)[0]
    except Exception:  # noqa: BLE001 - not foldable here (a sharding): left as it is
        return None


MAX_CHAIN_STEPS = 8
"""Equations a `lane_chain` follows back, at most."""


def lane_chain(atom: Any, producer_of: Callable[[Any], JaxprEqn | None],
               stop: Callable[[Any], bool]) -> tuple[list[JaxprEqn], Any] | None:
    """The equations that compute `atom` lane by lane from one variable, the first on the way
    back for which `stop` holds (`1 - float(p)` from `p`, `iota + 0` from `iota`): each
    elementwise and foldable, of one variable operand and scalar literals, the last first; and
    that variable. None where another equation or more than `MAX_CHAIN_STEPS` come between."""
    chain: list[JaxprEqn] = []
    for _ in range(MAX_CHAIN_STEPS):
        if not isinstance(atom, Var):
            return None
        if stop(atom):
            return chain, atom
        eqn = producer_of(atom)
        if eqn is None or len(eqn.outvars) != 1 or eqn.effects:
            return None
        rule = rule_for(eqn.primitive)
        operands = {u for u in eqn.invars if isinstance(u, Var)}
        if not rule.elementwise or not rule.foldable or len(operands) != 1 or any(
                np.ndim(literal_value(u)) != 0 for u in eqn.invars if isinstance(u, Literal)):
            return None
        chain.append(eqn)
        atom = operands.pop()
    return None


def fold_chain(chain: Sequence[JaxprEqn], value: Any) -> np.ndarray:
    """A `lane_chain`'s value, with `value` in place of its variable (any shape)."""
    out = np.asarray(value)
    for eqn in reversed(chain):
        out = np.asarray(fold(eqn, [out if isinstance(u, Var) else literal_value(u)
                                    for u in eqn.invars])[0])
    return out


PROOF_ORDER = 3
"""The order up to which a lower bound proves a unary primitive's domain (`_by_hand`,
`_sites`): Hessians and one more. A bound closer to 0 than that allows (`sqrt` under
`r2 > 1e-30`: its second derivative overflows there) keeps the guard."""


def domain_holds_above(eqn: JaxprEqn, point: Any) -> bool:
    """Whether a unary `decreasing` primitive is finite with its derivatives up to
    `PROOF_ORDER` at `point`, a lower bound of its operand: then at every operand above it. Not
    within the smallest normal number of its domain's `edge`: XLA flushes subnormals to zero
    on CPU (`sqrt` of one is 0, its derivative inf), and where it does not, `log`'s derivative
    overflows there."""
    point = np.asarray(point).reshape(())
    edge = rule_for(eqn.primitive).edge
    past = float(point) - edge  # float64: `-.999 - -1.` is exact enough
    return bool(past >= float_info(point.dtype).tiny) and finite_with_derivatives(
        eqn, [point], PROOF_ORDER)


ABOVE_END = 1e-3
"""The relative margin past a range's upper end at which `domain_holds_below` evaluates: XLA's
`exp` is faithful to a few ulps, not correctly rounded, and the range's end is itself a
bound."""


def domain_holds_below(eqn: JaxprEqn, point: Any) -> bool:
    """Whether a unary `increasing` primitive (`exp`) is finite with its derivatives up to
    `PROOF_ORDER` a little above `point`, an upper bound of its operand: then at every operand
    below it (-inf included: `exp` and its derivatives are 0 there)."""
    point = np.asarray(point).reshape(())
    if not np.isfinite(point):
        return False
    with np.errstate(over="ignore"):
        past = np.asarray(float(point) + abs(float(point)) * ABOVE_END + ABOVE_END, point.dtype)
    return bool(np.isfinite(past)) and finite_with_derivatives(eqn, [past], PROOF_ORDER)


def domain_holds_between(eqn: JaxprEqn, k: int, lo: Any, hi: Any, point: Sequence[Any]) -> bool:
    """Whether `eqn` (`PrimitiveRule.ranged_operand` k: monotone with each derivative in k over
    (0, inf), the other operands constant) is finite with its derivatives in operand k up to
    `PROOF_ORDER` at both ends of [lo, hi], the range of operand k: then at every value
    between. `point`: the other operands' values (k's is ignored). Not below the smallest
    normal number (see `domain_holds_above`)."""
    lo, hi = np.asarray(lo).reshape(()), np.asarray(hi).reshape(())
    if not (lo >= float_info(lo.dtype).tiny and np.isfinite(hi) and lo <= hi):
        return False
    ends = [[end if j == k else p for j, p in enumerate(point)] for end in (lo, hi)]
    return all(finite_with_derivatives(eqn, end, PROOF_ORDER, wrt=k) for end in ends)


def finite_with_derivatives(eqn: JaxprEqn, point: Sequence[Any], order: int = 1,
                            wrt: int | None = None) -> bool:
    """Whether `eqn`'s output and its first derivative in each floating-point operand (or in
    operand `wrt` only) are finite at `point` (one value per operand). False where JAX defines
    no such derivative. With `order` > 1 (one floating-point operand only, or `wrt`), the
    derivatives up to that order too, as far as JAX defines them."""
    try:
        return _MEMO.get(_MEMO.key(f"finite{order}:{wrt}", eqn, point),
                         lambda: _finite_with_derivatives(eqn, point, order, wrt))
    except FloatingPointError:  # the user's jax_debug_nans/infs met a NaN or inf: no proof
        return False


def _finite_with_derivatives(eqn: JaxprEqn, point: Sequence[Any], order: int,
                             wrt: int | None) -> bool:
    point = [np.asarray(p).reshape(()) if np.size(p) == 1 else np.asarray(p) for p in point]
    floats = [j for j, p in enumerate(point) if jnp.issubdtype(p.dtype, jnp.inexact)
              and (wrt is None or j == wrt)]
    if any(j in rule_for(eqn.primitive).no_derivative for j in floats):
        return False

    def op(*xs):
        vals = list(point)
        for j, x in zip(floats, xs, strict=True):
            vals[j] = x
        return bind_eqn(eqn, vals)[0]

    with jax.ensure_compile_time_eval():
        args = [point[j] for j in floats]
        outs = [np.asarray(op(*args))]
        if order > 1:  # one operand: each derivative from the one before
            if len(floats) != 1:
                return False
            derivative = op
            for _ in range(order):
                derivative = _derivative_of(derivative)
                try:
                    outs.append(np.asarray(derivative(args[0])))
                except NotImplementedError:  # JAX has no rule past it: no program gets there
                    break
        for j in range(len(floats) if order == 1 else 0):
            tangents = [np.ones_like(a) if n == j else np.zeros_like(a)
                        for n, a in enumerate(args)]
            outs.append(np.asarray(jax.jvp(op, args, tangents)[1]))
    return all(bool(np.all(np.isfinite(o))) for o in outs)


def _derivative_of(fn: Callable) -> Callable:
    return lambda x: jax.jvp(fn, (x,), (jax.numpy.ones_like(x),))[1]
