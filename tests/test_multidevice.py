"""nan_safe on 8 devices (simulated on CPU): its own session, as x64 is, because the device count
is read once per process. The Makefile runs it with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/test_multidevice.py`.

A `shard_map` body is rewritten like any nested jaxpr (its outputs and inputs live), keeping the
mesh, the specs and the varying-axes types; checked against the hand-written double where in the
body, and forward values bit for bit against `jax.jit` of the same program on the same mesh.
"""

import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise, assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsafe
from jaxsafe import nan_safe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sharded  # noqa: E402  (benchmarks/sharded.py: the masked-attention step it times)

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


def _padded_steps_loss(mesh, by_hand):
    """Per device, a scan over the steps of its shard of sequences, the padded steps dropped in
    the body; the features' log is taken before the scan (`_sinking.py` moves it into the
    body, whose per-step slices vary over the mesh axis) or, by hand, in the body."""
    def body(x):
        def step(h, inputs):
            t, feature = inputs
            live = t < 2
            if by_hand:
                feature = jnp.log(jnp.where(live, feature, 1.))
            return jnp.where(live, h + feature, h), None
        h0 = jax.lax.pcast(jnp.zeros(x.shape[1]), ("d",), to="varying")
        steps = jnp.arange(x.shape[0])
        h = jax.lax.scan(step, h0, (steps, x if by_hand else jnp.log(x)))[0]
        return jax.lax.psum(jnp.sum(h), "d")
    return jax.shard_map(body, mesh=mesh, in_specs=P(None, "d"), out_specs=P())


def test_work_before_a_scan_in_a_shard_map_body_is_moved_into_the_scan():
    mesh = jax.make_mesh((8,), ("d",))
    x = jnp.concatenate([jnp.full((2, 16), 2.), jnp.zeros((2, 16))])  # two padded steps
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "d")))
    f, hand = _padded_steps_loss(mesh, False), _padded_steps_loss(mesh, True)
    assert np.isnan(jax.jit(jax.grad(f))(xs)).any()
    assert_close(jax.jit(jax.grad(nan_safe(f)))(xs), jax.jit(jax.grad(hand))(xs))
    assert_bitwise(nan_safe(f)(xs), jax.jit(f)(xs))


def test_a_zero_one_mask_from_outside_a_shard_map_masks_the_product_in_its_checkpoint():
    """`m * sqrt(x) * x` in a checkpoint inside a `shard_map`, with a 0/1 mask `m` made outside
    from a predicate: each device's slice of `m` carries no derivative inside either, so the
    lanes where it is 0 are dropped (`PrimitiveRule.body_operands`). Before: NaN."""
    mesh = jax.make_mesh((8,), ("d",))
    xs = jax.device_put(jnp.linspace(-1., 1., 16) ** 2 * (jnp.arange(16) % 3 != 0),
                        NamedSharding(mesh, P("d")))

    def loss(x):
        m = (x > 0.).astype(x.dtype)
        body = jax.checkpoint(lambda m, x: jax.lax.psum(jnp.sum(m * jnp.sqrt(x) * x), "d"))
        return jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P())(m, x)

    def live_lanes_only(x):
        return jnp.sum(jnp.where(x > 0., jnp.sqrt(jnp.where(x > 0., x, 1.)) * x, 0.))

    assert np.isnan(jax.jit(jax.grad(loss))(xs)).any()  # the bug
    assert_bitwise(nan_safe(loss)(xs), jax.jit(loss)(xs))
    assert_close(jax.jit(jax.grad(nan_safe(loss)))(xs), jax.jit(jax.grad(live_lanes_only))(xs))


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
    assert report.changed and not report.unknown  # shard_map, pvary, psum: all known


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


def test_collectives_in_a_shard_map_body_pass_liveness_conservatively():
    """A ring step (`ppermute`), a gather and a `pmax` after the where: every lane they read
    stays live (the other devices' lanes are not seen), the where's own drop is guarded."""
    mesh = jax.make_mesh((8,), ("d",))
    xs = jax.device_put(jnp.linspace(-1., 1., 16), NamedSharding(mesh, P("d")))
    ring = [(i, (i + 1) % 8) for i in range(8)]

    def make(guard):
        def body(x):
            safe = jnp.where(x > 0, x, 1.) if guard else x
            y = jnp.where(x > 0, jnp.sqrt(safe), 0.)
            shifted = jax.lax.ppermute(y, "d", ring)
            gathered = jax.lax.all_gather(shifted, "d", tiled=True)
            top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(y)), "d")  # JAX: no pmax rule
            return jax.lax.psum(jnp.sum(gathered * gathered), "d") / (1. + top * top)
        return jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P())
    f, hand = make(False), make(True)
    assert np.isnan(jax.jit(jax.grad(f))(xs)).any()
    assert_close(jax.jit(jax.grad(nan_safe(f)))(xs), jax.jit(jax.grad(hand))(xs))
    assert_bitwise(nan_safe(f)(xs), jax.jit(f)(xs))
    assert not nan_safe(f).trace(xs)[1].unknown


_COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")


def _collectives(compiled_text: str) -> dict:
    import re
    return {c: len(re.findall(rf"\b{c}(-start)?\(", compiled_text)) for c in _COLLECTIVES}


def test_data_parallel_step_adds_no_collective():
    """A batch-sharded masked loss (replicated weights): the compiled gradient of the rewritten
    program has the collectives of the original's, no more; masks follow the batch sharding."""
    mesh = jax.make_mesh((8,), ("d",))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, (64, 16)), NamedSharding(mesh, P("d")))
    w = jax.device_put(jax.random.normal(kw, (16, 16)) / 4., NamedSharding(mesh, P()))

    def loss(w, x):
        h = x @ w
        return jnp.mean(jnp.where(h > 0, jnp.sqrt(h), 0.))

    def hand(w, x):
        h = x @ w
        return jnp.mean(jnp.where(h > 0, jnp.sqrt(jnp.where(h > 0, h, 1.)), 0.))

    texts = {name: jax.jit(jax.grad(fn)).lower(w, x).compile().as_text()
             for name, fn in (("original", loss), ("nan_safe", nan_safe(loss)))}
    counts = {name: _collectives(t) for name, t in texts.items()}
    assert sum(counts["original"].values()) > 0  # the weight gradient is summed over devices
    assert counts["nan_safe"] == counts["original"], counts
    g = jax.jit(jax.grad(nan_safe(loss)))(w, x)
    assert_close(g, jax.jit(jax.grad(hand))(w, x))
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, P()), 2)


def test_sharding_constraints_are_kept_and_liveness_passes_through_them():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = NamedSharding(mesh, P("d"))
    xs = jax.device_put(jnp.linspace(-1., 1., 16), sharded)

    def f(x):
        y = jax.lax.with_sharding_constraint(jnp.sqrt(x), sharded)
        return jnp.sum(jnp.where(x > 0, y, 0.))

    def hand(x):
        y = jax.lax.with_sharding_constraint(jnp.sqrt(jnp.where(x > 0, x, 1.)), sharded)
        return jnp.sum(jnp.where(x > 0, y, 0.))
    assert np.isnan(jax.jit(jax.grad(f))(xs)).any()
    assert_close(jax.jit(jax.grad(nan_safe(f)))(xs), jax.jit(jax.grad(hand))(xs))
    assert_bitwise(nan_safe(f)(xs), jax.jit(f)(xs))
    report = nan_safe(f).trace(xs)[1]
    assert report.changed and not report.unknown
    old = [e for e in jax.make_jaxpr(f)(xs).jaxpr.eqns if "sharding" in e.primitive.name]
    new = [e for e in jaxsafe.make_jaxpr(f)(xs).jaxpr.eqns if "sharding" in e.primitive.name]
    assert old and [e.params for e in new] == [e.params for e in old]


def _placed_roots(sharding):
    """`sum(where(x > 0, device_put(sqrt(x), sharding), 0.))`, and its hand fix."""
    def make(clean):
        def f(x):
            y = jax.device_put(jnp.sqrt(clean(x)), sharding)
            return jnp.sum(jnp.where(x > 0, y, 0.))
        return f
    return make(lambda x: x), make(lambda x: jnp.where(x > 0, x, 1.))


def test_a_sharded_device_put_inside_the_function_passes_liveness_through():
    """`jax.device_put(v, sharding)` inside the traced function: the value itself, placed. The
    drop after it reaches the `sqrt` before it, and the placement is kept."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = NamedSharding(mesh, P("d"))
    xs = jnp.linspace(-1., 1., 16)

    f, hand = _placed_roots(sharded)
    assert np.isnan(jax.jit(jax.grad(f))(xs)).any()
    assert_close(jax.jit(jax.grad(nan_safe(f)))(xs), jax.jit(jax.grad(hand))(xs))
    assert_close(jax.jit(jax.hessian(nan_safe(f)))(xs), jax.jit(jax.hessian(hand))(xs))
    assert_bitwise(nan_safe(f)(xs), jax.jit(f)(xs))
    report = nan_safe(f).trace(xs)[1]
    assert report.changed and not report.unknown
    new = [e for e in jaxsafe.make_jaxpr(f)(xs).jaxpr.eqns if e.primitive.name == "device_put"]
    assert new and all(e.params["devices"] == (sharded,) for e in new)


def test_a_device_put_under_explicit_axes_passes_liveness_only_where_the_type_is_kept():
    """Under `Explicit` mesh axes a `device_put` to another sharding changes the value's type:
    a mask of the output's sharding cannot select the operand's lanes, so the operand is live
    in every lane there (as `reshard`'s); to the same sharding, the drop reaches through."""
    mesh = jax.make_mesh((8,), ("d",))  # Explicit axes
    sharded = NamedSharding(mesh, P("d"))

    f, hand = _placed_roots(sharded)
    with jax.set_mesh(mesh):
        kept = jax.device_put(jnp.linspace(-1., 1., 16), sharded)
        assert np.isnan(jax.jit(jax.grad(f))(kept)).any()
        assert_close(jax.jit(jax.grad(nan_safe(f)))(kept), jax.jit(jax.grad(hand))(kept))
        retyped = jnp.linspace(-1., 1., 16)  # not sharded: device_put changes its type
        assert not nan_safe(f).trace(retyped)[1].changed
        jaxsafe.make_jaxpr(f)(retyped)  # emitted without a select across shardings
        assert_bitwise(nan_safe(f)(retyped), jax.jit(f)(retyped))


def _transformer_loss(guard):
    """One masked-attention block with an RMS norm on padded token rows (zero embeddings: the
    norm's 0/0 is dropped by the where, the classic leak), and attention masked to valid keys:
    the loss `make bench` times (benchmarks/sharded.py); `guard`: the hand fix."""
    return sharded.transformer_loss(hand=guard)


def _transformer_inputs(shape):
    mesh = jax.make_mesh(shape, ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    b, t, d = 8, 6, 16
    keys = jax.random.split(jax.random.key(1), 6)
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
    params = {"w_in": put(jax.random.normal(keys[0], (d, d)) / 4., None, "model"),
              "wq": put(jax.random.normal(keys[1], (d, d)) / 4., None, "model"),
              "wk": put(jax.random.normal(keys[2], (d, d)) / 4., None, "model"),
              "wv": put(jax.random.normal(keys[3], (d, d)) / 4., None, "model"),
              "wo": put(jax.random.normal(keys[4], (d, d)) / 4., "model", None)}
    lengths = jnp.array([6, 3, 1, 5, 2, 6, 4, 3])
    valid = put(jnp.arange(t)[None, :] < lengths[:, None], "data")
    x = put(jnp.where(valid[..., None], jax.random.normal(keys[5], (b, t, d)), 0.), "data")
    return params, x, valid


MESHES = pytest.mark.parametrize("shape", [(8, 1), (2, 4)], ids=["data_parallel", "data2_model4"])


def _step(fn):
    return jax.jit(jax.grad(fn))


@MESHES
def test_sharded_transformer_step_gives_the_hand_fix_gradient(shape):
    """Data parallel (8x1) and data x model parallel (2x4, weights split over `model`)."""
    params, x, valid = _transformer_inputs(shape)
    f, hand = _transformer_loss(False), _transformer_loss(True)
    plain = _step(f)(params, x, valid)
    assert any(np.isnan(np.asarray(g)).any() for g in jax.tree.leaves(plain))
    g = _step(nan_safe(f))(params, x, valid)
    jax.tree.map(lambda a, r: assert_close(a, r, rtol=1e-5, atol=1e-6), g,
                 _step(hand)(params, x, valid))
    assert_bitwise(nan_safe(f)(params, x, valid), jax.jit(f)(params, x, valid))


@MESHES
def test_sharded_transformer_step_keeps_shardings_and_adds_no_collective(shape):
    """On 2x4 this failed while a guard's `select_n` read the program's own broadcast mask
    (shared with the `where` after `@ wo`): XLA placed that one broadcast for the other select
    and gathered the model-sharded activation (6 all-gathers against 2). Each guard now
    broadcasts its mask afresh (`_masks.selecting`)."""
    params, x, valid = _transformer_inputs(shape)
    f = _transformer_loss(False)
    texts = [_step(fn).lower(params, x, valid).compile().as_text() for fn in (f, nan_safe(f))]
    assert _collectives(texts[1]) == _collectives(texts[0])
    # the gradient is placed as the original program's (XLA chooses it under Auto axes)
    plain, g = _step(f)(params, x, valid), _step(nan_safe(f))(params, x, valid)
    for leaf, ref in zip(jax.tree.leaves(g), jax.tree.leaves(plain), strict=True):
        assert leaf.sharding.is_equivalent_to(ref.sharding, ref.ndim)


def test_the_sharded_benchmark_rows_run_and_count_collectives():
    """`make bench`'s sharded rows (benchmarks/sharded.py) at toy sizes: the gradient agrees with
    the hand fix's, and the data-parallel step has the original's collectives."""
    row = sharded.row("dp", (8, 1), (8, 8, 16), budget_s=0.01, rounds=(1, 1), compile_rounds=1)
    assert row["check"]["agree"] and row["check"]["unguarded_has_nan"]
    assert row["collectives"]["nan_safe"] == row["collectives"]["unguarded"]
    assert row["collectives"]["unguarded"]["all-reduce"] >= 1


@MESHES
def test_jit_shardings_are_kept_through_the_rewrite(shape):
    """`jax.jit` with `in_shardings`/`out_shardings` and a `with_sharding_constraint` inside:
    the rewritten step compiles to the original's collectives and returns the same shardings."""
    params, x, valid = _transformer_inputs(shape)
    mesh = valid.sharding.mesh
    loss = _transformer_loss(False)

    def constrained(params, x, valid):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data", None, None)))
        return loss(params, x, valid)
    shardings = jax.tree.map(lambda a: a.sharding, (params, x, valid))

    def step(fn):
        return jax.jit(jax.grad(fn), in_shardings=shardings, out_shardings=shardings[0])
    texts = [step(fn).lower(params, x, valid).compile().as_text()
             for fn in (constrained, nan_safe(constrained))]
    assert _collectives(texts[1]) == _collectives(texts[0])
    g, ref = step(nan_safe(constrained))(params, x, valid), step(constrained)(params, x, valid)
    for leaf, want in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True):
        assert leaf.sharding.is_equivalent_to(want.sharding, want.ndim)
    hand = step(lambda p, a, v: _transformer_loss(True)(p, a, v))(params, x, valid)
    jax.tree.map(lambda a, r: assert_close(a, r, rtol=1e-5, atol=1e-6), g, hand)


def test_explicit_mesh_axes_and_reshard():
    """Under `Explicit` axes (shardings in the types) with `jax.sharding.reshard`: known to
    jaxsafe (no unknown primitive), no mask crosses it (operand and result are typed
    differently), the hand fix's gradient with the input's sharding, the forward bit for bit."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))

    def loss(guard):
        def f(x):
            safe = jnp.where(x > 0, x, 1.) if guard else x
            y = jax.sharding.reshard(jnp.where(x > 0, jnp.sqrt(safe), 0.), P())
            return jnp.sum(y * y + jnp.sqrt(jnp.abs(y) + 1.))
        return f
    with jax.set_mesh(mesh):
        xs = jax.device_put(jnp.linspace(-1., 1., 16), NamedSharding(mesh, P("d")))
        f = loss(False)
        report = nan_safe(f).trace(xs)[1]
        assert report.changed and not report.unknown
        g = jax.jit(jax.grad(nan_safe(f)))(xs)
        assert_close(g, jax.jit(jax.grad(loss(True)))(xs))
        assert g.sharding.is_equivalent_to(xs.sharding, 1)
        assert_bitwise(jax.jit(nan_safe(f))(xs), jax.jit(f)(xs))


SCALAR_CASES = {  # (f, the hand fix): each traces an identity `reshard` under `set_mesh`
    "where": (lambda x: jnp.sum(jnp.where(x > 0, jnp.log(x), 0.)),
              lambda x: jnp.sum(jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.)), 0.))),
    "where, cases swapped": (
        lambda x: jnp.sum(jnp.where(x <= 0, 0., jnp.log(x))),
        lambda x: jnp.sum(jnp.where(x <= 0, 0., jnp.log(jnp.where(x <= 0, 1., x))))),
    "select": (lambda x: jnp.sum(jnp.select([x > 1, x > 0], [jnp.log(x), jnp.sqrt(x)], 0.)),
               lambda x: jnp.sum(jnp.select([x > 1, x > 0],
                                            [jnp.log(jnp.where(x > 1, x, 2.)),
                                             jnp.sqrt(jnp.where(x > 0, x, 1.))], 0.))),
    "logsumexp where": (
        lambda x: jax.nn.logsumexp(jnp.log(jnp.abs(x)), where=x != 0),
        lambda x: jax.nn.logsumexp(jnp.log(jnp.abs(jnp.where(x != 0, x, 1.))), where=x != 0)),
}


@pytest.mark.parametrize("name", list(SCALAR_CASES))
def test_a_where_with_a_scalar_case_under_an_explicit_mesh(name):
    """Under `jax.set_mesh` with `Explicit` axes (`jax.make_mesh`'s default), `jnp.where` with a
    scalar case traces an identity `reshard` (the same sharding both sides): its mask crosses it.
    It had kept every lane live: plain JAX's NaN (hunt AK)."""
    f, hand = SCALAR_CASES[name]
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jnp.array([-1., 0., 2., 0.5, 3., -2., 1., 4.])
    with jax.set_mesh(mesh):
        assert not np.isfinite(np.asarray(jax.grad(f)(x))).all()
        assert_close(jax.grad(nan_safe(f))(x), jax.grad(hand)(x))
        assert_bitwise(nan_safe(f)(x), jax.jit(f)(x))
        assert not _unknown_anywhere(nan_safe(f).trace(x)[1])
        xs = jax.device_put(x, NamedSharding(mesh, P("d")))
        assert_close(jax.jit(jax.grad(nan_safe(f)))(xs), jax.jit(jax.grad(hand))(xs))


_LEAK = lambda x: jnp.where(x > 0, jnp.sqrt(x), -1.)  # noqa: E731
_HAND = lambda x: jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.)), -1.)  # noqa: E731
PICKERS = {
    "max": jnp.max,
    "min of the negation": lambda h: -jnp.min(-h),
    "cummax": lambda h: jnp.sum(jax.lax.cummax(h, axis=0)),
    "top_k": lambda h: jnp.sum(jax.lax.top_k(h, 1)[0]),
    "argmax slice": lambda h: jnp.sum(jax.lax.dynamic_slice(h, (jnp.argmax(h),), (1,))),
    "sort": lambda h: jnp.sum(jnp.sort(h)[1:]),
}


@pytest.mark.parametrize("name", list(PICKERS))
def test_a_choice_by_value_in_a_shard_map_body_checking_varying_axes(name):
    """In a `shard_map` body with `check_vma` (the default), the masks a choice by value is
    planned with are pulled back through `jax.vjp`, whose cotangent and primal must vary as
    the body's values do: they were made invariant, the analysis failed and the program ran
    unguarded (hunt AK). The hand fix's gradient, and no warning."""
    pick = PICKERS[name]
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    smap = lambda inner: jax.shard_map(  # noqa: E731
        lambda x: jax.lax.psum(pick(inner(x)), "d"), mesh=mesh, in_specs=P("d"), out_specs=P())
    x = jax.device_put(jnp.linspace(-1., 2., 32), NamedSharding(mesh, P("d")))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error", jaxsafe.AnalysisFailedWarning)
        assert np.isnan(np.asarray(jax.jit(jax.grad(smap(_LEAK)))(x))).any()
        assert_close(jax.jit(jax.grad(nan_safe(smap(_LEAK))))(x),
                     jax.jit(jax.grad(smap(_HAND)))(x))


def test_a_maximum_of_data_feeding_a_collective_in_a_shard_map_body():
    """`g = psum(max(y))`, then `where(x > g, log(x - g), 0.)`: the `max` is planned with a
    pulled-back mask inside the body (hunt AK: the analysis failed, plain JAX's NaN stayed)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(guard):
        def f(x, y):
            g = jax.lax.psum(jnp.max(y), "d")
            safe = jnp.where(x > g, x - g, 1.) if guard else x - g
            return jax.lax.psum(jnp.sum(jnp.where(x > g, jnp.log(safe), 0.)), "d")
        return jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P())
    x = jnp.linspace(1., 2., 16).at[3].set(0.)
    put = lambda v: jax.device_put(v, NamedSharding(mesh, P("d")))  # noqa: E731
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error", jaxsafe.AnalysisFailedWarning)
        got = jax.jit(jax.grad(nan_safe(body(False))))(put(x), put(jnp.zeros(16)))
        assert_close(got, jax.jit(jax.grad(body(True)))(put(x), put(jnp.zeros(16))))
        assert np.asarray(got)[3] == 0.


_PICK = np.zeros((4, 3), np.float32)
_PICK[0, 0] = _PICK[1, 1] = _PICK[3, 2] = 1.  # a selection matrix: column 2 of x unused
EXPLICIT_DROPS = {
    "slice": lambda x: jnp.sum(jnp.log(x)[:, :2]),
    "gather at constant indices": lambda x: jnp.sum(jnp.log(x)[:, jnp.array([0, 1])]),
    "selection matrix": lambda x: jnp.sum(jnp.sqrt(x) @ _PICK),
    "mask product": lambda x: jnp.sum(jnp.sqrt(x) * jnp.array([1., 1., 0., 1.])[None, :]),
    "concatenate": lambda x: jnp.sum(jnp.concatenate([jnp.log(x), x], 1)[:, 4:]),
    "masked softmax": lambda x: jnp.sum(jax.nn.softmax(
        jnp.where(x > 0, jnp.log(x), -jnp.inf), axis=1) * jnp.arange(4.)[None, :]),
    "row max": lambda x: jnp.sum(jnp.max(jnp.where(x > 0, jnp.sqrt(x), -1.), axis=1)),
    "top_k": lambda x: jnp.sum(jax.lax.top_k(jnp.where(x > 0, jnp.sqrt(x), -1.), 2)[0]),
    "cummax": lambda x: jnp.sum(jax.lax.cummax(jnp.where(x > 0, jnp.sqrt(x), -1.), axis=1)),
    # re-decided on the original values: the literal's broadcast is placed too (hunt AT)
    "maximum": lambda x: jnp.sum(jnp.sqrt(jnp.maximum(x, 1.) - 1.)),
    "minimum": lambda x: jnp.sum(jnp.sqrt(1. - jnp.minimum(x, 1.))),
    "clip": lambda x: jnp.sum(jnp.sqrt(jnp.clip(x, 1., 1.5) - 1.)),
}


@pytest.mark.parametrize("name", list(EXPLICIT_DROPS))
def test_drops_of_an_input_sharded_on_explicit_axes(name):
    """With `Explicit` mesh axes and an input sharded `P("d")`, the masks the rewrite makes
    (constants, replicated) are placed as the values they select (`_compat.sharded_like`): a
    `select_n` of a replicated mask and a sharded value is a type error there, and the analysis
    failed, running the program unguarded (hunt AK). The gradient is the unsharded one's."""
    f = EXPLICIT_DROPS[name]
    x = np.linspace(.5, 2., 32).astype(np.float32).reshape(8, 4)
    x[:, 2] = 0.  # every drop above drops column 2: `log` and `sqrt` are singular at 0
    assert np.isnan(np.asarray(jax.grad(f)(jnp.asarray(x)))).any()
    want = jax.grad(nan_safe(f))(jnp.asarray(x))
    assert np.isfinite(np.asarray(want)).all()
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error", jaxsafe.AnalysisFailedWarning)
        xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("d")))
        got = jax.jit(jax.grad(nan_safe(f)))(xs)
        assert_close(got, want, atol=1e-6)
        assert got.sharding.is_equivalent_to(xs.sharding, 2)
        assert_bitwise(jax.jit(nan_safe(f))(xs), jax.jit(f)(xs))


_KEPT = jnp.array([False, True])
BODY_CONTRACTIONS = {  # lane 0 of `log(x)` meets only zero weights
    "a closed-over weight vector": lambda h: h @ jnp.array([0., 1.]),
    "a one-hot made in the body": lambda h: h @ jax.nn.one_hot(1, 2),
    "an einsum with a selection matrix": lambda h: jnp.einsum(
        "ij,jk->ik", h, jnp.array([[0., 0.], [1., 2.]])),
}


@pytest.mark.parametrize("name", list(BODY_CONTRACTIONS))
@pytest.mark.parametrize("mapped", ["shard_map", "pmap"])
def test_a_zero_weight_contraction_in_a_per_device_body(name, mapped):
    """In a `shard_map` or `pmap` body a constant weight reaches the contraction through `pvary`
    (it is typed as varying over the manual axes), which kept its zeros unknown: the dropped
    lane's `log(0)` gave NaN (hunt AM). `pvary` now moves what its operand holds, and a
    closed-over weight passed to the body holds its values there."""
    contract = BODY_CONTRACTIONS[name]
    f = lambda x: jnp.sum(contract(jnp.log(x)))
    hand = lambda x: jnp.sum(contract(jnp.log(jnp.where(_KEPT, x, 1.))))
    x = jnp.tile(jnp.array([[0., 1.5]]), (8, 1))
    if mapped == "shard_map":
        mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        wrap = lambda g: jax.shard_map(  # noqa: E731
            lambda x: jax.lax.psum(g(x), "d"), mesh=mesh, in_specs=P("d"), out_specs=P())
    else:
        wrap = lambda g: lambda x: jnp.sum(jax.pmap(g)(x[:, None]))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsafe.AnalysisFailedWarning)
        assert np.isnan(np.asarray(jax.grad(wrap(f))(x))).any()
        assert_close(jax.grad(nan_safe(wrap(f)))(x), jax.grad(wrap(hand))(x))


def _unknown_anywhere(report) -> list:
    found, stack = [], [report]
    while stack:
        r = stack.pop()
        found += [e.primitive.name for e in r.unknown]
        stack += [sub for _, sub in r.nested]
    return found


def test_explain_of_a_shard_map_body_knows_every_collective_and_pvary():
    """Inside the body too (nested reports): `pvary` (which a `where` with a literal adds under
    varying-axes checking), `psum`, `axis_index` and the invariant forms are known."""
    mesh = jax.make_mesh((8,), ("d",))

    def body(x):
        s = jax.lax.psum(jnp.where(x > 0, jnp.sqrt(x), 0.), "d")
        i = jax.lax.axis_index("d")
        g = jax.lax.all_gather(x, "d", tiled=True)[:2]
        p = jax.lax.ppermute(x, "d", [(j, (j + 1) % 8) for j in range(8)])
        a = jax.lax.all_to_all(jnp.tile(x, 4), "d", 0, 0, tiled=True)[:2]
        r = jax.lax.psum_scatter(jnp.tile(x, 8), "d", tiled=True)
        m = jax.lax.pmean(x, "d") + jax.lax.pmax(x, "d") + jax.lax.pmin(x, "d")
        return jnp.where(x > 0, s * x, 0.) + i + g + p + a + r + m
    sm = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    xs = jax.device_put(jnp.linspace(-1., 1., 16), NamedSharding(mesh, P("d")))
    report = nan_safe(sm).trace(xs)[1]
    assert report.changed and _unknown_anywhere(report) == []
    assert "unknown" not in str(jaxsafe.explain(sm)(xs))


@pytest.mark.parametrize("factor", ["literal", "closed-over constant", "mask"])
def test_nan_safe_inside_a_shard_map_body_differentiates_a_masked_product(factor):
    """`nan_safe` called inside the body (not around the `shard_map`): its rewrite is traced when
    JAX differentiates the body, over values that vary over the mesh axis. A product's mask
    compared a value with a constant at trace time, which JAX casts to vary (`pvary`) and
    cannot run: `jax.grad` raised. Masks of such a program are staged. Reference: the
    hand-written double where."""
    mesh = jax.make_mesh((8,), ("d",))
    scale = jnp.array([0.5, 0.25])

    def one(x, fix=False):
        root = jnp.sqrt(jnp.where(x > 0, x, 1.) if fix else x)
        if factor == "mask":
            return jnp.sum(root * (x > 0))
        weighted = root * (0.5 if factor == "literal" else scale[0])
        return jnp.sum(jnp.where(x > 0, weighted, 0.))

    def loss(body):
        return jax.shard_map(lambda x: jax.lax.psum(body(x), "d"), mesh=mesh,
                             in_specs=P("d"), out_specs=P())

    xs = jax.device_put(jnp.linspace(-1., 1., 16), NamedSharding(mesh, P("d")))
    if factor != "mask":  # XLA folds the NaN times a constant 0 of a mask away
        assert np.isnan(np.asarray(jax.jit(jax.grad(loss(one)))(xs))).any()  # the leak
    got = jax.jit(jax.grad(loss(nan_safe(one))))(xs)
    assert_close(got, jax.jit(jax.grad(loss(lambda x: one(x, fix=True))))(xs))
    assert_bitwise(jax.jit(loss(nan_safe(one)))(xs), jax.jit(loss(one))(xs))


def test_nan_safe_inside_a_shard_map_body_guards_work_before_a_scan():
    """GAE per device: a value net over the shard's observations, then a scan whose body drops
    the terminal steps (`_hoisted.py`), with `nan_safe` inside the body."""
    mesh = jax.make_mesh((8,), ("d",))
    w = jnp.array([0.1, -0.2, 0.3])
    obs = (jnp.arange(8 * 4 * 3, dtype=jnp.float32).reshape(8, 4, 3) / 50 + 0.5).at[:, 2].set(
        jnp.nan)
    done = jnp.tile(jnp.array([False, False, True, False]), (8, 1))
    obs, done = (jax.device_put(a, NamedSharding(mesh, P("d"))) for a in (obs, done))

    def gae(w, obs, done):
        values = obs @ w

        def step(adv, inputs):
            v, d = inputs
            adv = jnp.where(d, 0., 1. - v + 0.9 * adv)
            return adv, adv
        return jnp.sum(jax.lax.scan(step, values[0] * 0., (values, done), reverse=True)[1] ** 2)

    def by_hand(w, obs, done):
        return gae(w, jnp.where(done[:, None], 0., obs), done)

    def loss(per_device):
        def body(w, o, d):
            return jax.lax.psum(per_device(w, o[0], d[0]), "d")
        return lambda w: jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                                       out_specs=P())(w, obs, done)

    got = jax.jit(jax.grad(loss(nan_safe(gae))))(w)
    assert np.isfinite(np.asarray(got)).all()
    assert_close(got, jax.jit(jax.grad(loss(by_hand)))(w))
