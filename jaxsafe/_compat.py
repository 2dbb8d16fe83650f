"""Every JAX-version-sensitive name jaxsafe uses, in one place.

jaxsafe works on public APIs only: `jax.make_jaxpr`, `jax.extend.core` (the jaxpr types and the
primitives), `jax.extend.source_info_util` (the user's source lines on re-emitted equations),
`jax.interpreters.partial_eval.dce_jaxpr` (JAX's dead-code pass), `jax.extend.linear_util` and
`jax.interpreters.ad.Zero` (how JAX binds a custom_vjp's backward rule) and `jax.core` (`Tracer`,
`eval_jaxpr`, some of whose neighbours JAX 0.11 removes). The few `jax._src` names that have
no public spelling (`shard_map`'s primitive and the context its body is traced in, the state
`jax.ensure_compile_time_eval` turns on) are imported here too, each with why. They are all
spelled here, so that a JAX upgrade breaks in this file only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import pathlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

# `is_user_filename`: whether a file is the user's (not JAX's, not an excluded library's): the
# inlining pass gives a library call's body (`jnp.where`'s jit) the call's own source line, as
# the body's traceback is that of its first, cached trace, maybe at another line.
from jax._src.source_info_util import is_user_filename as is_user_filename  # noqa: E402

# `user_frame`: the innermost user frame of an equation's traceback, with its line and columns.
# `jax.extend.source_info_util` has `summarize` only (a string): the diagnostics quote the
# user's line and put a marker under the call, which needs the columns.
from jax._src.source_info_util import user_frame as user_frame  # noqa: E402
from jax.core import Trace as Trace
from jax.core import Tracer as Tracer
from jax.core import eval_context as eval_context
from jax.core import eval_jaxpr as eval_jaxpr
from jax.extend import core as jex
from jax.extend import linear_util, source_info_util
from jax.interpreters.ad import Zero as SymbolicZero  # noqa: F401  (a bwd rule's "no cotangent")
from jax.interpreters.partial_eval import dce_jaxpr

# jaxsafe's own frames are not the user's: an equation jaxsafe emits (a guard, a shard_map it
# re-binds) is reported at the user's line that made it, as JAX's own frames are skipped.
source_info_util.register_exclusion(str(pathlib.Path(__file__).resolve().parent))

# ... and JAX's filtered tracebacks skip them too, as they skip JAX's own: an error raised while
# nan_safe traces the user's function shows the frames jax.jit would (the user's), not
# jaxsafe's. `traceback_util.register_exclusion` has no public spelling.
importlib.import_module("jax._src.traceback_util").register_exclusion(
    str(pathlib.Path(__file__).resolve().parent))

def _extend_core(name: str) -> Any:
    """`jax.extend.core.<name>`; JAX 0.9 did not export `DropVar`, `set_current_trace` and
    `concrete_or_error` there yet, so they come from `jax._src.core`, where 0.9 defines them
    under the same names (and 0.10 too: `jax.extend.core` re-exports them)."""
    found = getattr(jex, name, None)
    return found if found is not None else getattr(importlib.import_module("jax._src.core"), name)


Jaxpr = jex.Jaxpr
ClosedJaxpr = jex.ClosedJaxpr
JaxprEqn = jex.JaxprEqn
Literal = jex.Literal
Var = jex.Var
DropVar = _extend_core("DropVar")
Primitive = jex.Primitive
primitives = jex.primitives


def dce(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Drop equations whose results are unused (effects are kept), and constants nothing reads
    (a mask computed at trace time leaves some: JAX lifts a value it folds into the trace)."""
    jaxpr = closed.jaxpr
    new_jaxpr, used_inputs = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    assert all(used_inputs)
    read = {v for eqn in new_jaxpr.eqns for v in eqn.invars if isinstance(v, Var)}
    read.update(v for v in new_jaxpr.outvars if isinstance(v, Var))
    kept = [k for k, v in enumerate(new_jaxpr.constvars) if v in read]
    if len(kept) == len(new_jaxpr.constvars):
        return ClosedJaxpr(new_jaxpr, closed.consts)
    new_jaxpr = new_jaxpr.replace(constvars=[new_jaxpr.constvars[k] for k in kept])
    return ClosedJaxpr(new_jaxpr, [closed.consts[k] for k in kept])


def source_summary(eqn: JaxprEqn) -> str:
    """'file:line (function)' of the user code that emitted `eqn`."""
    return source_info_util.summarize(eqn.source_info) or "(inside JAX, no user frame)"


def eqn_context(eqn: JaxprEqn) -> contextlib.AbstractContextManager:
    """Context that makes re-emitted equations keep `eqn`'s source info and name stack."""
    stack = contextlib.ExitStack()
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack.enter_context(
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack))
    stack.enter_context(eqn.ctx.manager)
    return stack


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Bind `eqn`'s primitive on `invals` (as `jax.core.eval_jaxpr` does); always a list."""
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)
    with eqn_context(eqn):
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def custom_jvp_rule_of(eqn: JaxprEqn) -> Any:
    """A `custom_jvp` call's rule, as the equation holds it (`jvp_jaxpr_fun`; before JAX 0.6,
    `jvp_jaxpr_thunk`): what tells two calls of one body with different rules apart."""
    params = eqn.params
    return params["jvp_jaxpr_fun"] if "jvp_jaxpr_fun" in params else params.get("jvp_jaxpr_thunk")


def custom_jvp_symbolic_zeros(eqn: JaxprEqn) -> bool:
    """Whether a `custom_jvp` call's rule is handed symbolic zeros (it may then compute other
    tangents than the ones a trace with every tangent given shows); True when not said."""
    return bool(eqn.params.get("symbolic_zeros", True))


def trace_to_jaxpr(fun: Any, avals: Sequence[Any]) -> ClosedJaxpr:
    """`jax.make_jaxpr` over abstract values (avals keep weak_type, ShapeDtypeStruct would not).
    Avals of a `shard_map` body vary over manual mesh axes (`{V:d}`), which `jax.make_jaxpr`
    drops: those are traced as they are, by JAX's own staging."""
    if any(_varying_axes(a) for a in avals):
        return _trace_keeping_varying_axes(fun, avals)
    return jax.make_jaxpr(fun)(*avals)


def with_leading_arg_names(info: Any, names: Sequence[str]) -> Any:
    """A jaxpr's debug info with `names` for arguments put before the others: JAX checks that
    it names as many arguments as the jaxpr has. Its type (a NamedTuple in JAX 0.10) is not
    public."""
    arg_names = getattr(info, "arg_names", None)
    if arg_names is None:
        return info
    return with_arg_names(info, (*names, *arg_names))


def with_arg_names(info: Any, new_names: Sequence[str]) -> Any:
    """A jaxpr's debug info naming its arguments `new_names` (as many as the jaxpr has)."""
    if getattr(info, "arg_names", None) is None:
        return info
    new_names = tuple(new_names)
    if hasattr(info, "_replace"):
        return info._replace(arg_names=new_names)
    return dataclasses.replace(info, arg_names=new_names)


def transpose_to_zero_where_missing(primitive: Primitive) -> None:
    """Give `primitive` the transpose rule of a map whose derivative is zero, unless JAX (or
    a library) already has one. For `stop_gradient`: `jax.grad(jax.vmap(nan_safe(f)))` of an
    `f` with a `lax.cond` batches nan_safe's custom_jvp rule, and JAX's batching of a cond on
    a batched predicate runs each branch on `select(taken, x, stop_gradient(x))`, tangents
    included; JAX has no transpose for that stop_gradient and the gradient raised
    (jax-ml/jax#22011). Zero is its derivative, and keeps what the select is for: a branch's
    lanes that it does not take send back no cotangent, NaN included, as in plain JAX. lineax
    registers the identity instead when it is imported (equal but for those NaN)."""
    from jax.interpreters import ad

    if primitive in ad.primitive_transposes:
        return

    def zero_transpose(cotangent, operand):
        return [ad.Zero(operand.aval) if ad.is_undefined_primal(operand) else None]

    ad.primitive_transposes[primitive] = zero_transpose


def varies_over_manual_axes(avals: Iterable[Any]) -> bool:
    """Whether a value of a `shard_map` body varies over its manual mesh axes (`{V:d}`): a
    constant that meets it is cast to vary too (`pvary`), which JAX can stage but not run, so
    its masks are never computed at trace time (`_masks.at_trace_time`)."""
    return any(_varying_axes(a) for a in avals)


def _varying_axes(aval: Any) -> frozenset:
    # JAX 0.10 types a value's varying manual axes as `aval.mat.varying`, JAX 0.9 as `aval.vma`
    mat = getattr(aval, "mat", None)
    if mat is None:
        return frozenset(getattr(aval, "vma", ()) or ())
    return frozenset(getattr(mat, "varying", ()) or ())


def sharded_like(x: Any, like: Any) -> Any:
    """`x` (a mask) placed as `like` (the value it selects) where the mesh's `Explicit` axes put
    shardings in the types: a `select_n` of a replicated mask and a value sharded `P("d")` is a
    type error there. Elsewhere (no mesh, `Auto` axes) `x` itself."""
    want = getattr(jax.typeof(like), "sharding", None)
    have = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(want, "mesh", None)
    explicit = jax.sharding.AxisType.Explicit
    if want is None or have is None or mesh is None or np.shape(x) != np.shape(like) or \
            explicit not in tuple(getattr(mesh, "axis_types", ()) or ()):
        return x
    if tuple(have.spec) == tuple(want.spec):
        return x
    return jax.sharding.reshard(x, want.spec)


def varying_like(x: Any, like: Any) -> Any:
    """`x` cast to vary over the manual axes `like` varies over and `x` does not (`pcast`): a
    cotangent handed to `jax.vjp` inside a `shard_map` body must have its primal output's type
    (a mask of ones made there is not varying)."""
    missing = _varying_axes(jax.typeof(like)) - _varying_axes(jax.typeof(x))
    if not missing:
        return x
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying")


def _trace_keeping_varying_axes(fun: Any, avals: Sequence[Any]) -> ClosedJaxpr:
    # No public API stages a function over avals with varying manual axes: jax.make_jaxpr
    # re-abstracts its arguments and loses them (a psum of the body then fails its type check).
    from jax._src import api_util
    from jax._src import linear_util as lu
    from jax._src.interpreters import partial_eval as pe
    debug = api_util.debug_info("jaxsafe", fun, tuple(avals), {})
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fun, debug_info=debug), list(avals))
    return ClosedJaxpr(jaxpr, consts)


def _shard_map_primitive() -> Primitive | None:
    # `shard_map`'s primitive is not in jax.extend.core.primitives (JAX 0.10).
    try:
        from jax._src.shard_map import shard_map_p
    except ImportError:  # pragma: no cover - another JAX layout: shard_map stays unknown
        return None
    return shard_map_p


shard_map_p = _shard_map_primitive()


def _private_primitives(module: str, *names: str) -> list[Primitive]:
    """Primitives that jax.extend.core.primitives does not list, from `module` (JAX 0.10 keeps
    `shard_map` bodies' `psum_invariant`, `pmin`, `reduce_scatter`, ... in jax._src.lax.parallel,
    `pvary` in jax._src.core and `jax.sharding.reshard`'s in jax._src.pjit); absent ones are
    skipped (they stay unknown: live, reported). No names: every primitive `module` defines."""
    try:
        found = importlib.import_module(module)
    except ImportError:  # pragma: no cover - another JAX layout
        return []
    if not names:
        return [v for v in vars(found).values() if isinstance(v, Primitive)]
    return [getattr(found, n) for n in names if hasattr(found, n)]


PRIVATE_LINEAR_COLLECTIVES = _private_primitives(
    "jax._src.lax.parallel", "psum_invariant_p", "reduce_scatter_p", "all_gather_invariant_p",
    "pbroadcast_p")
# each operand itself, typed as varying over manual axes (`pvary`: a constant that meets a
# `shard_map` body's values, a one-hot weight)
PRIVATE_VARY_CASTS = _private_primitives("jax._src.core", "pvary_p")
PRIVATE_OTHER_COLLECTIVES = _private_primitives("jax._src.lax.parallel", "pmin_p")
# the value itself, placed anew under `Explicit` mesh axes
PRIVATE_RESHARDS = _private_primitives("jax._src.pjit", "reshard_p")
# a typed PRNG key made from (`random_wrap`: `jax.random.normal(jax.random.PRNGKey(0), ...)`
# with the raw key an argument) and turned back into its uint32 data (`random_unwrap`): in
# jax._src.prng up to JAX 0.9, jax._src.random.prng from 0.10
PRIVATE_KEY_WRAPS = (_private_primitives("jax._src.prng", "random_wrap_p", "random_unwrap_p")
                     or _private_primitives("jax._src.random.prng", "random_wrap_p",
                                            "random_unwrap_p"))
# the index of the platform a `lax.platform_dependent` cond runs on (`jnp.diagonal` of a matrix
# picks a TPU branch by it): an integer, no derivative
PRIVATE_PLATFORM_INDEX = _private_primitives("jax._src.lax.control_flow", "platform_index_p")


@contextlib.contextmanager
def shard_map_body_context(params: dict):
    """The context `shard_map` traces its body in: its manual mesh axes bound (collectives and
    `pvary` name them), the manual abstract mesh, and its varying-axes checking. JAX has no
    public way to re-enter it (jax._src.shard_map builds it inline)."""
    from jax._src import config as jax_config
    from jax._src import shard_map as jax_shard_map
    from jax._src.mesh import use_abstract_mesh
    # JAX 0.10 names the axes this shard_map makes manual `newly_manual_axes`; 0.9 `manual_axes`
    mesh = params["mesh"]
    manual = params["newly_manual_axes"] if "newly_manual_axes" in params else \
        params["manual_axes"]
    with (jax_shard_map._extend_axis_env(mesh, manual),
          use_abstract_mesh(jax_shard_map._as_manual_mesh(mesh, manual)),
          jax_config._check_vma(params["check_vma"])):
        yield


# -- tracing with the values in hand (_by_value) ------------------------------------------------
# A value tracer implements JAX's Trace protocol (process_primitive, process_custom_jvp_call, ...)
# on the public `jax.core.Trace`/`jax.core.Tracer` classes and the public trace-context helpers.
set_current_trace = _extend_core("set_current_trace")

# JAX 0.10's `Tracer.__init__` takes the tracer's aval (kept in a slot); 0.9's takes the trace
# only and reads an `aval` property that the subclass defines.
_TRACER_TAKES_AVAL = "aval" in inspect.signature(Tracer.__init__).parameters


def init_tracer(tracer: Any, trace: Any, aval: Any) -> None:
    """`Tracer.__init__` on any supported JAX."""
    if _TRACER_TAKES_AVAL:
        Tracer.__init__(tracer, trace, aval)
    else:
        Tracer.__init__(tracer, trace)  # pyright: ignore[reportCallIssue]  (JAX 0.9)


def with_aval_property(aval_of: Any) -> Any:
    """Class decorator: on JAX 0.9, the `aval` property its Tracer asks subclasses for."""
    def decorate(cls: Any) -> Any:
        if not _TRACER_TAKES_AVAL:
            cls.aval = property(aval_of)
        return cls
    return decorate
take_current_trace = _extend_core("take_current_trace")
_concrete_or_error = _extend_core("concrete_or_error")
ConcretizationTypeError = jax.errors.ConcretizationTypeError

# `eager_constant_folding`: the state `jax.ensure_compile_time_eval` turns on (a staging trace
# evaluates an operation whose operands are all concrete). The mask pass computes a mask that
# depends on shapes only at trace time, and must turn it off again to read the program's own
# values, which XLA computes (bit for bit as the program does): no public spelling turns it off.
from jax._src.config import eager_constant_folding as eager_constant_folding  # noqa: E402

# `trace_context()`: the configuration a trace depends on (x64, rank and dtype promotion, default
# matmul precision, ...), which `jax.jit` keys its own cache by. nan_safe's per-signature cache
# must key by it too, or a program traced under `jax.enable_x64(True)` is reused outside it;
# no public function returns it.
from jax._src.config import trace_context as trace_context  # noqa: E402

# `_convert_element_type(..., weak_type=True)`: a literal the program holds weakly typed (the
# `0.` of `jnp.where(c, x, 0.)`) must be bound weakly typed again, or every result it reaches
# turns strongly typed (a float16 step `p - lr * g` would promote to float32); no public
# function makes a weakly typed array of a given dtype.
from jax._src.lax.lax import _convert_element_type  # noqa: E402


def weak_constant(value: Any, dtype: Any) -> Any:
    """`value` as a weakly typed constant of `dtype`."""
    return _convert_element_type(value, dtype, weak_type=True)


def concrete_value(x: Any) -> Any:
    """The concrete value of `x` (itself unless a tracer; a JVP tracer's primal), or raise
    ConcretizationTypeError."""
    return _concrete_or_error(None, x, "nan_safe needs the value")


def reset_stores(fun: Any) -> None:
    """Empty a `linear_util.WrappedFun`'s output stores so that it can run a second time (once
    staged, once on the values); JAX's own staging of custom_jvp rules does the same."""
    for store in getattr(fun, "stores", ()):
        if store is not None:
            store.reset()


def wrap_function(fun: Any, like: Any) -> Any:
    """`fun` as a `linear_util.WrappedFun` (what JAX binds a custom_vjp's `bwd` as), with the
    debug info of `like`, the wrapped function it stands for."""
    return linear_util.wrap_init(fun, debug_info=like.debug_info)


# Primitives whose meaning depends on the named axes in scope (collectives, `axis_index`,
# `pvary`): `_replay` binds them as they are, never through a jit cached across axis sizes.
# jax.extend.core.primitives lists some, not all; they are defined in these two modules.
AXIS_PRIMITIVES = frozenset(_private_primitives("jax._src.lax.parallel")
                            + _private_primitives("jax._src.core", "pvary_p",
                                                  "reduced_vary_cast_p"))


# -- a call differentiated while a program is staged (_api's replayed path) ----------------------
# No public API names JAX's differentiation traces or tells a staging trace (jax.jit,
# make_jaxpr) from eager evaluation: the trace classes come from jax._src.interpreters.
def _trace_classes(module: str, *names: str) -> tuple[type, ...]:
    try:
        found = importlib.import_module(module)
    except ImportError:  # pragma: no cover - another JAX layout: never seen as differentiated
        return ()
    return tuple(getattr(found, n) for n in names if isinstance(getattr(found, n, None), type))


_DIFFERENTIATING_TRACES = _trace_classes("jax._src.interpreters.ad", "JVPTrace", "LinearizeTrace")
_STAGING_TRACES = _trace_classes("jax._src.interpreters.partial_eval", "DynamicJaxprTrace")
# the trace context: `jax.extend.core.find_top_trace` reads it too, through two calls that
# would cost every cached nan_safe call a tenth of jax.jit's dispatch
_TRACE_CONTEXT = importlib.import_module("jax._src.core").trace_ctx


def differentiated_while_staging(args: tuple, kwargs: dict) -> bool:
    """Whether the arguments hold a tracer of the current trace, that trace differentiates
    (jvp, grad, linearize), and a staging trace lies under it (the call's program is being
    built, not run eagerly). Made on every call: one look at the trace context first, the
    arguments flattened only under differentiation."""
    trace = _TRACE_CONTEXT.trace
    if not isinstance(trace, _DIFFERENTIATING_TRACES):
        return False
    if not any(isinstance(x, Tracer) and getattr(x, "_trace", None) is trace
               for x in jax.tree_util.tree_leaves((args, kwargs))):
        return False
    while trace is not None:
        if isinstance(trace, _STAGING_TRACES):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


_BATCH_TRACES = _trace_classes("jax._src.interpreters.batching", "BatchTrace")
_EXTEND_AXIS_ENV = importlib.import_module("jax._src.core").extend_axis_env_nd


def axis_sizes_now() -> tuple[tuple[Any, int], ...]:
    """The named axes bound where a program is traced (a `vmap`'s `axis_name`), with their
    sizes. A program traced there may name them (`psum(x, "b")`); its rewrite, traced later
    (when JAX differentiates a call that an outer `jit` staged), binds them again
    (`with_axis_sizes`). Private: the trace context's axis environment, which
    `jax.make_jaxpr(axis_env=...)` extends."""
    sizes = getattr(_TRACE_CONTEXT.axis_env, "axis_sizes", None) or {}
    return tuple(sizes.items())


@contextlib.contextmanager
def with_axis_sizes(pairs: Sequence[tuple[Any, int]]) -> Iterator[None]:
    """The named axes of `axis_sizes_now` bound again, for tracing."""
    if not pairs:
        yield
        return
    with _EXTEND_AXIS_ENV(pairs):
        yield


def batching_a_named_axis() -> bool:
    """Whether a `vmap` with an axis name is among the current traces. JAX cannot
    differentiate a `jit` of a custom_jvp call whose program names that axis (a `psum` over
    it), once an outer `jit` has staged the batched call: `jax.grad(jax.jit(jax.vmap(
    jax.jit(g), axis_name="b")))` raises NameError in JAX itself for a custom_jvp `g`. The
    jit front is left out there (private: the trace context and `BatchTrace.axis_data`)."""
    trace = _TRACE_CONTEXT.trace
    while trace is not None:
        if isinstance(trace, _BATCH_TRACES):
            axis = getattr(trace, "axis_data", None)
            name = getattr(axis, "name", None)  # an unnamed vmap's is a bare `object()`
            if name is not None and type(name) is not object \
                    or getattr(axis, "spmd_name", None) is not None:
                return True
        trace = getattr(trace, "parent_trace", None)
    return False


def differentiating_now() -> bool:
    """Whether the current trace differentiates (`jax.jvp`, `jax.grad`, `jax.linearize`): it
    meets a custom_jvp's rule at once, before a transformation outside it (`vmap`) batches
    the call."""
    return isinstance(_TRACE_CONTEXT.trace, _DIFFERENTIATING_TRACES)


def scan_counts(params: dict) -> tuple[int, int]:
    """(constants, carries) among a `scan`'s operands, before its stacked inputs. JAX 0.9 and
    0.10 name them `num_consts` and `num_carry`; from 0.11 the operands are described by a
    flat tree `ft_in` of three parts (constants, carries, stacked inputs), each of whose
    lengths is its number of leaves."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def scan_params_with(params: dict, body: ClosedJaxpr, new_consts: int,
                     stacked_kept: Sequence[bool], new_stacked: int) -> dict | None:
    """A `scan`'s parameters for `body`, whose inputs are `new_consts` constants, then the old
    ones and the carries, then the stacked inputs kept (`stacked_kept`) and `new_stacked` new
    ones (`_sinking.py`). None where the operands are described by `ft_in` (JAX 0.11 on),
    which is not rebuilt here: the scan is then left as it is."""
    if "num_consts" not in params:
        return None
    new: dict[str, Any] = dict(params, jaxpr=body, num_consts=params["num_consts"] + new_consts)
    if "linear" in params:  # JAX 0.9: one flag per operand, none of the new ones linear
        linear = params["linear"]
        first = params["num_consts"] + params["num_carry"]
        kept = [flag for flag, keep in zip(linear[first:], stacked_kept, strict=True) if keep]
        new["linear"] = (*([False] * new_consts), *linear[:first], *kept,
                         *([False] * new_stacked))
    return new


# `mapped_aval`: the abstract value of one step's slice of a stacked input (its leading axis
# removed), with whatever else the aval carries (a sharding in types) made to match; JAX has no
# public way to take an axis off an aval.
from jax._src.core import mapped_aval as _mapped_aval  # noqa: E402


def step_aval(aval: Any) -> Any:
    """The aval of one step's slice of a scan's stacked input of aval `aval`."""
    return _mapped_aval(aval.shape[0], 0, aval)
