"""Random programs for differential fuzzing of `jaxsafe.nan_safe`, and their hand-guarded twins.

A program is data: a tuple of output expressions over four float inputs of fixed shape and a
mask (a validity mask from a data loader),

    x: f32[4]   y: f32[4]   m: f32[3, 4]   s: f32[]   k: bool[3, 4]

built from NaN-prone operations (HAZARDS), selections that drop lanes (`jnp.where`, a where
whose predicate is computed from the selected value itself, a where on a mask that reads no
value: the argument `k`, a closed-over NumPy array, one built from iota, or a literal as in
`lax.select(False, a, b)`; `jnp.maximum`/`jnp.minimum`, `jnp.clip`, slicing and indexing),
shape changes (broadcasts, reductions, dot products) and control flow (a `lax.scan` and a
`lax.cond` whose bodies contain selections and hazards). Every expression is a tree: no
intermediate value is shared, except where the grammar says so (the predicate of
`swhere` reads the value it selects), so the liveness of every lane is unambiguous.

`emit(program, guarded)` writes it as Python source, and `build` executes that source:

- `guarded=False`: the natural program, as a JAX user writes it;
- `guarded=True`: its *twin*, the same program with every hazard whose output lanes are dropped
  written with the hand-made double where, `H(jnp.where(live, x, SAFE))`, where `live` is built
  from the same conditions as the selections that drop the lanes (the predicate of a where, the
  decision of max/min/clip on the original values, the lanes a slice keeps, ...). Predicates and
  decisions always read the original values. Max/min/clip whose operand was guarded are written
  as a select on the original decision (a guarded operand must not turn a loss into a tie).

The arguments hold inf and NaN as data does (`inputs`): most often in the lanes that line up
with a False of `k`, sometimes anywhere. jaxsafe treats every argument as possibly non-finite
(docs/how-it-works.md, "Operands that may be non-finite"), and so does the twin: it replaces such
an operand of a non-linear operation by 0 in the operation's dropped lanes.

The liveness rules of the twin are those of docs/how-it-works.md: reductions and dot products keep
a whole row (every lane that meets a live output), a broadcast source lane is live if any copy
is, a scan's operands are live if any of its outputs is, its carries are live, and a cond
operand is live where the taken branch reads it.

The twin of a program is what a careful user writes by hand; the safe values are the ones of the
guard table (docs/how-it-works.md, "Value guards"), so the twin and the rewrite compute the same
numbers in dropped lanes too.

Printing a program (`repr`) gives its natural source; `emit(p, True)` the twin's.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# --------------------------------------------------------------------------- vocabulary

SHAPES = {"S": (), "R": (3,), "V": (4,), "M": (3, 4)}
INPUTS = {"x": "V", "y": "V", "m": "M", "s": "S"}  # the float arguments (leaves of programs)
MASK_ARG = "k"  # a bool[3, 4] argument: a validity mask from the data loader, never a leaf
ARGS = ("x", "y", "m", "s", MASK_ARG)
# The lanes of the mask argument that a predicate of each shape reads, and the lanes of each
# float argument that line up with them (where `inputs` puts inf and NaN most often).
MASK_ARG_SRC = {"M": "k", "V": "k[0]", "R": "k[:, 0]", "S": "k[0, 0]"}
MASK_LANES = {"x": (0, slice(None)), "y": (0, slice(None)), "m": (slice(None), slice(None)),
              "s": (0, 0)}
# Masks that are constants of the function: built from iota (JAX folds nothing, the rewrite
# evaluates them), by shape.
IOTA_MASKS = {
    "V": ("jnp.arange(4) % 2 == 0", "jnp.arange(4) < 2", "jnp.arange(4) != 3"),
    "R": ("jnp.arange(3) % 2 == 0", "jnp.arange(3) > 0"),
    "M": ("jnp.tril(jnp.ones((3, 4), bool))",
          "(jnp.arange(3)[:, None] + jnp.arange(4)[None, :]) % 2 == 0",
          "jnp.arange(4)[None, :] < jnp.arange(1, 4)[:, None]"),
}
NONFINITE = (float("inf"), float("-inf"), float("nan"))

# NaN-prone unary operations: source template and the safe value of the guard table.
HAZARDS = {
    "sqrt": ("jnp.sqrt({})", 1.0),
    "log": ("jnp.log({})", 1.0),
    "log1p": ("jnp.log1p({})", 0.0),
    "pow": ("{} ** 0.5", 1.0),
    "arcsin": ("jnp.arcsin({})", 0.0),
    "arccos": ("jnp.arccos({})", 0.0),
    "arctanh": ("jnp.arctanh({})", 0.0),
    "exp": ("jnp.exp({})", 0.0),
    "recip": ("jnp.reciprocal({})", 1.0),
}
DIV_SAFE = 1.0  # the denominator of a / b
POOLS = {  # max pooling: (operand shape, result shape, source, the window sum's source)
    # overlapping windows (2, stride 1), and windows that tile the operand (stride = window)
    "slide": ("V", "R", 'lax.reduce_window({}, -jnp.inf, lax.max, (2,), (1,), "VALID")',
              'lax.reduce_window({}, 0., lax.add, (2,), (1,), "VALID")'),
    "cols": ("M", "V", 'lax.reduce_window({}, -jnp.inf, lax.max, (3, 1), (3, 1), "VALID")[0]',
             'lax.reduce_window({}, 0., lax.add, (3, 1), (3, 1), "VALID")[0]'),
    "all": ("V", "S", 'lax.reduce_window({}, -jnp.inf, lax.max, (4,), (4,), "VALID")[0]',
            'lax.reduce_window({}, 0., lax.add, (4,), (4,), "VALID")[0]'),
}

SAFE_UNARY = {
    "sin": "jnp.sin({})",
    "tanh": "jnp.tanh({})",
    "neg": "-{}",
    "square": "jnp.square({})",
}
LINEAR_UNARY = {"neg"}
BINOPS = {"add": "+", "sub": "-", "mul": "*"}
CMPS = {"gt": ">", "lt": "<", "ge": ">=", "le": "<="}
CONSTS = (0.0, 1.0, -1.0, 0.5, 2.0)
CLIPS = ((-1.0, 1.0), (0.0, 1.0), (0.5, 2.0))

# Values of the inputs: the boundaries of the hazards' domains, exp overflow, huge and tiny.
SPECIAL = (1.0, 0.0, -1.0, 0.5, 2.0, -0.5, -0.0, 1e30, -1e30, 100.0, -100.0, 1e-30, 0.25, 3.0,
           -2.0, 1.5)

# --------------------------------------------------------------------------- programs


@dataclasses.dataclass(frozen=True)
class Program:
    outputs: tuple  # expression trees, see `Gen`

    def __repr__(self) -> str:
        return emit(self, guarded=False)


# Node forms (tuples):
#   ("in", name)                       an input, or a body's leaf ("xi", "c", "u")
#   ("const", c, shape_key)            jnp.full(shape, c)
#   ("haz", kind, a)                   HAZARDS[kind](a)
#   ("div", a, b)                      a / b
#   ("un", kind, a)                    SAFE_UNARY[kind](a)
#   ("bin", op, a, b)                  a op b (b may be a scalar)
#   ("where", pred, a, b)              jnp.where(pred, a, b) (pred may be a scalar)
#   ("swhere", cmp, c, h, fill, side)  h = ...; jnp.where(cmp(h, c), h, fill) (side 1) or
#                                      jnp.where(cmp(h, c), fill, h) (side 0); cmp may be "isnan"
#   ("max", a, b) / ("min", a, b)      jnp.maximum / jnp.minimum (b may be a scalar)
#   ("clip", a, lo, hi)                jnp.clip(a, lo, hi)
#   ("slice", "tail"|"head", a)        a[1:] / a[:3]               V -> R
#   ("index", i, a)                    a[i]                        V, R -> S
#   ("row", i, a) / ("col", j, a)      a[i] / a[:, j]              M -> V / M -> R
#   ("reduce", op, axis, a)            jnp.sum/max/mean(a[, axis])
#   ("dot", a, b)                      a @ b                       MV -> R, VV -> S, RM -> V
#   ("bcast", to, a)                   jnp.broadcast_to            S -> any, V -> M, R -> M
#   ("cum", "max"|"min", a)            lax.cummax/cummin(a, axis=0)  (shape kept)
#   ("sort", "tail"|"head", a)         jnp.sort(a)[1:] / [:3]      V -> R
#   ("topk", a)                        lax.top_k(a, 3)[0]          V -> R
#   ("pool", kind, a)                  max pooling (POOLS): V -> R, M -> V, V -> S
#   ("set", i, a, b)                   a.at[i].set(b)              V, S -> V
#   ("scan", xs, init, t, y, out)      lax.scan(lambda c, xi: (c + t, y), init, xs)[out]
#   ("cond", pred, u, tb, fb)          lax.cond(pred, lambda u: tb, lambda u: fb, u)
# Predicates:
#   ("cmp", op, a, c)                  a op c  (a read for its value only)
#   ("isnan", a)                       jnp.isnan(a)


def shape_of(node, env: dict) -> str:
    """Shape key of a node; `env` maps leaf names to shape keys."""
    k = node[0]
    if k == "in":
        return env[node[1]]
    if k == "const":
        return node[2]
    if k in ("haz", "un"):
        return shape_of(node[2], env)
    if k in ("div", "max", "min"):
        return shape_of(node[1], env)
    if k == "bin":
        return shape_of(node[2], env)
    if k == "where":
        return shape_of(node[2], env)
    if k == "swhere":
        return shape_of(node[3], env)
    if k == "clip":
        return shape_of(node[1], env)
    if k in ("slice", "sort", "topk"):
        return "R"
    if k == "pool":
        return POOLS[node[1]][1]
    if k == "cum":
        return shape_of(node[2], env)
    if k == "set":
        return shape_of(node[2], env)
    if k == "index":
        return "S"
    if k == "row":
        return "V"
    if k == "col":
        return "R"
    if k == "reduce":
        axis = node[2]
        return "S" if axis is None else ("V" if axis == 0 else "R")
    if k == "dot":
        return {("M", "V"): "R", ("V", "V"): "S", ("R", "M"): "V"}[
            (shape_of(node[1], env), shape_of(node[2], env))]
    if k == "bcast":
        return node[1]
    if k == "scan":
        xs = shape_of(node[1], env)
        return xs if node[5] == "ys" else {"V": "S", "M": "V"}[xs]
    if k == "cond":
        return shape_of(node[2], env)
    raise ValueError(node)


def _diff_children(node):
    """Children reached through a differentiable edge (not predicates)."""
    k = node[0]
    if k in ("in", "const"):
        return ()
    if k in ("haz", "un"):
        return (node[2],)
    if k in ("div", "max", "min", "dot"):
        return (node[1], node[2])
    if k == "bin":
        return (node[2], node[3])
    if k == "where":
        return (node[2], node[3])
    if k == "swhere":
        return (node[3], node[4])
    if k == "clip":
        return (node[1],)
    if k in ("slice", "index", "row", "col", "bcast", "cum", "sort", "pool"):
        return (node[2],)
    if k == "topk":
        return (node[1],)
    if k == "set":
        return (node[2], node[3])
    if k == "reduce":
        return (node[3],)
    if k == "scan":
        return (node[1], node[2], node[3], node[4])
    if k == "cond":
        return (node[2], node[3], node[4])
    raise ValueError(node)


def walk(node):
    """Every node of a tree, predicates and bodies included."""
    yield node
    k = node[0]
    if k == "mask":
        kids = []
    elif k == "cmp":
        kids = [node[2]]
    elif k == "isnan":
        kids = [node[1]]
    else:
        kids = list(_diff_children(node))
        if k in ("where", "cond"):
            kids.append(node[1])
    for c in kids:
        yield from walk(c)


def lanewise(node, env: dict) -> bool:
    """Whether a scan's body computes lane by lane (the elementwise case of jaxsafe's
    `_aligned.py`): its carry is a vector (not a scalar) and every operation in it is
    elementwise; the only non-elementwise operation a body can hold is an iota-built mask."""
    _, xs, _, t, y, _ = node
    if shape_of(xs, env) != "M":
        return False
    return not any(n[0] == "mask" and n[1] == "iota" for b in (t, y) for n in walk(b))


# --------------------------------------------------------------------------- generation


class Gen:
    """Draws one program. `budget` bounds the number of nodes."""

    def __init__(self, draw, budget: int):
        self.draw = draw
        self.budget = budget
        self.control_flow = 1  # at most one scan or cond per program (compile time)

    def pick(self, options):
        return self.draw(st.sampled_from(options))

    def const(self):
        return self.pick(CONSTS)

    # -- leaves ------------------------------------------------------------------------
    def leaf(self, shape: str, env: dict, top: bool):
        names = [n for n, s in env.items() if s == shape]
        options = [("in", n) for n in names]
        if top:
            if shape == "R":
                options += [("slice", "tail", ("in", "x")), ("col", 1, ("in", "m")),
                            ("slice", "head", ("in", "y"))]
            if shape == "S":
                options += [("index", 0, ("in", "x")), ("index", 2, ("in", "y"))]
        if not options or self.draw(st.integers(0, 5)) == 0:
            options.append(("const", self.const(), shape))
        return self.pick(options)

    # -- predicates ----------------------------------------------------------------------
    def pred(self, shape: str, env: dict, top: bool, depth: int):
        """A predicate of `shape`, or a scalar one (broadcast by jnp.where)."""
        pshape = shape if shape == "S" or not self.draw(st.booleans()) else "S"
        kinds = ["cmp", "cmp", "cmp", "mask", "mask"] + (["isnan"] if top else [])
        kind = self.pick(kinds)
        if kind == "mask":  # lanes chosen by data the values do not decide
            return self.mask(pshape, top)
        if kind == "isnan":  # a NaN test on a hazard computed separately
            return ("isnan", ("haz", self.pick(sorted(HAZARDS)),
                              self.expr(pshape, env, top, depth - 1, False)))
        a = self.expr(pshape, env, top, min(depth - 1, 1), False)
        return ("cmp", self.pick(sorted(CMPS)), a, self.const())

    def mask(self, pshape: str, top: bool):
        """A predicate that reads no value: the mask argument (top level only: bodies do not
        see it), a closed-over NumPy array, one built from iota, or a literal."""
        kinds = ["np", "lit"] + (["arg", "arg"] if top else []) + (["iota"] if pshape != "S"
                                                                  else [])
        kind = self.pick(kinds)
        if kind == "arg":
            return ("mask", "arg", pshape, None)
        if kind == "lit":
            return ("mask", "lit", "S", self.draw(st.booleans()))
        if kind == "iota":
            return ("mask", "iota", pshape, self.draw(st.integers(0, len(IOTA_MASKS[pshape]) - 1)))
        n = int(np.prod(SHAPES[pshape], dtype=int))
        return ("mask", "np", pshape, tuple(self.draw(st.lists(st.booleans(), min_size=n,
                                                                max_size=n))))

    # -- expressions ---------------------------------------------------------------------
    def expr(self, shape: str, env: dict, top: bool, depth: int, under_drop: bool):
        """An expression of `shape`. `under_drop`: some selection above may drop its lanes."""
        if depth <= 0 or self.budget <= 0:
            return self.leaf(shape, env, top)
        self.budget -= 1
        if under_drop:  # below a selection: mostly hazards
            kinds = ["leaf"] * 2 + ["haz"] * 7 + ["div"] * 2 + ["un", "bin", "bin"] + \
                ["where", "mwhere", "guarded", "swhere", "max", "min", "clip"]
        else:  # above: mostly selections
            kinds = ["leaf", "haz", "haz", "div", "un", "bin", "bin"] + ["where"] * 3 + \
                ["mwhere"] * 3 + ["guarded"] * 3 + ["swhere"] * 3 + ["max", "min", "clip"]
        if top:
            kinds += ["shape"] * (2 if under_drop else 4)
            if shape != "S":
                kinds += ["chooser"] * 6  # issue 13's drops
            if self.control_flow and shape in ("S", "V", "M"):
                kinds += ["scan"] * 2
            if self.control_flow:
                kinds += ["cond"] * 2
        kind = self.pick(kinds)
        d = depth - 1
        sub = lambda shp, drop=under_drop: self.expr(shp, env, top, d, drop)  # noqa: E731
        if kind == "leaf":
            return self.leaf(shape, env, top)
        if kind == "haz":
            return ("haz", self.pick(sorted(HAZARDS)), sub(shape))
        if kind == "div":
            return ("div", sub(shape), sub(shape))
        if kind == "un":
            return ("un", self.pick(sorted(SAFE_UNARY)), sub(shape))
        if kind == "bin":
            bshape = "S" if top and shape != "S" and self.draw(st.booleans()) else shape
            return ("bin", self.pick(sorted(BINOPS)), sub(shape), sub(bshape))
        if kind == "where":
            p = self.pred(shape, env, top, depth)
            return ("where", p, sub(shape, True), sub(shape, True))
        if kind == "mwhere":  # a where on a mask that reads no value (padding, validity)
            pshape = shape if shape == "S" or not self.draw(st.booleans()) else "S"
            return ("where", self.mask(pshape, top), sub(shape, True), sub(shape, True))
        if kind == "guarded":
            # the textbook case: the predicate tests the hazard's own operand (computed again),
            # jnp.where(a > c, sqrt(a), b)
            a = sub(shape, True)
            p = ("cmp", self.pick(sorted(CMPS)), a, self.const())
            h = ("haz", self.pick(sorted(HAZARDS)), a)
            if self.draw(st.booleans()):
                return ("where", p, h, sub(shape, True))
            return ("where", p, sub(shape, True), h)
        if kind == "swhere":
            cmp = self.pick(["isnan", "gt", "lt", "ge"] if top else ["gt", "lt", "ge"])
            h = ("haz", self.pick(sorted(HAZARDS)), sub(shape, True))
            return ("swhere", cmp, self.const(), h, sub(shape, True), self.draw(st.integers(0, 1)))
        if kind in ("max", "min"):
            bshape = "S" if top and shape != "S" and self.draw(st.booleans()) else shape
            return (kind, sub(shape, True), sub(bshape, True))
        if kind == "clip":
            lo, hi = self.pick(CLIPS)
            return ("clip", sub(shape, True), lo, hi)
        if kind == "shape":
            return self.shape_change(shape, env, d, under_drop)
        if kind == "chooser":
            return self.shape_change(shape, env, d, under_drop, CHOOSER_KINDS[shape])
        if kind == "scan":
            return self.scan(shape, env, d, under_drop)
        if kind == "cond":
            return self.cond(shape, env, d, under_drop)
        raise AssertionError(kind)

    def shape_change(self, shape, env, d, under_drop, options=None):
        sub = lambda shp, drop=under_drop: self.expr(shp, env, True, d, drop)  # noqa: E731
        reduce_op = lambda: self.pick(["sum", "max", "mean"])  # noqa: E731
        options = {
            "S": ["index", "reduceV", "reduceR", "dotVV", "poolall"],
            "R": ["slice", "col", "reduceM1", "dotMV", "bcastS", "cum", "sort", "topk", "pool"],
            "V": ["row", "reduceM0", "dotRM", "bcastS", "cum", "set"],
            "M": ["bcastV", "bcastR", "bcastS", "cum"],
        }[shape] if options is None else options
        kind = self.pick(options)
        if kind == "index":
            src = self.pick(["V", "R"])
            return ("index", self.draw(st.integers(0, SHAPES[src][0] - 1)), sub(src, True))
        if kind == "reduceV":
            return ("reduce", reduce_op(), None, sub("V"))
        if kind == "reduceR":
            return ("reduce", reduce_op(), None, sub("R"))
        if kind == "dotVV":
            return ("dot", sub("V"), sub("V"))
        if kind == "slice":
            return ("slice", self.pick(["tail", "head"]), sub("V", True))
        if kind == "col":
            return ("col", self.draw(st.integers(0, 3)), sub("M", True))
        if kind == "reduceM1":
            return ("reduce", reduce_op(), 1, sub("M"))
        if kind == "reduceM0":
            return ("reduce", reduce_op(), 0, sub("M"))
        if kind == "dotMV":
            return ("dot", sub("M"), sub("V"))
        if kind == "dotRM":
            return ("dot", sub("R"), sub("M"))
        if kind == "row":
            return ("row", self.draw(st.integers(0, 2)), sub("M", True))
        if kind == "cum":  # issue 13's drops: a running choice, a permutation, an overwrite
            return ("cum", self.pick(["max", "min"]), sub(shape, True))
        if kind == "sort":
            return ("sort", self.pick(["tail", "head"]), sub("V", True))
        if kind == "topk":
            return ("topk", sub("V", True))
        if kind in ("pool", "poolcols", "poolall"):
            pool = {"pool": "slide", "poolcols": "cols", "poolall": "all"}[kind]
            return ("pool", pool, sub(POOLS[pool][0], True))
        if kind == "set":
            return ("set", self.draw(st.integers(0, 3)), sub("V", True), sub("S", True))
        if kind == "bcastS":
            return ("bcast", shape, sub("S"))
        if kind == "bcastV":
            return ("bcast", "M", sub("V"))
        if kind == "bcastR":
            return ("bcast", "M", sub("R"))
        raise AssertionError(kind)

    def body_expr(self, shape, env, depth):
        return self.expr(shape, env, False, depth, False)

    def scan(self, shape, env, d, under_drop):
        self.control_flow -= 1
        # Output: the stacked per-step outputs ("ys") or the final carry. A carry is placed
        # under a selection only when the body computes lane by lane (`lanewise`): liveness
        # flows into such a scan's carries from outside; into any other scan's it does not
        # (docs/how-it-works.md, Limitations), so a hazard dropped only through its carry is
        # not guarded.
        outs = []
        if shape in ("V", "M"):
            outs.append(("ys", shape))
        if shape == "V" or shape == "S" and not under_drop:
            outs.append(("carry", {"S": "V", "V": "M"}[shape]))
        if not outs:
            self.control_flow += 1
            return self.leaf(shape, env, True)
        out, xs_shape = self.pick(outs)
        elem = {"V": "S", "M": "V"}[xs_shape]
        benv = {"c": elem, "xi": elem}
        xs = self.expr(xs_shape, env, True, d, under_drop)
        init = self.expr(elem, env, True, min(d, 1), under_drop)
        t = self.body_expr(elem, benv, 2)
        y = self.body_expr(elem, benv, 2)
        node = ("scan", xs, init, t, y, out)
        if out == "carry" and under_drop and not lanewise(node, env):
            self.control_flow += 1
            return self.leaf(shape, env, True)
        return node

    def cond(self, shape, env, d, under_drop):
        self.control_flow -= 1
        p = ("cmp", self.pick(sorted(CMPS)), self.expr("S", env, True, min(d, 1), False),
             self.const())
        u = self.expr(shape, env, True, d, under_drop)
        benv = {"u": shape}
        return ("cond", p, u, self.body_expr(shape, benv, 2), self.body_expr(shape, benv, 2))


@st.composite
def programs(draw, max_nodes: int = 8, hazard_free: bool = False):
    """A `Program` with one or two outputs. `hazard_free`: see `defang`."""
    g = Gen(draw, draw(st.integers(2, max_nodes)))
    n_out = draw(st.integers(1, 2))
    outs = []
    for _ in range(n_out):
        shape = draw(st.sampled_from(["V", "S", "R", "M"]))
        outs.append(g.expr(shape, INPUTS, True, draw(st.integers(2, 4)), False))
    program = Program(tuple(outs))
    return defang(program) if hazard_free else program


def _element():
    return st.one_of(st.sampled_from(SPECIAL),
                     st.floats(-4.0, 4.0, width=32, allow_subnormal=False))


@st.composite
def inputs(draw, nonfinite: bool = True):
    """Arguments (x, y, m, s) as float32 numpy arrays and the mask k as a bool array.

    With `nonfinite`, inf and NaN arrive in the arguments as data does (padding, sentinels,
    missing observations): mostly in the lanes that line up with a False of the mask argument
    (MASK_LANES), sometimes anywhere (a NaN a live lane then reads is a real one)."""
    k = np.asarray(draw(st.lists(st.booleans(), min_size=12, max_size=12)), bool).reshape(3, 4)
    # out of 8: how often a lane under a False of the mask, and any other lane, is non-finite
    masked, anywhere = (draw(st.sampled_from([0, 4, 8])), draw(st.sampled_from([0, 0, 1]))) \
        if nonfinite else (0, 0)

    def arr(name):
        shape = SHAPES[INPUTS[name]]
        under = ~np.broadcast_to(k[MASK_LANES[name]], shape)
        vals = []
        for i in range(int(np.prod(shape, dtype=int))):
            rate = masked if under.flat[i] else anywhere
            if rate and draw(st.integers(0, 7)) < rate:
                vals.append(draw(st.sampled_from(NONFINITE)))
            else:
                vals.append(draw(_element()))
        return np.asarray(vals, np.float32).reshape(shape)
    return (*(arr(a) for a in INPUTS), k)


def features(program: Program, args) -> set:
    """What a fuzz example holds that issue 12 asks for, to count in tests/.fuzz-counts.json:
    each kind of value-free mask, and inf/NaN in the arguments (anywhere, and in the lanes that
    line up with a False of the mask argument)."""
    found = {f"mask_{n[1]}" for o in program.outputs for n in walk(o) if n[0] == "mask"}
    found |= {f"drop_{'mul' if n[0] == 'bin' else n[0]}" for o in program.outputs
              for n in walk(o) if n[0] in (*CHOOSERS, "set") or n[0] == "bin" and drops(n)}
    k = np.asarray(args[-1])
    for name, a in zip(INPUTS, args, strict=False):
        bad = ~np.isfinite(np.asarray(a))
        if bad.any():
            found.add("nonfinite_args")
        if (bad & ~np.broadcast_to(k[MASK_LANES[name]], bad.shape)).any():
            found.add("nonfinite_under_false_mask_lanes")
    return found


# --------------------------------------------------------------------------- hazard-free


def _may_hold_constants(node) -> bool:
    """Whether some lanes of `node` may carry no derivative of the inputs: a selection, a
    comparison's winner, an overwrite, a product, a constant, a body (conservative)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, tuple) or not n:
            continue
        if n[0] in ("where", "swhere", "max", "min", "clip", "set", "const", "cond", "scan") \
                or n[0] == "bin" and n[1] == "mul":
            return True
        stack.extend(x for x in n[1:] if isinstance(x, tuple))
    return False


def defang(program: Program) -> Program:
    """The same program with nothing for jaxsafe to guard: every hazard that sits under a
    selection (or anywhere in a scan/cond body, or in a scan or cond operand, which the body
    may drop) becomes `jnp.sin`, a division there becomes a product, and NaN tests become
    comparisons (a NaN test, a body with a hazard, or a body input a hazard computed makes
    jaxsafe treat values as possibly non-finite). Hazards in other live positions and in
    top-level predicates stay: jaxsafe must leave them alone; a max/min/clip under such a
    hazard becomes a sum (its cotangent may be inf there: jaxsafe selects it)."""
    def go(node, dropped: bool, body: bool, below: bool = False):
        # below: under a live hazard, whose derivative may be inf: the cotangent there may be
        # non-finite, and a max/min/clip under it has a dropped lane to guard (it is selected
        # on its decision): it becomes a sum (the clip, its operand)
        k = node[0]
        g = lambda n, d=dropped, b=below: go(n, d or body, body, b)  # noqa: E731
        # a value that a hazard left live may make non-finite (the arguments are promised
        # finite): a derivative that reads it may be non-finite (`_Emitter.partial_bad`)
        made_nonfinite = lambda n: _anywhere(g(n), set())  # noqa: E731
        if k in ("in", "const"):
            return node
        if k == "haz":
            if dropped or body or _may_hold_constants(node[2]):
                # (a live hazard whose operand may hold a constant in some lanes is guarded
                # there for forward mode: jaxsafe/_free.py)
                return ("un", "sin", g(node[2]))
            return ("haz", node[1], g(node[2], b=True))
        if k == "div":
            if dropped or body:
                return ("bin", "mul", g(node[1]), g(node[2]))
            return ("div", g(node[1], b=True), g(node[2], b=True))
        if k == "un":
            return ("un", node[1], g(node[2], b=below or (node[1] not in LINEAR_UNARY
                                                          and made_nonfinite(node[2]))))
        if k == "bin":
            mul = node[1] == "mul"
            # a factor that may mask drops the other's lanes; under a live hazard such a
            # product is selected (as a max is): it becomes a sum
            op = "add" if below and drops(node) else node[1]
            return ("bin", op,
                    g(node[2], dropped or (mul and may_mask(node[3])),
                      below or (mul and made_nonfinite(node[3]))),
                    g(node[3], dropped or (mul and may_mask(node[2])),
                      below or (mul and made_nonfinite(node[2]))))
        if k == "where":
            return ("where", pred(node[1], body), g(node[2], True), g(node[3], True))
        if k == "swhere":
            cmp = "gt" if node[1] == "isnan" else node[1]
            return ("swhere", cmp, node[2], g(node[3], True), g(node[4], True), node[5])
        if k in ("max", "min"):
            a, b = g(node[1], True), g(node[2], True)
            return ("bin", "add", a, b) if below else (k, a, b)
        if k == "clip":
            return g(node[1], True) if below else ("clip", g(node[1], True), node[2], node[3])
        if k in ("slice", "index", "row", "col"):
            return (k, node[1], g(node[2], True))
        if k == "reduce":  # max and min drop all but the chosen lanes
            chooser = node[1] in ("max", "min")
            return ("reduce", "sum" if below and chooser else node[1], node[2],
                    g(node[3], dropped or chooser, below or (chooser and made_nonfinite(node[3]))))
        if k in CHOOSERS:
            # under a live hazard a chooser is selected on its choice: a slice (or the
            # operand) instead; a running max or a pooling reads values: made non-finite
            # below, its derivative may be too
            child = node[1] if k == "topk" else node[2]
            if below:
                if k == "cum":
                    return g(child)
                if k == "pool" and node[1] != "slide":  # M -> V, V -> S
                    return ("row" if node[1] == "cols" else "index", 0, g(child, True))
                return ("slice", node[1] if k == "sort" else "head", g(child, True))
            kid = g(child, True, k in ("cum", "pool") and made_nonfinite(child))
            return (*node[:-1], kid) if k != "topk" else (k, kid)
        if k == "set":
            return ("set", node[1], g(node[2], True), g(node[3], True))
        if k == "dot":
            return ("dot", g(node[1], b=below or made_nonfinite(node[2])),
                    g(node[2], b=below or made_nonfinite(node[1])))
        if k == "bcast":
            return ("bcast", node[1], g(node[2]))
        if k == "scan":
            # its operands too: what a body receives is possibly non-finite if a NaN-prone
            # operation computed it, live or not (the body may drop the lane at some step)
            return ("scan", g(node[1], True), g(node[2], True), go(node[3], True, True, below),
                    go(node[4], True, True, below), node[5])
        if k == "cond":
            return ("cond", pred(node[1], body), g(node[2], True), go(node[3], True, True, below),
                    go(node[4], True, True, below))
        raise ValueError(node)

    def pred(p, body: bool):
        if p[0] == "mask":
            return p
        if p[0] == "isnan":
            p = ("cmp", "gt", p[1], 0.0)
        if body:  # a hazard in a body, even in a predicate, taints the loop's outputs
            return ("cmp", p[1], go(p[2], True, True), p[3])
        return ("cmp", p[1], no_nan_test(p[2]), p[3])

    def no_nan_test(node):  # a predicate's operand: hazards stay, NaN tests go
        k = node[0]
        if k == "where":
            return ("where", pred(node[1], False), no_nan_test(node[2]), no_nan_test(node[3]))
        if k == "swhere" and node[1] == "isnan":
            node = ("swhere", "gt") + node[2:]
        if k == "cond":
            return go(node, False, False)
        kids = _diff_children(node)
        if not kids:
            return node
        new = {id(c): no_nan_test(c) for c in kids}
        return tuple(new.get(id(x), x) if isinstance(x, tuple) else x for x in node)

    return Program(tuple(go(o, False, False) for o in program.outputs))


# --------------------------------------------------------------------------- emission


class _Emitter:
    """Writes the statements of one function body (or a nested body) as source lines."""

    def __init__(self, counter, indent: int, env: dict):
        self.counter = counter
        self.indent = indent
        self.env = env            # leaf -> shape key
        self.lines: list[str] = []
        self.taint_inputs: set = set()  # twin, top level: inputs jaxsafe may treat as non-finite
        self.events: set = set()        # twin: shapes that meet an open jaxsafe bug (KNOWN_BUGS)
        self.ocache: dict = {}
        self.sunk_env: dict = {}  # a body's leaves of a chain moved into it: name -> (o, g)
        self.recorded: dict = {}  # twin: body input -> the masks `tw` reaches it with (hoist)

    def let(self, expr: str, prefix: str = "v") -> str:
        name = f"{prefix}{next(self.counter)}"
        self.lines.append("    " * self.indent + f"{name} = {expr}")
        return name

    def line(self, text: str):
        self.lines.append("    " * self.indent + text)

    def shape(self, node) -> tuple:
        return SHAPES[shape_of(node, self.env)]

    # -- the natural program ---------------------------------------------------------------
    def ev(self, node, names: dict) -> str:
        """The natural program; `names` maps leaves to variable names."""
        k = node[0]
        ev = lambda n: self.ev(n, names)  # noqa: E731
        if k == "in":
            return names[node[1]]
        if k == "const":
            return self.let(f"jnp.full({SHAPES[node[2]]}, {node[1]!r})")
        if k == "haz":
            return self.let(HAZARDS[node[1]][0].format(ev(node[2])))
        if k == "div":
            a = ev(node[1])
            return self.let(f"{a} / {ev(node[2])}")
        if k == "un":
            return self.let(SAFE_UNARY[node[1]].format(ev(node[2])))
        if k == "bin":
            a = ev(node[2])
            return self.let(f"{a} {BINOPS[node[1]]} {ev(node[3])}")
        if k == "where":
            if node[1][:2] == ("mask", "lit"):  # jax-ml/jax#20601's shape
                a = ev(node[2])
                return self.let(f"lax.select({node[1][3]!r}, {a}, {ev(node[3])})")
            p = self.pred(node[1], names)
            a = ev(node[2])
            return self.let(f"jnp.where({p}, {a}, {ev(node[3])})")
        if k == "swhere":
            _, cmp, c, h, fill, side = node
            h = ev(h)
            p = self.let(self.cmp_src(cmp, h, c), "p")
            f = ev(fill)
            return self.let(f"jnp.where({p}, {h}, {f})" if side else f"jnp.where({p}, {f}, {h})")
        if k in ("max", "min"):
            a = ev(node[1])
            fn = "maximum" if k == "max" else "minimum"
            return self.let(f"jnp.{fn}({a}, {ev(node[2])})")
        if k == "clip":
            return self.let(f"jnp.clip({ev(node[1])}, {node[2]!r}, {node[3]!r})")
        if k == "slice":
            return self.let(f"{ev(node[2])}[1:]" if node[1] == "tail" else f"{ev(node[2])}[:3]")
        if k in ("index", "row"):
            return self.let(f"{ev(node[2])}[{node[1]}]")
        if k == "col":
            return self.let(f"{ev(node[2])}[:, {node[1]}]")
        if k == "reduce":
            axis = "" if node[2] is None else f", axis={node[2]}"
            return self.let(f"jnp.{node[1]}({ev(node[3])}{axis})")
        if k == "dot":
            a = ev(node[1])
            return self.let(f"{a} @ {ev(node[2])}")
        if k == "cum":
            return self.let(f"lax.cum{node[1]}({ev(node[2])}, axis=0)")
        if k == "sort":
            return self.let(f"jnp.sort({ev(node[2])})" + ("[1:]" if node[1] == "tail" else "[:3]"))
        if k == "topk":
            return self.let(f"lax.top_k({ev(node[1])}, 3)[0]")
        if k == "pool":
            return self.let(POOLS[node[1]][2].format(ev(node[2])))
        if k == "set":
            a = ev(node[2])
            return self.let(f"{a}.at[{node[1]}].set({ev(node[3])})")
        if k == "bcast":
            a, src = ev(node[2]), shape_of(node[2], self.env)
            if src == "R":
                a = f"{a}[:, None]"
            return self.let(f"jnp.broadcast_to({a}, {SHAPES[node[1]]})")
        if k == "scan":
            return self.scan(node, names)
        if k == "cond":
            return self.cond(node, names)
        raise ValueError(node)

    @staticmethod
    def cmp_src(cmp, h, c):
        return f"jnp.isnan({h})" if cmp == "isnan" else f"{h} {CMPS[cmp]} {c!r}"

    def pred(self, p, names) -> str:
        if p[0] == "mask":
            _, kind, shape, payload = p
            if kind == "arg":
                return self.let(MASK_ARG_SRC[shape], "p")
            if kind == "lit":  # as the twin's masks read it; `ev` writes the literal itself
                return self.let(f"jnp.asarray({payload!r})", "p")
            if kind == "iota":
                return self.let(IOTA_MASKS[shape][payload], "p")
            vals = np.asarray(payload, bool).reshape(SHAPES[shape]).tolist()
            return self.let(f"np.array({vals!r}, bool)", "p")  # closed over by the function
        if p[0] == "cmp":
            return self.let(f"{self.ev(p[2], names)} {CMPS[p[1]]} {p[3]!r}", "p")
        if p[0] == "isnan":
            return self.let(f"jnp.isnan({self.ev(p[1], names)})", "p")
        raise ValueError(p)

    def sub(self, env: dict) -> _Emitter:
        e = _Emitter(self.counter, self.indent + 1, env)
        e.events = self.events
        return e

    def scan(self, node, names) -> str:
        _, xs, init, t, y, out = node
        xs_v, init_v = self.ev(xs, names), self.ev(init, names)
        elem = {"V": "S", "M": "V"}[shape_of(xs, self.env)]
        fn = f"body{next(self.counter)}"
        b = self.sub({"c": elem, "xi": elem})
        bn = {"c": "c", "xi": "xi"}
        tv = b.ev(t, bn)
        yv = b.ev(y, bn)
        b.line(f"return c + {tv}, {yv}")
        self.line(f"def {fn}(c, xi):")
        self.lines += b.lines
        return self.let(f"lax.scan({fn}, {init_v}, {xs_v})[{0 if out == 'carry' else 1}]")

    def cond(self, node, names) -> str:
        _, p, u, tb, fb = node
        pv = self.pred(p, names)
        uv = self.ev(u, names)
        fns = []
        for br in (tb, fb):
            fn = f"branch{next(self.counter)}"
            b = self.sub({"u": shape_of(u, self.env)})
            b.line(f"return {b.ev(br, {'u': 'u'})}")
            self.line(f"def {fn}(u):")
            self.lines += b.lines
            fns.append(fn)
        return self.let(f"lax.cond({pv}, {fns[0]}, {fns[1]}, {uv})")

    # -- masks -------------------------------------------------------------------------------
    # A mask is a variable name (bool array of the node's shape, True: live) or None (all
    # live). Decisions read the original values (`orig`).

    def orig(self, node, env2) -> str:
        if node not in self.ocache:
            self.ocache[node] = self.ev(node, {n: o for n, (o, g) in env2.items()})
        return self.ocache[node]

    def orig_pred(self, p, env2) -> str:
        key = ("pred", p)
        if key not in self.ocache:
            self.ocache[key] = self.pred(p, {n: o for n, (o, g) in env2.items()})
        return self.ocache[key]

    def carries(self, node, env2) -> str:
        """The lanes of `node` that carry a derivative, at run time (jaxsafe/_carries.py)."""
        shape = self.shape(node)
        c = carry_class(node)
        if c != PART:
            return self.let(f"jnp.full({shape}, {c == ALL})", "k")
        k = node[0]
        kids = [self.carries(ch, env2) for ch in _diff_children(node)]
        if k == "where":
            p = self.orig_pred(node[1], env2)
            pb = p if SHAPES[self.pred_shape(node[1])] == shape else self.bto(p, shape)
            return self.let(f"jnp.where({pb}, {kids[0]}, {kids[1]})", "k")
        if k == "swhere":
            _, cmp, cst, h, fill, side = node
            p = self.let(self.cmp_src(cmp, self.orig(h, env2), cst), "p")
            a, b = (kids[0], kids[1]) if side else (kids[1], kids[0])
            return self.let(f"jnp.where({p}, {a}, {b})", "k")
        if k in ("max", "min"):  # the winner's lanes; a tie or a NaN: both sides' (JAX's)
            ao, bo = (self.bto(self.orig(c, env2), shape) for c in (node[1], node[2]))
            a, b = (self.bto(x, shape) for x in kids)
            first = "<" if k == "min" else ">"
            return self.let(f"jnp.where({ao} {first} {bo}, {a}, jnp.where({bo} {first} {ao}, "
                            f"{b}, {a} | {b}))", "k")
        if k == "clip":  # min(hi, max(lo, a)): a's lanes where no bound wins alone (a tie,
            # a NaN: both sides' lanes, as for max/min)
            _, a, lo, hi = node
            ao = self.orig(a, env2)
            mx = self.let(f"jnp.maximum({lo!r}, {ao})")
            return self.let(f"{kids[0]} & ~({hi!r} < {mx}) & ~({lo!r} > {ao})", "k")
        return self.let(" | ".join(f"jnp.broadcast_to({x}, {shape})" for x in kids), "k")

    def chosen(self, node, env2) -> str:
        """`jnp.max`/`jnp.min`: the lanes equal to their row's result, and every lane of a row
        whose result is NaN, and NaN lanes (jaxsafe/_choosers.py)."""
        _, op, axis, a = node
        ao = self.orig(a, env2)
        src = self.shape(a)
        ax = "" if axis is None else f", axis={axis}, keepdims=True"
        r = self.bto(self.let(f"jnp.{op}({ao}{ax})"), src)
        return self.let(f"({ao} == {r}) | jnp.isnan({r}) | jnp.isnan({ao})", "k")

    def sliced(self, part, m):
        """The lanes of a V that `[1:]` ("tail") or `[:3]` ("head") keeps, live where `m` is."""
        if m is None:
            keep = "[False, True, True, True]" if part == "tail" else "[True, True, True, False]"
            return self.let(f"jnp.array({keep})", "k")
        pad = f"[jnp.zeros(1, bool), {m}]" if part == "tail" else f"[{m}, jnp.zeros(1, bool)]"
        return self.let(f"jnp.concatenate({pad})", "k")

    def running_chosen(self, node, env2, m):
        """`lax.cummax` (`cummin`) along axis 0: a lane is chosen where it equals the running
        maximum at the nearest live output at or after it (the running maximum only grows; a
        tie shares); every lane a live output reads where the output or the lane is NaN."""
        _, op, a = node
        ao = self.orig(a, env2)
        shape = self.shape(node)
        out = self.let(f"lax.cum{op}({ao}, axis=0)")
        live = self.full(m, shape)
        far, nearest = ("jnp.inf", "cummin") if op == "max" else ("-jnp.inf", "cummax")
        at = self.let(f"jnp.where({live}, {out}, {far})")
        near = self.let(f"lax.{nearest}({at}, axis=0, reverse=True)")
        nan_out = self.let(f"{live} & jnp.isnan({out})", "k")

        def reads(x):  # the lanes at or before a True: a running op reads its prefix
            return f"(lax.cumsum({x}.astype(jnp.int32), axis=0, reverse=True) > 0)"
        # (with a live output at or after it: where there is none, `near` is the sentinel
        # `far`, which an infinite lane equals)
        return self.let(f"(({ao} == {near}) & {reads(live)}) | {reads(nan_out)} | "
                        f"(jnp.isnan({ao}) & {reads(live)})", "k")

    def pool_chosen(self, node, env2, m):
        """Max pooling: the lane each live window hands its derivative to (JAX's own
        derivative, one lane per window), and every lane of a live window that is NaN or
        holds a NaN."""
        _, kind, a = node
        src, dst, pool, window_sum = POOLS[kind]
        ao = self.orig(a, env2)
        live = self.full(m, SHAPES[dst])
        out = self.let(pool.format(ao))
        ct = self.let(f"jax.vjp(lambda v: {pool.format('v')}, lax.stop_gradient({ao}))[1]("
                      f"{live}.astype({ao}.dtype))[0]")
        nan_out = self.let(f"{live} & jnp.isnan({out})", "k")

        def reads(x):  # the lanes of the windows where x is True
            return (f"(jax.vjp(lambda v: {window_sum.format('v')}, jnp.zeros({SHAPES[src]}))"
                    f"[1]({x}.astype(jnp.float32))[0] > 0)")
        return self.let(f"({ct} != 0) | {reads(nan_out)} | (jnp.isnan({ao}) & {reads(live)})",
                        "k")

    def AND(self, m, c):
        return c if m is None else self.let(f"{m} & {c}", "k")

    def NOT(self, c):
        return self.let(f"~{c}", "k")

    def full(self, m, shape):
        return self.let(f"jnp.ones({shape}, bool)", "k") if m is None else m

    def bto(self, expr, shape):
        return self.let(f"jnp.broadcast_to({expr}, {shape})", "k")

    def fit(self, m, child_shape, node_shape):
        """The mask an operand of `child_shape` sees; a scalar operand is live where any lane
        it is broadcast to is."""
        if m is None or child_shape == node_shape:
            return m
        assert child_shape == ()
        return self.let(f"jnp.any({m})", "k")

    def pred_shape(self, p) -> str:
        if p[0] == "mask":
            return p[2]
        return shape_of(p[2] if p[0] == "cmp" else p[1], self.env)

    def child_masks(self, node, env2, m) -> list:
        """The masks of the differentiable children (`_diff_children` order), given the
        node's mask `m`. Selections compute their decisions from the original values."""
        k = node[0]
        shape = self.shape(node)
        if k in ("haz", "un"):
            return [m]
        if k == "div":
            return [m, m]
        if k == "bin":
            masks = []
            for c, other in ((node[2], node[3]), (node[3], node[2])):
                mc = m
                if node[1] == "mul" and may_mask(other):  # dropped where the factor masks
                    keep = self.bto(f"~({self.orig(other, env2)} == 0) | "
                                    f"{self.carries(other, env2)}", shape)
                    mc = self.AND(m, keep)
                masks.append(self.fit(mc, self.shape(c), shape))
            return masks
        if k == "where":
            p = self.orig_pred(node[1], env2)
            pb = p if SHAPES[self.pred_shape(node[1])] == shape else self.bto(p, shape)
            return [self.AND(m, pb), self.AND(m, self.NOT(pb))]
        if k == "swhere":
            _, cmp, c, h, fill, side = node
            p = self.let(self.cmp_src(cmp, self.orig(h, env2), c), "p")
            np_ = self.NOT(p)
            mh, mf = (p, np_) if side else (np_, p)
            return [self.AND(m, mh), self.AND(m, mf)]
        if k in ("max", "min"):
            # the losing operand is dropped; on a tie or a NaN both stay live
            ao, bo = self.orig(node[1], env2), self.orig(node[2], env2)
            gt = ">" if k == "max" else "<"
            a_live = self.bto(f"~({bo} {gt} {ao})", shape)
            b_live = self.bto(f"~({ao} {gt} {bo})", shape)
            return [self.AND(m, a_live),
                    self.fit(self.AND(m, b_live), self.shape(node[2]), shape)]
        if k == "clip":  # jnp.clip(a, lo, hi) is jnp.minimum(hi, jnp.maximum(lo, a))
            _, a, lo, hi = node
            ao = self.orig(a, env2)
            mx = self.let(f"jnp.maximum({lo!r}, {ao})")
            live = self.let(f"~({hi!r} < {mx}) & ~({lo!r} > {ao})", "k")
            return [self.AND(m, live)]
        if k == "slice":
            return [self.sliced(node[1], m)]
        if k == "cum":
            return [self.running_chosen(node, env2, m)]
        if k == "sort":  # a lane is live where its sorted position is
            perm = self.let(f"jnp.argsort({self.orig(node[2], env2)}, stable=True)", "i")
            return [self.let(f"jnp.zeros(4, bool).at[{perm}].set({self.sliced(node[1], m)})",
                             "k")]
        if k == "topk":
            idx = self.let(f"lax.top_k({self.orig(node[1], env2)}, 3)[1]", "i")
            return [self.let(f"jnp.zeros(4, bool).at[{idx}].set({self.full(m, (3,))})", "k")]
        if k == "pool":
            return [self.pool_chosen(node, env2, m)]
        if k == "set":  # the overwritten lane of `a` is dropped; `b` is live where it lands
            other = self.let(f"jnp.arange(4) != {node[1]}", "k")
            return [self.AND(m, other), None if m is None else self.let(f"{m}[{node[1]}]", "k")]
        if k == "index":
            n = self.shape(node[2])[0]
            return [self.AND(m, self.let(f"jnp.arange({n}) == {node[1]}", "k"))]
        if k == "row":
            onehot = self.bto(f"(jnp.arange(3) == {node[1]})[:, None]", (3, 4))
            return [onehot if m is None else self.let(f"{onehot} & {m}[None, :]", "k")]
        if k == "col":
            onehot = self.bto(f"(jnp.arange(4) == {node[1]})[None, :]", (3, 4))
            return [onehot if m is None else self.let(f"{onehot} & {m}[:, None]", "k")]
        if k == "reduce":  # every lane of a live row is live (of max/min: the chosen lanes)
            src = self.shape(node[3])
            row = None if m is None else self.bto(
                m if node[2] is None else f"{m}[None, :]" if node[2] == 0 else f"{m}[:, None]",
                src)
            if node[1] not in ("max", "min"):
                return [row]
            return [self.AND(row, self.chosen(node, env2))]
        if k == "dot":  # an operand lane is live if any output it is multiplied into is
            sa, sb = shape_of(node[1], self.env), shape_of(node[2], self.env)
            if m is None:
                return [None, None]
            if (sa, sb) == ("M", "V"):
                return [self.bto(f"{m}[:, None]", (3, 4)), self.bto(f"jnp.any({m})", (4,))]
            if (sa, sb) == ("V", "V"):
                return [self.bto(m, (4,)), self.bto(m, (4,))]
            return [self.bto(f"jnp.any({m})", (3,)), self.bto(f"{m}[None, :]", (3, 4))]
        if k == "bcast":  # a source lane is live if any of its copies is
            if m is None:
                return [None]
            src = shape_of(node[2], self.env)
            if src == "S":
                return [self.let(f"jnp.any({m})", "k")]
            return [self.let(f"jnp.any({m}, axis={0 if src == 'V' else 1})", "k")]
        raise ValueError(node)

    # -- the twin ------------------------------------------------------------------------------
    # `tw` returns (guarded variable, tainted, changed):
    # - tainted: jaxsafe treats the value as possibly non-finite (docs/how-it-works.md,
    #   "Operands that may be non-finite": a value tested with isnan and everything it is
    #   computed from, scan and cond outputs whose bodies hold a NaN-prone primitive, and
    #   everything computed from them that no guard cleaned). Where such an operand feeds a
    #   non-linear operation whose output has dropped lanes, the twin replaces it by 0 in its
    #   dropped lanes, as jaxsafe documents.
    # - changed: a guard or a replacement happened below; then a max/min/clip above is written
    #   as a select on its original decision ("Implicit selections").
    # `maybe`: the node's output may have dropped lanes (a selection above it);
    # `tested`: the node is a value tested with isnan, or one it is computed from.

    def zero(self, v, mv):
        return self.let(f"jnp.where({mv}, {v}, 0.0)", "g")

    def tw(self, node, env2, m, maybe: bool, tested: bool, bad: bool = False):
        # bad: the cotangent of this value may be inf or NaN (jaxsafe/_cotangents.py): a
        # max/min/clip there is written as a where on its decision, whose loser gets 0
        assert (m is not None) == maybe, (node, m, maybe)
        k = node[0]
        if k == "in":
            if node[1] in self.recorded:
                self.recorded[node[1]].append(m)
            return env2[node[1]][1], node[1] in self.taint_inputs, False
        if k == "const":
            return self.ev(node, {}), tested, False
        if k == "scan":
            return self.tw_scan(node, env2, m, maybe, tested, bad)
        if k == "cond":
            return self.tw_cond(node, env2, m, maybe, tested, bad)
        kids = _diff_children(node)
        cms = self.child_masks(node, env2, m)
        res = []
        for i, (c, cm) in enumerate(zip(kids, cms, strict=False)):
            t = tested or (k == "swhere" and node[1] == "isnan" and i == 0)
            # a product drops the lanes of a factor only where the other may mask it
            kid_maybe = maybe or (drops(node) and cm is not None)
            res.append(self.tw(c, env2, cm, kid_maybe, t, bad or self.partial_bad(node, i)))
        gs = [r[0] for r in res]
        taints = [r[1] for r in res]
        changed = any(r[2] for r in res)
        # operands replaced in dropped lanes: the table operand of a hazard (its safe value),
        # possibly non-finite operands of a non-linear operation (0)
        zeroed = [False] * len(kids)
        if maybe and _is_nonlinear(node):
            zeroed = [t and not (k == "haz" or (k == "div" and i == 1))
                      for i, t in enumerate(taints)]
        for i, z in enumerate(zeroed):
            if z:
                gs[i] = self.zero(gs[i], cms[i])
        table = maybe and k in ("haz", "div")
        site = table or any(zeroed)
        cleaned = [z or (table and (k == "haz" or i == 1)) for i, z in enumerate(zeroed)]
        tainted = tested or any(t and not c for t, c in zip(taints, cleaned, strict=False))
        # a value without dropped lanes is bitwise the original: never "changed"
        out_changed = maybe and (changed or site)

        if k == "haz":
            (a,) = gs
            if maybe:
                a = self.let(f"jnp.where({m}, {a}, {HAZARDS[node[1]][1]!r})", "g")
            return self.let(HAZARDS[node[1]][0].format(a)), tainted, out_changed
        if k == "div":
            a, b = gs
            if maybe:
                b = self.let(f"jnp.where({m}, {b}, {DIV_SAFE!r})", "g")
            return self.let(f"{a} / {b}"), tainted, out_changed
        if k == "un":
            return self.let(SAFE_UNARY[node[1]].format(gs[0])), tainted, out_changed
        if k == "bin":
            prod = self.let(f"{gs[0]} {BINOPS[node[1]]} {gs[1]}")
            if node[1] != "mul" or not drops(node):
                return prod, tainted, out_changed
            # where a factor masks a lane of a live output: the original product, its
            # derivative cut (jaxsafe/_choosers.py, by_original)
            shape = self.shape(node)
            cut = [self.NOT(self.bto(cm, shape)) for cm in cms if cm is not None]
            if not cut:
                return prod, tainted, out_changed
            c = self.let(" | ".join(cut), "k")
            if m is not None:
                c = self.AND(m, c)
            orig = self.orig(node, env2)
            return (self.let(f"jnp.where({c}, lax.stop_gradient({orig}), {prod})"), tainted,
                    True)
        if k == "where":
            p = self.orig_pred(node[1], env2)
            return self.let(f"jnp.where({p}, {gs[0]}, {gs[1]})"), tainted, out_changed
        if k == "swhere":
            _, cmp, c, h, fill, side = node
            p = self.let(self.cmp_src(cmp, self.orig(h, env2), c), "p")
            hg, fg = gs
            return (self.let(f"jnp.where({p}, {hg}, {fg})" if side else
                             f"jnp.where({p}, {fg}, {hg})"), tainted, out_changed)
        if k in ("max", "min"):
            a, b = gs
            fn = "maximum" if k == "max" else "minimum"
            if not changed and not bad:
                return self.let(f"jnp.{fn}({a}, {b})"), tainted, False
            ao, bo = self.orig(node[1], env2), self.orig(node[2], env2)
            gt = ">" if k == "max" else "<"
            return (self.let(f"jnp.where({ao} {gt} {bo}, {a}, jnp.where({bo} {gt} {ao}, {b}, "
                             f"jnp.{fn}({a}, {b})))"), tainted, maybe and changed)
        if k == "clip":
            return self.tw_clip(node, env2, gs[0], changed, tainted, maybe, bad)
        if k == "slice":
            return (self.let(f"{gs[0]}[1:]" if node[1] == "tail" else f"{gs[0]}[:3]"),
                    tainted, out_changed)
        if k in ("index", "row"):
            return self.let(f"{gs[0]}[{node[1]}]"), tainted, out_changed
        if k == "col":
            return self.let(f"{gs[0]}[:, {node[1]}]"), tainted, out_changed
        if k == "reduce":
            op, axis, a = node[1], node[2], gs[0]
            ax = "" if axis is None else f", axis={axis}"
            if op in ("max", "min"):  # dropped lanes of live rows hold the identity
                src = self.shape(node[3])
                row = self.full(None if m is None else self.bto(
                    m if axis is None else f"{m}[None, :]" if axis == 0 else f"{m}[:, None]",
                    src), src)
                fill = self.let(f"~{cms[0]} & {row}", "k") if cms[0] is not None else None
                if fill is not None:
                    ident = "-jnp.inf" if op == "max" else "jnp.inf"
                    a = self.let(f"jnp.where({fill}, {ident}, {a})", "g")
                return self.let(f"jnp.{op}({a}{ax})"), tainted, out_changed
            if op != "mean":
                return self.let(f"jnp.{op}({a}{ax})"), tainted, out_changed
            # jnp.mean is a sum (linear) and a division (not linear, by a literal): the sum
            # is what a replacement would zero
            src = self.shape(node[3])
            n = src[0] if axis is None else src[axis]
            if not (maybe and (tested or taints[0])):
                return self.let(f"jnp.mean({a}{ax})"), tested or taints[0], changed
            total = self.zero(self.let(f"jnp.sum({a}{ax})"), m)
            return self.let(f"{total} / {float(n)!r}"), tested, True
        if k == "dot":
            return self.let(f"{gs[0]} @ {gs[1]}"), tainted, out_changed
        if k in ("cum", "pool"):
            # dropped lanes hold the identity, so a guarded value is never chosen; a dropped
            # output takes the guarded values' own result (no -inf there to meet a zero)
            a = gs[0]
            op = node[1] if k == "cum" else "max"
            fn = (lambda v: f"lax.cum{op}({v}, axis=0)") if k == "cum" else \
                POOLS[node[1]][2].format
            ident = "-jnp.inf" if op == "max" else "jnp.inf"
            out = self.let(fn(self.let(f"jnp.where({cms[0]}, {a}, {ident})", "g")))
            if m is not None:
                out = self.let(f"jnp.where({m}, {out}, {fn(a)})")
            return out, tainted, out_changed
        if k == "sort":  # the original permutation, gathered from the guarded operand
            perm = self.let(f"jnp.argsort({self.orig(node[2], env2)}, stable=True)", "i")
            return (self.let(f"{gs[0]}[{perm}]" + ("[1:]" if node[1] == "tail" else "[:3]")),
                    tainted, out_changed)
        if k == "topk":
            idx = self.let(f"lax.top_k({self.orig(node[1], env2)}, 3)[1]", "i")
            return self.let(f"{gs[0]}[{idx}]"), tainted, out_changed
        if k == "set":
            return self.let(f"{gs[0]}.at[{node[1]}].set({gs[1]})"), tainted, out_changed
        if k == "bcast":
            a = gs[0]
            if shape_of(node[2], self.env) == "R":
                a = f"{a}[:, None]"
            return self.let(f"jnp.broadcast_to({a}, {SHAPES[node[1]]})"), tainted, out_changed
        raise ValueError(node)

    def partial_bad(self, node, i: int) -> bool:
        """Whether jaxsafe judges the derivative of `node` in its i-th value child possibly
        non-finite (`_cotangents._partial_may_be_nonfinite`): a NaN-prone operation, or a
        non-linear one whose derivative reads a value that may hold inf or NaN somewhere."""
        k = node[0]
        kids = _diff_children(node)
        leaves = set(self.taint_inputs)
        if k in ("haz", "div"):
            return True
        if k == "un":
            return node[1] not in LINEAR_UNARY and _anywhere(kids[0], leaves)
        if k == "bin":
            return node[1] == "mul" and _anywhere(kids[1 - i], leaves)
        if k == "dot":
            return _anywhere(kids[1 - i], leaves)
        if k == "reduce":
            return node[1] in ("max", "min") and _anywhere(kids[0], leaves)
        if k in ("cum", "pool"):
            return _anywhere(kids[0], leaves)
        return False

    def tw_clip(self, node, env2, a, a_changed, tainted, maybe, bad):
        # jnp.clip(a, lo, hi) = min(hi, max(lo, a)): both re-decided on the original values
        # when `a` changed below them, or when their cotangent may be non-finite
        _, an, lo, hi = node
        if not a_changed and not bad:
            return self.let(f"jnp.clip({a}, {lo!r}, {hi!r})"), tainted, False
        ao = self.orig(an, env2)
        mx_o = self.let(f"jnp.maximum({lo!r}, {ao})")
        mx = self.let(f"jnp.where({ao} > {lo!r}, {a}, jnp.where({lo!r} > {ao}, {lo!r}, "
                      f"jnp.maximum({lo!r}, {a})))")
        return (self.let(f"jnp.where({mx_o} < {hi!r}, {mx}, jnp.where({hi!r} < {mx_o}, "
                         f"{hi!r}, jnp.minimum({hi!r}, {mx})))"), tainted, maybe and a_changed)

    def tw_scan(self, node, env2, m, maybe, tested, bad=False):
        # The operands of a scan are live as soon as any output is (jaxsafe's conservative
        # rule), its carries are live, and the per-step outputs take the mask from outside,
        # step by step. A body that computes lane by lane (`lanewise`) is the exception: there
        # lane j of the init, of every step's input and of the carry at every step is live
        # where lane j of the output is, at some step.
        # Another exception: a per-step output that is the step's input itself (`y = xi`) is
        # moved out of the scan by JAX (`lax.scan` forwards it), so the stacked output is the
        # operand and takes the mask from outside; the scan itself is then unused (its carry is
        # not the output) and jaxsafe plans without it.
        # Otherwise every operand is live where any lane of the output is (all of it dropped:
        # the whole loop is).
        _, xs, init, t, y, out = node
        xs_o, init_o = self.orig(xs, env2), self.orig(init, env2)
        forwarded = out == "ys" and y == ("in", "xi")
        xs_shape = shape_of(xs, self.env)
        elem = {"V": "S", "M": "V"}[xs_shape]
        lane, anywhere = None, None
        if m is not None and not forwarded and lanewise(node, self.env):
            lane = self.let(f"jnp.any({m}, axis=0)", "k") if out == "ys" else m
        elif m is not None and not forwarded:
            anywhere = self.let(f"jnp.any({m})", "k")
        xs_m = m if forwarded else None
        init_m = lane
        if lane is not None:
            xs_m = self.let(f"jnp.broadcast_to({lane}, {SHAPES['M']!r})", "k")
        if anywhere is not None:
            xs_m = self.let(f"jnp.broadcast_to({anywhere}, {SHAPES[xs_shape]!r})", "k")
            init_m = self.let(f"jnp.broadcast_to({anywhere}, {SHAPES[elem]!r})", "k")
        # as for a cond (tw_cond)
        bad = bad or _body_has_hazard(t) or _body_has_hazard(y) or \
            _anywhere(xs, set(self.taint_inputs)) or _anywhere(init, set(self.taint_inputs))
        sunk = _sinkable_chain(xs, self.env) \
            if _dropped_leaf(t, "xi") or _dropped_leaf(y, "xi") else None
        if sunk is None:  # jaxsafe's hoist (`jaxsafe/_hoisted.py`): what the body drops by xi
            hoisted = self.hoisted(t, y, {"xi": elem}, {"xi": xs_o}, "xi", bad)
            xs_m = _and_masks(xs_m, hoisted)
        xs_g, xs_t, xs_c = self.tw(xs, env2, xs_m, xs_m is not None, tested, bad)
        init_g, init_t, init_c = self.tw(init, env2, init_m, init_m is not None, tested, bad)
        ym = m if out == "ys" else None
        fn = f"body{next(self.counter)}"
        b = self.sub({"c": elem, "xi": elem})
        # jaxsafe's sinking pass (`jaxsafe/_sinking.py`): an elementwise chain that computes the
        # stacked operand, with a non-linear operation in it, is computed in the body when the
        # body drops some lane of its step's input: then the body's guards reach it. Its
        # stacked leaves are the loop's inputs then, each dropped before the loop where the
        # body drops it by the step's inputs (the hoist)
        stacked_in: list[tuple[str, str]] = []
        if sunk is not None:
            chain, leaves = sunk
            renamed, stacked_leaves, const_leaves, outer = {}, [], [], {}
            for leaf in leaves:
                name = f"l{next(self.counter)}"
                lo = self.orig(leaf, env2)
                if shape_of(leaf, self.env) == xs_shape:  # one slice per step
                    b.env[name] = elem
                    b.sunk_env[name] = (f"{name}_o", f"{name}_g")
                    stacked_leaves.append((leaf, name, lo))
                    outer[name] = lo
                else:  # a scalar: the same at every step (a constant of the loop)
                    b.env[name] = "S"
                    const_leaves.append((leaf, name, lo))
                renamed[leaf] = ("in", name)
                if tested or _anywhere(leaf, set(self.taint_inputs)):
                    b.taint_inputs.add(name)
            t = _replace_leaf(t, ("in", "xi"), _renamed_leaves(chain, renamed))
            y = _replace_leaf(y, ("in", "xi"), _renamed_leaves(chain, renamed))
            for leaf, name, lo in stacked_leaves:
                hoisted = self.hoisted(t, y, {n: b.env[n] for n in outer} | {"xi": elem},
                                       outer, name, bad, b.sunk_env)
                lm = _and_masks(xs_m, hoisted)
                lg = self.tw(leaf, env2, lm, lm is not None, tested, bad)[0]
                stacked_in.append((lo, lg))
            # a constant: dropped where the body drops it at every step (the hoist's OR)
            for leaf, name, lo in const_leaves:
                b.sunk_env[name] = (lo, f"{name}_g")  # the hoist reads `lo`, never this
                hoisted = self.hoisted(t, y, {n: b.env[n] for n in outer} | {"xi": elem,
                                       name: "S"}, outer, name, bad, b.sunk_env, const=True)
                lm = _and_masks(anywhere, hoisted)
                lg = self.tw(leaf, env2, lm, lm is not None, tested, bad)[0]
                b.sunk_env[name] = (lo, lg)
        # what the body receives may be non-finite as jaxsafe judges a body's inputs: computed
        # from an argument or a NaN-prone operation, guards not counted; the carry `c + t` from
        # the init or from what t makes of the rest (the fixpoint, one step for one carry)
        leaves = set(self.taint_inputs)
        if tested or _anywhere(xs, leaves):
            b.taint_inputs.add("xi")
        if tested or _anywhere(init, leaves) or _anywhere(t, b.taint_inputs):
            b.taint_inputs.add("c")
        benv = {"c": ("c_o", "c_g"), "xi": ("xi_o", "xi_g"), **b.sunk_env}
        t_o = b.orig(t, benv)
        t_g = b.tw(t, benv, lane, lane is not None, False, bad)[0]
        y_g = b.tw(y, benv, None if ym is None else "my", ym is not None, False, bad)[0]
        b.line(f"return (c_o + {t_o}, c_g + {t_g}), {y_g}")
        self.line(f"def {fn}(carry, inp):")
        self.line("    c_o, c_g = carry")
        steps = "".join(f", {n}_o, {n}_g" for n, (o, _) in b.sunk_env.items()
                        if o == f"{n}_o")
        self.line(f"    xi_o, xi_g{steps}, my = inp" if ym is not None
                  else f"    xi_o, xi_g{steps} = inp")
        self.lines += b.lines
        extra = "".join(f", {lo}, {lg}" for lo, lg in stacked_in)
        ins = f"({xs_o}, {xs_g}{extra}, {ym})" if ym is not None else \
            f"({xs_o}, {xs_g}{extra})"
        r = self.let(f"lax.scan({fn}, ({init_o}, {init_g}), {ins})")
        tainted = tested or xs_t or init_t or _body_has_hazard(t) or _body_has_hazard(y)
        # the operands are live (unless the body is lane by lane), so a guard inside them
        # changes no lane the scan reads
        changed = (maybe and out == "ys" and (_has_hazard(y) or _has_dropped_hazard(t))) \
            or (forwarded and xs_c) or lane is not None \
            or (anywhere is not None and (xs_c or init_c))
        return self.let(f"{r}[0][1]" if out == "carry" else f"{r}[1]"), tainted, changed

    def hoisted(self, t, y, inputs: dict, outer: dict, target: str, bad: bool,
                sunk_env: dict | None = None, const: bool = False):
        """jaxsafe's hoist (`jaxsafe/_hoisted.py`): the lanes of a scan's stacked input that its
        body keeps, with every output live at every step, computed for every step at once
        before the loop (`jax.vmap`) where that mask reads the step's stacked inputs alone
        (never the carry); else None. `inputs`: the body's stacked inputs and their shapes at
        one step; `outer`: their stacked values (original) outside; `target`: the one asked
        (`const`: a constant of the loop, read by the body as it is outside: the OR over the
        steps). The masks come from the twin's own rules, as the body reaches `target` with
        them."""
        hb = self.sub({"c": inputs.get("xi", "S"), **inputs})
        hb.events = set()  # a throwaway twin of the body: its events are not the program's
        hb.recorded = {target: []}
        hb.sunk_env = dict(sunk_env or {})
        hb.taint_inputs = {"c", *inputs}  # as a body's inputs may be, for its masks' rules
        benv = {"c": ("c_o", "c_g"), "xi": ("xi_o", "xi_g"), **hb.sunk_env}
        hb.tw(t, benv, None, False, False, bad)
        hb.tw(y, benv, None, False, False, bad)
        masks = hb.recorded[target]
        if not masks or any(m is None for m in masks):
            return None  # live in every lane where read whole, or not read (DEAD, no hoist)
        union = hb.let(" | ".join(f"({m})" for m in masks), "k")
        needed = _needed_lines(hb.lines, union)
        if needed is None:
            return None  # reads the carry, or the guarded program: not known before the loop
        names = [n for n in outer if n in inputs]
        params = [f"{'xi' if n == 'xi' else n}_o" for n in names]
        fn = f"hoist{next(self.counter)}"
        self.line(f"def {fn}({', '.join(params)}):")
        self.lines += needed
        self.line(f"    return jnp.broadcast_to({union}, {SHAPES[inputs[target]]!r})")
        steps = self.let(f"jax.vmap({fn})({', '.join(outer[n] for n in names)})", "k")
        return self.let(f"jnp.any({steps}, axis=0)", "k") if const else steps

    def tw_cond(self, node, env2, m, maybe, tested, bad=False):
        # A branch runs again on the guarded operand and decides on what it reads, so the
        # operand is live wherever the taken branch reads it at all (predicates included) and
        # its output is live: liveness through a cond is structural. Inside the branches the
        # selections take the mask from outside.
        _, p, u, tb, fb = node
        pv = self.orig_pred(p, env2)
        u_o = self.orig(u, env2)
        ushape = shape_of(u, self.env)
        reads = [any(n == ("in", "u") for n in walk(br)) for br in (tb, fb)]
        if all(reads):
            mu = m
        else:
            zeros = self.let(f"jnp.zeros({SHAPES[ushape]}, bool)", "k")
            mt, mf = (self.full(m, SHAPES[ushape]) if r else zeros for r in reads)
            mu = self.let(f"jnp.where({pv}, {mt}, {mf})", "k")
        # jaxsafe: a body's cotangents may be non-finite where the cond's are, or where the
        # cond's own derivative may be (a hazard in a branch, an operand that may be non-finite)
        bad = bad or _body_has_hazard(tb) or _body_has_hazard(fb) or \
            _anywhere(u, set(self.taint_inputs))
        u_g, u_t, u_c = self.tw(u, env2, mu, mu is not None, tested, bad)
        zeroed = maybe and mu is not None and u_t  # cond is not linear
        if zeroed:
            u_g = self.zero(u_g, mu)
        fns = []
        # what a branch receives may be non-finite as jaxsafe judges a body's inputs (see
        # tw_scan)
        u_anywhere = tested or _anywhere(u, set(self.taint_inputs))
        for br in (tb, fb):
            fn = f"branch{next(self.counter)}"
            b = self.sub({"u": ushape})
            if u_anywhere:
                b.taint_inputs.add("u")
            benv = {"u": ("u_o", "u_g")}
            b.line(f"return {b.tw(br, benv, 'mm' if maybe else None, maybe, False, bad)[0]}")
            self.line(f"def {fn}(ops):")
            self.line("    u_o, u_g, mm = ops" if maybe else "    u_o, u_g = ops")
            self.lines += b.lines
            fns.append(fn)
        ops = f"({u_o}, {u_g}, {m})" if maybe else f"({u_o}, {u_g})"
        r = self.let(f"lax.cond({pv}, {fns[0]}, {fns[1]}, {ops})")
        tainted = tested or (u_t and not zeroed) or _body_has_hazard(tb) or _body_has_hazard(fb)
        changed = maybe and (u_c or zeroed or _has_hazard(tb) or _has_hazard(fb))
        return r, tainted, changed


DROPS = frozenset({"where", "swhere", "max", "min", "clip", "slice", "index", "row", "col",
                   "cum", "sort", "topk", "pool", "set"})
CHOOSERS = ("cum", "pool", "sort", "topk")  # issue 13: re-emitted on the original choice
CHOOSER_KINDS = {"V": ["set", "cum", "poolcols"], "R": ["topk", "sort", "pool", "cum"],
                 "M": ["cum"]}

NONE, PART, ALL = 0, 1, 2
"""Which lanes of a value carry a derivative of the arguments (jaxsafe/_carries.py)."""
_BY_LANE = ("haz", "un", "bin", "div", "bcast", "const")


def carry_class(node) -> int:
    """NONE (constants), ALL (the arguments, and what a lane-mixing or value-selecting
    operation computes from them) or PART (a where between the two, lane by lane)."""
    k = node[0]
    if k == "in":
        return ALL
    if k == "const":
        return NONE
    kids = [carry_class(c) for c in _diff_children(node)]
    if k in ("where", "swhere", "max", "min"):  # each lane takes one side (a tie: both)
        return kids[0] if kids[0] == kids[1] else PART
    if k == "clip":  # a clamped lane takes a constant bound, which carries nothing
        return NONE if kids[0] == NONE else PART
    if k in _BY_LANE:
        return ALL if ALL in kids else max(kids, default=NONE)
    return ALL if any(kids) else NONE


def may_mask(node) -> bool:
    """Whether a factor may be 0 in a lane that carries no derivative (a constant may; jaxsafe
    folds a small constant and knows, the twin decides at run time)."""
    return carry_class(node) != ALL


def drops(node) -> bool:
    """Whether the node drops lanes of its value children: the selections, `jnp.max`/`min`
    (all but the chosen lanes), a product with a factor that may mask."""
    k = node[0]
    if k in DROPS:
        return True
    if k == "reduce":
        return node[1] in ("max", "min")
    if k == "bin":
        return node[1] == "mul" and (may_mask(node[2]) or may_mask(node[3]))
    return False


def _is_nonlinear(node) -> bool:
    """Whether jaxsafe counts the operation as not linear: a zero cotangent meets a value
    (max/min/clip only select, so they count as linear)."""
    k = node[0]
    if k in ("haz", "div", "dot", "scan", "cond", "cum", "pool"):
        return True
    if k == "un":
        return node[1] not in LINEAR_UNARY
    if k == "bin":
        return node[1] == "mul"
    if k == "reduce":
        return node[1] in ("max", "mean")
    return False


def _has_hazard(node) -> bool:
    """A hazard in the differentiable part of a body expression."""
    return node[0] in ("haz", "div") or any(_has_hazard(c) for c in _diff_children(node))


_SINKABLE = ("haz", "un", "bin", "div")


def _sinkable_chain(xs, env: dict):
    """`xs` as jaxsafe's sinking pass reads it: a chain of elementwise nodes (at least one not
    linear) over leaves that are values of `xs`'s shape (stacked: one slice per step) or
    scalars (constants of the loop); (the chain, its leaves), else None. A constant of any
    shape is part of the chain (it is the same at every step)."""
    shape = shape_of(xs, env)
    if xs[0] not in _SINKABLE:
        return None
    leaves: list = []
    nonlinear = False
    todo = [xs]
    while todo:
        node = todo.pop()
        if node[0] == "const":
            continue
        if node[0] in _SINKABLE and shape_of(node, env) == shape:
            nonlinear = nonlinear or _is_nonlinear(node)
            todo.extend(_diff_children(node))
            continue
        if shape_of(node, env) not in (shape, "S"):
            return None  # broadcast from another shape: not modelled (not generated so)
        if node not in leaves:
            leaves.append(node)
    return (xs, leaves) if nonlinear else None


def _renamed_leaves(node, renamed: dict):
    """`node` with each subtree in `renamed` replaced, and constants at one step's shape."""
    if node in renamed:
        return renamed[node]
    if node[0] == "const":
        return ("const", node[1], {"V": "S", "M": "V"}.get(node[2], node[2]))
    if node[0] == "haz" or node[0] == "un":
        return (node[0], node[1], _renamed_leaves(node[2], renamed))
    if node[0] == "bin":
        return ("bin", node[1], _renamed_leaves(node[2], renamed),
                _renamed_leaves(node[3], renamed))
    if node[0] == "div":
        return ("div", _renamed_leaves(node[1], renamed), _renamed_leaves(node[2], renamed))
    raise ValueError(node)


def _and_masks(a, b):
    """The intersection of two masks' expressions (None: every lane live)."""
    if a is None or b is None:
        return b if a is None else a
    return f"({a}) & ({b})"


def _needed_lines(lines: list[str], target: str):
    """The lines of a body twin that compute `target`, in order; None when one reads the carry
    (`c_o`, `c_g`) or a guarded value (`*_g`): a mask computed from them is not known before
    the loop."""
    defined = {}
    for i, line in enumerate(lines):
        name, _, expr = line.strip().partition(" = ")
        if expr:
            defined[name] = (i, expr)
    keep, todo = set(), [target]
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        if name in ("c_o", "c_g") or name.endswith("_g"):
            return None
        if name not in defined:
            continue  # an input's original value, a module (jnp), a literal's name
        keep.add(name)
        todo.extend(re.findall(r"[A-Za-z_]\w*", defined[name][1]))
    return [lines[defined[n][0]] for n in sorted(keep, key=lambda n: defined[n][0])]


def _replace_leaf(node, leaf, by):
    """`node` with every occurrence of `leaf` replaced by `by` (a body's input by the chain
    that computes it)."""
    if node == leaf:
        return by
    if not isinstance(node, tuple):
        return node
    return tuple(_replace_leaf(c, leaf, by) if isinstance(c, tuple) else c for c in node)


def _dropped_leaf(node, name: str, dropped: bool = False) -> bool:
    """Whether the body input `name` is read below a node that drops lanes (a selection, a
    maximum, a product with a factor that may mask): its static liveness in the body is not
    every lane, as jaxsafe's sinking pass asks."""
    if node == ("in", name):
        return dropped
    d = dropped or drops(node)
    return any(_dropped_leaf(c, name, d) for c in _diff_children(node))


def _has_dropped_hazard(node, dropped=False) -> bool:
    """A hazard below a selection inside a body expression."""
    if node[0] in ("haz", "div") and dropped:
        return True
    d = dropped or drops(node)
    return any(_has_dropped_hazard(c, d) for c in _diff_children(node))


def _anywhere(node, leaves) -> bool:
    """Whether a value may hold NaN or inf in some lane, guards not counted (jaxsafe's
    `nonfinite_anywhere`): computed, through value edges, from one of `leaves` or from a
    NaN-prone operation."""
    if node[0] in ("haz", "div"):
        return True
    if node[0] == "in":
        return node[1] in leaves
    return any(_anywhere(c, leaves) for c in _diff_children(node))


def _body_has_hazard(node) -> bool:
    """A NaN-prone primitive anywhere in a body, predicates included (jaxsafe then treats the
    loop's or branch's outputs as possibly non-finite)."""
    return any(n[0] in ("haz", "div") for n in walk(node))


# Open jaxsafe bugs found by this fuzzer (tests/test_fuzz_regressions.py), by the shape of
# program that meets them; `known_bugs(program)` says which a program may meet, so that a fuzz
# run can go on looking for others while they are open (JAXSAFE_FUZZ_AVOID, tests/test_fuzz.py).
KNOWN_BUGS: dict = {
    # none open. Fixed (1260ac0): "maxmin-replaced-operand", a max/min/clip operand replaced as
    # possibly non-finite was not re-decided; "cond-guarded-operand", a guarded cond operand
    # flipped the branch's own selections.
}


def known_bugs(program: Program) -> set:
    e = _Emitter(itertools.count(), 1, dict(INPUTS))
    e.taint_inputs = set(INPUTS)  # arguments may hold inf and NaN
    env2 = {a: (a, a) for a in ARGS}
    for o in program.outputs:
        e.tw(o, env2, None, False, False)
    return set(e.events)


def emit(program: Program, guarded: bool = False) -> str:
    """Python source of `f(x, y, m, s)` (natural) or `twin(x, y, m, s)` (hand-guarded)."""
    counter = itertools.count()
    e = _Emitter(counter, 1, dict(INPUTS))
    if guarded:
        e.taint_inputs = set(INPUTS)  # arguments may hold inf and NaN
        env2 = {a: (a, a) for a in ARGS}
        outs = [e.tw(o, env2, None, False, False)[0] for o in program.outputs]
        name = "twin"
    else:
        outs = [e.ev(o, {a: a for a in ARGS}) for o in program.outputs]
        name = "f"
    return "\n".join([f"def {name}({', '.join(ARGS)}):", *e.lines,
                      f"    return ({', '.join(outs)},)"])


_BUILT: dict = {}


def build(program: Program, guarded: bool = False):
    """The function `emit` writes, executed."""
    key = (program, guarded)
    if key not in _BUILT:
        src = emit(program, guarded)
        scope = {"jnp": jnp, "lax": lax, "jax": jax, "np": np}
        exec(compile(src, f"<fuzz {'twin' if guarded else 'f'}>", "exec"), scope)
        if len(_BUILT) > 64:
            _BUILT.clear()
        _BUILT[key] = scope["twin" if guarded else "f"]
    return _BUILT[key]
