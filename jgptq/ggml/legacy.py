"""Legacy GGML formats (32-value blocks): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Encoders reproduce llama.cpp's ``ggml_quantize_chunk`` byte for byte:

- without importance, the reference rounding of each format (``quantize_row_*_ref``): a scale from the block's
  extreme value, codes by truncation (Q4/Q5) or ``roundf`` (Q8_0);
- with per-column importance ``qw`` (n,), the weighted search: Q4_0/Q5_0 a symmetric scale search, Q4_1/Q5_1 an
  affine (scale, min) search, with weights ``qw * sqrt(sigma2 + x**2)`` where ``sigma2`` is the mean of ``x**2``
  over the **whole row**. Q8_0 ignores importance, as llama.cpp does.

``x`` float32 (..., n), n % 32 == 0 -> payload uint8 (..., n // 32 * type_size); decoders invert the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jgptq.ggml.common import (
    F32,
    as_f32,
    blocks,
    div,
    f16_bits,
    first_absmax,
    mul,
    pack_nibbles,
    read_f16,
    read_u32,
    roundf,
    scan_min_max,
    sqrt,
    trunc_int,
    u16_le,
    u32_le,
    unblock,
    unpack_nibbles,
    where,
)
from jgptq.ggml.registry import register
from jgptq.ggml.scale_search import affine_search, symmetric_search

QK = 32


# ----------------------------------------------------------------------------------------------- helpers

def row_mean_square(x):
    """Mean of ``x**2`` over each whole row, summed left to right as llama.cpp does: float32 (...,)."""
    xb = blocks(x, QK)
    sq = mul(xb, xb)

    def body(b, acc):
        t = lax.dynamic_index_in_dim(sq, b, axis=-2, keepdims=False)
        for i in range(QK):
            acc = acc + t[..., i]
        return acc

    total = lax.fori_loop(0, xb.shape[-2], body, jnp.zeros(x.shape[:-1], F32))
    return div(total, np.float32(x.shape[-1]))


def _weights(xb, importance, sigma2):
    """``qw * sqrtf(sigma2 + x*x)`` per value: float32 (..., nb, 32)."""
    qw = blocks(jnp.asarray(importance, F32), QK)
    return mul(qw, sqrt(sigma2[..., None, None] + mul(xb, xb)))


def _high_bits(q):
    """int codes (..., 32) in 0..31 -> the ``qh`` word: bit i = bit 4 of code i, as 4 bytes."""
    bits = ((q >> 4) & 1).astype(jnp.uint32) << jnp.arange(QK, dtype=jnp.uint32)
    return u32_le(jnp.sum(bits, axis=-1, dtype=jnp.uint32))


def _nibbles(q):
    return pack_nibbles(q[..., :16] & 0xF, q[..., 16:] & 0xF)


def _absmax_scale(xb, div_by):
    amax, mx = first_absmax(xb)
    d = div(mx, np.float32(div_by))
    inv = where(d != 0, div(np.float32(1), d), 0.0)
    return d, inv


def _min_max_scale(xb, levels):
    lo, hi = scan_min_max(xb)
    d = div(hi - lo, np.float32(levels))
    inv = where(d != 0, div(np.float32(1), d), 0.0)
    return lo, d, inv


def _sigma2(x, row_sigma2):
    return row_mean_square(x) if row_sigma2 is None else jnp.asarray(row_sigma2, F32)


# ----------------------------------------------------------------------------------------------- encoders

def encode_q4_0(x, importance=None, row_sigma2=None):
    """Q4_0: fp16 d, 16 bytes of 4-bit codes; w = d*(q-8).

    ``row_sigma2`` (float32 (...,), optional, importance path only) replaces the mean of ``x**2`` over each row:
    pass it when ``x`` holds only some of the columns of the rows llama.cpp would see (Q4_0, Q4_1, Q5_0 and Q5_1
    weigh every block by a statistic of its whole row).
    """
    xb = blocks(jnp.asarray(x, F32), QK)
    if importance is None:
        d, inv = _absmax_scale(xb, -8)
        q = jnp.minimum(15, trunc_int(mul(xb, inv[..., None]) + np.float32(8.5)))
    else:
        w = _weights(xb, importance, _sigma2(x, row_sigma2))
        d, q = symmetric_search(xb, 8, w)
    return unblock(jnp.concatenate([u16_le(f16_bits(d)), _nibbles(q)], axis=-1))


def encode_q5_0(x, importance=None, row_sigma2=None):
    """Q5_0: fp16 d, 32-bit high-bit word, 16 bytes of low nibbles; w = d*(q-16)."""
    xb = blocks(jnp.asarray(x, F32), QK)
    if importance is None:
        d, inv = _absmax_scale(xb, -16)
        q = jnp.minimum(31, trunc_int(mul(xb, inv[..., None]) + np.float32(16.5)))
    else:
        w = _weights(xb, importance, _sigma2(x, row_sigma2))
        d, q = symmetric_search(xb, 16, w)
    return unblock(jnp.concatenate([u16_le(f16_bits(d)), _high_bits(q), _nibbles(q)], axis=-1))


def encode_q4_1(x, importance=None, row_sigma2=None):
    """Q4_1: fp16 d, fp16 m, 16 bytes of 4-bit codes; w = d*q + m."""
    xb = blocks(jnp.asarray(x, F32), QK)
    if importance is None:
        m, d, inv = _min_max_scale(xb, 15)
        v = mul(xb - m[..., None], inv[..., None]) + np.float32(0.5)
        q = jnp.minimum(15, trunc_int(v))
    else:
        w = _weights(xb, importance, _sigma2(x, row_sigma2))
        d, the_min, q = affine_search(xb, w, 15, -0.9, 0.05, 36, False)
        m = -the_min
    return unblock(jnp.concatenate([u16_le(f16_bits(d)), u16_le(f16_bits(m)), _nibbles(q)], axis=-1))


def encode_q5_1(x, importance=None, row_sigma2=None):
    """Q5_1: fp16 d, fp16 m, 32-bit high-bit word, 16 bytes of low nibbles; w = d*q + m."""
    xb = blocks(jnp.asarray(x, F32), QK)
    if importance is None:
        m, d, inv = _min_max_scale(xb, 31)
        v = mul(xb - m[..., None], inv[..., None]) + np.float32(0.5)
        q = trunc_int(v) & 0xFF  # C stores the truncated value in a uint8_t without clamping
    else:
        w = _weights(xb, importance, _sigma2(x, row_sigma2))
        d, the_min, q = affine_search(xb, w, 31, -0.9, 0.05, 36, False)
        m = -the_min
    parts = [u16_le(f16_bits(d)), u16_le(f16_bits(m)), _high_bits(q), _nibbles(q)]
    return unblock(jnp.concatenate(parts, axis=-1))


def encode_q8_0(x, importance=None):
    """Q8_0: fp16 d, 32 int8 codes ``roundf(x/d)``; importance is ignored (as in llama.cpp)."""
    del importance
    xb = blocks(jnp.asarray(x, F32), QK)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    d = div(amax, np.float32(127))
    inv = where(d != 0, div(np.float32(1), d), 0.0)
    q = roundf(mul(xb, inv[..., None])).astype(jnp.int32)
    return unblock(jnp.concatenate([u16_le(f16_bits(d)), (q & 0xFF).astype(jnp.uint8)], axis=-1))


# ----------------------------------------------------------------------------------------------- decoders

def _split(payload, size):
    return blocks(jnp.asarray(payload, jnp.uint8), size)


def decode_q4_0(payload):
    """Q4_0 payload uint8 (..., nb*18) -> float32 (..., nb*32)."""
    p = _split(payload, 18)
    d = read_f16(p[..., 0:2])
    q = unpack_nibbles(p[..., 2:18]) - 8
    return unblock(mul(as_f32(q), d[..., None]))


def decode_q4_1(payload):
    """Q4_1 payload uint8 (..., nb*20) -> float32 (..., nb*32)."""
    p = _split(payload, 20)
    d, m = read_f16(p[..., 0:2]), read_f16(p[..., 2:4])
    q = unpack_nibbles(p[..., 4:20])
    return unblock(mul(as_f32(q), d[..., None]) + m[..., None])


def _five_bit(qh_bytes, qs):
    qh = read_u32(qh_bytes)
    hi = ((qh[..., None] >> jnp.arange(QK, dtype=jnp.uint32)) & 1).astype(jnp.int32)
    return unpack_nibbles(qs) | (hi << 4)


def decode_q5_0(payload):
    """Q5_0 payload uint8 (..., nb*22) -> float32 (..., nb*32)."""
    p = _split(payload, 22)
    d = read_f16(p[..., 0:2])
    q = _five_bit(p[..., 2:6], p[..., 6:22]) - 16
    return unblock(mul(as_f32(q), d[..., None]))


def decode_q5_1(payload):
    """Q5_1 payload uint8 (..., nb*24) -> float32 (..., nb*32)."""
    p = _split(payload, 24)
    d, m = read_f16(p[..., 0:2]), read_f16(p[..., 2:4])
    q = _five_bit(p[..., 4:8], p[..., 8:24])
    return unblock(mul(as_f32(q), d[..., None]) + m[..., None])


def decode_q8_0(payload):
    """Q8_0 payload uint8 (..., nb*34) -> float32 (..., nb*32)."""
    p = _split(payload, 34)
    d = read_f16(p[..., 0:2])
    q = lax.bitcast_convert_type(p[..., 2:34], jnp.int8).astype(jnp.int32)
    return unblock(mul(as_f32(q), d[..., None]))


register("q4_0", decode=jax.jit(decode_q4_0), encode=jax.jit(encode_q4_0))
register("q4_1", decode=jax.jit(decode_q4_1), encode=jax.jit(encode_q4_1))
register("q5_0", decode=jax.jit(decode_q5_0), encode=jax.jit(encode_q5_0))
register("q5_1", decode=jax.jit(decode_q5_1), encode=jax.jit(encode_q5_1))
register("q8_0", decode=jax.jit(decode_q8_0), encode=jax.jit(encode_q8_0))
