"""Padded sequences: a query row with no key to attend to, before and after `jaxsafe.nn`.

Run with `.venv/bin/python examples/masked_attention.py` (after `make demo` built the venv).

Left-padded batches under a causal mask leave the padding queries with no valid key. Their rows
are dropped from the loss, yet with `-inf` masking their softmax is NaN and so is the gradient.
`jaxsafe.nn.dot_product_attention` gives such rows 0, with zero gradient; `jaxsafe.nan_safe`
fixes the same attention written by hand.
"""

import jax
import jax.numpy as jnp

import jaxsafe
import jaxsafe.nn

B, T, N, H = 2, 6, 2, 8
PAD = jnp.array([2, 0])  # sequence 0 starts with 2 padding positions


def inputs():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (B, T, N, H)) for key in (kq, kk, kv))
    valid = jnp.arange(T)[None, :] >= PAD[:, None]                      # (B, T)
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = causal[None, None] & valid[:, None, None, :]                  # (B, 1, T, S)
    return q, k, v, valid, mask


def hand_written_attention(q, k, v, mask):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(H)
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)            # NaN on empty rows
    return jnp.einsum("bnts,bsnh->btnh", p, v)


def loss(attention, valid):
    def value(q, k, v, mask):
        out = attention(q, k, v, mask)
        return jnp.sum(jnp.where(valid[:, :, None, None], out, 0.) ** 2)  # padding dropped
    return value


def main() -> None:
    q, k, v, valid, mask = inputs()
    ours = lambda q, k, v, mask: jaxsafe.nn.dot_product_attention(q, k, v, mask=mask)
    theirs = lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, mask=mask)

    print("output of the first padding query (sequence 0, position 0, head 0):")
    print("  jax.nn     ", theirs(q, k, v, mask)[0, 0, 0, :4], "<- attends to keys it may not see")
    print("  jaxsafe.nn ", ours(q, k, v, mask)[0, 0, 0, :4])

    def grad(value):  # with respect to q, k and v
        return jax.grad(value, argnums=(0, 1, 2))(q, k, v, mask)
    # nan_safe wraps the function that drops the rows (the loss), not the attention alone: its
    # analysis sees the drops inside the program it is given
    grads = {"hand-written, -inf mask": grad(loss(hand_written_attention, valid)),
             "nan_safe(hand-written)": grad(jaxsafe.nan_safe(loss(hand_written_attention, valid))),
             "jaxsafe.nn": grad(loss(ours, valid))}
    print("\ngradient of the loss with respect to q, k, v: any NaN?")
    for name, g in grads.items():
        print(f"  {name:24s} {[bool(jnp.isnan(x).any()) for x in g]}")
    same = all(jnp.allclose(a, b, rtol=1e-5, atol=1e-6)
               for a, b in zip(grads["nan_safe(hand-written)"], grads["jaxsafe.nn"],
                               strict=True))
    print("\nnan_safe(hand-written) and jaxsafe.nn give the same gradient:", bool(same))


if __name__ == "__main__":
    main()
