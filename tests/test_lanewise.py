"""Scans that compute lane by lane (`jaxsafe/_lanewise.py`): liveness crosses them, carries
included, so a drop outside the scan reaches the hazards inside it.

References: the hand-written double where (the operand cleaned before the scan), and JAX on the
same program; forward values bitwise equal to `jax.jit(f)`.
"""

import jax
import jax.numpy as jnp
import jax.scipy.special as sp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close, structure
from jax import lax

import jaxsafe
from jaxsafe._aligned import aligned_axes

# a numerics sweep: the modules of nan_safe's tracing paths check for tracer leaks (conftest)
pytestmark = pytest.mark.no_leak_check

nan, inf = np.nan, np.inf
EDGES = jnp.array([0.5, nan, -inf, inf, -2., 0., -0., 3.])


def _check(f, hand, x):
    """Forward bitwise; first and second order, eager, jit and vmap, against the hand fix.
    nan_safe runs through XLA even when called eagerly, so the reference is the jitted hand fix
    (eager JAX rounds op by op, a few ulps away in the second order)."""
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(x), jax.jit(f)(x))
    grad, hessian = jax.jit(jax.grad(hand)), jax.jit(jax.hessian(hand))
    assert_close(jax.grad(safe)(x), grad(x))
    assert_close(jax.jit(jax.grad(safe))(x), grad(x))
    assert_close(jax.hessian(safe)(x), hessian(x))
    xs = jnp.stack([x, x[::-1]])
    assert_close(jax.vmap(jax.grad(safe))(xs), jax.jit(jax.vmap(jax.grad(hand)))(xs))


# The special functions: each evaluates a polynomial with `lax.scan` (jnp.polyval)
# inside a custom_jvp, so the custom rule is cut in dropped lanes only if liveness crosses the
# scan.
SPECIAL = [("erfcx", sp.erfcx, lambda x: x > 0),
           ("dawsn", sp.dawsn, lambda x: x > 0),
           ("ndtri", sp.ndtri, lambda x: (x > 0) & (x < 1))]
SLOW_SPECIAL = {"ndtri"}  # 10 s: make fuzz runs it (make test is at its 10 minutes)


@pytest.mark.no_leak_check  # library functions: compiled with JAX's caches
@pytest.mark.parametrize("name,fn,live", [
    pytest.param(*s, id=s[0], marks=[pytest.mark.slow] if s[0] in SLOW_SPECIAL else [])
    for s in SPECIAL])
def test_scan_based_special_function_behind_a_where_gets_the_hand_fix(name, fn, live):
    x = EDGES / 4 if name == "ndtri" else EDGES

    def f(x):
        return jnp.where(live(x), fn(x), 0.).sum()

    def hand(x):
        return jnp.where(live(x), fn(jnp.where(live(x), x, 0.5)), 0.).sum()

    _check(f, hand, x)
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()  # plain JAX leaks here


def test_carry_under_a_where_outside_the_scan():
    """How-it-works' former limitation: the drop is outside, on the final carry."""
    def f(x):
        c = lax.scan(lambda c, _: (jnp.sqrt(c), None), x, None, length=2)[0]
        return jnp.sum(jnp.where(x > 0, c, 0.))

    def hand(x):
        safe = jnp.where(x > 0, x, 1.)
        c = lax.scan(lambda c, _: (jnp.sqrt(c), None), safe, None, length=2)[0]
        return jnp.sum(jnp.where(x > 0, c, 0.))

    x = jnp.array([0., 1., 4., -1., nan])
    _check(f, hand, x)
    report = jaxsafe.explain(f)(x)
    assert "sqrt" in str(report)


def test_stacked_outputs_and_scalar_inputs_of_a_lanewise_scan():
    """xs stacked over steps, a scalar constant, a scalar step counter: lane i of the carry and
    of every step's input is dropped where lane i of every output is."""
    def body(x, scale):
        def step(carry, xi):
            c, n = carry
            c = c * scale + jnp.log(c * xi)
            return (c, n + 1.), jnp.sqrt(c)
        (c, n), ys = lax.scan(step, (x, 0.), jnp.stack([x, 2. * x, x]))
        return c, ys, n

    def f(x):
        c, ys, n = body(x, 0.5)
        keep = x > 0
        return jnp.where(keep, c, 0.).sum() + jnp.where(keep, ys, 0.).sum() + n

    def hand(x):
        keep = x > 0
        c, ys, n = body(jnp.where(keep, x, 1.), 0.5)
        return jnp.where(keep, c, 0.).sum() + jnp.where(keep, ys, 0.).sum() + n

    _check(f, hand, jnp.array([1., -1., 2., nan, 0., inf]))


def test_a_body_that_mixes_lanes_stays_conservative():
    """A reduction in the body makes every lane of the carry reach every output lane: nothing is
    dropped, nothing guarded, the program runs unchanged (the NaN is real)."""
    def f(x):
        c = lax.scan(lambda c, _: (jnp.sqrt(c) + c.sum(), None), x, None, length=2)[0]
        return jnp.sum(jnp.where(x > 0, c, 0.))

    x = jnp.array([1., -1., 4.])
    assert _aligned(lambda c: jnp.sqrt(c) + c.sum(), x) is None
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))
    assert_close(jax.grad(jaxsafe.nan_safe(f))(x), jax.grad(f)(x))


def test_a_scan_whose_every_lane_is_live_is_unchanged():
    def f(x):
        c = lax.scan(lambda c, _: (jnp.sqrt(c), None), x, None, length=2)[0]
        return c.sum()

    x = jnp.array([1., 4.])
    assert structure(jaxsafe.make_jaxpr(f)(x)) == structure(jax.make_jaxpr(f)(x))


def _aligned(step, *args):
    """The aligned axes of a scan body `step` whose first input comes back as its output."""
    return aligned_axes(jax.make_jaxpr(step)(*args), [(0, 0)])


def test_aligned_axes_of_lane_by_lane_bodies():
    v = jnp.ones(3)
    al = _aligned(lambda c, s: jnp.where(c > s, c * s, 1.), v, 2.)
    assert al.inputs[0] == al.outputs[0] and al.inputs[0][0] is not None and al.inputs[1] == ()
    assert _aligned(lambda c: c[::-1], v) is None                 # moves lanes
    assert _aligned(lambda c: c @ c * c, v) is None               # contracts
    assert _aligned(lambda s: s * 2., 2.) is None                 # scalars only
    al = _aligned(lambda c, m: c + m.sum(), v, jnp.ones((2, 3)))  # a scalar of other values
    assert al.inputs[0][0] is not None and al.inputs[1] == (None, None)


def test_an_unused_final_carry_drops_nothing():
    """Found by the fuzzer: the final carry is unused (no lane reaches an output) and the
    stacked outputs are live in every lane; the lane mask is their union, so every operand lane
    is live and the program, with its hazard in a live position, runs unchanged."""
    def f(x, m):
        ys = lax.scan(lambda c, xi: (c + c, c), jnp.arccos(x), m)[1]
        return jnp.arccos(jnp.sum(ys, axis=0))

    args = (jnp.ones(4), jnp.ones((3, 4)))
    assert structure(jaxsafe.make_jaxpr(f)(*args)) == structure(jax.make_jaxpr(f)(*args))


# ------------------------------------------------------------ scans without carries (lax.map)

_ROWS = jnp.array([[1., 4.], [-1., nan], [9., 16.]])
_KEEP_ROWS = jnp.array([True, False, True])


def _two_maps_of_rows(x, keep=_KEEP_ROWS):
    """A NaN-prone map, then another map, then a drop per step (row): the second map's steps
    are independent, so the dropped row's lanes reach the first map's body."""
    roots = lax.map(jnp.sqrt, x)
    return jnp.sum(jnp.where(keep, lax.map(lambda r: jnp.sum(r) * 2., roots), 0.))


def _two_maps_of_rows_by_hand(x, keep=_KEEP_ROWS):
    return jnp.sum(jnp.where(keep, 2. * jnp.sum(jnp.sqrt(jnp.where(keep[:, None], x, 1.)), 1), 0.))


def _two_maps_of_lanes(x):
    """Lane-by-lane bodies: a drop per lane after the second map reaches the first map's lane."""
    logs = lax.map(jnp.log, x)
    return jnp.sum(jnp.where(x > 0, lax.map(lambda r: r * 3., logs), 0.))


def _two_maps_of_lanes_by_hand(x):
    return jnp.sum(jnp.where(x > 0, 3. * jnp.log(jnp.where(x > 0, x, 1.)), 0.))


@pytest.mark.parametrize("f, hand", [(_two_maps_of_rows, _two_maps_of_rows_by_hand),
                                     (_two_maps_of_lanes, _two_maps_of_lanes_by_hand)],
                         ids=["rows", "lanes"])
def test_a_drop_after_a_second_map_reaches_the_first_map(f, hand):
    """`lax.map` is a scan without carries: step t of its stacked input is live where step t
    of some output is (lane by lane for a lane-by-lane body). Plain JAX: NaN. Reference: the
    hand-written double where before the first map, at every order."""
    # lanes: log(0) in the dropped lane (log(-1) has a finite derivative)
    x = jnp.array([[1., 4.], [0., 4.], [9., 16.]]) if f is _two_maps_of_lanes else _ROWS
    assert np.isnan(jax.grad(f)(x)).any()
    assert_bitwise(jaxsafe.nan_safe(f)(x), jax.jit(f)(x))
    for d in (jax.grad, jax.jacfwd, jax.hessian):
        assert_close(d(jaxsafe.nan_safe(f))(x), d(hand)(x))


def test_a_map_whose_other_output_is_live_keeps_every_step_live():
    """A step is live where any output of that step is: `y * y`, summed whole, keeps every
    step of `sqrt(z)` live, though `where` drops the step's `log`. So the guard before the map
    leaves step 1 alone, and the real singularity there (`sqrt(z) ** 2` at `z = 0`: 0 * inf)
    stays NaN, as in plain JAX; the other steps take the hand fix's derivatives."""
    def f(z):
        logs, squares = lax.map(lambda y: (jnp.log(y), y * y), jnp.sqrt(z))
        return jnp.sum(jnp.where(z > 1., logs, 0.)) + jnp.sum(squares)

    def hand(z):
        root = jnp.sqrt(z)
        logs = jnp.log(jnp.where(z > 1., root, 1.))
        return jnp.sum(jnp.where(z > 1., logs, 0.)) + jnp.sum(root * root)

    z = jnp.array([4., 0., 9.])
    got = jax.grad(jaxsafe.nan_safe(f))(z)
    assert np.isnan(got[1]) and np.isnan(jax.grad(hand)(z)[1])
    assert_close(got[::2], jax.grad(hand)(z)[::2])
    z = jnp.array([4., 0.5, 9.])  # step 1 dropped by the where, live through `y * y`
    assert_close(jax.grad(jaxsafe.nan_safe(f))(z), jax.grad(hand)(z))
    assert_close(jax.hessian(jaxsafe.nan_safe(f))(z), jax.hessian(hand)(z), atol=1e-6)  # 0 +- ulp
