"""nan_safe on 8 devices (simulated on CPU): its own session, as x64 is, because the device count
is read once per process. The Makefile runs it with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/test_multidevice.py`.

A `shard_map` body is rewritten like any nested jaxpr (its outputs and inputs live), keeping the
mesh, the specs and the varying-axes types; checked against the hand-written double where in the
body, and forward values bit for bit against `jax.jit` of the same program on the same mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsafe
from jaxsafe import nan_safe

# A few compiled multi-device programs: the API's tracing paths are checked for leaks elsewhere.
pytestmark = pytest.mark.no_leak_check


def test_session_has_eight_devices():
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def _ring_loss(mesh, guard):
    """A per-device masked loss, summed over the ring (`psum`), as sequence-parallel losses are."""
    def body(x):
        safe = jnp.where(x > 0, x, 1.) if guard else x
        return jax.lax.psum(jnp.where(x > 0, jnp.sqrt(safe), 0.).sum(), "d")
    return jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P())


def test_shard_map_body_is_rewritten_and_gives_the_hand_fix_gradient():
    mesh = jax.make_mesh((8,), ("d",))
    xs = jax.device_put(jnp.linspace(-1., 1., 16), NamedSharding(mesh, P("d")))
    f, hand = _ring_loss(mesh, False), _ring_loss(mesh, True)
    assert np.isnan(jax.jit(jax.grad(f))(xs)).any()  # the bug, per device
    g = jax.jit(jax.grad(nan_safe(f)))(xs)
    assert_close(g, jax.jit(jax.grad(hand))(xs))
    assert np.isfinite(np.asarray(g)).all()
    assert_bitwise(nan_safe(f)(xs), jax.jit(f)(xs))
    with jax.set_mesh(mesh):  # eager grad of a shard_map needs the mesh set, in plain JAX too
        assert_close(jax.grad(nan_safe(f))(xs), g)


def test_shard_map_keeps_mesh_specs_and_checks():
    mesh = jax.make_mesh((8,), ("d",))
    xs = jax.device_put(jnp.linspace(-1., 1., 16), NamedSharding(mesh, P("d")))
    f = _ring_loss(mesh, False)
    (old,) = [e for e in jax.make_jaxpr(f)(xs).jaxpr.eqns if e.primitive.name == "shard_map"]
    (new,) = [e for e in jaxsafe.make_jaxpr(f)(xs).jaxpr.eqns if e.primitive.name == "shard_map"]
    for name in ("mesh", "in_specs", "out_specs", "check_vma", "newly_manual_axes"):
        assert new.params[name] == old.params[name], name
    assert new.params["jaxpr"] is not old.params["jaxpr"]  # the body was rewritten
    assert [v.aval for v in new.params["jaxpr"].invars] == \
        [v.aval for v in old.params["jaxpr"].invars]  # varying types kept
    report = nan_safe(f).trace(xs)[1]
    assert report.changed and not any(e.primitive.name == "shard_map" for e in report.unknown)


def test_shard_map_with_nothing_to_guard_is_unchanged():
    mesh = jax.make_mesh((8,), ("d",))
    xs = jax.device_put(jnp.linspace(-1., 1., 16), NamedSharding(mesh, P("d")))
    f = jax.shard_map(lambda x: jax.lax.psum(jnp.sum(x * x), "d"), mesh=mesh,
                      in_specs=P("d"), out_specs=P())
    assert not nan_safe(f).trace(xs)[1].changed
    assert_bitwise(jax.jit(jax.grad(nan_safe(f)))(xs), jax.jit(jax.grad(f))(xs))


def test_data_parallel_jit_over_named_sharding_and_pmap_give_the_hand_fix_gradient():
    """Already worked before shard_map bodies were rewritten: kept so."""
    mesh = jax.make_mesh((8,), ("d",))
    xs = jax.device_put(jnp.linspace(-1., 1., 16), NamedSharding(mesh, P("d")))
    f = lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.))
    hand = lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.)), 0.))
    g = jax.jit(jax.grad(nan_safe(f)))(xs)
    assert_close(g, jax.jit(jax.grad(hand))(xs))
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, P("d")), 1)
    per_device = jnp.linspace(-1., 1., 16).reshape(8, 2)
    assert_close(jax.pmap(jax.grad(nan_safe(f)))(per_device), jax.pmap(jax.grad(hand))(per_device))


def test_nan_safe_of_pmap_rewrites_its_body():
    """`pmap` traces to a shard_map over an internal axis in JAX 0.10: its body is rewritten."""
    f = lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.))
    hand = lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.)), 0.))
    x = jnp.linspace(-1., 1., 16).reshape(8, 2)
    loss = lambda g: (lambda x: g(x).sum())
    assert np.isnan(jax.grad(loss(jax.pmap(f)))(x)).any()
    assert_close(jax.grad(loss(nan_safe(jax.pmap(f))))(x), jax.grad(loss(jax.pmap(hand)))(x))
    assert_bitwise(nan_safe(jax.pmap(f))(x), jax.pmap(f)(x))
