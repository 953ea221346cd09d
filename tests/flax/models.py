"""Tiny Flax models for the JAX-native pipeline tests (dense and MoE NNX language models, a Linen MLP LM).

Every weight matrix is 64 x 64 (experts: 4 x 64 x 64) so that the solver compiles once per configuration. The
embeddings and norm scales are anisotropic (correlated features of unequal scale), as real activations are, so
that GPTQ has input correlations to exploit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

VOCAB, DIM, HEADS, EXPERTS, TOP_K = 96, 64, 4, 4, 2


def anisotropic(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    mix = rng.standard_normal((cols, cols)) / np.sqrt(cols) + np.eye(cols)
    scale = np.exp(rng.uniform(-1.0, 1.0, cols))
    return ((rng.standard_normal((rows, cols)) @ mix) * scale).astype(np.float32)


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.q, self.k, self.v, self.o = (nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs) for _ in range(4))

    def __call__(self, x):  # (B, S, D)
        b, s, _ = x.shape
        split = lambda t: t.reshape(b, s, HEADS, DIM // HEADS)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(DIM // HEADS)
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
        y = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(att, axis=-1), v)
        return self.o(y.reshape(b, s, DIM))


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(DIM, DIM, rngs=rngs)
        self.down = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class MoE(nnx.Module):
    """Top-2 of 4 experts; token copies sorted by expert and run through ``jax.lax.ragged_dot``."""

    def __init__(self, rngs: nnx.Rngs):
        self.router = nnx.Linear(DIM, EXPERTS, use_bias=False, rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
        self.up = nnx.Param(init(rngs.params(), (EXPERTS, DIM, DIM)))
        self.down = nnx.Param(init(rngs.params(), (EXPERTS, DIM, DIM)))

    def route(self, x2d):
        """(rows (T*k, D) grouped by expert, group sizes (E,), order (T*k,), gate weights (T, k))."""
        top, expert = jax.lax.top_k(self.router(x2d), TOP_K)
        order = jnp.argsort(expert.reshape(-1), stable=True)
        sizes = jnp.bincount(expert.reshape(-1), length=EXPERTS).astype(jnp.int32)
        return x2d[order // TOP_K], sizes, order, jax.nn.softmax(top, axis=-1)

    def __call__(self, x):  # (B, S, D)
        x2d = x.reshape(-1, DIM)
        rows, sizes, order, gates = self.route(x2d)
        h = jax.nn.silu(jax.lax.ragged_dot(rows, self.up[...], sizes))
        y = jax.lax.ragged_dot(h, self.down[...], sizes)
        y = jnp.zeros_like(y).at[order].set(y).reshape(x2d.shape[0], TOP_K, DIM)
        return jnp.einsum("tkd,tk->td", y, gates).reshape(x.shape)


class Block(nnx.Module):
    def __init__(self, moe: bool, rngs: nnx.Rngs, rng: np.random.Generator):
        self.norm1 = nnx.RMSNorm(DIM, rngs=rngs)
        self.norm2 = nnx.RMSNorm(DIM, rngs=rngs)
        for norm in (self.norm1, self.norm2):
            norm.scale[...] = jnp.asarray(np.exp(rng.uniform(-1.0, 1.0, DIM)), jnp.float32)
        self.attn = Attention(rngs)
        self.ffn = MoE(rngs) if moe else Mlp(rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyLM(nnx.Module):
    def __init__(self, moe: bool = False, layers: int = 2, seed: int = 0):
        rngs, rng = nnx.Rngs(seed), np.random.default_rng(seed)
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.embed.embedding[...] = jnp.asarray(anisotropic(rng, VOCAB, DIM) / 2)
        self.blocks = nnx.List([Block(moe, rngs, rng) for _ in range(layers)])
        self.lm_head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


class LinenLM(linen.Module):
    """Embedding, two residual MLP blocks and a head, in Linen."""

    @linen.compact
    def __call__(self, ids):
        x = linen.Embed(VOCAB, DIM, name="embed")(ids)
        for i in range(2):
            h = linen.RMSNorm(name=f"norm{i}")(x)
            x = x + linen.Dense(DIM, name=f"down{i}")(jax.nn.gelu(linen.Dense(DIM, name=f"up{i}")(h)))
        return linen.Dense(VOCAB, use_bias=False, name="lm_head")(x)


def token_batches(seed: int, count: int, batch: int = 4, seq: int = 32) -> list:
    """Token id batches from a fixed Zipf-like distribution (int32 (batch, seq))."""
    rng = np.random.default_rng(seed)
    p = 1.0 / (np.arange(VOCAB) + 4.0)
    return [jnp.asarray(rng.choice(VOCAB, size=(batch, seq), p=p / p.sum()), jnp.int32) for _ in range(count)]


def mean_kl(logits_ref, logits) -> float:
    """Mean over tokens of KL(softmax(ref) || softmax(logits)), in float64."""
    a = np.asarray(logits_ref, np.float64)
    b = np.asarray(logits, np.float64)
    la = a - np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True)) - a.max(-1, keepdims=True)
    lb = b - np.log(np.exp(b - b.max(-1, keepdims=True)).sum(-1, keepdims=True)) - b.max(-1, keepdims=True)
    return float((np.exp(la) * (la - lb)).sum(-1).mean())
