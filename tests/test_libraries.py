"""Whole programs of a heavy library: jax-md's pair energies (`make test-libs`).

jax-md (with pymatgen and flax behind it) is the `libs` extra, not the `test` one: installing
it doubles `make test`'s set-up. These tests are marked `libs`; `make test-libs` installs the
extra and runs them, and `.ci/run` calls it after `make test`. jax-md guards its singular lanes
by hand (`safe_mask`, `nan_to_num`): values, forces and Hessians must be the original's.
"""

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_finite, structure

import jaxsafe

pytestmark = [pytest.mark.libs, pytest.mark.no_leak_check]

R = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.2], [0.0, 1.2]])  # a coincident pair


def _jax_md():
    """jax-md, imported by the tests that use it (its import takes seconds)."""
    import jax_md
    return jax_md


JAX_MD_WARNINGS = pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")


@JAX_MD_WARNINGS
@pytest.mark.parametrize("make", ["lennard_jones_pair", "morse_pair", "soft_sphere_pair"])
def test_jax_md_pair_energies_forces_and_hessians_are_unchanged(make):
    jax_md = _jax_md()
    displacement, _ = jax_md.space.free()
    energy = getattr(jax_md.energy, make)(displacement)
    r = jnp.array([[0.0, 1.2], [1.1, 0.0], [0.0, 1.2]])  # a coincident pair
    safe = jaxsafe.nan_safe(energy)
    np.testing.assert_array_equal(safe(r), jax.jit(energy)(r))
    forces = jax.grad(safe)(r)
    assert_finite(forces)
    assert_close(forces, jax.grad(energy)(r), rtol=1e-5, atol=1e-6)
    assert_close(jax.hessian(safe)(r), jax.hessian(energy)(r), rtol=1e-4, atol=1e-5)


@JAX_MD_WARNINGS
def test_jax_md_distance_adds_nothing_for_finite_positions():
    jax_md = _jax_md()
    displacement, _ = jax_md.space.free()
    metric = jax_md.space.metric(displacement)
    f = lambda r: jnp.sum(jax_md.space.map_product(metric)(r, r))
    assert structure(jaxsafe.make_jaxpr(f, finite_args=True)(R)) == \
        structure(jax.make_jaxpr(f)(R))
    assert_close(jax.grad(jaxsafe.nan_safe(f, finite_args=True))(R), jax.grad(f)(R))


@JAX_MD_WARNINGS
def test_jax_md_lennard_jones_at_a_tiny_separation_is_fixed_not_left_alone():
    """jax-md's guards are not the whole fix: at 1e-9 apart, (sigma / r) ** 12 overflows, the
    pair's energy is NaN and `nan_to_num` drops it, and its zero cotangent meets the infinite
    derivative: plain JAX's forces are NaN. nan_safe's are those of the system without that
    pair, which is why the rewritten energy keeps guards (docs/how-it-works.md)."""
    jax_md = _jax_md()
    displacement, _ = jax_md.space.free()
    energy = jax_md.energy.lennard_jones_pair(displacement)
    r = jnp.array([[0.0, 1.2], [1.1, 0.0], [1e-9, 1.2]])
    assert np.isnan(jax.grad(energy)(r)).any()

    def without_the_pair(r):  # pairs (0, 1) and (1, 2); (0, 2) is the dropped one
        return energy(r[jnp.array([0, 1])]) + energy(r[jnp.array([1, 2])])

    safe = jaxsafe.nan_safe(energy, finite_args=True)
    np.testing.assert_array_equal(safe(r), jax.jit(energy)(r))
    assert_close(safe(r), without_the_pair(r), rtol=1e-6)
    assert_close(jax.grad(safe)(r), jax.grad(without_the_pair)(r), rtol=1e-5, atol=1e-6)


@JAX_MD_WARNINGS
def test_jax_md_morse_with_a_far_particle_is_fixed_not_left_alone():
    """Morse's guards are not redundant either: with finite positions 3e19 apart, `r2`
    overflows to inf, the cutoff's `r ** 2.` has an infinite derivative there, and the zero
    cotangent of the pair its `where` drops makes every force NaN in plain JAX. nan_safe's are
    those of the system without the far particle's pairs (docs/how-it-works.md)."""
    jax_md = _jax_md()
    displacement, _ = jax_md.space.free()
    energy = jax_md.energy.morse_pair(displacement)
    r = jnp.array([[0.0, 0.0], [1.3, 0.0], [3e19, 0.0], [0.2, 2.1]])
    assert np.isnan(np.asarray(jax.grad(energy)(r))).all()

    def without_the_far_particle(r):
        return energy(r[jnp.array([0, 1, 3])])

    safe = jaxsafe.nan_safe(energy, finite_args=True)
    np.testing.assert_array_equal(safe(r), jax.jit(energy)(r))
    assert_close(jax.grad(safe)(r), jax.grad(without_the_far_particle)(r), rtol=1e-5,
                 atol=1e-5)


def test_flax_nnx_example_value_and_grad_and_a_jitted_train_step():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "flax_nnx.py"
    spec = importlib.util.spec_from_file_location("flax_nnx", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert np.isnan(example.gradient(example.loss)).all()
    assert_close(example.gradient(jaxsafe.nan_safe(example.loss)),
                 example.gradient(example.loss_by_hand))
    safe, value = example.train(jaxsafe.nan_safe(example.loss))
    hand, _ = example.train(example.loss_by_hand)
    assert np.isfinite(value)
    assert_close(safe, hand, rtol=1e-5)


@JAX_MD_WARNINGS
def test_jax_md_soft_sphere_with_a_nan_particle_gives_the_other_particles_forces():
    """Why nan_safe(energy) keeps guards by default: a NaN position makes its pairs' squared
    distances NaN, lanes `safe_mask(r2 > 0, sqrt, r2)` drops (the distance is its placeholder,
    a constant), and jax-md's forces on every other particle are NaN (`0 * NaN` in the
    derivative of the dropped `r2`). nan_safe's are those of the system without that particle;
    with finite positions (`finite_args=True`) nothing is guarded: not for a NaN, not the
    whole power (its base is in [2**-24, 1]), not `sqrt` (the cutoff bounds it where it drops
    pairs, and on the diagonal that `1 - eye` drops, `r2 = 0` exactly, so `safe_mask`'s
    constant is what `sqrt` reads there): the rewritten program is jax-md's own."""
    jax_md = _jax_md()
    displacement, _ = jax_md.space.free()
    energy = jax_md.energy.soft_sphere_pair(displacement)
    r = jnp.array([[0.0, 0.0], [0.5, 0.0], [0.0, 0.6], [jnp.nan, 0.0]])
    assert np.isnan(np.asarray(jax.grad(energy)(r)[:3, 0])).all()
    safe = jaxsafe.nan_safe(energy)
    np.testing.assert_array_equal(safe(r), jax.jit(energy)(r))
    assert_close(jax.grad(safe)(r)[:3], jax.grad(energy)(r[:3]), rtol=1e-6)
    assert not jaxsafe.explain(energy, finite_args=True)(r[:3]).guards
    assert structure(jaxsafe.make_jaxpr(energy, finite_args=True)(r[:3])) == \
        structure(jax.make_jaxpr(energy)(r[:3]))


@JAX_MD_WARNINGS
def test_jax_md_parameters_are_read_as_known_values(monkeypatch):
    """jax-md makes its parameters `jnp` scalars, constants of the traced program, and computes
    the cutoff's `r_c`, `r_o` from them eagerly: the smooth cutoff's divisor `(r_c - r_o) ** 3`
    is a known nonzero constant, so it is no hazard. The analysis folds closed-over scalars
    itself, so the guards are the same whether or not the inlining pass made them literals
    first (the pass is tested on its own in test_already_safe.py)."""
    jax_md = _jax_md()
    displacement, _ = jax_md.space.free()
    energy = jax_md.energy.lennard_jones_pair(displacement)
    cutoff = jax_md.energy.multiplicative_isotropic_cutoff
    # the line of the cutoff's division by the constant (r_c - r_o) ** 3
    source, first = inspect.getsourcelines(cutoff)
    division = first + next(i for i, text in enumerate(source) if "/ (r_c - r_o)" in text)
    sites = lambda: sorted((g.primitive, os.path.realpath(g.location.file), g.location.line)
                           for g in jaxsafe.explain(energy, finite_args=True)(R).guards)
    inlined = sites()
    assert inlined and all(
        site[1:] != (os.path.realpath(cutoff.__code__.co_filename), division) for site in inlined)
    from jaxsafe import _rewrite
    monkeypatch.setattr(_rewrite, "inline_scalar_constants", lambda closed: closed)
    assert sites() == inlined


def test_flax_nn_scan_over_layers_with_padded_rows():
    """Flax's scan over layers (`nn.scan` of a Dense + LayerNorm block): the padded rows of the
    batch (NaN features) are dropped after the model, and every parameter's gradient is the one
    of the same model on the real rows alone."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return nn.LayerNorm()(jnp.tanh(nn.Dense(4)(h))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=3)
            return stack()(x, None)[0]

    live = np.array([True, False, True, True, False])
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 4)).at[1].set(jnp.nan).at[4].set(jnp.inf)
    model = Model()
    params = model.init(jax.random.PRNGKey(1), x[live])

    def loss(params, x, live):
        out = model.apply(params, x)
        return jnp.sum(jnp.where(live[:, None], out, 0.) ** 2)

    safe = jaxsafe.nan_safe(loss)
    assert np.isnan(jax.tree.leaves(jax.grad(loss)(params, x, live))[0]).all()
    reference = jax.grad(loss)(params, x[live], jnp.ones(live.sum(), bool))
    assert_close(jax.grad(safe)(params, x, jnp.asarray(live)), reference, rtol=2e-5, atol=1e-6)
