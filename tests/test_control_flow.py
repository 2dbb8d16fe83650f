"""Leaking wheres inside loops and branches: the bodies are rewritten, the structure is kept."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_bitwise, assert_close
from jax import lax

import jaxsafe
from jaxsafe import nan_safe

P = jax.extend.core.primitives
XS = jnp.array([-1., 0., 0.25, 4.])


def _prims(closed):
    return [e.primitive for e in closed.eqns]


def test_scan_body():
    def body(c, x):
        return c + jnp.where(x > 0, jnp.sqrt(x), 0.), c

    def hand_body(c, x):
        return c + jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.)), 0.), c

    f = lambda xs: lax.scan(body, 0., xs)[0]
    hand = lambda xs: lax.scan(hand_body, 0., xs)[0]
    assert np.isnan(jax.grad(f)(XS)).any()
    assert_bitwise(nan_safe(f)(XS), jax.jit(f)(XS))
    assert_close(jax.grad(nan_safe(f))(XS), jax.grad(hand)(XS))
    new = jaxsafe.make_jaxpr(f)(XS)
    assert _prims(new).count(P.scan_p) == 1  # a rewritten scan stays a scan
    body_prims = _prims(new.eqns[-1].params["jaxpr"]) if new.eqns[-1].primitive is P.scan_p else []
    assert body_prims.count(P.select_n_p) >= 2


def test_fori_loop_with_static_bounds():
    f = lambda x: lax.fori_loop(0, 3, lambda i, c: c + jnp.where(c > 0, jnp.log(c), 0.), x)
    hand = lambda x: lax.fori_loop(
        0, 3, lambda i, c: c + jnp.where(c > 0, jnp.log(jnp.where(c > 0, c, 1.)), 0.), x)
    assert np.isnan(jax.grad(f)(0.))
    for x in [0., -2., 1.5]:
        assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
        assert jax.grad(nan_safe(f))(x) == jax.grad(hand)(x)


def test_while_body_is_guarded():
    def f(x, n):
        def body(c):
            i, v = c
            return i + 1, v + jnp.where(v > 0, jnp.log(v), 0.)
        return lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    new = jaxsafe.make_jaxpr(f)(0., 3)
    (loop,) = [e for e in new.eqns if e.primitive is P.while_p]
    assert _prims(loop.params["body_jaxpr"]).count(P.select_n_p) >= 2
    for x in [0., -2., 1.5]:
        assert_bitwise(nan_safe(f)(x, 3), jax.jit(f)(x, 3))
    # while loops are forward-differentiable only; the guarded body stays NaN-free forward
    with jax.debug_nans(True):
        primal, tangent = jax.jvp(lambda x: nan_safe(f, jit=False)(x, 3), (0.,), (1.,))
    assert (primal, tangent) == (0., 1.)


def test_cond_branches():
    f = lambda x: lax.cond(jnp.sum(x) > 0, lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.),
                           lambda x: x, x)
    loss = lambda g: (lambda x: jnp.sum(g(x)))
    assert np.isnan(jax.grad(loss(f))(XS)).any()
    assert_bitwise(nan_safe(f)(XS), jax.jit(f)(XS))
    assert_close(jax.grad(loss(nan_safe(f)))(XS), jnp.array([0., 0., 1., 0.25]))
    assert_close(jax.grad(loss(nan_safe(f)))(-XS), jnp.ones(4))


def test_vmap_of_cond_whose_branch_has_sqrt():
    c = lambda x: lax.cond(x > 0, jnp.sqrt, lambda x: 0. * x, x)
    want = jnp.array([0., 0., 1., 0.25])
    assert_close(jax.vmap(jax.grad(nan_safe(c)))(XS), want)
    assert_close(jax.grad(lambda x: jnp.sum(nan_safe(jax.vmap(c))(x)))(XS), want)
    assert_bitwise(nan_safe(jax.vmap(c))(XS), jax.jit(jax.vmap(c))(XS))


def test_grad_of_vmap_of_a_cond_on_a_batched_predicate():
    """`jax.grad(jax.vmap(nan_safe(f)))`: vmap batches nan_safe's derivative rule, and JAX's
    batching of a cond on a batched predicate puts `stop_gradient` on the branches' tangents,
    which JAX cannot transpose (jax-ml/jax#22011): this raised, with nothing to guard as with
    a guard in a branch. Reference: plain JAX, and the hand fix in the branch."""
    smooth = lambda v: lax.cond(v > 0, jnp.sin, jnp.cos, v)  # noqa: E731
    x = jnp.array([-1., 2.])
    total = lambda f: lambda x: jnp.sum(jax.vmap(f)(x))  # noqa: E731
    assert_bitwise(jax.grad(total(nan_safe(smooth)))(x), jax.grad(total(smooth))(x))
    assert_bitwise(jax.jit(jax.grad(total(nan_safe(smooth))))(x), jax.grad(total(smooth))(x))

    def branchy(fix):
        root = lambda v: jnp.sqrt(jnp.where(v > 1, v - 1, 1.) if fix else v - 1)  # noqa: E731
        return lambda v: lax.cond(v > 0, lambda v: jnp.where(v > 1, root(v), 0.), jnp.sqrt, v)
    x = jnp.array([-1., 0.5, 2.])
    assert np.isnan(jax.grad(total(branchy(False)))(x)[1])  # the dropped lane's NaN
    for d in (jax.grad, jax.hessian):
        assert_close(d(total(nan_safe(branchy(False))))(x), d(total(branchy(True)))(x))
    for d in (jax.jacrev, jax.jacfwd):
        batched = lambda f: jax.vmap(f)  # noqa: E731
        assert_close(d(batched(nan_safe(branchy(False))))(x), d(batched(branchy(True)))(x))


def test_where_inside_checkpoint():
    f = jax.checkpoint(lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.))
    assert np.isnan(jax.grad(f)(0.))
    assert jax.grad(nan_safe(f))(0.) == 0.
    assert _prims(jaxsafe.make_jaxpr(f)(0.)).count(P.remat_p) == 1


def test_jit_boundaries_are_crossed():
    f = lambda x: jnp.where(x > 0, jax.jit(jnp.sqrt)(x), 0.)
    assert jax.grad(nan_safe(f))(0.) == 0.
    norm = lambda x: jnp.sum(jnp.where(jnp.any(x != 0), x / jnp.linalg.norm(x), 0.))
    assert np.isnan(jax.grad(norm)(jnp.zeros(3))).all()
    assert_close(jax.grad(nan_safe(norm))(jnp.zeros(3)), jnp.zeros(3))
    x = jnp.array([3., 4., 0.])
    assert_close(jax.grad(nan_safe(norm))(x), jax.grad(norm)(x))


def test_custom_jvp_rule_is_kept():
    relu = lambda x: jnp.where(x > 0, jax.nn.relu(jnp.sqrt(x)), 0.)
    assert jax.grad(nan_safe(relu))(0.) == 0.
    assert jax.grad(nan_safe(relu))(4.) == 0.25

    @jax.custom_jvp
    def straight_through(x):
        return jnp.round(x)
    straight_through.defjvp(lambda p, t: (straight_through(p[0]), t[0]))
    g = lambda x: straight_through(jnp.sqrt(x))
    assert jax.grad(nan_safe(g))(4.) == 0.25  # the user's rule, not round's zero derivative


def test_custom_jvp_rule_singular_in_dropped_lanes_is_cut():
    import jax.scipy.special as jss
    x = jnp.array([-1., 0., 0.25, 4.])
    f = lambda x: jnp.sum(jnp.where(x > 0, jss.xlogy(x, x), 0.))
    hand = lambda x: jnp.sum(jnp.where(x > 0, jss.xlogy(jnp.where(x > 0, x, 1.),
                                                         jnp.where(x > 0, x, 1.)), 0.))
    # the plain-JAX references compiled (eager, each op compiles again under the leak checker)
    assert np.isnan(jax.jit(jax.grad(f))(x)).any()
    assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
    assert_close(jax.grad(nan_safe(f))(x), jax.jit(jax.grad(hand))(x))
    assert_close(jax.hessian(nan_safe(f))(x), jax.jit(jax.hessian(hand))(x))


def test_a_custom_rule_reads_what_its_primal_body_does_not():
    """The rule is the derivative: an operand (or lanes of one) that the primal body never
    reads may still get the rule's derivative, so it is live where the output is, never cut.
    Dropped, it is cut as before (the hand fix's zero)."""
    @jax.custom_jvp
    def ignores_x(x, y):
        return y
    ignores_x.defjvp(lambda p, t: (p[1], 3. * t[0]))
    f = lambda x: jnp.where(x > 0, ignores_x(x, 1.), 0.)
    assert jax.grad(nan_safe(f))(2.) == jax.grad(f)(2.) == 3.
    assert jax.jvp(nan_safe(f), (2.,), (1.,))[1] == 3.
    assert jax.grad(nan_safe(f))(-2.) == 0.

    @jax.custom_vjp
    def reads_first(x):
        return jnp.sqrt(x[0])
    reads_first.defvjp(lambda x: (jnp.sqrt(x[0]), x[0]),
                       lambda r, ct: (jnp.full((3,), 0.5 * ct / jnp.sqrt(r)),))
    g = lambda x: jnp.where(x[0] > 0, reads_first(x), 0.)
    x = jnp.array([4., 1., 1.])
    np.testing.assert_array_equal(jax.grad(nan_safe(g))(x), jax.grad(g)(x))
    np.testing.assert_array_equal(jax.grad(g)(x), [0.25, 0.25, 0.25])

    # implicit differentiation: the solver iterates on `a`, the rule differentiates in it
    def root(a):
        return lax.custom_root(lambda y: y * y - a, 1.,
                               lambda h, y0: lax.fori_loop(0, 20, lambda i, y: y - h(y) / (2 * y),
                                                           y0),
                               lambda h, b: b / h(1.))
    r = lambda a: jnp.where(a > 0, root(a), 0.)
    hand = lambda a: jnp.where(a > 0, root(jnp.where(a > 0, a, 1.)), 0.)
    assert_close(jax.grad(nan_safe(r))(2.), 0.5 / jnp.sqrt(2.))
    assert_close(jax.grad(nan_safe(r))(2.), jax.grad(r)(2.))
    assert jax.grad(nan_safe(r))(-2.) == jax.grad(hand)(-2.) == 0.


def test_liveness_flows_into_a_checkpoint_from_outside():
    f = lambda x: jnp.where(x > 0, jax.checkpoint(jnp.sqrt)(x), 0.)
    loss = lambda g: (lambda x: jnp.sum(g(x)))
    assert np.isnan(jax.grad(loss(f))(XS)).any()
    assert_bitwise(nan_safe(f)(XS), jax.jit(f)(XS))
    assert_close(jax.grad(loss(nan_safe(f)))(XS), jnp.array([0., 0., 1., 0.25]))
    new = jaxsafe.make_jaxpr(f)(XS)
    assert _prims(new).count(P.remat_p) == 1  # still a checkpoint


def test_liveness_flows_into_cond_branches_from_outside():
    f = lambda x: jnp.where(x > 0, lax.cond(jnp.sum(x) > 0, jnp.sqrt, jnp.log, x), 0.)
    loss = lambda g: (lambda x: jnp.sum(g(x)))
    for x, want in [(XS, [0., 0., 1., 0.25]), (-XS, [1., 0., 0., 0.])]:
        assert np.isnan(jax.grad(loss(f))(x)).any()
        assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
        assert_close(jax.grad(loss(nan_safe(f)))(x), jnp.array(want))


def test_liveness_flows_into_scan_outputs_from_outside():
    """Per-step outputs of a scan, masked afterwards (padded time steps of a sequence)."""
    def f(x):
        _, ys = lax.scan(lambda c, xi: (c + 1., jnp.log(xi) * c), 1., x)
        return jnp.sum(jnp.where(x > 0, ys, 0.))

    def hand(x):
        _, ys = lax.scan(lambda c, xi: (c + 1., jnp.log(xi) * c), 1., jnp.where(x > 0, x, 1.))
        return jnp.sum(jnp.where(x > 0, ys, 0.))
    assert np.isnan(jax.grad(f)(XS)).any()
    assert_bitwise(nan_safe(f)(XS), jax.jit(f)(XS))
    assert_close(jax.grad(nan_safe(f))(XS), jax.grad(hand)(XS))
    assert_close(jax.hessian(nan_safe(f))(XS), jax.hessian(hand)(XS))
    assert _prims(jaxsafe.make_jaxpr(f)(XS)).count(P.scan_p) == 1


def test_scan_operand_counts_are_read_in_both_of_jax_s_forms():
    """JAX 0.9/0.10 name a scan's constants and carries (`num_consts`, `num_carry`); JAX 0.11+
    describes its operands as a flat tree of three parts (`ft_in`: constants, carries, stacked
    inputs). CI runs the first; the second is what `make test-jax-newest` runs, so here it is
    checked on the shape of that object: three parts whose lengths are their leaf counts."""
    from jaxsafe._compat import scan_counts

    eqn = next(e for e in jax.make_jaxpr(
        lambda c, x, k: lax.scan(lambda a, b: ((a[0] * k + b[0], a[1] + b[1]), a[0]), (c, c), x))(
            1.0, jnp.ones((3, 2)), 2.0).eqns if e.primitive.name == "scan")
    consts, carries = scan_counts(eqn.params)
    n_xs = len(eqn.invars) - consts - carries
    assert (consts, carries, n_xs) == (1, 2, 1)

    class FlatTree:  # JAX 0.11's flattree: unpack() -> parts, len(part) -> its leaves
        def __init__(self, *parts):
            self.parts = parts

        def unpack(self):
            return self.parts

    assert scan_counts({"ft_in": FlatTree([None], [None, None], [None])}) == (1, 2)
    assert scan_counts({"ft_in": FlatTree([], [None], [None, None])}) == (0, 1)
