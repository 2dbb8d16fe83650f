"""What a loop's carries hand back to the step before (`_rewrite.carried_cotangents`).

A `max`, `min` or `clamp` is re-decided on original values where its output's cotangent may be
non-finite (`_cotangents.py`). In a loop's body, a carry's output cotangent is what the next
step makes of its carry input: the body's own cotangent pass says whether that can be
non-finite, so a clamp before a pole in a body (`sqrt(maximum(t, 1e-6))`) is left as it is, as
it is outside a loop (contract 4), and a carry whose next step meets a pole (`sqrt` of the
clamped carry) still gets the hand fix's derivatives (contract 2).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, structure
from jax import lax

import jaxsafe

X = jnp.array([2.0, 0.0, -1.0, 3.0, jnp.nan])


def clamped_sqrt(t, hand=False):
    """`hand`: the clamp as a where, which keeps a NaN `t` as `maximum` does."""
    return jnp.sqrt(jnp.where(t < 1e-6, 1e-6, t) if hand else jnp.maximum(t, 1e-6))


def clamped_log(t, hand=False):
    return jnp.log(jnp.clip(t, 1e-6, 1.0))


def clamped_inverse(t, hand=False):
    return 1.0 / (jnp.where(t < 1e-3, 1e-3, t) if hand else jnp.maximum(t, 1e-3))


ALREADY_SAFE = {
    "scan_outputs": lambda x, hand=False: lax.scan(
        lambda c, t: (c, clamped_sqrt(t, hand)), 0.0, x)[1].sum(),
    "scan_carry": lambda x, hand=False: lax.scan(
        lambda c, t: (c + clamped_log(t, hand), None), 0.0, x)[0],
    "scan_inverse": lambda x, hand=False: lax.scan(
        lambda c, t: (c * clamped_inverse(t, hand), None), 1.0, x)[0],
    "fori_carry": lambda x, hand=False: lax.fori_loop(
        0, 3, lambda i, c: clamped_sqrt(c, hand), x).sum(),
    "fori_two_carries": lambda x, hand=False: lax.fori_loop(
        0, 3, lambda i, c: (clamped_sqrt(c[1], hand), 0.5 * c[0] + 1.0), (x, x))[1].sum(),
    "reverse_scan": lambda x, hand=False: lax.scan(
        lambda c, t: (clamped_sqrt(c + t, hand), c), 1.0, x, reverse=True)[0],
}
# A NaN argument reaches these clamps' cotangents from another lane's step: `c * q` with a
# NaN carry `c` (a NaN `t` of an earlier step) weighs `q = 1 / max(t, 1e-3)` by NaN where `t`
# is finite and below the clamp, and `max`'s 0 weight makes `0 * NaN` for that dropped lane.
# With `finite_args` they are left as they are; without, the clamp is re-decided.
NAN_REACHES_THE_CLAMP = {"scan_inverse", "reverse_scan"}


@pytest.mark.parametrize("finite_args", [False, True])
@pytest.mark.parametrize("name", sorted(ALREADY_SAFE))
def test_a_clamp_before_a_pole_in_a_loop_body_is_left_as_it_is(name, finite_args):
    """Nothing in these loops can make a non-finite cotangent that a clamp would weigh by 0:
    the program runs unchanged, and its gradient is JAX's, the NaN argument's lane included.
    Where a NaN argument can, the gradient is the hand-written where's."""
    f = ALREADY_SAFE[name]
    x = X[:4] if finite_args else X
    report = str(jaxsafe.explain(f, finite_args=finite_args)(x))
    safe_grad = jax.grad(jaxsafe.nan_safe(f, finite_args=finite_args))(x)
    if name in NAN_REACHES_THE_CLAMP and not finite_args:
        assert "re-decided max" in report, report
        assert_bitwise(safe_grad, jax.grad(lambda x: f(x, hand=True))(x))
        return
    assert report == "nothing to guard: the program runs unchanged", report
    assert structure(jaxsafe.make_jaxpr(f, finite_args=finite_args)(x)) == \
        structure(jax.make_jaxpr(f)(x))
    assert_bitwise(safe_grad, jax.grad(f)(x))


def test_a_clamp_in_a_while_loop_body_is_left_as_it_is():
    """A `while_loop` (forward mode only): its body's clamp is left as it is too."""
    def f(x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, clamped_sqrt(c[1])),
                              (0, x))[1].sum()
    report = str(jaxsafe.explain(f)(X))
    assert report == "nothing to guard: the program runs unchanged", report
    t = jnp.ones_like(X)
    assert_bitwise(jax.jvp(jaxsafe.nan_safe(f), (X,), (t,)), jax.jvp(f, (X,), (t,)))


def swap(c, hand):
    """`(a, b) -> (max(b, 0), sqrt(a))`: the next step's `sqrt` of the first carry has an
    infinite derivative where the clamp made 0, and that cotangent comes back to the `max` of
    the step before, whose dropped lane (`b < 0`) must get 0, not `0 * inf`."""
    a, b = c
    clamped = jnp.where(b > 0, b, 0.0) if hand else jnp.maximum(b, 0.0)
    return clamped, jnp.sqrt(a)


LOOPS = {
    "fori": lambda step: lambda a, b: lax.fori_loop(0, 2, lambda i, c: step(c), (a, b))[1].sum(),
    "scan": lambda step: lambda a, b: lax.scan(lambda c, _: (step(c), None), (a, b),
                                               length=2)[0][1].sum(),
    "scan_unrolled": lambda step: lambda a, b: lax.scan(lambda c, _: (step(c), None), (a, b),
                                                        length=2, unroll=2)[0][1].sum(),
}


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_carry_that_meets_a_pole_in_the_next_step_is_re_decided(loop):
    """The body alone makes no non-finite cotangent for its outputs: the one it hands back
    through the first carry is, and the fixpoint finds it. Gradients and Hessians are the
    hand-written where's (plain JAX's gradient is NaN in the dropped lane)."""
    f = LOOPS[loop](lambda c: swap(c, hand=False))
    hand = LOOPS[loop](lambda c: swap(c, hand=True))
    a, b = jnp.array([4.0, 1.0]), jnp.array([-1.0, 9.0])
    assert np.isnan(np.asarray(jax.grad(f, 1)(a, b)[0]))
    safe = jaxsafe.nan_safe(f)
    assert_bitwise(safe(a, b), jax.jit(f)(a, b))
    assert_bitwise(jax.grad(safe, (0, 1))(a, b), jax.grad(hand, (0, 1))(a, b))
    assert_bitwise(jax.hessian(safe, 1)(a, b), jax.hessian(hand, 1)(a, b))
    assert "re-decided max" in str(jaxsafe.explain(f)(a, b))
