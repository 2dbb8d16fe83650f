"""Leaves of pytree arguments that are not arrays are static (issue 17): an Equinox module's
activation function, a string, a config object. Hashable ones by value, others by identity, as
Equinox's filtered transformations treat them."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_bitwise, assert_close

import jaxsafe

pytestmark = pytest.mark.no_leak_check


class Layer(eqx.Module):
    weight: jax.Array
    activation: object  # a function: not an array
    name: str

    def __call__(self, x):
        return self.activation(x @ self.weight)


def loss(model, x):
    h = model(x)
    return jnp.sum(jnp.where(h > 0, jnp.log(h), 0.0))


def loss_by_hand(model, x):
    h = model(x)
    ok = h > 0
    return jnp.sum(jnp.where(ok, jnp.log(jnp.where(ok, h, 1.0)), 0.0))


MODEL = Layer(jnp.array([[1.0, -1.0], [2.0, 0.5]]), jnp.tanh, "layer")
X = jnp.array([[1.0, 1.0], [0.0, 0.0], [-1.0, 2.0]])  # h = 0 and h < 0 in dropped lanes


def test_equinox_filter_grad_of_a_nan_safe_loss():
    assert jnp.isnan(eqx.filter_grad(loss)(MODEL, X).weight).any()  # the leak is real
    expected = eqx.filter_grad(loss_by_hand)(MODEL, X).weight
    assert_close(eqx.filter_grad(jaxsafe.nan_safe(loss))(MODEL, X).weight, expected)
    jitted = eqx.filter_jit(eqx.filter_grad(jaxsafe.nan_safe(loss)))
    assert_close(jitted(MODEL, X).weight, expected)
    value, grads = eqx.filter_value_and_grad(jaxsafe.nan_safe(loss))(MODEL, X)
    assert_bitwise(value, eqx.filter_jit(loss)(MODEL, X))
    assert_close(grads.weight, expected)


@pytest.mark.parametrize("use_jit", [True, False])
def test_a_module_argument_is_called_traced_and_explained(use_jit):
    safe = jaxsafe.nan_safe(loss, jit=use_jit)
    assert_bitwise(safe(MODEL, X), eqx.filter_jit(loss)(MODEL, X))
    assert_close(jax.grad(lambda w: safe(eqx.tree_at(lambda m: m.weight, MODEL, w), X))(
        MODEL.weight), eqx.filter_grad(loss_by_hand)(MODEL, X).weight)
    assert "guarded log" in str(jaxsafe.explain(loss)(MODEL, X))
    assert jax.vmap(safe, in_axes=(None, 0))(MODEL, X[:, None]).shape == (3,)


def _scaled(x, options):
    y = x * options["scale"]
    return jnp.sum(jnp.where(y > 0, jnp.sqrt(y), 0.0)) if options["mode"] == "sqrt" else \
        jnp.sum(y)


def test_hashable_leaves_are_static_by_value():
    safe = jaxsafe.nan_safe(_scaled)
    x = jnp.array([1.0, -1.0])
    for mode in ("sqrt", "sqrt", "sum"):  # equal strings share a trace; another one does not
        out = safe(x, {"scale": 2.0, "mode": "".join(mode)})  # a new str object each time
        assert_bitwise(out, _scaled(x, {"scale": 2.0, "mode": mode}))
    assert safe.cache_info()["size"] == 2
    g = jax.grad(safe)(x, {"scale": 2.0, "mode": "sqrt"})
    assert_close(g, jnp.array([2.0 ** -0.5, 0.0]))  # d/dx sqrt(2x) at 1


class Config:
    """Unhashable (it defines __eq__ only): static by identity."""

    __hash__ = None

    def __init__(self, power):
        self.power = power

    def __eq__(self, other):
        return isinstance(other, Config) and other.power == self.power


def _powered(x, config):
    return jnp.sum(jnp.where(x > 0, x ** config[0].power, 0.0))


def test_unhashable_leaves_are_static_by_identity():
    safe = jaxsafe.nan_safe(_powered)
    x = jnp.array([4.0, 0.0])
    first = Config(0.5)
    assert_close(jax.grad(safe)(x, [first]), jnp.array([0.25, 0.0]))
    safe(x, [first])
    assert safe.cache_info()["size"] == 1  # the same object: the same trace
    assert_close(jax.grad(safe)(x, [Config(1.5)]), jnp.array([3.0, 0.0]))
    assert safe.cache_info()["size"] == 2  # an equal but other object: traced again
