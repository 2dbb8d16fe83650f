"""Failing examples found by the differential fuzzer (tests/test_fuzz.py), shrunk and written out.

Each test is an explicit program `f`, its hand-guarded twin (what a careful user writes: the
double where, decisions on the original values) and the inputs, checked with the fuzzer's own
assertions (`compare_to_twin`: first and second order equal to the twin's, no NaN where the twin
has none, equal to plain JAX where plain JAX is finite).

An open bug is marked `xfail(strict=True)` (it fails loudly, XPASS, once fixed) and named in
`fuzzgen.KNOWN_BUGS`, so that a fuzz run can skip it while it is open (JAXSAFE_FUZZ_AVOID). The
two bugs below were fixed in 1260ac0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, structure
from jax import lax
from test_fuzz import _all_derivatives, compare_to_twin

import jaxsafe
from jaxsafe import nan_safe

# Numerics: conftest's leak checker is for the modules that exercise the API's tracing paths
# (test_api, test_composition, ...); here it would only turn JAX's caches off (2-3x slower).
pytestmark = pytest.mark.no_leak_check

f32 = np.float32
M0 = np.zeros((3, 4), f32)
K1 = np.ones((3, 4), bool)  # the generated programs' mask argument (fuzzgen.MASK_ARG)


def _check(f, twin, args):
    assert_bitwise(nan_safe(f)(*args), jax.jit(f)(*args))
    compare_to_twin(f, twin, args)


# -------------------------------------------------------------------------- maxmin-replaced-operand
# A value that the program tests with isnan is "possibly non-finite", and so is everything it is
# computed from. jaxsafe replaced such an operand by 0 in the lanes a max/min/clip drops (the
# losing side), but re-decided the max/min on the original values only when an operand was
# *changed below it*, not when its own operand was replaced. The replaced 0 then tied with, or
# beat, the winner: the winner's derivative was halved or lost. (Fixed: max/min/clamp only
# select, they are never taint-guarded, and always re-decided when an operand changed.)


def test_isnan_filtered_maximum_keeps_the_winner_derivative():
    # minimal form: d/dc of max(x, c) where c wins is 1; jaxsafe gives 0 (max(0, c) = 0 wins)
    def f(x, y, m, s):
        h = jnp.maximum(x, s)
        return (jnp.where(jnp.isnan(h), 0., h),)

    def twin(x, y, m, s):  # nothing to guard: the twin is f
        h = jnp.maximum(x, s)
        return (jnp.where(jnp.isnan(h), 0., h),)

    _check(f, twin, (np.full(4, -2., f32), np.zeros(4, f32), M0, f32(-1.)))


def test_isnan_filtered_minimum_does_not_split_on_a_replaced_zero():
    # as shrunk by the fuzzer: min(2, x) with x = 0; the losing 2 is replaced by 0 and ties with
    # x, so d/dx is halved (0.55 instead of 1.11 in lane 0)
    def f(x, y, m, s):
        h = jnp.arctanh(jnp.minimum(jnp.full((4,), 2.0), x))
        return (jnp.where(jnp.isnan(h), x, h),)

    def twin(x, y, m, s):
        two = jnp.full((4,), 2.0)
        h = jnp.arctanh(jnp.minimum(two, x))
        live = ~jnp.isnan(h)
        mn = jnp.where(two < x, two, jnp.where(x < two, x, jnp.minimum(two, x)))
        return (jnp.where(jnp.isnan(h), x, jnp.arctanh(jnp.where(live, mn, 0.0))),)

    _check(f, twin, (np.zeros(4, f32), np.zeros(4, f32), M0, f32(0.)))


# --------------------------------------------------------------------------- cond-guarded-operand
# A cond operand was guarded in the lanes the taken branch drops (liveness flowed out of the
# branch). The guarded operand was then passed to the branch, whose own predicates read it: the
# branch decided on the safe value. Here exp(-200) = 0 is dropped by `u > 0`, was guarded to
# exp(0) = 1, and the branch then selected sqrt(1) = 1 instead of 0 in a lane that is live
# outside: d/dy there was 1 instead of 0. (Fixed: liveness through a cond is structural, every
# read keeps a lane live.)


def test_cond_branch_decides_on_the_original_operand():
    def f(x, y, m, s):
        u = jnp.exp(x)
        c = lax.cond(s > 0, lambda u: jnp.where(u > 0, jnp.sqrt(u), 0.), lambda u: u, u)
        return (c * y,)

    def twin(x, y, m, s):
        u = jnp.exp(x)
        live = jnp.where(s > 0, u > 0, jnp.ones((4,), bool))

        def taken(ops):
            u_o, u_g = ops
            return jnp.where(u_o > 0, jnp.sqrt(jnp.where(u_o > 0, u_g, 1.)), 0.)
        u_g = jnp.exp(jnp.where(live, x, 0.))
        return (lax.cond(s > 0, taken, lambda ops: ops[1], (u, u_g)) * y,)

    _check(f, twin, (np.array([-200., 1., 0., 1.], f32), np.ones(4, f32), M0, f32(1.)))


# --------------------------------------------------------------------------- fusion rounding
# Found by the 10,500-example run (2026-11-21): not a jaxsafe bug. `m / m` at a tiny `m` has a
# derivative that is the difference of two terms near 1e17; XLA fuses the guarded program and
# the twin differently and the jitted results differ by rounding (plain jax.grad of f under jit
# gives -5.8e7 there, eagerly 0). `compare_to_twin` now settles such a disagreement equation by
# equation, where the rewrite must match the twin.


def _tiny_denominator_program(pred_of_x):
    def f(x, y, m, s):
        v2 = m / m
        v4 = lax.scan(lambda c, xi: (c + c, xi), x, v2)[1]
        return (jnp.where(pred_of_x(x, y), v4, m),)

    def twin(x, y, m, s):  # the scan passes m / m through to a where: guarded where dropped
        p1 = pred_of_x(x, y)
        v4 = lax.scan(lambda c, xi: (c + c, xi), x, m / jnp.where(p1, m, 1.))[1]
        return (jnp.where(p1, v4, m),)
    return f, twin


@pytest.mark.slow  # 20 s, equation by equation: `make fuzz`
def test_tiny_denominator_first_order_matches_the_twin_equation_by_equation():
    f, twin = _tiny_denominator_program(lambda x, y: x @ y < 0.)
    m = np.ones((3, 4), f32)
    m[2, 3] = 2.1879179e-17
    _check(f, twin, (np.array([1., 1., 1., -3.], f32), np.array([1., 1., 0., 1.], f32), m,
                     f32(1.)))


def test_tiny_denominator_in_a_dropped_scan_output_has_finite_second_order():
    # Here the where drops the scan's per-step outputs (x[0] < 0 is false), so m / m is dropped:
    # jaxsafe guards its denominator and the second order is 0 where the generator's twin had
    # NaN. The twin was wrong: it kept the operands of a scan live when a per-step output merely
    # passes them through (fuzzgen's scan rule is coarser than jaxsafe's); the twin here is
    # written by hand.
    f, twin = _tiny_denominator_program(lambda x, y: x[0] < 0.)
    m = np.ones((3, 4), f32)
    m[1, 3] = 2.1879179e-17
    _check(f, twin, (np.array([1., 1., 1., -2.5738523], f32), np.array([1., 1., -.5, 1.], f32),
                     m, f32(1.)))


def test_generated_twin_guards_a_scan_output_that_jax_forwards_out_of_the_scan():
    # The same program as above, twin written by the generator: `lax.scan` moves a per-step
    # output that is the step's input out of the scan, so the operand takes the where's mask.
    import fuzzgen as G
    scan = ("scan", ("div", ("in", "m"), ("in", "m")), ("in", "x"),
            ("in", "c"), ("in", "xi"), "ys")
    program = G.Program((("where", ("cmp", "lt", ("index", 0, ("in", "x")), 0.), scan,
                          ("in", "m")),))
    m = np.ones((3, 4), f32)
    m[1, 3] = 2.1879179e-17
    args = (np.array([1., 1., 1., -2.5738523], f32), np.array([1., 1., -.5, 1.], f32), m, f32(1.))
    assert "jnp.where" in G.emit(program, guarded=True).split("lax.scan")[0]  # guarded before
    _check(G.build(program), G.build(program, guarded=True), (*args, K1))


def test_generated_twin_computes_a_stacked_chain_in_the_body_that_drops_it():
    # Found by `make fuzz` (2026-11-29), after the sinking pass (jaxsafe/_sinking.py): `arccos`
    # of the stacked operand, taken before the scan, whose body drops every step's input
    # (`where(False, xi, c)`); the output drops the scan too. jaxsafe moves the `arccos` into the
    # body and its gradient is the identity's; the generator's twin still computed it before
    # the loop, where `0 * arccos'(1)` made NaN. The twin now models the pass (a chain computed
    # in a body that drops its input is computed there, guarded by the body's masks).
    import fuzzgen as G
    scan = ("scan", ("haz", "arccos", ("in", "x")),
            ("where", ("cmp", "ge", ("in", "s"), 0.0), ("in", "s"),
             ("haz", "arccos", ("in", "s"))),
            ("where", ("mask", "np", "S", (False,)), ("in", "xi"), ("in", "c")),
            ("in", "c"), "ys")
    program = G.Program((("where", ("mask", "np", "S", (False,)), ("set", 0, scan, ("in", "s")),
                          ("in", "x")),))
    args = (np.ones(4, f32), np.ones(4, f32), np.ones((3, 4), f32), f32(1.), K1)
    assert np.isnan(jax.grad(lambda *a: jnp.sum(G.build(program)(*a)[0]))(*args)).all()
    assert "jnp.arccos" in G.emit(program, guarded=True).split("def body")[1]  # in the body
    _check(G.build(program), G.build(program, guarded=True), args)


@pytest.mark.parametrize("stacked", ["matmul", "sunk chain over a matmul"])
def test_generated_twin_drops_before_the_loop_what_the_body_drops_by_the_step(stacked):
    # jaxsafe's hoist (jaxsafe/_hoisted.py, 2026-11-30): a scan's stacked operand that the body
    # drops by the step's own input (`where(xi > 0, xi, 0.)`) is dropped before the loop too, so
    # `log(m)`'s 0 in a dropped row reaches no gradient through the matmul before the scan. The
    # twin kept the operand live and gave plain JAX's NaN; it now models the hoist (the body's
    # masks of the input, with every output live, where they read no carry), also for the
    # stacked leaves of a chain the sinking pass moves into the body (`sqrt(1 + xs)`).
    import fuzzgen as G
    xs = ("dot", ("col", 0, ("in", "m")), ("haz", "log", ("in", "m")))
    if stacked != "matmul":
        xs = ("haz", "sqrt", ("bin", "add", ("const", 1.0, "V"), xs))
    body = ("where", ("cmp", "gt", ("in", "xi"), 0.0), ("in", "xi"), ("const", 0.0, "S"))
    scan = ("scan", xs, ("const", 0.0, "S"), body, ("bin", "mul", ("in", "c"), ("const", 2.0, "S")),
            "carry")
    program = G.Program((scan,))
    m = np.ones((3, 4), f32)
    m[2, 3] = 0.  # log 0 = -inf in step 3, which the body drops
    args = (np.ones(4, f32), np.ones(4, f32), m, f32(1.), K1)
    grad_m = jax.grad(lambda m: jnp.sum(G.build(program)(*args[:2], m, *args[3:])[0]))
    assert np.isnan(grad_m(m)).any()  # plain JAX's leak
    assert "jax.vmap(hoist" in G.emit(program, guarded=True)
    _check(G.build(program), G.build(program, guarded=True), args)


def test_generated_twin_reads_a_minimum_with_a_constant_as_a_mask():
    # Found by `make fuzz` (2026-11-29), an oracle gap older than the session: `arccos(x) *
    # min(y, 0.)` at `x = 1`. Where the constant 0 wins, the factor is 0 and carries no
    # derivative: jaxsafe reads it as a mask (how-it-works, masked products) and x's gradient
    # is 0; the twin counted every lane of a minimum as carrying one (NaN: 0 * arccos'(1)).
    # The twin now takes the winner's class lane by lane, as it does a where's.
    import fuzzgen as G
    program = G.Program((("bin", "mul",
                          ("haz", "arccos", ("where", ("mask", "lit", "S", False), ("in", "x"),
                                             ("in", "x"))),
                          ("min", ("in", "y"), ("const", 0.0, "V"))),))
    m = np.ones((3, 4), f32)
    for y in ([1., 1., 1., 1.], [-1., 2., 0., np.nan]):  # the constant wins, loses, ties
        args = (np.ones(4, f32), np.array(y, f32), m, f32(1.), K1)
        _check(G.build(program), G.build(program, guarded=True), args)
    wins = (np.ones(4, f32), np.ones(4, f32), m, f32(1.), K1)  # the constant wins everywhere
    assert np.isnan(jax.grad(lambda x: jnp.sum(G.build(program)(x, *wins[1:])[0]))(wins[0])).all()


def test_generated_twin_reads_a_clip_clamped_lane_as_carrying_nothing():
    # The same oracle gap for `jnp.clip` (make fuzz, 2026-11-29): `arccos(x) * clip(y, 0., 1.)`
    # at `x = 1`. A lane where a bound wins alone holds that constant and carries no derivative:
    # jaxsafe reads the product there as a mask. The twin counted every lane of a clip as
    # carrying one; it now carries where `lo <= y <= hi` or `y` is NaN (both sides' lanes).
    import fuzzgen as G
    program = G.Program((("bin", "mul",
                          ("haz", "arccos", ("where", ("mask", "lit", "S", False), ("in", "x"),
                                             ("in", "x"))),
                          ("clip", ("in", "y"), 0.0, 1.0)),))
    m = np.ones((3, 4), f32)
    for y in ([-1., -1., 2., 2.], [-1., 0.5, 0., np.nan], [1., 2., -3., 0.25]):
        args = (np.ones(4, f32), np.array(y, f32), m, f32(1.), K1)
        _check(G.build(program), G.build(program, guarded=True), args)
    clamped = (np.ones(4, f32), np.array([-1., -1., 2., 2.], f32), m, f32(1.), K1)
    assert not np.isfinite(jax.grad(lambda x: jnp.sum(G.build(program)(x, *clamped[1:])[0]))(
        clamped[0])).any()  # plain JAX: NaN where 0 clamps, -inf where 1 does


def test_generated_twin_chooses_no_lane_of_a_running_max_no_output_reads():
    # Found by `make fuzz` (2026-11-30), an oracle gap: `where(all False, cummax(m / 0.), m)`.
    # No output of the running max is live, so `m / 0.` is dropped whole and m's gradient is
    # the identity's (jaxsafe). The twin took a lane as chosen where it equals the running max
    # at the nearest live output after it, whose sentinel when there is none is +inf, which
    # `1 / 0.` equals: it kept the division live (NaN). It now needs a live output after it.
    import fuzzgen as G
    program = G.Program((("where", ("mask", "np", "M", (False,) * 12),
                          ("cum", "max", ("div", ("in", "m"), ("const", 0.0, "M"))),
                          ("in", "m")),))
    args = (np.ones(4, f32), np.ones(4, f32), np.ones((3, 4), f32), f32(1.), ~K1)
    _check(G.build(program), G.build(program, guarded=True), args)


# --------------------------------------------------------------------------- constant predicate
# Found by the 10,500-example run (2026-11-21), contract point 4 ("nothing to guard, nothing
# changed"). A scan body holding `where(0. >= 0., arccos(c), c)` (a predicate computed from
# literals, always true) in an output nobody uses: the body was rewritten on its own with all its
# outputs live and `arccos` guarded where the predicate could be false; DCE then removed the
# guard, but the program came back flattened instead of as the original. Fixed twice over: the
# static pass folds predicates computed from literals, and plans on the program without its
# unused results.


def test_scan_body_with_a_constant_predicate_and_an_unused_output_is_unchanged():
    def f(x, y, m, s):
        def body(c, xi):
            return c + c, jnp.where(jnp.full((), 0.) >= 0., jnp.arccos(c), c)
        v5 = lax.scan(body, x, m)[0]
        return (jnp.where(v5 >= 0., x, x),)
    args = (np.ones(4, f32), np.ones(4, f32), np.ones((3, 4), f32), f32(1.))
    assert structure(jaxsafe.make_jaxpr(f)(*args)) == structure(jax.make_jaxpr(f)(*args))


# --------------------------------------------------------------------------- second run
# Found by the 10,500-example run of 2026-11-22 (at 3df58eb), shrunk by hypothesis.

_ARGS_2 = (np.array([-3.3366185e-01, -5.9604645e-08, 2.0, -2.5738523e+00], f32),
           np.array([2.0, 0.4891242, -0.5, 0.88495433], f32),
           np.array([[-0.0, -0.5, 2.9417, -1.0e+30],
                     [3.0, 1.0, -3.4006395, 2.1879179e-17],
                     [1.0e-30, 1.1, -0.5, 1.8075681]], f32),
           f32(1e30))


def _scan_forwarding_its_input(pred):
    import fuzzgen as G
    scan = ("scan", ("div", ("in", "m"), ("in", "m")), ("un", "neg", ("in", "x")),
            ("in", "xi"), ("in", "xi"), "ys")
    return G, G.Program((("where", pred, scan, ("in", "m")),))


@pytest.mark.slow  # 22 s, equation by equation: `make fuzz`
def test_ill_conditioned_live_lane_is_settled_equation_by_equation_with_numpy_arguments():
    # The tiny-denominator case again (m / m at 2.2e-17, jit and eager differ by rounding);
    # the eager re-check crashed on NumPy arguments (NumPy computed `m / m` itself and warned).
    G, program = _scan_forwarding_its_input(("cmp", "lt", ("dot", ("in", "x"), ("in", "y")), 0.))
    _check(G.build(program), G.build(program, guarded=True), (*_ARGS_2, K1))


def test_forwarded_scan_output_whose_carry_reads_it_is_guarded_like_the_twin():
    # `lambda c, xi: (c + xi, xi)`: JAX forwards the per-step output out of the scan, and the
    # carry is unused, so the scan is dead code and `m / m` is dropped by the where. The
    # generator's twin kept the scan's operand live because the carry reads it.
    G, program = _scan_forwarding_its_input(("cmp", "lt", ("index", 0, ("in", "y")), 0.))
    _check(G.build(program), G.build(program, guarded=True), (*_ARGS_2, K1))


def test_scan_read_only_by_a_comparison_is_unchanged():
    # Nothing differentiates the scan's output (a comparison reads it): its body is not
    # rewritten, though arccos is dropped there.
    def f(x, y, m, s):
        def body(c, xi):
            return c, jnp.where(c >= 0., c, jnp.arccos(c))
        v = lax.scan(body, x, m)[1]
        return (jnp.where(v >= 0., m, m),)
    args = (np.ones(4, f32), np.ones(4, f32), np.ones((3, 4), f32), f32(1.))
    assert structure(jaxsafe.make_jaxpr(f)(*args)) == structure(jax.make_jaxpr(f)(*args))


# -------------------------------------------------------------------------- scan-body-inputs
# The twin treated what a scan body receives as finite; jaxsafe (rightly) treats a body input
# computed from an argument as possibly non-finite, and guards its products in the steps the
# program drops. With NaN and -inf in the lanes a mask drops, the twin was NaN where jaxsafe was
# 0 (a generator bug, found while scans that compute lane by lane were added). Programs of the
# fuzzer's own language, the twin as fuzzgen writes it now.

_NONFINITE_M = np.where(np.arange(4) % 3 == 0, f32(1.5), np.array([np.nan, -np.inf] * 2, f32))
_ARGS_NONFINITE = (np.array([1., np.nan, -np.inf, 2.], f32), np.ones(4, f32),
                   np.broadcast_to(_NONFINITE_M, (3, 4)).copy(), f32(1.))
_K_MIDDLE = np.broadcast_to(np.array([True, False, False, True]), (3, 4)).copy()


def _scan_program(xs, init, t, y, out, mask):
    import fuzzgen as G
    zero = ("const", 0.0, "M" if out == "ys" else "V")
    return G, G.Program((("where", mask, ("scan", xs, init, t, y, out), zero),))


@pytest.mark.parametrize("case", ["ys-square-of-input", "ys-log-of-product", "carry-sin",
                                  "carry-sqrt"])
def test_scan_body_inputs_that_may_be_non_finite(case):
    xi, c = ("in", "xi"), ("in", "c")
    arg_mask = ("mask", "arg", "M", None)
    np_mask = ("mask", "np", "V", (True, False, False, True))
    G, program = {
        "ys-square-of-input": lambda: _scan_program(("in", "m"), ("in", "x"), c,
                                                    ("bin", "mul", xi, xi), "ys", arg_mask),
        "ys-log-of-product": lambda: _scan_program(("in", "m"), ("in", "x"), xi,
                                                   ("haz", "log", ("bin", "mul", c, xi)), "ys",
                                                   arg_mask),
        "carry-sin": lambda: _scan_program(("in", "m"), ("in", "x"), ("un", "sin", c), xi,
                                           "carry", np_mask),
        "carry-sqrt": lambda: _scan_program(("in", "m"), ("in", "x"), ("haz", "sqrt", c), c,
                                            "carry", ("cmp", "gt", ("in", "x"), 0.0)),
    }[case]()
    assert G.lanewise(program.outputs[0][2], G.INPUTS)
    _check(G.build(program), G.build(program, guarded=True), (*_ARGS_NONFINITE, _K_MIDDLE))


def test_scan_whose_final_carry_is_unused_is_unchanged_when_nothing_is_dropped():
    # Found by the fuzz profile (nothing to guard): a lane-by-lane scan whose final carry is
    # unused and whose stacked outputs are live took MAYBE for its operands (an output no lane
    # reaches counted as a drop), so the live arccos feeding it was "guarded" and the program
    # re-staged. The lane mask is the union of the lane-shaped outputs'.
    import fuzzgen as G
    c = ("in", "c")
    scan = ("scan", ("in", "m"), ("haz", "arccos", ("in", "x")), c, c, "ys")
    program = G.Program((("haz", "arccos", ("reduce", "sum", 0, scan)),))
    args = (np.ones(4, f32), np.ones(4, f32), np.ones((3, 4), f32), f32(1.), K1 & False)
    f = G.build(program)
    new = jaxsafe.make_jaxpr(f, finite_args=True)(*args)
    assert structure(new) == structure(jax.make_jaxpr(f)(*args))


# ------------------------------------------------------------------------- fuzz profile 2026-11-26
# Found by the first fuzz-profile run after the issue-12 work (derivatives, 1,309 examples).

def test_cond_branch_input_that_may_be_non_finite_is_guarded_like_the_twin():
    # A cond branch receives x[1:] (an argument: possibly inf/NaN); jaxsafe guards `u * u` in
    # the lanes the branch's own where drops. The twin treated branch inputs as finite (the
    # same generator bug as for scan bodies), NaN where jaxsafe was finite. Twin fixed.
    import fuzzgen as G
    u = ("in", "u")
    branch = ("where", ("cmp", "le", ("where", ("cmp", "gt", u, 0.0), u, u), 1.0),
              ("bin", "mul", u, u), ("min", u, u))
    cond = ("cond", ("cmp", "ge", ("reduce", "sum", None, ("in", "x")), 0.5),
            ("slice", "tail", ("in", "x")), branch, ("div", u, u))
    program = G.Program((cond, ("in", "y")))
    args = (np.array([2., -2., np.inf, np.inf], f32), np.array([-100., .5, -np.inf, np.nan], f32),
            np.array([[1e30, .25, np.inf, np.inf], [1e30, np.inf, .25, -5.8222815e-02],
                      [1.9329331e-33, -np.inf, -2.4276497, np.nan]], f32), f32(.5),
            np.array([[True, True, False, False], [True, False, True, True],
                      [True, False, True, False]]))
    _check(G.build(program), G.build(program, guarded=True), args)


def test_clip_of_arccos_at_one_in_a_cond_branch_second_order():
    # x = [1, 1, 1, -1e30]: the false branch computes clip(arccos(u), -1, 1) with u = 1 in two
    # lanes, where arccos' derivative is -inf (a real singularity, live). Plain JAX's and
    # jaxsafe's second order are NaN there; the twin's is +-inf. Without the cond, all three
    # give +-inf: the NaN comes from how JAX differentiates a cond (residuals of both branches)
    # at a live singularity, and the twin's branches are built differently. Settled as the
    # contract says (point 3: live derivatives are not changed): where the twin is non-finite
    # too, jaxsafe must give exactly plain JAX's non-finite value (test_fuzz._nonfinite_as_plain);
    # asserted directly below, before the fuzzer's own check.
    import fuzzgen as G
    u = ("in", "u")
    cond = ("cond", ("cmp", "ge", ("reduce", "sum", None, ("in", "x")), 0.0),
            ("slice", "tail", ("in", "x")),
            ("where", ("mask", "np", "S", (False,)), ("haz", "arccos", u), ("haz", "arccos", u)),
            ("clip", ("haz", "arccos", u), -1.0, 1.0))
    program = G.Program((cond, ("in", "x")))
    args = (np.array([1., 1., 1., -1e30], f32), np.ones(4, f32), np.ones((3, 4), f32), f32(1.),
            np.zeros((3, 4), bool))
    f, twin = G.build(program), G.build(program, guarded=True)
    r = jax.device_get(_all_derivatives(f, twin)(*args))
    (g_js, h_js), (g_pl, h_pl), (_, h_tw) = r["jaxsafe"], r["plain"], r["twin"]
    assert_bitwise(g_js, g_pl)
    assert_bitwise(h_js, h_pl)
    x_second = np.asarray(jax.tree.leaves(h_js)[0])
    assert np.isnan(x_second[1:3]).all()  # the singular lanes: NaN, as plain JAX
    assert np.isinf(np.asarray(jax.tree.leaves(h_tw)[0])[1:3]).all()  # the twin: -inf
    _check(f, twin, args)


# -------------------------------------------------------------------------- nonfinite-cotangent
# JAX weighs a min's cotangent by 0 for the losing operand: where the winner's lane has an
# infinite derivative (sqrt at 0, live), the loser's dropped lane got 0 * inf = NaN. (Fixed:
# a max/min/clamp whose cotangent may be non-finite is selected on its decision,
# jaxsafe/_cotangents.py.)


def test_min_loser_gets_zero_under_an_infinite_live_derivative():
    # as found by the fuzzer (run 7): d/dy is NaN in lane 2, where m[0] = 0 and sqrt(0 / 2)
    def f(x, y, m, s, k):
        v1 = lax.select(False, x, m[0])
        v4 = lax.scan(lambda c, xi: (c + c, c), y, m)[0]
        v7 = jnp.sqrt(v1 / jnp.minimum(x + x, v4))
        return (jnp.where(jnp.isnan(v7), x, v7), x)

    def twin(x, y, m, s, k):
        v1 = lax.select(False, x, m[0])
        v2 = x + x
        v4 = lax.scan(lambda c, xi: (c + c, c), y, m)[0]
        v5 = jnp.where(v2 < v4, v2, jnp.where(v4 < v2, v4, jnp.minimum(v2, v4)))
        v7 = jnp.sqrt(v1 / v5)
        keep = ~jnp.isnan(v7)
        g = jnp.sqrt(jnp.where(keep, jnp.where(keep, v1, 0.) / jnp.where(keep, v5, 1.), 1.))
        return (jnp.where(jnp.isnan(v7), x, g), x)

    m = np.ones((3, 4), f32)
    m[0, 2] = 0.
    args = (np.ones(4, f32), np.ones(4, f32), m, f32(1.), np.zeros((3, 4), bool))
    _check(f, twin, args)


# -------------------------------------------------------------------------- selected-after-decision
# A chooser whose cotangent may be non-finite is emitted as a selection on its choice. When a
# decision (here the isnan test's mask) had already computed its original output, and values
# after it from that output, the selection was emitted but nothing read it: the derivative went
# through the weighed original, 0 * inf = NaN in the lane cummax drops. (Fixed: the selection
# then carries the derivative, and what reads it is emitted again from it.)


def test_cummax_selected_after_a_decision_computed_its_original():
    # as found by the fuzzer (run 9): the unchosen m[2, 3] = 0 under arccos'(1) = -inf, live
    def f(x, y, m, s, k):
        v2 = jnp.where(k, m, lax.cummax(m, axis=0))
        v4 = jnp.arccos(jnp.arccos(v2))
        return (jnp.where(jnp.isnan(v4), m, v4), x)

    def twin(x, y, m, s, k):
        v1 = lax.cummax(m, axis=0)
        v4 = jnp.arccos(jnp.arccos(jnp.where(k, m, v1)))
        keep = ~jnp.isnan(v4)
        running = keep & ~k  # the lanes of v1 that reach the output
        nearest = lax.cummin(jnp.where(running, v1, jnp.inf), axis=0, reverse=True)
        chosen = (m == nearest) | (jnp.isnan(m) & running)
        g1 = jnp.where(running, lax.cummax(jnp.where(chosen, m, -jnp.inf), axis=0), v1)
        g = jnp.where(keep, jnp.where(k, m, g1), 0.)
        g = jnp.arccos(jnp.where(keep, jnp.arccos(g), 0.))
        return (jnp.where(jnp.isnan(v4), m, g), x)

    m = np.ones((3, 4), f32)
    m[2, 3] = 0.
    args = (np.ones(4, f32), np.ones(4, f32), m, f32(1.), np.zeros((3, 4), bool))
    _check(f, twin, args)


# -------------------------------------------------------------------------- fill-changes-dropped
# A `cummin` selected on its choice fills its dropped operand lanes with +inf, which changes the
# dropped lanes of its output; a max pooling read them and was not re-decided: its window of
# ties chose the +inf and the window's derivative was lost. (Fixed: a chooser that fills marks
# its outputs changed, `Chooser.keeps_dropped_values`, and the pooling is re-decided.)


def test_pooling_of_a_filled_cummin_keeps_every_windows_derivative():
    # as found by the fuzzer (run 9): nothing is NaN-prone, the arguments may hold inf
    def f(x, y, m, s, k):
        v1 = lax.cummin(m, axis=0)[0]
        return (lax.reduce_window(v1, -jnp.inf, lax.max, (2,), (1,), "VALID"),)

    args = (np.ones(4, f32), np.ones(4, f32), np.ones((3, 4), f32), f32(1.), K1)
    _check(f, f, args)
    ct = np.array([-0.5, 0.5, 1.25], f32)
    got = jax.vjp(lambda m: nan_safe(f)(*args[:2], m, *args[3:])[0], args[2])[1](ct)[0]
    np.testing.assert_array_equal(got[0], [-0.5, 0.5, 1.25, 0.])  # ties: the first lane
