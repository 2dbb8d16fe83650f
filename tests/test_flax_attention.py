"""`jaxsafe.nn.dot_product_attention` as Flax's `attention_fn` (issue 17): NNX and Linen pass
their keyword arguments (dropout included); rows with a key are Flax's own, a row with none is
0 (Flax attends uniformly there, with a large negative logit instead of -inf)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_finite

import jaxsafe
import jaxsafe.nn

pytestmark = [pytest.mark.libs, pytest.mark.no_leak_check]

B, T, N, H = 2, 4, 2, 8
MASK = jnp.ones((B, 1, T, T), bool).at[0, :, 1, :].set(False)  # batch 0, query 1: no key
ROWS = np.ones((B, T), bool)
ROWS[0, 1] = False


def _flax():
    """Flax (the libs extra, installed by make test-libs), imported by the tests that use it."""
    from flax import linen, nnx
    return linen, nnx


def _qkv():
    q, k, v = (jax.random.normal(jax.random.key(i), (B, T, N, H)) for i in range(3))
    return q, k, v


@pytest.mark.parametrize("broadcast", [True, False])
def test_flax_keywords_and_dropout_match_flax_on_rows_with_a_key(broadcast):
    _, nnx = _flax()
    q, k, v = _qkv()
    options = dict(mask=MASK, dropout_rng=jax.random.key(7), dropout_rate=0.3,
                   broadcast_dropout=broadcast, deterministic=False, dtype=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST, module=None)
    ours = jaxsafe.nn.dot_product_attention(q, k, v, **options)
    theirs = nnx.dot_product_attention(q, k, v, **options)
    assert_close(ours[ROWS], theirs[ROWS], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(ours[0, 1]) == 0.0)
    grads = jax.grad(lambda v: jnp.sum(jaxsafe.nn.dot_product_attention(q, k, v, **options)))(v)
    assert_finite(grads)
    with pytest.raises(ValueError, match="needs `dropout_rng`"):
        jaxsafe.nn.dot_product_attention(q, k, v, mask=MASK, dropout_rate=0.3)


def test_nnx_multi_head_attention_takes_it_as_attention_fn():
    _, nnx = _flax()
    x = jax.random.normal(jax.random.key(3), (B, T, N * H))

    def layer(fn):
        return nnx.MultiHeadAttention(num_heads=N, in_features=N * H, attention_fn=fn,
                                      decode=False, rngs=nnx.Rngs(0))
    ours, theirs = layer(jaxsafe.nn.dot_product_attention), layer(nnx.dot_product_attention)
    out = ours(x, mask=MASK, deterministic=True)
    assert_close(out[ROWS], theirs(x, mask=MASK, deterministic=True)[ROWS], rtol=1e-5, atol=1e-6)

    def loss(model, x):
        return jnp.sum(model(x, mask=MASK, deterministic=True)[ROWS] ** 2)
    grads = nnx.grad(loss)(ours, x)
    assert_finite(jax.tree.leaves(nnx.state(grads)))


def test_linen_multi_head_attention_takes_it_and_sows_the_weights():
    linen, _ = _flax()
    x = jax.random.normal(jax.random.key(4), (B, T, N * H))
    ours = linen.MultiHeadDotProductAttention(num_heads=N,
                                              attention_fn=jaxsafe.nn.dot_product_attention)
    theirs = linen.MultiHeadDotProductAttention(num_heads=N)
    params = theirs.init(jax.random.key(0), x, mask=MASK, deterministic=True)
    out, state = ours.apply(params, x, mask=MASK, deterministic=True, sow_weights=True,
                            mutable=["intermediates"])
    expected = theirs.apply(params, x, mask=MASK, deterministic=True)
    assert_close(out[ROWS], expected[ROWS], rtol=1e-5, atol=1e-6)
    weights = state["intermediates"]["attention_weights"][0]
    assert weights.shape == (B, N, T, T) and np.all(np.asarray(weights[0, :, 1]) == 0.0)


def test_linen_takes_the_float_mask_of_its_own_make_attention_mask():
    """`linen.make_attention_mask` is float32 by default: Linen's attention reads it as
    `where(mask, ...)`, and so does ours (it raised "mask dtype should be bool")."""
    linen, _ = _flax()
    x = jax.random.normal(jax.random.key(5), (B, T, N * H))
    tokens = jnp.asarray(ROWS)
    mask = linen.make_attention_mask(tokens, tokens)
    assert mask.dtype == jnp.float32
    ours = linen.MultiHeadDotProductAttention(num_heads=N,
                                              attention_fn=jaxsafe.nn.dot_product_attention)
    theirs = linen.MultiHeadDotProductAttention(num_heads=N)
    params = theirs.init(jax.random.key(0), x, mask=mask, deterministic=True)
    out = ours.apply(params, x, mask=mask, deterministic=True)
    expected = theirs.apply(params, x, mask=mask, deterministic=True)
    assert_close(out[ROWS], expected[ROWS], rtol=1e-5, atol=1e-6)


def test_batch_norm_state_is_carried_by_the_split_and_merge_pattern():
    """As under jax.jit, state updated inside nan_safe is not carried back; the documented
    pattern (docs/nn.md) returns it as an auxiliary output and matches plain JAX."""
    _, nnx = _flax()

    class Model(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(3, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(self.linear(x))

    def loss(model, x):
        h = model(x)
        return jnp.sum(jnp.where(h > 0, jnp.sqrt(h), 0.0))

    def loss_and_state(graphdef, state, x):
        model = nnx.merge(graphdef, state)
        return loss(model, x), nnx.state(model)

    x = jax.random.normal(jax.random.key(1), (4, 3))
    means = []
    for wrap in (lambda f: f, jaxsafe.nan_safe):
        model = Model()
        graphdef, state = nnx.split(model)
        (_, new_state), _ = jax.value_and_grad(wrap(loss_and_state), argnums=1,
                                               has_aux=True)(graphdef, state, x)
        nnx.update(model, new_state)
        means.append(model.norm.mean[...])
    assert np.any(np.asarray(means[0]) != 0.0)
    assert_close(means[1], means[0])
