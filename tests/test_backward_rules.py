"""Backward rules that jaxsafe cannot rewrite: the structural-zero pass (`_backward.py`).

A custom_vjp whose `bwd` re-traces its body and differentiates it (as equinox's checkpointed
while loop does for every diffrax solve) leaks inside the rule: the rewritten primal program never
reaches that code. The reference is the same rule written with the hand double where.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_finite, structure

import jaxsafe

# The slow tests (second order, whole solvers) run without the leak checker: it turns JAX's
# tracing caches off. The first-order ones keep it: the wrapped rule must leak no tracer.
SLOW = pytest.mark.no_leak_check

X = jnp.array([-1.0, 0.0, 0.25, 4.0, -2.0])
W = jnp.arange(1.0, 6.0)


def leaky(x):
    """The branch that is not taken keeps x's lanes live (no cut at the call can help)."""
    return jnp.where(x > 0, jnp.sqrt(x), x)


def hand(x):
    return jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.0)), x)


def retracing(body):
    """A custom_vjp whose backward rule differentiates `body` again, from Python."""
    @jax.custom_vjp
    def f(x):
        return body(x)

    def fwd(x):
        return body(x), x

    def bwd(x, g):
        return jax.vjp(body, x)[1](g)

    f.defvjp(fwd, bwd)
    return f


def loss_of(f):
    return lambda x: jnp.sum(f(x) * W)


def test_a_leak_inside_a_backward_rule_is_fixed_at_first_order():
    loss = loss_of(retracing(leaky))
    assert np.isnan(np.asarray(jax.grad(loss)(X))).any()  # plain JAX leaks
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(X), jax.grad(loss_of(hand))(X))


@SLOW
def test_a_leak_inside_a_backward_rule_is_fixed_in_the_hessian_too():
    loss = loss_of(retracing(leaky))
    got = jax.hessian(jaxsafe.nan_safe(loss))(X)
    assert_finite(got)
    assert_close(got, jax.hessian(loss_of(hand))(X))
    assert_close(jax.jacrev(jax.grad(jaxsafe.nan_safe(loss)))(X), got)  # reverse over reverse


def test_the_rule_s_forward_values_are_unchanged():
    loss = loss_of(retracing(leaky))
    np.testing.assert_array_equal(jaxsafe.nan_safe(loss)(X), jax.jit(loss)(X))
    value, grad = jax.value_and_grad(jaxsafe.nan_safe(loss))(X)
    np.testing.assert_array_equal(value, jax.jit(loss)(X))
    assert_finite(grad)


def test_a_live_singularity_inside_a_backward_rule_stays():
    # x = 0 is taken by sqrt's branch here: its infinite derivative is the function's own
    body = lambda x: jnp.where(x >= 0, jnp.sqrt(x), x)
    loss = loss_of(retracing(body))
    got = np.asarray(jax.grad(jaxsafe.nan_safe(loss))(X))
    assert np.isposinf(got[1])
    assert_close(got[[0, 2, 3, 4]], np.asarray(jax.grad(loss_of(hand))(X))[[0, 2, 3, 4]])


def test_structural_zeros_inside_a_loop_of_the_backward_rule():
    """The rule runs a loop whose body differentiates a `where` (as a checkpointed solve
    does); the zeros it writes are local to the body."""
    def step(y):
        return y + 0.1 * jnp.where(y > 0, -jnp.sqrt(y), 0.0)

    def step_hand(y):
        return y + 0.1 * jnp.where(y > 0, -jnp.sqrt(jnp.where(y > 0, y, 1.0)), 0.0)

    def solver(step):
        @jax.custom_vjp
        def solve(y):
            return jax.lax.fori_loop(0, 3, lambda i, y: step(y), y)

        def fwd(y):
            ys = jax.lax.scan(lambda y, _: (step(y), y), y, None, length=3)[1]
            return solve(y), ys

        def bwd(ys, g):
            def back(i, g):
                return jax.vjp(step, ys[2 - i])[1](g)[0]
            return (jax.lax.fori_loop(0, 3, back, g),)

        solve.defvjp(fwd, bwd)
        return solve

    y0 = jnp.array([0.05, -1.0, 0.0, 2.0])
    loss = lambda y: jnp.sum(solver(step)(y))
    assert np.isnan(np.asarray(jax.grad(loss)(y0))).any()
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(y0),
                 jax.grad(lambda y: jnp.sum(solver(step_hand)(y)))(y0))


def test_a_zero_that_a_gather_s_transpose_writes_stays_zero():
    body = lambda x: jnp.sqrt(x)[jnp.array([2, 3])]  # lanes 0, 1, 4 dropped by the gather
    loss = lambda x: jnp.sum(retracing(body)(x))
    got = jax.grad(jaxsafe.nan_safe(loss))(X)
    assert_close(got, jnp.array([0.0, 0.0, 1.0, 0.25, 0.0]))


def test_a_custom_vjp_with_a_closed_over_constant_differentiates():
    """A custom_vjp's constant operands must keep a zero tangent: JAX refuses to differentiate
    one with respect to a closed-over value (this failed inside every diffrax BacksolveAdjoint
    solve under nan_safe)."""
    scale = np.linspace(1.0, 2.0, 5).astype(np.float32)

    @jax.custom_vjp
    def f(x):
        return x * scale

    f.defvjp(lambda x: (f(x), None), lambda _, g: (g * scale,))

    @jax.custom_vjp
    def g(x):
        return f(x)

    def g_fwd(x):
        return f(x), x

    def g_bwd(x, ct):
        return jax.vjp(f, x)[1](ct)

    g.defvjp(g_fwd, g_bwd)
    loss = lambda x: jnp.sum(jnp.where(x > 0, jnp.log(g(x)), 0.0))
    expected = jnp.where(X > 0, 1.0 / jnp.where(X > 0, X, 1.0), 0.0)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(X), expected)


def test_nothing_to_guard_leaves_the_call_as_it_is():
    loss = lambda x: jnp.sum(retracing(lambda x: 2.0 * x + 1.0)(x))
    closed = jax.make_jaxpr(loss)(X)
    assert structure(jaxsafe.make_jaxpr(loss)(X)) == structure(closed)
    assert "nothing to guard" in str(jaxsafe.explain(loss)(X))


def test_explain_names_the_guarded_backward_rule():
    text = str(jaxsafe.explain(loss_of(retracing(leaky)))(X))
    assert "guarded the backward rule of custom_vjp_call" in text
    assert "test_backward_rules.py" in text


def test_symbolic_zeros_and_python_residuals_pass_through():
    """A rule with symbolic zeros, and residuals that are not arrays."""
    @functools.partial(jax.custom_vjp)
    def f(x, y):
        return leaky(x) + y

    def fwd(x, y):
        return f(x, y), (x, True)

    def bwd(res, g):
        x, flag = res
        assert flag is True
        return jax.vjp(leaky, x)[1](g)[0], None

    f.defvjp(fwd, bwd, symbolic_zeros=False)
    loss = lambda x: jnp.sum(f(x, jnp.ones(5)) * W)
    assert_close(jax.grad(jaxsafe.nan_safe(loss))(X), jax.grad(loss_of(hand))(X))


# --------------------------------------------------------------------------- libraries

diffrax = pytest.importorskip("diffrax")


def _tanks(field):
    def solve(h0, k):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field), diffrax.Tsit5(), 0.0, 3.0, 0.1, h0, args=k,
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-6), max_steps=64)
        return jnp.sum(sol.ys[-1])
    return solve


def _drain(t, h, k):
    return jnp.where(h > 0, -k * jnp.sqrt(h), 0.0)


def _drain_hand(t, h, k):
    return jnp.where(h > 0, -k * jnp.sqrt(jnp.where(h > 0, h, 1.0)), 0.0)


H0 = jnp.array([1.0, 0.5, 2.0])
K = jnp.array([1.0, 1.0, 0.3])


@SLOW
def test_diffrax_draining_tanks_gradient_equals_the_hand_fix():
    """Two tanks run dry inside the solve: sqrt's branch is dropped there, inside equinox's
    checkpointed while loop, whose backward rule re-traces the vector field."""
    solve = _tanks(_drain)
    plain = jax.grad(solve, (0, 1))(H0, K)
    assert np.isnan(np.asarray(plain[0])).any()
    got = jax.grad(jaxsafe.nan_safe(solve), (0, 1))(H0, K)
    assert_close(got, jax.grad(_tanks(_drain_hand), (0, 1))(H0, K), rtol=1e-5)


@SLOW
def test_library_programs_have_no_unknown_primitive():
    import lineax as lx
    import optimistix as optx

    def newton(y0, k):
        fn = lambda y, a: y ** 3 - a
        return optx.root_find(fn, optx.Newton(rtol=1e-5, atol=1e-5), y0, args=k,
                              max_steps=20).value.sum()

    def linsolve(b, k):
        a = jnp.eye(3) * 2 + jnp.outer(k, k) * 0.1
        return lx.linear_solve(lx.MatrixLinearOperator(a), jnp.sqrt(b)).value.sum()

    def backsolve(h0, k):
        return diffrax.diffeqsolve(diffrax.ODETerm(_drain), diffrax.Dopri5(), 0.0, 1.0, 0.1,
                                   h0, args=k, adjoint=diffrax.BacksolveAdjoint()).ys.sum()

    for f in (_tanks(_drain), newton, linsolve, backsolve):
        report = jaxsafe.nan_safe(f).trace(H0, K)[1]
        text = str(jaxsafe.explain(f)(H0, K))
        assert "unknown primitive" not in text, text
        assert not _unknowns(report)
    # a BacksolveAdjoint solve differentiates under nan_safe as it does without
    assert_close(jax.grad(jaxsafe.nan_safe(backsolve), (0, 1))(H0, K),
                 jax.grad(backsolve, (0, 1))(H0, K), rtol=1e-5)


def _unknowns(report):
    return list(report.unknown) + [e for _, sub in report.nested for e in _unknowns(sub)]


def writing_its_derivative(x):
    """A rule whose derivative is written by hand, with its own `where` (no structural zero)."""
    @jax.custom_vjp
    def f(x):
        return leaky(x)

    f.defvjp(lambda x: (leaky(x), x),
             lambda x, g: (jnp.where(x > 0, 0.5 / jnp.sqrt(x), 1.) * g,))
    return f(x)


@SLOW
@pytest.mark.parametrize("where", ["top", "scan", "rule written by hand"])
def test_reverse_over_reverse_through_a_rule_in_a_loss_not_linear_in_it(where):
    """A derivative of the derivative differentiates the rule's forward program (the value it
    returns is read again by the loss: `f(x) ** 2`, `f(x) * x`) and its backward program; both
    leak as plain code (a `where` in each) unless rewritten, at the top of the program and in a
    loop's body, whose differentiation JAX evaluates partially as a program."""
    rule = {"top": retracing(leaky), "scan": retracing(leaky),
            "rule written by hand": writing_its_derivative}[where]
    ref = retracing(hand)

    def loss_of_square(f):
        if where == "scan":
            return lambda x: jax.lax.scan(lambda c, v: (c + f(v) ** 2 + f(v) * v, None),
                                          0., x)[0]
        return lambda x: jnp.sum(f(x) ** 2 * W + f(x) * x)

    loss = loss_of_square(rule)
    want = jax.hessian(loss_of_square(ref))(X)
    assert not np.isfinite(np.asarray(jax.jacrev(jax.grad(loss))(X))).all()  # plain JAX leaks
    for second in (jax.jacrev(jax.grad(jaxsafe.nan_safe(loss))),
                   jax.jit(jax.jacrev(jax.jacrev(jaxsafe.nan_safe(loss)))),
                   jax.hessian(jaxsafe.nan_safe(loss))):
        got = second(X)
        assert_finite(got)
        assert_close(got, want)
    np.testing.assert_array_equal(jaxsafe.nan_safe(loss)(X), jax.jit(loss)(X))
    value, _ = jax.value_and_grad(jaxsafe.nan_safe(loss))(X)
    np.testing.assert_array_equal(value, jax.jit(loss)(X))


def two_outputs_hazard_in_the_first():
    """A rule with two outputs whose backward differentiates the first (a leaking `where`) on
    whatever cotangent it is handed: zero when the program reads only the second."""
    @jax.custom_vjp
    def f(x):
        return leaky(x), 2. * x

    def bwd(x, g):
        g_first, g_second = g
        return (jax.vjp(leaky, x)[1](g_first)[0] + 2. * g_second,)

    f.defvjp(lambda x: (f(x), x), bwd)
    return f


@pytest.mark.parametrize("where", ["top", "scan", "jit in cond"])
def test_a_rule_whose_hazard_is_in_an_output_the_program_does_not_read(where):
    """JAX's DCE removes the unread output from the call's body (no hazard is left there) but
    not from its backward rule, which differentiates it on a zero cotangent."""
    f = two_outputs_hazard_in_the_first()
    second = {"top": lambda x: f(x)[1],
              "scan": lambda x: jax.lax.scan(lambda c, _: (c, f(c)[1]), x, None, length=2)[1][1],
              "jit in cond": lambda x: jax.lax.cond(x[0] < 0, jax.jit(lambda x: f(x)[1]),
                                                     lambda x: x, x)}[where]

    def loss(x):
        return jnp.sum(second(x) * W)

    def without_the_unread_output(x):
        return jnp.sum(2. * x * W)

    assert np.isnan(np.asarray(jax.grad(loss)(X))).any()  # plain JAX leaks
    got = jax.grad(jaxsafe.nan_safe(loss))(X)
    np.testing.assert_array_equal(got, jax.grad(without_the_unread_output)(X))
    np.testing.assert_array_equal(jaxsafe.nan_safe(loss)(X), jax.jit(loss)(X))


def test_grad_of_vmap_of_a_program_with_a_custom_vjp():
    """Under `vmap`, JAX batches the forward mode a custom_jvp's rule runs, where a custom_vjp
    call raises: a program with one is differentiated through a custom_vjp of its own
    (`_rewrite._reverse_only`), in either order of `grad` and `vmap`, jitted or not."""
    @jax.custom_vjp
    def root(x):
        return jnp.sqrt(x)

    root.defvjp(lambda x: (jnp.sqrt(x), jnp.sqrt(x)), lambda y, g: (g / (2 * y),))

    def f(x):
        return jnp.where(x > 0, root(x), 0.)

    def hand_fix(x):
        return jnp.where(x > 0, root(jnp.where(x > 0, x, 1.)), 0.)

    def double(x):  # nothing to guard
        return root(x * x + 1.) * x

    def summed(g):
        return lambda xs: jnp.sum(jax.vmap(g)(xs) * W)

    safe, safe_double = jaxsafe.nan_safe(f), jaxsafe.nan_safe(double)
    assert np.isnan(np.asarray(jax.grad(summed(f))(X))).any()  # plain JAX
    want = jax.grad(summed(hand_fix))(X)
    for got in (jax.grad(summed(safe))(X), jax.jit(jax.grad(summed(safe)))(X),
                jax.vmap(jax.grad(safe))(X) * W, jax.grad(summed(jax.jit(safe)))(X)):
        np.testing.assert_array_equal(got, want)
    assert_close(jax.grad(summed(safe_double))(X), jax.grad(summed(double))(X), rtol=1e-6)
    assert_close(jax.vmap(jax.hessian(safe))(X), jax.vmap(jax.hessian(hand_fix))(X))
    np.testing.assert_array_equal(jax.vmap(safe)(X), jax.jit(jax.vmap(f))(X))
