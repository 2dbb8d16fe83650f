"""The benchmark workloads, each with its hand-fixed twin.

Every workload has three variants, all run under `jax.jit`:

- `nan_safe`: `jaxsafe.nan_safe(f)`, the program as a user writes it, fixed automatically;
- `hand`: the same program with the double where written by hand (the reference);
- `unguarded`: `f` itself (the floor; its gradient has NaN in it).

`f` and its twin differ only in the hand-written safe inputs. Modes: `forward` (the function's
value) and `forward+backward` (value and gradient of the sum of its outputs, `jax.value_and_grad`).
The transformer step is a full training step (loss, gradient, optax update).

`make(workload, variant, mode)` builds a fresh jitted function on every call (new function
objects, so nothing is reused from JAX's tracing or compilation caches): the benchmark lowers and
compiles it explicitly to time compilation too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxsafe

VARIANTS = ("nan_safe", "hand", "unguarded", "finite_args")
"""nan_safe(f) (arguments possibly non-finite, the default), the hand fix, f itself, and
nan_safe(f, finite_args=True) (arguments promised finite)."""
FORWARD, BACKWARD = "forward", "forward+backward"


@dataclasses.dataclass
class Workload:
    name: str
    shapes: str
    f: Callable                      # the natural program (unguarded)
    hand: Callable                   # the hand-written double where
    args: tuple
    argnums: Sequence[int] = (0,)    # differentiated arguments
    modes: Sequence[str] = (FORWARD, BACKWARD)
    step: Callable | None = None     # step(loss_fn) -> (fn, args): custom program (training step)

    def function(self, variant: str) -> Callable:
        if variant == "hand":
            return self.hand
        if variant == "nan_safe":
            return jaxsafe.nan_safe(self.f)   # a fresh wrapper: nothing cached
        if variant == "finite_args":
            return jaxsafe.nan_safe(self.f, finite_args=True)
        return self.f


def make(w: Workload, variant: str, mode: str) -> tuple[Callable, tuple]:
    """A fresh `jax.jit` function for this variant and mode, and its arguments."""
    f = w.function(variant)
    if w.step is not None:
        return w.step(f)
    if mode == FORWARD:
        def run(*args):
            return f(*args)
    else:
        argnums = tuple(w.argnums)

        def run(*args):
            return jax.value_and_grad(lambda *a: jnp.sum(f(*a)), argnums)(*args)
    return jax.jit(run), w.args


def check_outputs(w: Workload, variant: str, timed_outputs: Any) -> Any:
    """What `check` compares for this variant: the timed program's outputs, except for a
    training step, whose loss and gradients are compared instead. An optimizer's first step
    (adam: about `lr * sign(g)`) turns a rounding difference in a gradient near 0 into a whole
    step: on a GPU, whose float32 matmuls round to TF32 by default, the hand fix's parameters
    and nan_safe's came out 2e-2 apart while their gradients were 7e-4 apart (7e-7 with
    `jax_default_matmul_precision='highest'`)."""
    if w.step is None:
        return timed_outputs
    f = w.function(variant)
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a)), tuple(w.argnums)))(*w.args)


# --------------------------------------------------------------------------- 1. piecewise

def piecewise(x):
    """sqrt above 1, log on (0, 1], a power below 0: each branch is NaN or singular elsewhere."""
    return jnp.where(x > 1., jnp.sqrt(x - 1.),
                     jnp.where(x > 0., jnp.log(x), -(-x) ** 1.5))


def piecewise_hand(x):
    x_sqrt = jnp.where(x > 1., x - 1., 1.)
    x_log = jnp.where(x > 0., x, 1.)
    x_pow = jnp.where(x > 0., 1., -x)
    return jnp.where(x > 1., jnp.sqrt(x_sqrt),
                     jnp.where(x > 0., jnp.log(x_log), -x_pow ** 1.5))


def _piecewise(quick: bool) -> Workload:
    n = (1 << 22) // (32 if quick else 1)   # 4M float32 (128k quick)
    x = jax.random.uniform(jax.random.key(1), (n,), jnp.float32, -2., 3.)
    x = x.at[::97].set(0.).at[1::97].set(1.)   # the branch points themselves
    return Workload("piecewise sqrt/log/pow", f"x: f32[{n}]", piecewise, piecewise_hand, (x,))


# --------------------------------------------------------------------------- 2. Lennard-Jones

SIGMA, EPSILON, CUTOFF = 1.0, 1.0, 2.5


def lennard_jones(pos):
    """Pair energy within the cutoff; the diagonal (r = 0) and far pairs are dropped."""
    n = pos.shape[0]
    d = pos[:, None, :] - pos[None, :, :]
    r2 = jnp.sum(d * d, axis=-1)
    pair = (r2 < CUTOFF ** 2) & ~jnp.eye(n, dtype=bool)
    r = jnp.sqrt(r2)
    sr6 = (SIGMA / r) ** 6
    e = 4. * EPSILON * (sr6 * sr6 - sr6)
    return 0.5 * jnp.sum(jnp.where(pair, e, 0.))


def lennard_jones_hand(pos):
    n = pos.shape[0]
    d = pos[:, None, :] - pos[None, :, :]
    r2 = jnp.sum(d * d, axis=-1)
    pair = (r2 < CUTOFF ** 2) & ~jnp.eye(n, dtype=bool)
    r = jnp.sqrt(jnp.where(pair, r2, 1.))
    sr6 = (SIGMA / r) ** 6
    e = 4. * EPSILON * (sr6 * sr6 - sr6)
    return 0.5 * jnp.sum(jnp.where(pair, e, 0.))


def _lennard_jones(quick: bool) -> Workload:
    n = 256 if quick else 2048
    side = math.ceil(n ** (1 / 3))
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    jitter = np.random.default_rng(2).uniform(-0.1, 0.1, grid.shape)
    pos = jnp.asarray(1.12 * grid + jitter, jnp.float32)   # a jittered lattice, no overlaps
    return Workload("Lennard-Jones, cutoff", f"N={n} (pairs {n}x{n})",
                    lennard_jones, lennard_jones_hand, (pos,))


# --------------------------------------------------------------------------- 3. attention

def attention(q, k, v, mask):
    """Masked attention; query rows with no valid key (padding) are NaN and dropped after."""
    scale = 1. / math.sqrt(q.shape[-1])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = jnp.where(mask[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    valid = jnp.any(mask, axis=-1)
    return jnp.where(valid[:, :, None, None], o, 0.)


def attention_hand(q, k, v, mask):
    scale = 1. / math.sqrt(q.shape[-1])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = jnp.where(mask[:, None], s, -jnp.inf)
    valid = jnp.any(mask, axis=-1)
    s = jnp.where(valid[:, None, :, None], s, 0.)   # the second where: no all -inf rows
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return jnp.where(valid[:, :, None, None], o, 0.)


def padding_causal_mask(key, batch: int, seq: int) -> jax.Array:
    """Causal mask of right-padded sequences: padded query rows have no valid key."""
    lengths = jax.random.randint(key, (batch,), seq // 2, seq + 1)
    pos = jnp.arange(seq)
    valid = pos[None, :] < lengths[:, None]
    causal = pos[:, None] >= pos[None, :]
    return causal[None] & valid[:, :, None] & valid[:, None, :]


def _attention(quick: bool) -> Workload:
    b, t, h, d = (2, 128, 4, 32) if quick else (8, 512, 8, 64)
    kq, kk, kv, km = jax.random.split(jax.random.key(3), 4)
    q, k, v = (jax.random.normal(kk_, (b, t, h, d), jnp.float32) for kk_ in (kq, kk, kv))
    mask = padding_causal_mask(km, b, t)
    return Workload("masked attention", f"B={b} T={t} H={h} D={d}", attention, attention_hand,
                    (q, k, v, mask), argnums=(0, 1, 2))


# --------------------------------------------------------------------------- 4. Gaussian NLL

LOG_2PI = math.log(2 * math.pi)


def gaussian_nll(mu, log_sigma, y):
    """Negative log-likelihood; missing targets (NaN) are masked out with where."""
    z = (y - mu) / jnp.exp(log_sigma)
    nll = 0.5 * z * z + log_sigma + 0.5 * LOG_2PI
    return jnp.where(jnp.isnan(y), 0., nll)


def gaussian_nll_hand(mu, log_sigma, y):
    missing = jnp.isnan(y)
    y = jnp.where(missing, 0., y)
    z = (y - mu) / jnp.exp(log_sigma)
    nll = 0.5 * z * z + log_sigma + 0.5 * LOG_2PI
    return jnp.where(missing, 0., nll)


def _gaussian(quick: bool) -> Workload:
    n = (1 << 20) // (16 if quick else 1)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(4), 4)
    mu = jax.random.normal(k1, (n,), jnp.float32)
    log_sigma = 0.1 * jax.random.normal(k2, (n,), jnp.float32)
    y = mu + jax.random.normal(k3, (n,), jnp.float32)
    y = jnp.where(jax.random.uniform(k4, (n,)) < 0.2, jnp.nan, y)   # 20% missing
    return Workload("Gaussian NLL, NaN targets", f"{n} points, 20% missing",
                    gaussian_nll, gaussian_nll_hand, (mu, log_sigma, y), argnums=(0, 1))


# --------------------------------------------------------------------------- 5. transformer LM

@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int
    d_model: int
    heads: int
    layers: int
    seq: int
    batch: int


def _layer_norm(x, g, b):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def lm_init(cfg: LMConfig, key) -> dict:
    d = cfg.d_model
    keys = iter(jax.random.split(key, 4 + 6 * cfg.layers))

    def dense(shape):
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[0])
    params = {"embed": jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32) * 0.02,
              "pos": jax.random.normal(next(keys), (cfg.seq, d), jnp.float32) * 0.02,
              "ln_g": jnp.ones((d,)), "ln_b": jnp.zeros((d,)),
              "unembed": dense((d, cfg.vocab)), "layers": []}
    for _ in range(cfg.layers):
        params["layers"].append({
            "ln1_g": jnp.ones((d,)), "ln1_b": jnp.zeros((d,)),
            "ln2_g": jnp.ones((d,)), "ln2_b": jnp.zeros((d,)),
            "qkv": dense((d, 3 * d)), "out": dense((d, d)),
            "up": dense((d, 4 * d)), "down": dense((4 * d, d))})
    return params


def lm_loss(params, tokens, heads: int, hand: bool = False):
    """Next-token cross-entropy of a pre-LN transformer on left-padded sequences (token 0).

    The query rows of padding positions have no valid key (causal mask and key padding), so their
    softmax is NaN; the attention drops them right after (`where(valid, o, 0.)`), and the loss
    ignores padded targets. `hand=True` adds the double where in the attention.
    """
    b, t = tokens.shape
    valid = tokens != 0
    h = params["embed"][tokens] + params["pos"][None, :t]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    mask = causal[None, None] & valid[:, None, None, :]           # (b, 1, q, k)
    row_valid = jnp.any(mask, axis=-1, keepdims=True)              # (b, 1, q, 1)
    for layer in params["layers"]:
        x = _layer_norm(h, layer["ln1_g"], layer["ln1_b"])
        q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
        d = q.shape[-1]
        q, k, v = (a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)
                   for a in (q, k, v))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // heads)
        s = jnp.where(mask, s, -jnp.inf)
        if hand:
            s = jnp.where(row_valid, s, 0.)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.where(row_valid, p @ v, 0.)
        o = o.transpose(0, 2, 1, 3).reshape(b, t, d)
        h = h + o @ layer["out"]
        x = _layer_norm(h, layer["ln2_g"], layer["ln2_b"])
        h = h + jax.nn.gelu(x @ layer["up"]) @ layer["down"]
    logits = _layer_norm(h, params["ln_g"], params["ln_b"]) @ params["unembed"]
    logits, targets, keep = logits[:, :-1], tokens[:, 1:], valid[:, 1:]
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(keep, logz - picked, 0.)) / jnp.maximum(jnp.sum(keep), 1)


def _transformer(quick: bool) -> Workload:
    import optax
    cfg = (LMConfig(vocab=256, d_model=64, heads=1, layers=1, seq=64, batch=4) if quick else
           LMConfig(vocab=1024, d_model=256, heads=4, layers=2, seq=256, batch=16))
    kp, kt, kl = jax.random.split(jax.random.key(5), 3)
    params = lm_init(cfg, kp)
    tokens = jax.random.randint(kt, (cfg.batch, cfg.seq), 1, cfg.vocab)
    pad = jax.random.randint(kl, (cfg.batch, 1), 0, cfg.seq // 4)    # left padding
    tokens = jnp.where(jnp.arange(cfg.seq)[None] < pad, 0, tokens)
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)

    def step(loss_fn):
        def train_step(params, opt_state, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return jax.jit(train_step), (params, opt_state, tokens)

    shapes = (f"L={cfg.layers} d={cfg.d_model} heads={cfg.heads} T={cfg.seq} B={cfg.batch} "
              f"V={cfg.vocab}")
    return Workload("transformer LM train step (adamw)", shapes,
                    functools.partial(lm_loss, heads=cfg.heads),
                    functools.partial(lm_loss, heads=cfg.heads, hand=True),
                    (params, tokens), modes=(BACKWARD,), step=step)


# --------------------------------------------------------------------------- 6. physics scan

GRAVITY, STIFFNESS, DAMPING, DT = 9.81, 1e4, 0.5, 1e-3


def _bounce(contact_force: Callable, steps: int):
    def simulate(x0, v0):
        def body(carry, _):
            x, v = carry
            pen = -x[:, 1]                          # depth below the ground y = 0
            f = contact_force(pen)
            a = jnp.stack([jnp.zeros_like(f), f - GRAVITY], -1) - DAMPING * v
            v = v + DT * a
            return (x + DT * v, v), None
        (x, v), _ = jax.lax.scan(body, (x0, v0), None, length=steps)
        return x[:, 1] + 0.5 * jnp.sum(v * v, -1)
    return simulate


def hertz(pen):
    """Hertzian contact force k * pen^1.5, only in contact (pen > 0): NaN outside."""
    return jnp.where(pen > 0., STIFFNESS * pen ** 1.5, 0.)


def hertz_hand(pen):
    return jnp.where(pen > 0., STIFFNESS * jnp.where(pen > 0., pen, 1.) ** 1.5, 0.)


def _physics(quick: bool) -> Workload:
    n, steps = (512, 100) if quick else (4096, 1000)
    k1, k2 = jax.random.split(jax.random.key(6))
    x0 = jnp.stack([jnp.zeros(n), jax.random.uniform(k1, (n,), jnp.float32, 0.1, 1.)], -1)
    v0 = jax.random.normal(k2, (n, 2), jnp.float32)
    return Workload("scan: bouncing particles", f"{steps} steps, {n} particles",
                    _bounce(hertz, steps), _bounce(hertz_hand, steps), (x0, v0), argnums=(0, 1))


# --------------------------------------------------------------------------- 7. max-pool CNN

def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _pool(h):
    return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def pool_cnn(w1, w2, x):
    """Two conv layers with a square-root activation, each followed by 2x2 max pooling: the
    lanes that pooling drops, and those the clamp at 0 drops, are sqrt's singular lanes (a
    plain `jnp.maximum`, not `jax.nn.relu`, whose custom derivative selects)."""
    h = _pool(jnp.sqrt(jnp.maximum(_conv(x, w1), 0.)))
    h = _pool(jnp.sqrt(jnp.maximum(_conv(h, w2), 0.)))
    return jnp.mean(h, axis=(1, 2, 3))


def pool_cnn_hand(w1, w2, x):
    def act(h):
        pos = h > 0
        return jnp.where(pos, jnp.sqrt(jnp.where(pos, h, 1.)), 0.)
    h = _pool(act(_conv(x, w1)))
    h = _pool(act(_conv(h, w2)))
    return jnp.mean(h, axis=(1, 2, 3))


def _pool_cnn(quick: bool) -> Workload:
    b, s, c = (8, 32, 16) if quick else (32, 64, 32)
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    w1 = jax.random.normal(k1, (3, 3, 3, c), jnp.float32) / 4.
    w2 = jax.random.normal(k2, (3, 3, c, c), jnp.float32) / (3. * math.sqrt(c))
    x = jax.random.normal(k3, (b, s, s, 3), jnp.float32)
    return Workload("max-pool CNN, sqrt activation", f"B={b} {s}x{s}x3 -> {c}x2 channels",
                    pool_cnn, pool_cnn_hand, (w1, w2, x), argnums=(0, 1))


# --------------------------------------------------------------------------- 8. top-k MoE routing

MOE_K = 2


def moe_routing(w_router, x):
    """Top-k routing on log-probabilities: a sharp router underflows some probabilities to 0,
    whose log is -inf (derivative inf); top_k drops those experts."""
    logp = jnp.log(jax.nn.softmax(x @ w_router, axis=-1))
    top, _ = jax.lax.top_k(logp, MOE_K)
    return -jnp.mean(jax.nn.logsumexp(top, axis=-1))


def moe_routing_hand(w_router, x):
    p = jax.nn.softmax(x @ w_router, axis=-1)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(p), MOE_K)
    chosen = jnp.any(jnp.arange(p.shape[-1]) == idx[..., None], axis=-2)
    logp = jnp.log(jnp.where(chosen, p, 1.))
    top, _ = jax.lax.top_k(jnp.where(chosen, logp, -jnp.inf), MOE_K)
    return -jnp.mean(jax.nn.logsumexp(top, axis=-1))


def _moe(quick: bool) -> Workload:
    n, d, e = (4096, 64, 16) if quick else (65536, 128, 64)
    k1, k2 = jax.random.split(jax.random.key(8))
    w = 40. * jax.random.normal(k1, (d, e), jnp.float32) / math.sqrt(d)   # a sharp router
    x = jax.random.normal(k2, (n, d), jnp.float32)
    return Workload("top-k MoE routing", f"{n} tokens, d={d}, {e} experts, k={MOE_K}",
                    moe_routing, moe_routing_hand, (w, x))


# --------------------------------------------------------------------------- 9. unrolled Euler

EULER_STEPS, EULER_DT, EULER_DIFFUSION = 40, 0.05, 0.1


def _draining_tanks(outflow: Callable):
    """An explicit Euler integrator unrolled in Python (40 steps) over a grid of tanks: each
    drains at k * sqrt(h) while h > 0 (a `where` clamp per step) and exchanges with its four
    neighbours. The program is long and flat: its first call (trace, rewrite, compile) is what
    users wait for."""
    def simulate(h0, k):
        h = h0
        for _ in range(EULER_STEPS):
            exchange = (jnp.roll(h, 1, 0) + jnp.roll(h, -1, 0) + jnp.roll(h, 1, 1)
                        + jnp.roll(h, -1, 1) - 4 * h)
            h = h + EULER_DT * (outflow(h, k) + EULER_DIFFUSION * exchange)
        return h
    return simulate


def drain(h, k):
    return jnp.where(h > 0, -k * jnp.sqrt(h), 0.0)


def drain_hand(h, k):
    return jnp.where(h > 0, -k * jnp.sqrt(jnp.where(h > 0, h, 1.0)), 0.0)


def _euler(quick: bool) -> Workload:
    n = 32 if quick else 128
    h0 = jax.random.uniform(jax.random.key(9), (n, n), jnp.float32, 0.0, 2.0)
    k = jnp.float32(1.5)  # one outflow coefficient (per-tank rates would each be guarded)
    return Workload("unrolled Euler (40 steps)", f"{n}x{n} tanks",
                    _draining_tanks(drain), _draining_tanks(drain_hand), (h0, k),
                    argnums=(0, 1))


# --------------------------------------------------------------------------- 11. scan over layers

def _layer_stack(clean_rows: bool):
    """A pre-norm residual MLP scanned over its layers (`lax.scan`, as Flax's `nn.scan` and
    Equinox stack them), on a batch whose padded rows hold NaN; the loss drops them after the
    model. The hand fix cleans the padded rows before the scan."""
    def loss(params, x, live):
        if clean_rows:
            x = jnp.where(live[:, None], x, 0.)

        def layer(h, wb):
            w, b = wb
            mu = h.mean(-1, keepdims=True)
            z = (h - mu) / jnp.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
            return h + jnp.tanh(z @ w + b[None, :]), None
        h, _ = jax.lax.scan(layer, x, params)
        return jnp.sum(jnp.where(live[:, None], h, 0.) ** 2)
    return loss


def _scan_layers(quick: bool) -> Workload:
    n, d, layers = (256, 64, 4) if quick else (4096, 256, 12)
    k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
    params = (jax.random.normal(k1, (layers, d, d), jnp.float32) / math.sqrt(d),
              0.1 * jax.random.normal(k2, (layers, d), jnp.float32))
    live = jnp.arange(n) % 4 != 3                      # a quarter of the rows is padding
    x = jnp.where(live[:, None], jax.random.normal(k3, (n, d), jnp.float32), jnp.nan)
    return Workload("scan over layers, padded rows", f"{n} rows, d={d}, {layers} layers",
                    _layer_stack(False), _layer_stack(True), (params, x, live))


def _lstm_over_time(clean_rows: bool):
    """An LSTM over time (fused gates split from one matmul) on a batch whose padded rows hold
    NaN at every step; the loss drops them after the scan. The hand fix cleans the padded rows
    before it."""
    def loss(params, xs, live):
        wx, wh, b = params
        if clean_rows:
            xs = jnp.where(live[None, :, None], xs, 0.)

        def cell(carry, x):
            c, h = carry
            i, f, g, o = jnp.split(x @ wx + h @ wh + b[None, :], 4, axis=-1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            return (c, jax.nn.sigmoid(o) * jnp.tanh(c)), None

        zeros = jnp.zeros((xs.shape[1], wh.shape[0]), xs.dtype)
        (_, h), _ = jax.lax.scan(cell, (zeros, zeros), xs)
        return jnp.sum(jnp.where(live[:, None], h, 0.) ** 2)
    return loss


def _lstm(quick: bool) -> Workload:
    t, n, d, hidden = (8, 64, 16, 32) if quick else (32, 1024, 128, 256)
    k1, k2, k3 = jax.random.split(jax.random.key(12), 3)
    params = (jax.random.normal(k1, (d, 4 * hidden), jnp.float32) / math.sqrt(d),
              jax.random.normal(k2, (hidden, 4 * hidden), jnp.float32) / math.sqrt(hidden),
              jnp.zeros(4 * hidden, jnp.float32))
    live = jnp.arange(n) % 4 != 3                      # a quarter of the rows is padding
    xs = jnp.where(live[None, :, None], jax.random.normal(k3, (t, n, d), jnp.float32), jnp.nan)
    return Workload("LSTM over time, padded rows", f"T={t} B={n} d={d} hidden={hidden}",
                    _lstm_over_time(False), _lstm_over_time(True), (params, xs, live))


def _features_before_the_scan(by_hand: bool):
    """A padded batch of sequences: every step's features' log is taken at once, before the
    scan, and each row's steps past its length are dropped in the body (`_sinking.py` moves
    the log into the body). The hand fix takes the log in the body, on a double where."""
    def loss(w, xs, lengths):
        def step(h, inputs):
            t, x = inputs
            live = (t < lengths)[:, None]
            feature = jnp.log(jnp.where(live, x, 1.)) if by_hand else x
            return jnp.where(live, jnp.tanh(h @ w + feature), h), None

        steps = jnp.arange(xs.shape[0])
        h0 = jnp.zeros(xs.shape[1:], xs.dtype)
        h, _ = jax.lax.scan(step, h0, (steps, xs if by_hand else jnp.log(xs)))
        return jnp.sum(h ** 2)
    return loss


def _padded_sequences(quick: bool) -> Workload:
    t, n, d = (8, 32, 16) if quick else (64, 512, 128)
    k1, k2, k3 = jax.random.split(jax.random.key(13), 3)
    w = jax.random.normal(k1, (d, d), jnp.float32) / math.sqrt(d)
    lengths = jax.random.randint(k2, (n,), 1, t + 1)
    steps = jnp.arange(t)[:, None, None]
    xs = jnp.where(steps < lengths[None, :, None],                    # padding: zeros
                   jax.random.uniform(k3, (t, n, d), jnp.float32, 0.5, 2.), 0.)
    return Workload("features before the scan, padded steps", f"T={t} B={n} d={d}",
                    _features_before_the_scan(False), _features_before_the_scan(True),
                    (w, xs, lengths), argnums=(0, 1))


# --------------------------------------------------------------------------- 10. jax-md pairs

def _jax_md(quick: bool) -> Workload | None:
    """jax-md's soft-sphere pair energy (its own `safe_mask` double wheres, a `nan_to_num`):
    code already guarded by hand, where jaxsafe should cost nothing."""
    try:
        from jax_md import energy, space
    except ImportError:  # pragma: no cover - the bench extras install it
        return None
    n = 64 if quick else 512
    displacement, _ = space.free()
    f = energy.soft_sphere_pair(displacement)
    pos = jax.random.uniform(jax.random.key(10), (n, 3), jnp.float32, 0.0, n ** (1 / 3))
    return Workload("jax-md soft-sphere energy", f"{n} particles", f, f, (pos,))


BUILDERS = (_piecewise, _lennard_jones, _attention, _gaussian, _transformer, _physics,
            _pool_cnn, _moe, _euler, _jax_md, _scan_layers, _lstm, _padded_sequences)


def workloads(quick: bool) -> list[Workload]:
    return [w for w in (build(quick) for build in BUILDERS) if w is not None]


# --------------------------------------------------------------------------- checks

def _leaves(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]


def check(outputs: dict[str, Any]) -> dict:
    """nan_safe against the hand fix: same result up to rounding, and NaN-free where the hand fix
    is; and whether the unguarded program's result has NaN (the bug being fixed)."""
    ns, hand, raw = (_leaves(outputs[v]) for v in ("nan_safe", "hand", "unguarded"))
    finite_ns = all(np.isfinite(a).all() for a in ns)
    finite_hand = all(np.isfinite(a).all() for a in hand)
    err = 0.
    for a, b in zip(ns, hand, strict=True):
        scale = max(float(np.max(np.abs(b), initial=0.)), 1e-30)
        err = max(err, float(np.max(np.abs(a - b), initial=0.)) / scale)
    return {"agree": bool(finite_ns == finite_hand and err < 1e-3), "max_rel_err": err,
            "nan_safe_finite": finite_ns, "hand_finite": finite_hand,
            "unguarded_has_nan": not all(np.isfinite(a).all() for a in raw)}
