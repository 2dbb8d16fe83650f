"""The public entry points: `nan_safe` and `make_jaxpr`, with the per-signature cache."""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import numbers
import threading
import traceback
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from . import _guards
from ._by_value import concrete_values, make_jaxpr_by_value
from ._collector import fewer_collections
from ._compat import (
    ClosedJaxpr,
    Jaxpr,
    Tracer,
    axis_sizes_now,
    batching_a_named_axis,
    differentiated_while_staging,
    differentiating_now,
    eval_jaxpr,
    trace_context,
    with_axis_sizes,
    with_leading_arg_names,
)
from ._replay import replay
from ._report import Report
from ._rewrite import has_backward_rules, rewrite_with_report, values_of

DEFAULT_CACHE_SIZE = 256
"""Signatures (shapes, dtypes, static values) remembered per `nan_safe` function."""


class DataDependentShapeError(TypeError):
    """A value's shape depends on the data (`x[mask]`, `jnp.nonzero(m)` without `size=`) and the
    values are not known (under jit or vmap): the program cannot be traced, so nan_safe cannot
    rewrite it. Called eagerly, such a function is traced at its values instead.

    Example:

        f = jaxsafe.nan_safe(lambda x: jnp.sum(jnp.sqrt(x[x > 0])))
        jax.grad(f)(x)           # eager: traced at the values
        jax.jit(jax.grad(f))(x)  # raises DataDependentShapeError: use jnp.where, or size=
    """


_CONTROL_FLOW_NOTE = (
    "nan_safe: under jit, vmap or a jitted grad, nan_safe traces the function as jax.jit does: "
    "write the branch with jnp.where or lax.cond, or mark the argument static "
    "(static_argnums=/static_argnames=); called eagerly, nan_safe reads an `if`, bool() or "
    "int() of a traced value at the call's values, but not float(), range(), a slice or a "
    "shape, which need the argument static.")
"""The line nan_safe adds to JAX's error for Python control flow on a traced value."""

_BY_VALUE_NOTE = (
    "nan_safe: called eagerly, nan_safe traced the function at the values, which answers an "
    "`if`, bool() or int() of a traced value but not every conversion (float(), for one), nor "
    "one of a float that is being differentiated (its derivative would be lost). Mark a Python "
    "number that the function converts static (static_argnums=/static_argnames=), or write "
    "the branch with jnp.where or lax.cond.")
"""The line nan_safe adds to JAX's error when even the trace at the values needs a value."""

_NEEDS_VALUES = (jax.errors.NonConcreteBooleanIndexError, jax.errors.ConcretizationTypeError)
"""Errors of a trace that asked for a value: an eager call retries with the values in hand."""


_OWN_FRAMES = ("/jax/", "/jaxlib/", "/jaxsafe/", "/contextlib.py", "/functools.py")


def _shape_from_data(e: Exception) -> bool:
    """A boolean mask index, or a `size=` that JAX asks for (`jnp.nonzero`, `jnp.unique`); not
    Python control flow on a traced value (JAX's own error says what to do there)."""
    return isinstance(e, jax.errors.NonConcreteBooleanIndexError) or (
        type(e) is jax.errors.ConcretizationTypeError and "size" in str(e))


def _data_dependent_message(fun: Callable, e: Exception, by_value: bool = False) -> str:
    frames = [fr for fr in traceback.extract_tb(e.__traceback__)
              if not any(part in fr.filename for part in _OWN_FRAMES)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" \
        if frames else ""
    line = f"\n    {frames[-1].line}" if frames and frames[-1].line else ""
    head = (f"nan_safe({getattr(fun, '__name__', 'f')}): the shape of a value{where} depends "
            f"on the data ({type(e).__name__}){line}\n")
    if by_value:
        return head + (
            "Called eagerly, nan_safe traces at the values, but here JAX asks for the value of "
            "a float that is being differentiated (jnp.unique of it, for one): as a constant "
            "its derivative would be silently lost. Compute the shape from a value that is "
            "not differentiated (a boolean mask, integers), or use one of the two ways below.\n"
            "Under jit or vmap: select instead of indexing, `jnp.where(mask, v, 0.)`, or give "
            "the size, `jnp.nonzero(mask, size=n, fill_value=...)`.")
    return head + (
        "Under jit or vmap the values are abstract, so a boolean mask index (`v[mask]`), "
        "`jnp.nonzero`/`jnp.argwhere`/`jnp.compress` without `size=` or `jnp.unique` cannot be "
        "traced (an eager call, or an eager jax.grad, is traced at its values). Two ways out: "
        "select instead of indexing, `jnp.where(mask, v, 0.)` (then sum or reduce as before), "
        "or give the size, `jnp.nonzero(mask, size=n, fill_value=...)`.")


def _check_static_in_signature(fun: Callable, params: list | None, static_argnums: tuple,
                               static_argnames: tuple, who: str) -> None:
    """Positions and names that `fun` cannot take are errors, as `jax.jit` makes them (a
    signature that cannot be read, or one with *args / **kwargs, takes anything)."""
    if params is None:
        return
    name = getattr(fun, "__name__", "fun")
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not any(p.kind == p.VAR_POSITIONAL for p in params):
        n = len(positional)
        bad = [i for i in static_argnums if not -n <= i < n]
        if bad:
            raise ValueError(f"{who}: `static_argnums` {bad} out of range: `{name}` takes {n} "
                             f"positional argument{'s' if n != 1 else ''} "
                             f"({', '.join(positional)}).")
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        known = {p.name for p in params if p.kind != p.POSITIONAL_ONLY}
        bad_names = [a for a in static_argnames if a not in known]
        if bad_names:
            _refuse_static_names(name, params, bad_names, who)


def _refuse_static_names(name: str, params: list, bad_names: list[str], who: str) -> None:
    """The error for `static_argnames` that `fun` takes by no name: a positional-only
    parameter's (say its position, as `jax.jit` says it is positional-only) or none."""
    positions = {p.name: i for i, p in enumerate(params) if p.kind == p.POSITIONAL_ONLY}
    only = [a for a in bad_names if a in positions]
    if only:
        nums = [positions[a] for a in only]
        what = ("names a positional-only parameter", "it", nums[0]) if len(only) == 1 else \
            ("name positional-only parameters", "them", tuple(nums))
        raise ValueError(f"{who}: `static_argnames` {only} {what[0]} of `{name}`, which cannot "
                         f"be passed by name; mark {what[1]} static by position: "
                         f"static_argnums={what[2]}.")
    known = sorted(p.name for p in params if p.kind != p.POSITIONAL_ONLY)
    label = "the arguments it takes by name" if positions else "its arguments"
    raise ValueError(f"{who}: `static_argnames` {bad_names} name no argument of `{name}`; "
                     f"{label} are: {', '.join(known) or 'none'}.")


def _static_positions(static_argnums: Any, who: str) -> tuple[int, ...]:
    """`static_argnums` as a tuple of ints (None, an int, or a sequence of ints)."""
    if static_argnums is None:  # as jax.jit takes it
        return ()
    if isinstance(static_argnums, int | np.integer) and not isinstance(static_argnums, bool):
        return (int(static_argnums),)
    nums = None if isinstance(static_argnums, str | bytes) or \
        not isinstance(static_argnums, Iterable) else tuple(static_argnums)
    if nums is None or not all(isinstance(i, int | np.integer) and not isinstance(i, bool)
                               for i in nums):
        raise TypeError(f"{who}: `static_argnums` must be an int or a sequence of ints (argument "
                        f"positions), got {static_argnums!r}; name arguments with "
                        f"`static_argnames`.")
    return tuple(int(i) for i in nums)


def _static_names(static_argnames: Any, who: str) -> tuple[str, ...]:
    """`static_argnames` as a tuple of str (None, a str, or a sequence of str)."""
    if static_argnames is None:
        return ()
    if isinstance(static_argnames, str):
        return (static_argnames,)
    names = tuple(static_argnames) if isinstance(static_argnames, Iterable) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{who}: `static_argnames` must be a str or a sequence of str, "
                        f"got {static_argnames!r}.")
    return names


def _normalize_static(fun: Callable, static_argnums, static_argnames, who: str):
    static_argnums = _static_positions(static_argnums, who)
    static_argnames = _static_names(static_argnames, who)
    try:  # map names <-> positions the way jax.jit does
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = None
    _check_static_in_signature(fun, params, static_argnums, static_argnames, who)
    params = params or []
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    nums = set(static_argnums)
    names = set(static_argnames)
    for n in static_argnames:
        if n in positional:
            nums.add(positional.index(n))
    for i in static_argnums:
        if 0 <= i < len(positional):
            names.add(positional[i])
    return tuple(sorted(nums)), tuple(sorted(names))


def _keyword_names(fun: Callable, names: tuple[str, ...]) -> tuple[str, ...]:
    """`names` less the positional-only parameters of `fun`'s signature, which `jax.jit`
    rejects as static names (their positions are static already)."""
    try:
        params = inspect.signature(fun).parameters
    except (TypeError, ValueError):
        return names
    return tuple(n for n in names
                 if n not in params or params[n].kind != inspect.Parameter.POSITIONAL_ONLY)


# a ShapeDtypeStruct: `jaxsafe.make_jaxpr` and `explain` trace over shapes, as `jax.make_jaxpr`
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex, Tracer,
                jax.ShapeDtypeStruct)

FiniteArgs = bool | int | Sequence[int] | Any
"""`True`/`False`, argument positions, or a pytree prefix of booleans over the positional
arguments."""


def _is_position(x: Any) -> bool:
    """An argument position: any integer (a NumPy one too, as `static_argnums` takes), not a
    bool."""
    return isinstance(x, numbers.Integral | np.integer) and not isinstance(x, bool | np.bool_)


def _check_finite_args(finite_args: Any, who: str) -> Any:
    """Validate `finite_args` once, when the function is wrapped; returns its normal form: a
    bool, a frozenset of positions, or a tuple prefix of booleans."""
    if isinstance(finite_args, bool | np.bool_):
        return bool(finite_args)
    if _is_position(finite_args):
        return frozenset({int(finite_args)})
    leaves = jax.tree_util.tree_leaves(finite_args)
    if isinstance(finite_args, list | tuple) and finite_args and all(
            _is_position(x) for x in finite_args):
        return frozenset(int(x) for x in finite_args)
    if isinstance(finite_args, list | tuple) and all(isinstance(x, bool) for x in leaves):
        return tuple(finite_args)
    raise TypeError(
        f"{who}: `finite_args` must be True, False, an argument position, a sequence of "
        f"positions, or a tuple with one boolean (or a pytree of booleans) per positional "
        f"argument; got {finite_args!r}.")


def _check_finite_flags_fit(fun: Callable, finite_args: Any, who: str) -> None:
    """A tuple of flags longer than `fun`'s positional parameters names arguments that never
    come: an error when the function is wrapped (skipped for `*args` or no signature)."""
    if not isinstance(finite_args, tuple):
        return
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(finite_args) > len(positional):
        name = getattr(fun, "__name__", "the function")
        raise ValueError(
            f"{who}: `finite_args` gives {len(finite_args)} flags, but `{name}` takes "
            f"{len(positional)} positional argument(s) ({', '.join(positional) or 'none'}). "
            f"Give at most one flag per positional parameter (keyword-only arguments are "
            f"promised finite only by `finite_args=True`).")


def _finite_leaves(finite_args: Any, args: tuple, static_nums: set[int], kwargs: dict,
                   who: str) -> list[bool]:
    """One flag per leaf of the dynamic arguments, in `tree_flatten((dyn_args, kwargs))` order:
    whether the caller promised it finite. Keyword arguments are finite only with True."""
    n_kw = len(jax.tree_util.tree_leaves(kwargs))
    if isinstance(finite_args, bool):
        n = len(jax.tree_util.tree_leaves(
            tuple(a for i, a in enumerate(args) if i not in static_nums)))
        return [finite_args] * (n + n_kw)
    if isinstance(finite_args, frozenset):
        bad = sorted(p for p in finite_args if not -len(args) <= p < len(args))
        if bad:
            raise ValueError(
                f"{who}: `finite_args` names argument position(s) {bad}, but the function was "
                f"called with {len(args)} positional argument(s). Name positions it is called "
                f"with (keyword arguments are promised finite only by `finite_args=True`).")
    flags: list[bool] = []
    for i, arg in enumerate(args):
        if i in static_nums:
            continue
        count = len(jax.tree_util.tree_leaves(arg))
        if isinstance(finite_args, frozenset):
            flags.extend([i in finite_args or i - len(args) in finite_args] * count)
        elif i >= len(finite_args):
            flags.extend([False] * count)
        else:
            try:
                marked = jax.tree_util.tree_map(
                    lambda flag, sub: [flag] * len(jax.tree_util.tree_leaves(sub)),
                    finite_args[i], arg)
            except ValueError as e:
                raise ValueError(
                    f"{who}: `finite_args[{i}]` ({finite_args[i]!r}) is not a pytree prefix of "
                    f"positional argument {i}: {e}. Give one boolean for the whole argument, "
                    f"or a pytree of booleans with the argument's structure.") from None
            flags.extend(jax.tree_util.tree_leaves(marked))
    return flags + [False] * n_kw


def _is_array_leaf(leaf: Any) -> bool:
    """A leaf JAX can trace: an array, a NumPy or Python scalar, a tracer."""
    return isinstance(leaf, _ARRAY_TYPES) or hasattr(leaf, "__jax_array__")


class _StaticLeaf:
    """A leaf of a pytree argument that is not an array (a module's activation function, a
    string, a config object): part of the signature, as Equinox's filtered transformations
    treat it. Compared by value when hashable, else by identity (and kept alive by the cache
    key that holds it, so its id is not reused while the key exists)."""

    __slots__ = ("by_value", "value")

    def __init__(self, value: Any):
        self.value = value
        try:
            hash(value)
            self.by_value = True
        except TypeError:
            self.by_value = False

    def __hash__(self) -> int:
        return hash((type(self.value), self.value)) if self.by_value else id(self.value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _StaticLeaf) or other.by_value != self.by_value:
            return False
        if not self.by_value:
            return self.value is other.value
        try:
            return type(self.value) is type(other.value) and bool(self.value == other.value)
        except Exception:  # an __eq__ that returns no bool: the same object only
            return self.value is other.value


def _partition(leaves: list) -> tuple[list, tuple[tuple[int, _StaticLeaf], ...]]:
    """The array leaves, and the others with their positions (static)."""
    if all(isinstance(x, _ARRAY_TYPES) for x in leaves):
        return leaves, ()
    fixed = tuple((i, _StaticLeaf(x)) for i, x in enumerate(leaves) if not _is_array_leaf(x))
    return [x for x in leaves if _is_array_leaf(x)], fixed


def _merge(arrays: Sequence[Any], fixed: tuple[tuple[int, _StaticLeaf], ...]) -> list:
    """The leaves again: the static ones put back at their positions."""
    leaves = list(arrays)
    for i, leaf in fixed:
        leaves.insert(i, leaf.value)
    return leaves


def _tracers_as_arguments(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list]:
    """`closed` with the outer tracers it closes over (a value from an enclosing `grad`,
    `jit` or `vmap`) made its leading arguments, and those tracers. A constant is a value the
    analysis may read and that carries no derivative; a closed-over tracer is neither: it is
    an argument like the others, differentiated, never promised finite. As an argument it is
    not captured either, where a cached custom_jvp would keep it alive."""
    jaxpr = closed.jaxpr
    outer = [isinstance(c, Tracer) for c in closed.consts]
    if not any(outer):
        return closed, []
    pairs = list(zip(jaxpr.constvars, closed.consts, strict=True))
    hoisted = [v for (v, _), o in zip(pairs, outer, strict=True) if o]
    kept = [(v, c) for (v, c), o in zip(pairs, outer, strict=True) if not o]
    info = with_leading_arg_names(
        jaxpr.debug_info, [f"closed-over value {i}" for i in range(len(hoisted))])
    new = Jaxpr([v for v, _ in kept], [*hoisted, *jaxpr.invars], jaxpr.outvars, jaxpr.eqns,
                jaxpr.effects, info)
    return (ClosedJaxpr(new, [c for _, c in kept]),
            [c for c, o in zip(closed.consts, outer, strict=True) if o])


def _typed(static_pos: tuple, static_kw: tuple) -> tuple:
    """The static arguments with their types, for a cache key: `1`, `1.0` and `True` are equal
    and hash alike, yet `f` may read the type (`isinstance`, a dtype); `jax.jit` keeps them
    apart too."""
    return (tuple((i, type(v), v) for i, v in static_pos),
            tuple((k, type(v), v) for k, v in static_kw))


def _hashable(value: Any, where: str, who: str) -> Hashable:
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"{who}: static argument {where} of type {type(value).__name__} is not hashable; "
            f"static arguments must be hashable (as with jax.jit). Pass it as an array instead, "
            f"or convert it (a tuple for a list).") from None
    return value


class _Traced:
    """One signature's program and how to evaluate it on the current trace. The rewrite runs
    when first needed: when the call is differentiated (inside the rule of `values_of`), or
    asked for (`trace`, `explain`); a call that is only evaluated runs `f`'s own program and
    never pays for it."""

    def __init__(self, original: ClosedJaxpr, rewrite: Callable[[], tuple[ClosedJaxpr, Report]],
                 out_tree, use_jit: bool):
        self.out_tree = out_tree
        self._rewrite: Callable[[], tuple[ClosedJaxpr, Report]] | None = rewrite
        self._rewritten: tuple[ClosedJaxpr, Report] | None = None
        self._lock = threading.Lock()
        if not use_jit:
            # jit=False runs the rewritten program equation by equation: each primitive alone
            # gives the same bits in live lanes, and dropped lanes stay finite for
            # jax_debug_nans.
            closed = self.closed
            self.evaluate = functools.partial(eval_jaxpr, closed.jaxpr, closed.consts)
        else:
            self.evaluate = values_of(original, lambda: self.closed)
        # a call that a differentiating trace makes: a program with a custom_vjp call takes
        # the reverse-only join only where a differentiated argument reaches it
        self.evaluate_forward = values_of(original, lambda: self.closed, forward_mode=True) \
            if use_jit and has_backward_rules(original) else self.evaluate

    def rewritten(self) -> tuple[ClosedJaxpr, Report]:
        with self._lock:
            if self._rewritten is None:
                assert self._rewrite is not None
                self._rewritten = self._rewrite()
                self._rewrite = None  # the original program it closed over is held elsewhere
            return self._rewritten

    @property
    def closed(self) -> ClosedJaxpr:
        """The rewritten program (the original itself when nothing needs a guard)."""
        return self.rewritten()[0]

    @property
    def report(self) -> Report:
        return self.rewritten()[1]


def _rewrite_where_traced(axis_sizes: Sequence[tuple[Any, int]], closed: ClosedJaxpr,
                          finite: Sequence[bool]) -> tuple[ClosedJaxpr, Report]:
    """The rewrite, with the named axes bound where the program was traced: it may run later,
    outside them (`jax.grad(jax.jit(jax.vmap(nan_safe(f), axis_name="b")))`, whose rule JAX
    traces after the `vmap`), and the program may name them (`psum(x, "b")`)."""
    with with_axis_sizes(axis_sizes):
        return rewrite_with_report(closed, finite)


class NanSafeFunction:
    """`fun` with its dropped lanes made safe to differentiate; see `nan_safe`."""

    def __init__(self, fun: Callable, static_argnums, static_argnames, use_jit: bool,
                 cache_size: int, finite_args: Any = False):
        self._fun = fun
        self._given = (static_argnums, static_argnames, use_jit, cache_size, finite_args)
        self._finite_args = _check_finite_args(finite_args, "nan_safe")
        _check_finite_flags_fit(fun, self._finite_args, "nan_safe")
        self._static_argnums, self._static_argnames = _normalize_static(
            fun, static_argnums, static_argnames, "nan_safe")
        if not isinstance(use_jit, bool | np.bool_):
            raise TypeError(f"nan_safe: `jit` must be True or False, got {use_jit!r}.")
        self._use_jit = bool(use_jit)
        if not isinstance(cache_size, int) or isinstance(cache_size, bool) or cache_size < 0:
            raise TypeError(f"nan_safe: `cache_size` must be an int >= 0, got {cache_size!r}.")
        self._cache_size = cache_size
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._fronts: dict[bool, tuple[int, Callable]] = {}  # forward -> (generation, jit)
        self._leaf_jitted: Callable | None = None
        self._leaf_generation = -1
        self._static_leaves_seen = False  # a call had leaves that are not arrays
        # signatures whose trace asked for a value: later eager calls go straight to the
        # value tracer, without the jit front's and make_jaxpr's failed traces (LRU, as _cache)
        self._needs_values: collections.OrderedDict = collections.OrderedDict()
        # name, doc and __wrapped__ only: merging fun.__dict__ would let a jitted function's own
        # `_fun` (the undecorated Python function) replace ours and drop its custom rules
        functools.update_wrapper(self, fun, updated=())

    # -- copies ---------------------------------------------------------------------------
    def __copy__(self) -> NanSafeFunction:
        return self._over(self._fun)

    def __deepcopy__(self, memo: dict) -> NanSafeFunction:
        return self._over(copy.deepcopy(self._fun, memo))

    def _over(self, fun: Callable) -> NanSafeFunction:
        """A function over `fun` with these options and caches of its own: a lock, and traced
        programs whose tracebacks cannot be copied (a config or a model that holds a
        `nan_safe` loss is deep-copied)."""
        return NanSafeFunction(fun, *self._given)  # as the user gave them, checked again

    # -- signature ------------------------------------------------------------------------
    def _split(self, args: tuple, kwargs: dict):
        n = len(args)
        nums = {i % n if i < 0 else i for i in self._static_argnums if -n <= i < n}
        static_pos = tuple((i, _hashable(args[i], f"{i} (positional)", "nan_safe"))
                           for i in sorted(nums))
        static_kw = tuple(sorted((k, _hashable(v, f"'{k}'", "nan_safe"))
                                 for k, v in kwargs.items() if k in self._static_argnames))
        dyn_args = tuple(a for i, a in enumerate(args) if i not in nums)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        return static_pos, static_kw, dyn_args, dyn_kwargs

    def _flat_fun(self, static_pos, static_kw, in_tree, fixed):
        @functools.wraps(self._fun)  # JAX's error messages then name the user's function
        def flat(*leaves):
            dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(in_tree, _merge(leaves, fixed))
            args = list(dyn_args)
            for i, v in static_pos:
                args.insert(i, v)
            kwargs = dict(dyn_kwargs, **dict(static_kw))
            return self._fun(*args, **kwargs)
        return flat

    def _signature(self, args, kwargs):
        static_pos, static_kw, dyn_args, dyn_kwargs = self._split(args, kwargs)
        leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        leaves, fixed = _partition(leaves)
        avals = tuple(jax.typeof(x) for x in leaves)
        key = (in_tree, avals, _typed(static_pos, static_kw), fixed, _guards.GENERATION,
               trace_context())  # what jax.jit's cache keys by too: x64, promotion, ...
        return key, leaves, in_tree, avals, static_pos, static_kw, dyn_kwargs, fixed

    def _remember(self, store: collections.OrderedDict, key, value) -> bool:
        """Put `key` in an LRU store of `cache_size` entries; whether one was evicted."""
        with self._lock:
            store[key] = value
            store.move_to_end(key)
            evicted = len(store) > self._cache_size
            while len(store) > self._cache_size:
                store.popitem(last=False)
        return evicted

    def _known_to_need_values(self, args, kwargs) -> bool:
        """An eager call of a signature whose trace asked for a value before."""
        if not self._needs_values:
            return False
        try:
            key, leaves, *_ = self._signature(args, kwargs)
        except (TypeError, ValueError):
            return False
        return key in self._needs_values and concrete_values(leaves) is not None

    def _trace(self, args, kwargs) -> tuple[_Traced, list]:
        key, leaves, in_tree, avals, static_pos, static_kw, dyn_kwargs, fixed = \
            self._signature(args, kwargs)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit, leaves
        flat_fun = self._flat_fun(static_pos, static_kw, in_tree, fixed)
        by_value = False
        values = concrete_values(leaves) if key in self._needs_values else None
        if values is not None:
            closed, out_shape = self._trace_by_value(flat_fun, leaves, values)
            by_value = True
        else:
            try:
                closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*avals)
            except _NEEDS_VALUES as e:
                values = concrete_values(leaves)
                if values is None:  # under jit or vmap
                    if not _shape_from_data(e):  # Python control flow on a traced value
                        e.add_note(_CONTROL_FLOW_NOTE)
                        raise
                    raise DataDependentShapeError(_data_dependent_message(self._fun, e)) from e
                closed, out_shape = self._trace_by_value(flat_fun, leaves, values)
                by_value = True
                if self._cache_size:
                    self._remember(self._needs_values, key, True)
        finite = _finite_leaves(self._finite_args, args, {i for i, _ in static_pos},
                                dyn_kwargs, "nan_safe")
        if fixed:  # one flag per array leaf
            skip = {i for i, _ in fixed}
            finite = [f for i, f in enumerate(finite) if i not in skip]
        closed, closed_over = _tracers_as_arguments(closed)
        finite = [False] * len(closed_over) + list(finite)
        traced = _Traced(closed, functools.partial(_rewrite_where_traced, axis_sizes_now(),
                                                   closed, finite),
                         jax.tree_util.tree_structure(out_shape), self._use_jit)
        cacheable = not closed_over and self._cache_size and not by_value
        if cacheable and self._remember(self._cache, key, traced):
            # jax.jit keeps its own trace per signature: start a fresh front so that an
            # evicted signature's program is really released
            self._fronts.clear()
        return traced, [*closed_over, *leaves]

    def _trace_by_value(self, flat_fun: Callable, leaves: list, values: list):
        """The jaxpr at these values (`_by_value`); not cached: it holds for this call only."""
        try:
            return make_jaxpr_by_value(flat_fun, values,
                                       [isinstance(x, Tracer) for x in leaves])
        except _NEEDS_VALUES as e:
            if not _shape_from_data(e):
                e.add_note(_BY_VALUE_NOTE)
                raise
            raise DataDependentShapeError(
                _data_dependent_message(self._fun, e, by_value=True)) from e

    def _staged(self, *args, **kwargs):
        traced, leaves = self._trace(args, kwargs)
        return jax.tree_util.tree_unflatten(traced.out_tree, traced.evaluate(*leaves))

    def _staged_forward(self, *args, **kwargs):
        """`_staged` for a call that a differentiating trace makes (`_Traced.evaluate_forward`)."""
        traced, leaves = self._trace(args, kwargs)
        return jax.tree_util.tree_unflatten(traced.out_tree, traced.evaluate_forward(*leaves))

    def _replayed(self, args: tuple, kwargs: dict):
        """A call differentiated while the caller's program is staged: the rewritten program
        goes straight into the caller's trace (`_replay`), with neither the jit front nor the
        custom_jvp around it, whose linearization costs JAX more than the user's own code."""
        with fewer_collections():  # the trace, rewrite and replay allocate and free little
            traced, leaves = self._trace(args, kwargs)
            closed = traced.closed
            outs = replay(closed.jaxpr, closed.consts, *leaves)
        return jax.tree_util.tree_unflatten(traced.out_tree, outs)

    def _front(self, forward: bool = False) -> Callable:
        """`jax.jit` of the staged call: a cached call takes jit's C++ dispatch path, and a
        new signature traces (and rewrites) once. Re-made when a guard is registered. A call
        that a differentiating trace makes has a front of its own (`_staged_forward`)."""
        generation, jitted = self._fronts.get(forward, (-1, None))
        if jitted is None or generation != _guards.GENERATION or not self._cache_size:
            # cache_size=0: every call traces again, jax.jit's own trace cache included
            # a new callable each time: jax.jit shares its trace cache between jits of one
            # function, and the old traces hold the programs rewritten before the registration
            staged = self._staged_forward if forward else self._staged

            def front(*args, **kwargs):
                return staged(*args, **kwargs)
            # JAX's errors then name the user's function and arguments (`x`, not `args[0]`);
            # its static positions and names are ours (`_normalize_static` maps them alike)
            functools.update_wrapper(front, self._fun, updated=())
            jitted = jax.jit(front, static_argnums=self._static_argnums,
                             static_argnames=_keyword_names(self._fun, self._static_argnames))
            self._fronts[forward] = (_guards.GENERATION, jitted)
        return jitted

    def _validate(self, args: tuple, kwargs: dict) -> None:
        """Raise nan_safe's own error for bad arguments (names them, says what to do)."""
        self._split(args, kwargs)  # an unhashable static argument

    def _has_static_leaves(self, args: tuple, kwargs: dict) -> bool:
        leaves = jax.tree_util.tree_leaves(self._split(args, kwargs)[2:])
        return not all(_is_array_leaf(x) for x in leaves)

    def _leaf_front(self) -> Callable:
        """`jax.jit` over the array leaves only, the others static: for arguments with leaves
        that are not arrays (an Equinox module's functions), which `jax.jit` rejects."""
        if self._leaf_jitted is None or self._leaf_generation != _guards.GENERATION \
                or not self._cache_size:
            self._leaf_jitted = jax.jit(functools.partial(type(self)._staged_leaves, self),
                                        static_argnums=0)
            self._leaf_generation = _guards.GENERATION
        return self._leaf_jitted

    def _staged_leaves(self, spec, *arrays):
        tree, fixed, static_pos, static_kw, _, forward = spec
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(tree, _merge(arrays, fixed))
        args = list(dyn_args)
        for i, v in static_pos:
            args.insert(i, v)
        staged = self._staged_forward if forward else self._staged
        return staged(*args, **dyn_kwargs, **dict(static_kw))

    def _call_by_leaves(self, args: tuple, kwargs: dict, forward: bool):
        static_pos, static_kw, dyn_args, dyn_kwargs = self._split(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        arrays, fixed = _partition(leaves)
        spec = (tree, fixed, static_pos, static_kw, _typed(static_pos, static_kw), forward)
        return self._leaf_front()(spec, *arrays)

    def __call__(self, *args, **kwargs):
        if not self._use_jit or self._known_to_need_values(args, kwargs):
            return self._staged(*args, **kwargs)
        if differentiated_while_staging(args, kwargs):
            return self._replayed(args, kwargs)
        forward = differentiating_now()
        if batching_a_named_axis():  # no jit front (`batching_a_named_axis`)
            return (self._staged_forward if forward else self._staged)(*args, **kwargs)
        try:
            if self._static_leaves_seen and self._has_static_leaves(args, kwargs):
                return self._call_by_leaves(args, kwargs, forward)
            return self._front(forward)(*args, **kwargs)
        except (DataDependentShapeError, *_NEEDS_VALUES):
            # A shape or a branch that depends on the data: an eager call (or eager jax.grad)
            # has the values, and is traced at them outside the jit front.
            leaves = [x for x in jax.tree_util.tree_leaves(self._split(args, kwargs)[2:])
                      if _is_array_leaf(x)]
            if concrete_values(leaves) is None:
                raise
            return self._staged(*args, **kwargs)
        except (TypeError, ValueError):
            self._validate(args, kwargs)
            if self._static_leaves_seen or not self._has_static_leaves(args, kwargs):
                raise
            # leaves that are not arrays (jax.jit rejects them): static, as Equinox does
            self._static_leaves_seen = True
            return self(*args, **kwargs)

    # -- inspection -----------------------------------------------------------------------
    def trace(self, *args, **kwargs) -> tuple[ClosedJaxpr, Report]:
        """The rewritten ClosedJaxpr for these arguments, and the report of what was guarded."""
        traced, _ = self._trace(args, kwargs)
        return traced.closed, traced.report

    def cache_info(self) -> dict:
        return {"size": len(self._cache), "max_size": self._cache_size}

    def __get__(self, obj, objtype=None):  # methods: bind like a function
        if obj is None:
            return self
        return functools.partial(self, obj)


def nan_safe(fun: Callable | None = None, *, static_argnums: int | Sequence[int] = (),
             static_argnames: str | Sequence[str] = (), jit: bool = True,
             cache_size: int = DEFAULT_CACHE_SIZE, finite_args: FiniteArgs = False):
    """Make the dropped lanes of `fun` contribute exactly zero to every derivative.

    `fun` is traced with `jax.make_jaxpr` once per call signature; every NaN-prone primitive
    (sqrt, log, div, pow, ...) whose result has lanes that reach no output (the unselected side
    of `jnp.where`, the losing side of `jnp.maximum`, lanes sliced away, ...) gets a safe input in
    those lanes, and the rewritten program runs instead. Forward values are unchanged.

    **Arguments:**

    - `fun`: the function to wrap. Use as `@nan_safe` or `@nan_safe(...)`.
    - `static_argnums`, `static_argnames`: arguments that are Python values, not arrays (as in
      `jax.jit`); they must be hashable and are part of the cache key. Leaves of the other
      arguments that are not arrays (a module's activation function, a string) are static
      without being named: by value when hashable, else by identity.
    - `jit`: run the rewritten program compiled by XLA (default). `jit=False` evaluates it
      equation by equation, for `jax_debug_nans` or pdb.
    - `cache_size`: how many signatures to remember (LRU); 0 disables the cache.
    - `finite_args`: arguments you promise hold no inf or NaN, so that nothing guards them
      (speed, not correctness): `True` (all), a position or a sequence of positions, or a tuple
      with a boolean (or a pytree of booleans) per positional argument. By default every
      argument may be non-finite in any lane. A broken promise makes the gradient NaN where
      such a lane is dropped; live lanes are never wrong.

    **Returns:** a callable with `fun`'s name and docstring, composable with `jax.jit`,
    `jax.grad`, `jax.vmap` and the rest of JAX.

    Example:

        @jaxsafe.nan_safe
        def f(x):
            return jnp.where(x > 0, jnp.sqrt(x), 0.)
        jax.grad(f)(0.)  # 0.0, not nan
    """
    if fun is None:
        _check_finite_args(finite_args, "nan_safe")
        return functools.partial(nan_safe, static_argnums=static_argnums,
                                 static_argnames=static_argnames, jit=jit, cache_size=cache_size,
                                 finite_args=finite_args)
    if not callable(fun):
        raise TypeError(f"nan_safe: `fun` must be callable, got {type(fun).__name__}: {fun!r}.")
    if inspect.isgeneratorfunction(fun) or inspect.isasyncgenfunction(fun) \
            or inspect.iscoroutinefunction(fun):
        raise TypeError(f"nan_safe: `fun` ({getattr(fun, '__qualname__', fun)!r}) is a generator "
                        f"or coroutine function; it must return arrays (a pytree of arrays).")
    return NanSafeFunction(fun, static_argnums, static_argnames, jit, cache_size, finite_args)


def make_jaxpr(fun: Callable, *, static_argnums: int | Sequence[int] = (),
               static_argnames: str | Sequence[str] = (),
               finite_args: FiniteArgs = False) -> Callable[..., ClosedJaxpr]:
    """Like `jax.make_jaxpr`, but returns the jaxpr that `nan_safe(fun)` runs.

    Read it to see what was guarded: each guard is a `select_n(live, safe, x)` in front of a
    NaN-prone primitive. When nothing needs a guard, it is the original jaxpr.

    Example:

        print(jaxsafe.make_jaxpr(lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.))(1.))
        # { lambda ; a:f32[]. let b = gt a 0.0; c = select_n b 1.0 a; d = sqrt c; ... }
    """
    if not callable(fun):
        raise TypeError(f"make_jaxpr: `fun` must be callable, got {type(fun).__name__}: {fun!r}.")
    safe_fun = NanSafeFunction(fun, static_argnums, static_argnames, True, 0, finite_args)

    def make(*args, **kwargs) -> ClosedJaxpr:
        return safe_fun.trace(*args, **kwargs)[0]
    functools.update_wrapper(make, fun)
    return make
