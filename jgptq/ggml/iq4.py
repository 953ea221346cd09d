"""Non-linear 4-bit GGML formats: IQ4_NL (32-value blocks) and IQ4_XS (256-value super-blocks).

Each 4-bit code selects one of 16 fixed levels (``tables.KVALUES_IQ4NL``, from -127 to 113) times a scale.
IQ4_NL stores one fp16 scale per 32 values; IQ4_XS one fp16 super-scale per 256 and a 6-bit signed sub-scale per
32. The encoder is llama.cpp's ``quantize_iq4_nl`` / ``quantize_iq4_xs`` (what ``ggml_quantize_chunk`` runs, with
or without importance): per 32 values a least-squares scale over 15 trial grids, nearest levels by llama.cpp's
``best_index_int8`` (a tie between two levels goes to the upper one), then codes re-derived from the stored scale.

``x`` float32 (..., n) -> payload uint8 (..., n // block * type_size); decoders invert the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jgptq.ggml.common import (
    F32,
    GROUP_MAX_EPS,
    as_f32,
    blocks,
    div,
    f16_bits,
    first_absmax,
    mul,
    nearest_int,
    ordered_sum,
    pack_nibbles,
    read_f16,
    read_u16,
    sqrt,
    u16_le,
    unblock,
    unpack_nibbles,
)
from jgptq.ggml.registry import register
from jgptq.ggml.tables import KVALUES_IQ4NL

NTRY = 7  # llama.cpp's quantize_iq4_nl / quantize_iq4_xs search half-width


def _levels():
    return jnp.asarray(KVALUES_IQ4NL.astype(np.float32))


def nearest_level(v):
    """llama.cpp ``best_index_int8(16, kvalues_iq4nl, v)``: index of the nearest level, int32 (same shape as v).

    Values at or beyond the end levels map to 0 / 15; between two levels the lower wins only when it is strictly
    closer (``v - lower < upper - v`` in float32).
    """
    vals = _levels()
    v = jnp.asarray(v, F32)
    above = jnp.sum((vals <= v[..., None]).astype(jnp.int32), axis=-1)
    mu = jnp.where(v == v, jnp.clip(above, 1, 15), 15)  # C's bisection ends on the top pair for a NaN
    lower, upper = vals[mu - 1], vals[mu]
    idx = jnp.where(v - lower < upper - v, mu - 1, mu)
    idx = jnp.where(v <= vals[0], 0, idx)
    return jnp.where(v >= vals[15], 15, idx)


def _block_scale(xb, w):
    """Best float scale of each 32-value group (0 for groups with max |x| < 1e-15): float32 (...,)."""
    vals = _levels()
    amax, mx = first_absmax(xb)

    def sums(inv):
        q = vals[nearest_level(mul(inv[..., None], xb))]
        wq = mul(w, q)
        return ordered_sum(mul(wq, xb), 0.0), ordered_sum(mul(wq, q), 0.0)

    d0 = div(-mx, np.float32(KVALUES_IQ4NL[0]))
    sumqx, sumq2 = sums(div(np.float32(1), d0))
    d = jnp.where(sumq2 > 0, div(sumqx, sumq2), 0.0)
    best = mul(d, sumqx)
    tries = jnp.asarray(np.arange(-NTRY, NTRY + 1, dtype=np.float32) + np.float32(KVALUES_IQ4NL[0]))

    def body(k, carry):
        d, best = carry
        sumqx, sumq2 = sums(div(tries[k], mx))
        take = (sumq2 > 0) & (mul(sumqx, sumqx) > mul(best, sumq2))
        nd = div(sumqx, sumq2)
        return jnp.where(take, nd, d), jnp.where(take, mul(nd, sumqx), best)

    d, _ = lax.fori_loop(0, 2 * NTRY + 1, body, (d, best))
    return jnp.where(amax < GROUP_MAX_EPS, 0.0, d)


def _weights(xs, importance, sigma2):
    """Importance weights ``qw * sqrt(sigma2 + x*x)`` or, without importance, ``x*x``; (..., nb, k, 32)."""
    sq = mul(xs, xs)
    if importance is None:
        return sq
    qw = jnp.asarray(importance, F32).reshape(xs.shape[-3:])
    return mul(qw, sqrt(sigma2[..., None, None] + sq))


def _nibbles32(codes):
    """codes (..., 32k) -> uint8 (..., 16k): per 32 values, byte j = code j | code j+16 << 4."""
    c = codes.reshape(codes.shape[:-1] + (-1, 2, 16))
    return pack_nibbles(c[..., 0, :], c[..., 1, :]).reshape(codes.shape[:-1] + (-1,))


def encode_iq4_nl(x, importance=None):
    """IQ4_NL: fp16 d, 16 bytes of level indices; w = d * kvalues[q]."""
    xb = blocks(jnp.asarray(x, F32), 32)
    xs = xb[..., None, :]
    sigma2 = mul(ordered_sum(mul(xb, xb), 0.0), np.float32(2.0 / 32))
    d = _block_scale(xs, _weights(xs, importance, sigma2))[..., 0]
    inv = jnp.where(d != 0, div(np.float32(1), d), 0.0)
    codes = nearest_level(mul(inv[..., None], xb))
    return unblock(jnp.concatenate([u16_le(f16_bits(d)), _nibbles32(codes)], axis=-1))


def encode_iq4_xs(x, importance=None):
    """IQ4_XS: fp16 d, 16 bits of high sub-scale bits, 4 bytes of low sub-scale nibbles, 128 bytes of indices."""
    xb = blocks(jnp.asarray(x, F32), 256)
    xs = xb.reshape(xb.shape[:-1] + (8, 32))
    sigma2 = mul(ordered_sum(mul(xb, xb), 0.0), np.float32(2.0 / 256))
    scales = _block_scale(xs, _weights(xs, importance, sigma2))
    _, max_scale = first_absmax(scales)
    d = div(-max_scale, np.float32(32))
    inv = jnp.where(d != 0, div(np.float32(1), d), 0.0)
    ls = jnp.clip(nearest_int(mul(inv[..., None], scales)), -32, 31)
    dl = mul(d[..., None], as_f32(ls))
    idl = jnp.where(dl != 0, div(np.float32(1), dl), 0.0)
    codes = nearest_level(mul(idl[..., None], xs)).reshape(xb.shape)
    stored = ls + 32
    low = stored.reshape(stored.shape[:-1] + (4, 2))
    scales_l = pack_nibbles(low[..., 0] & 0xF, low[..., 1] & 0xF)
    scales_h = jnp.sum((stored >> 4) << (2 * jnp.arange(8)), axis=-1)
    parts = [u16_le(f16_bits(d)), u16_le(scales_h), scales_l, _nibbles32(codes)]
    return unblock(jnp.concatenate(parts, axis=-1))


def decode_iq4_nl(payload):
    """IQ4_NL payload uint8 (..., nb*18) -> float32 (..., nb*32)."""
    p = blocks(jnp.asarray(payload, jnp.uint8), 18)
    d = read_f16(p[..., 0:2])
    return unblock(mul(d[..., None], _levels()[unpack_nibbles(p[..., 2:18])]))


def decode_iq4_xs(payload):
    """IQ4_XS payload uint8 (..., nb*136) -> float32 (..., nb*256)."""
    p = blocks(jnp.asarray(payload, jnp.uint8), 136)
    d = read_f16(p[..., 0:2])
    sh = read_u16(p[..., 2:4]).astype(jnp.int32)
    sl = p[..., 4:8].astype(jnp.int32)
    ib = jnp.arange(8)
    ls = ((sl[..., ib // 2] >> (4 * (ib % 2))) & 0xF) | (((sh[..., None] >> (2 * ib)) & 3) << 4)
    dl = mul(d[..., None], as_f32(ls - 32))
    q = unpack_nibbles(p[..., 8:136].reshape(p.shape[:-1] + (8, 16)))
    return unblock(mul(dl[..., None], _levels()[q]).reshape(p.shape[:-1] + (256,)))


register("iq4_nl", decode=jax.jit(decode_iq4_nl), encode=jax.jit(encode_iq4_nl))
register("iq4_xs", decode=jax.jit(decode_iq4_xs), encode=jax.jit(encode_iq4_xs))
