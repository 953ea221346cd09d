"""K-quant GGML formats (256-value super-blocks): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

A super-block holds 16 (Q2_K, Q3_K, Q6_K) or 8 (Q4_K, Q5_K) sub-blocks, each with an integer sub-scale (and
sub-min) relative to fp16 super-scales. Encoders follow llama.cpp's ``ggml_quantize_chunk``:

- without importance, the reference path: a per-sub-block search (affine for Q2/Q4/Q5_K, symmetric with
  coordinate descent for Q3_K, symmetric for Q6_K), sub-scales rounded against the largest one;
- with per-column importance ``qw`` (n,), the weighted path: weights ``qw * sqrt(sigma2 + x**2)`` (sigma2 from
  the super-block; Q6_K uses ``qw`` itself), and the sub-scales themselves quantized by a weighted search.

Both paths then re-derive every code from the **fp16-rounded** super-scales times the integer sub-scales, as the
decoder will see them. ``x`` float32 (..., n), n % 256 == 0 -> payload uint8 (..., n // 256 * type_size).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jgptq.ggml.common import (
    F32,
    GROUP_MAX_EPS,
    as_f32,
    blocks,
    div,
    f16_round,
    first_absmax,
    mul,
    nearest_int,
    ordered_sum,
    read_f16,
    scan_max_gt,
    sqrt,
    u16_le,
    unblock,
    where,
)
from jgptq.ggml.registry import register
from jgptq.ggml.scale_search import affine_search, cubic_refine_search, positive_search, symmetric_search

QK_K = 256


def _u8(v):
    return (v & 0xFF).astype(jnp.uint8)


def _i8(v):
    """C's store of an int into an ``int8_t``: the low 8 bits, read back signed."""
    return ((v + 128) & 0xFF) - 128


def _sub(x, size):
    """(..., nb, 256) -> (..., nb, 256 // size, size)."""
    return x.reshape(x.shape[:-1] + (QK_K // size, size))


def _flat(v):
    """(..., nb, k, size) -> (..., nb, k * size)."""
    return v.reshape(v.shape[:-2] + (v.shape[-2] * v.shape[-1],))


# ------------------------------------------------------------------------------------------- bit layouts

def _pack_2bit(codes):
    """int (..., 256) in 0..3 -> uint8 (..., 64): per 128 values, byte l holds values l, l+32, l+64, l+96."""
    c = codes.reshape(codes.shape[:-1] + (2, 4, 32))
    return _u8(c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)).reshape(
        codes.shape[:-1] + (64,))


def _unpack_2bit(qs):
    """uint8 (..., 64) -> int32 (..., 256) (inverse of :func:`_pack_2bit`)."""
    q = qs.astype(jnp.int32).reshape(qs.shape[:-1] + (2, 1, 32))
    return ((q >> (2 * jnp.arange(4)[:, None])) & 3).reshape(qs.shape[:-1] + (256,))


def _pack_bitplanes(bits):
    """0/1 (..., 256) -> uint8 (..., 32): bit k of byte m is value 32k + m (Q3_K hmask, Q5_K qh)."""
    b = bits.reshape(bits.shape[:-1] + (8, 32)).astype(jnp.int32)
    return _u8(jnp.sum(b << jnp.arange(8)[:, None], axis=-2))


def _unpack_bitplanes(planes):
    """uint8 (..., 32) -> int32 0/1 (..., 256) (inverse of :func:`_pack_bitplanes`)."""
    p = planes.astype(jnp.int32)[..., None, :]
    return ((p >> jnp.arange(8)[:, None]) & 1).reshape(planes.shape[:-1] + (256,))


def _pack_nibble_pairs(codes):
    """int (..., 256) in 0..15 -> uint8 (..., 128): per 64 values, low nibbles 0..31, high nibbles 32..63."""
    c = codes.reshape(codes.shape[:-1] + (4, 2, 32))
    return _u8(c[..., 0, :] | (c[..., 1, :] << 4)).reshape(codes.shape[:-1] + (128,))


def _unpack_nibble_pairs(qs):
    q = qs.astype(jnp.int32).reshape(qs.shape[:-1] + (4, 1, 32))
    return ((q >> (4 * jnp.arange(2)[:, None])) & 0xF).reshape(qs.shape[:-1] + (256,))


def _pack_scale_min(ls, lm):
    """8 sub-scales and 8 sub-mins (int, C ``uint8_t`` values) -> the 12 bytes of Q4_K/Q5_K ``scales``."""
    lo = ls[..., :4] | ((ls[..., 4:] >> 4) << 6)
    mid = lm[..., :4] | ((lm[..., 4:] >> 4) << 6)
    hi = (ls[..., 4:] & 0xF) | ((lm[..., 4:] & 0xF) << 4)
    return _u8(jnp.concatenate([lo, mid, hi], axis=-1))


def _unpack_scale_min(b):
    """The 12 ``scales`` bytes -> (sc, m), int32 (..., 8) each (llama.cpp ``get_scale_min_k4``)."""
    b = b.astype(jnp.int32)
    sc = jnp.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)], axis=-1)
    m = jnp.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, m


def _pack_q3_scales(l):
    """16 six-bit values (stored s + 32) -> the 12 bytes of Q3_K ``scales``."""
    low = (l[..., :8] & 0xF) | ((l[..., 8:] & 0xF) << 4)
    top = (l >> 4).reshape(l.shape[:-1] + (4, 4))  # [k, i] = value 4k + i
    high = jnp.sum(top << (2 * jnp.arange(4)[:, None]), axis=-2)
    return _u8(jnp.concatenate([low, high], axis=-1))


def _unpack_q3_scales(b):
    """The 12 Q3_K ``scales`` bytes -> signed sub-scales int32 (..., 16) (stored value - 32)."""
    b = b.astype(jnp.int32)
    low = jnp.concatenate([b[..., :8] & 0xF, b[..., :8] >> 4], axis=-1)
    high = (b[..., None, 8:12] >> (2 * jnp.arange(4)[:, None])) & 3
    return (low | (high.reshape(b.shape[:-1] + (16,)) << 4)) - 32


def _pack_q6(codes):
    """int (..., 256) in 0..63 -> (ql uint8 (..., 128), qh uint8 (..., 64))."""
    c = codes.reshape(codes.shape[:-1] + (2, 4, 32))
    ql = jnp.concatenate([(c[..., 0, :] & 0xF) | ((c[..., 2, :] & 0xF) << 4),
                          (c[..., 1, :] & 0xF) | ((c[..., 3, :] & 0xF) << 4)], axis=-1)
    qh = jnp.sum((c >> 4) << (2 * jnp.arange(4)[:, None]), axis=-2)
    return _u8(ql).reshape(codes.shape[:-1] + (128,)), _u8(qh).reshape(codes.shape[:-1] + (64,))


def _unpack_q6(ql, qh):
    l = ql.astype(jnp.int32).reshape(ql.shape[:-1] + (2, 2, 32))  # [half, second 32 bytes, l]
    h = qh.astype(jnp.int32).reshape(qh.shape[:-1] + (2, 1, 32))
    low = jnp.stack([l[..., 0, :] & 0xF, l[..., 1, :] & 0xF, l[..., 0, :] >> 4, l[..., 1, :] >> 4], axis=-2)
    high = (h >> (2 * jnp.arange(4)[:, None])) & 3
    return (low | (high << 4)).reshape(ql.shape[:-1] + (256,))


# ------------------------------------------------------------------------------------------- decoders

def decode_q2_k(payload):
    """Q2_K payload uint8 (..., nb*84) -> float32 (..., nb*256)."""
    p = blocks(jnp.asarray(payload, jnp.uint8), 84)
    sc = p[..., 0:16].astype(jnp.int32)
    d, dmin = read_f16(p[..., 80:82]), read_f16(p[..., 82:84])
    dl = mul(d[..., None], as_f32(sc & 0xF))[..., None]
    ml = mul(dmin[..., None], as_f32(sc >> 4))[..., None]
    q = as_f32(_unpack_2bit(p[..., 16:80])).reshape(p.shape[:-1] + (16, 16))
    return unblock(_flat(mul(dl, q) - ml))


def decode_q3_k(payload):
    """Q3_K payload uint8 (..., nb*110) -> float32 (..., nb*256)."""
    p = blocks(jnp.asarray(payload, jnp.uint8), 110)
    hbit = _unpack_bitplanes(p[..., 0:32])
    q = _unpack_2bit(p[..., 32:96]) - where(hbit == 1, 0, 4)
    dl = mul(read_f16(p[..., 108:110])[..., None], as_f32(_unpack_q3_scales(p[..., 96:108])))
    return unblock(_flat(mul(dl[..., None], as_f32(q).reshape(q.shape[:-1] + (16, 16)))))


def _decode_affine(p, q):
    d, dmin = read_f16(p[..., 0:2]), read_f16(p[..., 2:4])
    sc, m = _unpack_scale_min(p[..., 4:16])
    dl = mul(d[..., None], as_f32(sc))[..., None]
    ml = mul(dmin[..., None], as_f32(m))[..., None]
    return unblock(_flat(mul(dl, as_f32(q).reshape(q.shape[:-1] + (8, 32))) - ml))


def decode_q4_k(payload):
    """Q4_K payload uint8 (..., nb*144) -> float32 (..., nb*256)."""
    p = blocks(jnp.asarray(payload, jnp.uint8), 144)
    return _decode_affine(p, _unpack_nibble_pairs(p[..., 16:144]))


def decode_q5_k(payload):
    """Q5_K payload uint8 (..., nb*176) -> float32 (..., nb*256)."""
    p = blocks(jnp.asarray(payload, jnp.uint8), 176)
    q = _unpack_nibble_pairs(p[..., 48:176]) | (_unpack_bitplanes(p[..., 16:48]) << 4)
    return _decode_affine(p, q)


def decode_q6_k(payload):
    """Q6_K payload uint8 (..., nb*210) -> float32 (..., nb*256)."""
    p = blocks(jnp.asarray(payload, jnp.uint8), 210)
    q = _unpack_q6(p[..., 0:128], p[..., 128:192]) - 32
    sc = _i8(p[..., 192:208].astype(jnp.int32))
    dl = mul(read_f16(p[..., 208:210])[..., None], as_f32(sc))[..., None]
    return unblock(_flat(mul(dl, as_f32(q).reshape(q.shape[:-1] + (16, 16)))))


# ------------------------------------------------------------------------------------------- shared steps

def _superblock_sigma2(xb, factor):
    """``factor * sum(x**2) / 256`` per super-block, float32 (..., nb)."""
    total = ordered_sum(mul(xb, xb), 0.0)
    return div(mul(np.float32(factor), total), np.float32(QK_K))


def _importance_weights(xs, importance, sigma2):
    """``qw * sqrtf(sigma2 + x*x)`` for sub-blocks xs (..., nb, k, size)."""
    qw = jnp.asarray(importance, F32).reshape(xs.shape[-3:])
    return mul(qw, sqrt(sigma2[..., None, None] + mul(xs, xs)))


def _requant(xs, dq, lo, hi, old, mq=None):
    """Codes from the decoded sub-scales: clamp(nearest_int((x + mq) / dq)), kept from ``old`` where dq == 0."""
    num = xs if mq is None else xs + mq[..., None]
    new = jnp.clip(nearest_int(div(num, dq[..., None])), lo, hi)
    return where((dq != 0)[..., None], new, old)


def _affine_payload(xb, scales, mins, ls, lm, d, dmin, lsub, nmax):
    """Shared tail of Q4_K/Q5_K: pack scales, store d/dmin, requantize. Returns (header bytes, codes 0..nmax)."""
    sbytes = _pack_scale_min(ls, lm)
    dbits, dval = f16_round(d)
    mbits, mval = f16_round(dmin)
    sc, m = _unpack_scale_min(sbytes)
    dq = mul(dval[..., None], as_f32(sc))
    mq = mul(mval[..., None], as_f32(m))
    codes = _flat(_requant(_sub(xb, 32), dq, 0, nmax, lsub, mq))
    return jnp.concatenate([u16_le(dbits), u16_le(mbits), sbytes], axis=-1), codes


# ------------------------------------------------------------------------------------------- encoders

def encode_q2_k(x, importance=None):
    """Q2_K: scales (4-bit scale | 4-bit min), 2-bit codes, fp16 d, fp16 dmin; w = d*sc*q - dmin*m."""
    xb = blocks(jnp.asarray(x, F32), QK_K)
    xs = _sub(xb, 16)
    if importance is None:
        scales, mins, lsub = affine_search(xs, jnp.abs(xs), 3, -0.5, 0.1, 15, True)
        max_scale, max_min = scan_max_gt(scales), scan_max_gt(mins)
        ls = nearest_int(mul(div(np.float32(15), max_scale)[..., None], scales))
        lm = nearest_int(mul(div(np.float32(15), max_min)[..., None], mins))
        sbytes = where((max_scale > 0)[..., None], ls & 0xFF, 0)
        sbytes = where((max_min > 0)[..., None], (sbytes | (lm << 4)) & 0xFF, sbytes)
        d = where(max_scale > 0, div(max_scale, np.float32(15)), 0.0)
        dmin = where(max_min > 0, div(max_min, np.float32(15)), 0.0)
    else:
        w = _importance_weights(xs, importance, _superblock_sigma2(xb, 1))
        sw = ordered_sum(w, 0.0)
        scales, mins, lsub = affine_search(xs, w, 3, -0.9, 0.05, 36, False)
        d, ls = positive_search(scales, sw, 15)
        dmin, lm = positive_search(mins, sw, 15)
        sbytes = (ls | (lm << 4)) & 0xFF
    dbits, dval = f16_round(d)
    mbits, mval = f16_round(dmin)
    dq = mul(dval[..., None], as_f32(sbytes & 0xF))
    mq = mul(mval[..., None], as_f32(sbytes >> 4))
    codes = _flat(_requant(xs, dq, 0, 3, lsub, mq))
    parts = [_u8(sbytes), _pack_2bit(codes), u16_le(dbits), u16_le(mbits)]
    return unblock(jnp.concatenate(parts, axis=-1))


def encode_q3_k(x, importance=None):
    """Q3_K: hmask, 2-bit low codes, 6-bit signed sub-scales, fp16 d; w = d*(sc-32)*(q-4)."""
    xb = blocks(jnp.asarray(x, F32), QK_K)
    xs = _sub(xb, 16)
    if importance is None:
        scales, lsub = cubic_refine_search(xs, 4)
        _, max_scale = first_absmax(scales)
        iscale = div(np.float32(-32), max_scale)
        l6 = jnp.clip(_i8(nearest_int(mul(iscale[..., None], scales))), -32, 31) + 32
        sbytes = where((max_scale != 0)[..., None], _pack_q3_scales(l6), jnp.uint8(0))
        d = where(max_scale != 0, div(np.float32(1), iscale), 0.0)
    else:
        w = _importance_weights(xs, importance, _superblock_sigma2(xb, 2))
        sw = ordered_sum(w, 0.0)
        scales, lsub = symmetric_search(xs, 4, w)
        d, l6 = symmetric_search(scales, 32, sw)
        sbytes = _pack_q3_scales(l6)
    dbits, dval = f16_round(d)
    dq = mul(dval[..., None], as_f32(_unpack_q3_scales(sbytes)))
    codes = _flat(_requant(xs, dq, -4, 3, lsub - 4) + 4)
    parts = [_pack_bitplanes(codes > 3), _pack_2bit(codes & 3), sbytes, u16_le(dbits)]
    return unblock(jnp.concatenate(parts, axis=-1))


def _encode_affine_k(x, importance, nmax, ref_search):
    """Q4_K (nmax 15) and Q5_K (nmax 31): sub-blocks of 32, 6-bit scales and mins. Returns (header, codes)."""
    xb = blocks(jnp.asarray(x, F32), QK_K)
    xs = _sub(xb, 32)
    if importance is None:
        av_x = sqrt(div(ordered_sum(mul(xs, xs), 0.0), np.float32(32)))
        w = av_x[..., None] + jnp.abs(xs)
        scales, mins, lsub = affine_search(xs, w, nmax, *ref_search, False)
        max_scale, max_min = scan_max_gt(scales), scan_max_gt(mins)
        inv_scale = where(max_scale > 0, div(np.float32(63), max_scale), 0.0)
        inv_min = where(max_min > 0, div(np.float32(63), max_min), 0.0)
        ls = jnp.minimum(63, nearest_int(mul(inv_scale[..., None], scales)) & 0xFF)
        lm = jnp.minimum(63, nearest_int(mul(inv_min[..., None], mins)) & 0xFF)
        d, dmin = div(max_scale, np.float32(63)), div(max_min, np.float32(63))
    else:
        w = _importance_weights(xs, importance, _superblock_sigma2(xb, 2))
        sw = ordered_sum(w, 0.0)
        scales, mins, lsub = affine_search(xs, w, nmax, -0.9, 0.05, 36, False)
        d, ls = positive_search(scales, sw, 63)
        dmin, lm = positive_search(mins, sw, 63)
        if nmax == 31:  # the Q5_K path clamps the sub-scales again, the Q4_K path does not
            ls, lm = jnp.minimum(63, ls), jnp.minimum(63, lm)
    return _affine_payload(xb, scales, mins, ls, lm, d, dmin, lsub, nmax)


def encode_q4_k(x, importance=None):
    """Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 4-bit codes; w = d*sc*q - dmin*m per 32."""
    header, codes = _encode_affine_k(x, importance, 15, (-1.0, 0.1, 20))
    return unblock(jnp.concatenate([header, _pack_nibble_pairs(codes)], axis=-1))


def encode_q5_k(x, importance=None):
    """Q5_K: as Q4_K plus a bit plane of 5th bits; codes 0..31."""
    header, codes = _encode_affine_k(x, importance, 31, (-0.5, 0.1, 15))
    parts = [header, _pack_bitplanes(codes >> 4), _pack_nibble_pairs(codes & 0xF)]
    return unblock(jnp.concatenate(parts, axis=-1))


def encode_q6_k(x, importance=None):
    """Q6_K: 4-bit low codes, 2-bit high codes, int8 sub-scales, fp16 d; w = d*sc*(q-32) per 16."""
    xb = blocks(jnp.asarray(x, F32), QK_K)
    xs = _sub(xb, 16)
    w = mul(xs, xs) if importance is None else jnp.asarray(importance, F32).reshape(xs.shape[-3:])
    scales, lsub = symmetric_search(xs, 32, jnp.broadcast_to(w, xs.shape))
    max_abs, max_scale = first_absmax(scales)
    iscale = div(np.float32(-128), max_scale)
    sc = _i8(jnp.minimum(127, nearest_int(mul(iscale[..., None], scales))))
    dbits, dval = f16_round(div(np.float32(1), iscale))
    dq = mul(dval[..., None], as_f32(sc))
    codes = _flat(_requant(xs, dq, -32, 31, lsub - 32) + 32)
    ql, qh = _pack_q6(codes)
    payload = jnp.concatenate([ql, qh, _u8(sc), u16_le(dbits)], axis=-1)
    payload = where((max_abs < GROUP_MAX_EPS)[..., None], jnp.uint8(0), payload)
    return unblock(payload)


register("q2_k", decode=jax.jit(decode_q2_k), encode=jax.jit(encode_q2_k))
register("q3_k", decode=jax.jit(decode_q3_k), encode=jax.jit(encode_q3_k))
register("q4_k", decode=jax.jit(decode_q4_k), encode=jax.jit(encode_q4_k))
register("q5_k", decode=jax.jit(decode_q5_k), encode=jax.jit(encode_q5_k))
register("q6_k", decode=jax.jit(decode_q6_k), encode=jax.jit(encode_q6_k))
