"""IQ1_S and IQ1_M: ternary codebook formats (grid points of 8 values in {-1, 0, 1}, shifted by +-1/8).

- IQ1_S (50 bytes): fp16 d; 32 low index bytes; per 32 values a uint16 with four 3-bit index highs (11-bit
  indices into a 2048-point grid), a 3-bit scale s (bits 12-14) and the shift sign (bit 15):
  value = d * (2 s + 1) * (grid +- 0.125).
- IQ1_M (56 bytes): 32 low index bytes; 16 bytes, one per 16 values: two 3-bit index highs and two shift signs
  (one per group of 8); 8 bytes = four uint16 holding sixteen 3-bit scales (one per 16 values) and, in their top
  nibbles, the fp16 super-scale d: value = d * (2 s + 1) * (grid +- 0.125).

Encoders reproduce llama.cpp's ``quantize_iq1_s`` / ``quantize_iq1_m`` bit for bit: per block, values are sorted and
every split of the sorted order into three groups (levels -1, 0, +1, both shift signs) is scored in llama.cpp's
order; the scan is a ``lax.fori_loop`` over the 561 splits, vectorized over blocks. IQ1_S needs importance; IQ1_M
has a no-importance path (weights x**2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jgptq.ggml import registry
from jgptq.ggml.common import (div, f16_bits, f16_value, from_le, le_bytes, mul, nearest_int, ordered_sum,
                               prefix_sums, seq_max)
from jgptq.ggml.iq_block import encode_rows, grid_values, imatrix_weights, pack_fields, payload_blocks, row_sigma2
from jgptq.ggml.iq_grids import get_grid
from jgptq.ggml.iq_search import compact_code, tables

DELTA = np.float32(0.125)
X_P = np.array([-1 + DELTA, DELTA, 1 + DELTA], np.float32)
X_M = np.array([-1 - DELTA, -DELTA, 1 - DELTA], np.float32)
FLT_MAX = np.float32(np.finfo(np.float32).max)


def _pairs(n):
    """(i1, i2) for 0 <= i1 <= i2 <= n in llama.cpp's loop order."""
    p = [(i1, i2) for i1 in range(n + 1) for i2 in range(i1, n + 1)]
    return np.array([a for a, _ in p], np.int32), np.array([b for _, b in p], np.int32)


# ----------------------------------------------------------------------------------------------- decoders

def decode_iq1_s(payload):
    """IQ1_S payload uint8 (..., nb * 50) -> float32 (..., nb * 256)."""
    blk, lead = payload_blocks(payload, 50)
    d = f16_value(from_le(blk[:, :2], 2)[:, 0])
    lo = blk[:, 2:34].astype(jnp.uint32).reshape(-1, 8, 4)
    qh = from_le(blk[:, 34:50], 2)  # (m, 8)
    idx = lo | (((qh[..., None] >> (3 * jnp.arange(4, dtype=jnp.uint32))) & 7) << 8)
    dl = d[:, None] * (2 * ((qh >> 12) & 7) + 1).astype(jnp.float32)
    delta = jnp.where((qh & 0x8000) != 0, -DELTA, DELTA)
    y = dl[..., None, None] * (grid_values("iq1s")[idx] + delta[..., None, None])
    return y.reshape(*lead, -1)


def decode_iq1_m(payload):
    """IQ1_M payload uint8 (..., nb * 56) -> float32 (..., nb * 256)."""
    blk, lead = payload_blocks(payload, 56)
    lo = blk[:, :32].astype(jnp.uint32).reshape(-1, 16, 2)  # per 16 values, two grid points
    qh = blk[:, 32:48].astype(jnp.uint32)  # (m, 16)
    sc = from_le(blk[:, 48:56], 2)  # (m, 4)
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = f16_value(bits)
    s = (sc[:, :, None] >> (3 * jnp.arange(4, dtype=jnp.uint32))) & 7  # (m, 4, 4): 16 scales in order
    dl = d[:, None] * (2 * s.reshape(-1, 16) + 1).astype(jnp.float32)
    hi = jnp.stack([qh & 7, (qh >> 4) & 7], axis=-1)
    idx = lo | (hi << 8)
    delta = jnp.where(jnp.stack([qh & 0x08, qh & 0x80], axis=-1) != 0, -DELTA, DELTA)
    y = dl[..., None, None] * (grid_values("iq1s")[idx] + delta[..., None])
    return y.reshape(*lead, -1)


# ----------------------------------------------------------------------------------------------- encoders

def _split_scan(candidates, n_pairs: int, mb: int):
    """llama.cpp's running best over splits: ``candidates(p) -> [(sumqx, sumq2), ...]`` for split p.

    A candidate replaces the best when sumq2 > 0 and sumqx**2 > best * sumq2, in split then candidate order.

    Returns (scale, pair index, candidate index) per block; pair index -1 when nothing was accepted.
    """
    def step(p, carry):
        best, scale, bp, bk = carry
        for k, (sqx, sq2) in enumerate(candidates(p)):
            accept = (sq2 > 0) & (mul(sqx, sqx) > mul(best, sq2))
            new_scale = div(sqx, sq2)
            best = jnp.where(accept, mul(new_scale, sqx), best)
            scale = jnp.where(accept, new_scale, scale)
            bp = jnp.where(accept, p, bp)
            bk = jnp.where(accept, k, bk)
        return best, scale, bp, bk

    init = (jnp.full((mb,), -FLT_MAX), jnp.zeros((mb,), jnp.float32), jnp.full((mb,), -1, jnp.int32),
            jnp.zeros((mb,), jnp.int32))
    _, scale, bp, bk = lax.fori_loop(0, n_pairs, step, init)
    return scale, bp, bk


def _levels_from_split(order, i1, i2):
    """Levels (mb, n) in original order: 0 below sorted position i1, 1 below i2, else 2."""
    n = order.shape[-1]
    j = jnp.arange(n)
    lsorted = (j >= i1[:, None]).astype(jnp.int32) + (j >= i2[:, None]).astype(jnp.int32)
    inv = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(lsorted, inv, axis=-1)


def _best_levels(scale, bp, skip, order, p1, p2):
    """The levels of the best split, flipped to a positive scale: (skip, levels (mb, n), flipped, scale).

    Blocks where no split was accepted are added to ``skip`` (their levels come from split 0, unused).
    """
    skip = skip | (bp < 0)
    bp = jnp.maximum(bp, 0)
    lev = _levels_from_split(order, p1[bp], p2[bp])
    neg = scale < 0
    return skip, jnp.where(neg[:, None], 2 - lev, lev), neg, jnp.where(neg, -scale, scale)


def _grid_indices(lev, x, w, scale, vals, t):
    """Grid index per group of 8 (mb, ng): the level code's own point, or its nearest neighbour
    (min sum w * (scale * vals[l] - x)**2, first in list order) when off the grid; and whether all were on it.

    lev int32 (mb, ng, 8); x, w float32 (mb, ng, 8); scale (mb,); vals float32 (mb, ng, 3) value of each level.
    """
    code = compact_code(lev, t.nlev)
    gi = t.kmap[code]
    nb = t.neighbours[code]
    idx = jnp.maximum(nb, 0)
    d2 = None
    for i in range(8):
        lv = t.levels[:, i][idx]  # (mb, ng, K)
        q = jnp.where(lv == 0, vals[..., 0:1], jnp.where(lv == 1, vals[..., 1:2], vals[..., 2:3]))
        diff = mul(scale[:, None, None], q) - x[..., i:i + 1]
        term = mul(mul(w[..., i:i + 1], diff), diff)
        d2 = term if d2 is None else d2 + term
    d2 = jnp.where(nb >= 0, d2, jnp.inf)
    best = jnp.take_along_axis(nb, jnp.argmin(d2, axis=-1)[..., None], axis=-1)[..., 0]
    on = gi >= 0
    return jnp.where(on, gi, best), jnp.all(on, axis=-1)


def _group_values(gidx, vals, t):
    """float32 (mb, ng, 8): vals[level] of the chosen grid points."""
    lv = t.levels[gidx]
    return jnp.where(lv == 0, vals[..., 0:1], jnp.where(lv == 1, vals[..., 1:2], vals[..., 2:3]))


def _sorted(x, w):
    """Stable ascending sort of each row of x (mb, n): (order, sorted x, w in that order).

    llama.cpp sorts with the C library's qsort comparing values only; glibc sorts arrays this small with a
    stable merge sort (equal values keep their index order), which is what a stable sort reproduces. -0.0 and
    +0.0 compare equal in both.
    """
    order = jnp.argsort(x, axis=-1, stable=True)
    xs = jnp.take_along_axis(x, order, axis=-1)
    ws = jnp.take_along_axis(w, order, axis=-1)
    return order, xs, ws


def _encode_s_blocks(xb, qw):
    m = xb.shape[0]
    mb = m * 8
    t = tables(get_grid("iq1s"))
    x = xb.reshape(m, 8, 32)
    weight = imatrix_weights(x, qw.reshape(m, 8, 32), row_sigma2(xb, 2.0)).reshape(mb, 32)
    x = x.reshape(mb, 32)
    skip = seq_max(jnp.abs(x)) < np.float32(1e-12)
    order, xs, ws = _sorted(x, weight)
    sums = prefix_sums(jnp.stack([mul(ws, xs), ws]))  # (33, 2, mb)
    sumx, sumw = sums[:, 0], sums[:, 1]
    p1, p2 = (jnp.asarray(a) for a in _pairs(32))

    def candidates(p):
        i1, i2 = p1[p], p2[p]
        ax, bx, cx = sumx[i1] - sumx[0], sumx[i2] - sumx[i1], sumx[32] - sumx[i2]
        aw, bw, cw = sumw[i1] - sumw[0], sumw[i2] - sumw[i1], sumw[32] - sumw[i2]
        out = []
        for v in (X_P, X_M):
            sqx = (mul(ax, v[0]) + mul(bx, v[1])) + mul(cx, v[2])
            sq2 = (mul(mul(aw, v[0]), v[0]) + mul(mul(bw, v[1]), v[1])) + mul(mul(cw, v[2]), v[2])
            out.append((sqx, sq2))
        return out

    scale, bp, bk = _split_scan(candidates, 561, mb)
    skip, lev, neg, scale = _best_levels(scale, bp, skip, order, p1, p2)
    minus = (bk == 1) != neg  # shift sign -1
    vals = jnp.broadcast_to(jnp.where(minus[:, None, None], jnp.asarray(X_M), jnp.asarray(X_P)), (mb, 4, 3))
    xg, wg = x.reshape(mb, 4, 8), weight.reshape(mb, 4, 8)
    gidx, all_on = _grid_indices(lev.reshape(mb, 4, 8), xg, wg, scale, vals, t)
    q = _group_values(gidx, vals, t).reshape(mb, 32)
    sqx = ordered_sum(mul(mul(weight, q), x))
    sq2 = ordered_sum(mul(mul(weight, q), q))
    refit = ~all_on & (sqx > 0) & (sq2 > 0)
    scale = jnp.where(refit, div(sqx, jnp.where(refit, sq2, np.float32(1.0))), scale)
    scale = jnp.where(skip, np.float32(0.0), scale)
    gidx = jnp.where(skip[:, None], 0, gidx).astype(jnp.uint32)
    minus = minus & ~skip
    scale, gidx, minus = scale.reshape(m, 8), gidx.reshape(m, 8, 4), minus.reshape(m, 8)
    ms = seq_max(jnp.concatenate([jnp.zeros((m, 1), jnp.float32), scale], axis=1))
    have = ms > 0
    d = div(ms, np.float32(15.0))
    id_ = div(np.float32(1.0), jnp.where(have, d, np.float32(1.0)))
    code = jnp.clip(nearest_int(mul(np.float32(0.5), mul(id_[:, None], scale) - np.float32(1.0))), 0, 7)
    code = (code | jnp.where(minus, 8, 0)).astype(jnp.uint32)
    qh = (gidx[..., 0] >> 8) | ((gidx[..., 1] >> 8) << 3) | ((gidx[..., 2] >> 8) << 6) | ((gidx[..., 3] >> 8) << 9)
    qh = qh | jnp.where(have[:, None], code << 12, 0)
    dbits = jnp.where(have, f16_bits(mul(d, np.float32(1.125))), 0)
    return pack_fields([le_bytes(dbits[:, None], 2), (gidx & 255).reshape(m, 32).astype(jnp.uint8),
                        le_bytes(qh, 2)])


_CP = (X_P[0] * X_P[0] - X_P[1] * X_P[1], X_P[1] * X_P[1] - X_P[2] * X_P[2])
_CM = (X_M[0] * X_M[0] - X_M[1] * X_M[1], X_M[1] * X_M[1] - X_M[2] * X_M[2])
_MASKS = np.array([0x00, 0x80, 0x08, 0x88], np.uint32)  # shift signs of the two groups of 8, per candidate


def _encode_m_blocks(xb, qw):
    m = xb.shape[0]
    mb = m * 16
    t = tables(get_grid("iq1s"))
    x = xb.reshape(m, 16, 16)
    if qw is not None:
        weight = imatrix_weights(x, qw.reshape(m, 16, 16), row_sigma2(xb, 2.0)).reshape(mb, 16)
    else:
        weight = mul(x, x).reshape(mb, 16)
    x = x.reshape(mb, 16)
    skip = seq_max(jnp.abs(x)) < np.float32(1e-7)
    order, xs, ws = _sorted(x, weight)
    # running sums per half of the block, in sorted order; an element of the other half adds +0, which leaves
    # the sum unchanged (a running sum from +0 is never -0), as llama.cpp's copy does
    second = order >= 8
    pwx = mul(ws, xs)
    zero = jnp.zeros_like(ws)
    sums = prefix_sums(jnp.stack([jnp.where(second, zero, pwx), jnp.where(second, pwx, zero),
                                  jnp.where(second, zero, ws), jnp.where(second, ws, zero)]))
    px, pw = [sums[:, 0], sums[:, 1]], [sums[:, 2], sums[:, 3]]  # (17, mb) per half
    txp = [mul(px[h][16], X_P[2]) for h in range(2)]
    txm = [mul(px[h][16], X_M[2]) for h in range(2)]
    twp = [mul(mul(pw[h][16], X_P[2]), X_P[2]) for h in range(2)]
    twm = [mul(mul(pw[h][16], X_M[2]), X_M[2]) for h in range(2)]
    p1, p2 = (jnp.asarray(a) for a in _pairs(16))

    def candidates(p):
        i1, i2 = p1[p], p2[p]
        qxp, qxm, q2p, q2m = [], [], [], []
        for h in range(2):
            sx = px[h][i1] + px[h][i2]
            qxp.append(txp[h] - sx)
            qxm.append(txm[h] - sx)
            q2p.append((twp[h] + mul(pw[h][i1], _CP[0])) + mul(pw[h][i2], _CP[1]))
            q2m.append((twm[h] + mul(pw[h][i1], _CM[0])) + mul(pw[h][i2], _CM[1]))
        return [(qxp[0] + qxp[1], q2p[0] + q2p[1]), (qxp[0] + qxm[1], q2p[0] + q2m[1]),
                (qxm[0] + qxp[1], q2m[0] + q2p[1]), (qxm[0] + qxm[1], q2m[0] + q2m[1])]

    scale, bp, bk = _split_scan(candidates, 153, mb)
    skip, lev, neg, scale = _best_levels(scale, bp, skip, order, p1, p2)
    bk = jnp.where(neg, 3 - bk, bk)
    minus = jnp.stack([bk >= 2, bk % 2 == 1], axis=-1)  # (mb, 2): group uses x_m
    vals = jnp.where(minus[..., None], jnp.asarray(X_M), jnp.asarray(X_P))  # (mb, 2, 3)
    gidx, all_on = _grid_indices(lev.reshape(mb, 2, 8), x.reshape(mb, 2, 8), weight.reshape(mb, 2, 8), scale,
                                 vals, t)
    q = _group_values(gidx, vals, t).reshape(mb, 16)
    sqx = ordered_sum(mul(mul(weight, q), x))
    sq2 = ordered_sum(mul(mul(weight, q), q))
    refit = ~all_on & (sqx > 0) & (sq2 > 0)
    scale = jnp.where(refit, div(sqx, jnp.where(refit, sq2, np.float32(1.0))), scale)
    scale = jnp.where(skip, np.float32(0.0), scale)
    gidx = jnp.where(skip[:, None], 0, gidx).astype(jnp.uint32)
    bk = jnp.where(skip, 0, bk)
    # super-block: 3-bit scales from max_scale / 15, then a weighted refit of d over all 256 decoded values
    scale, gidx, bk = scale.reshape(m, 16), gidx.reshape(m, 16, 2), bk.reshape(m, 16)
    ms = seq_max(jnp.concatenate([jnp.zeros((m, 1), jnp.float32), scale], axis=1))
    have = ms > 0
    d = div(ms, np.float32(15.0))
    id_ = div(np.float32(1.0), jnp.where(have, d, np.float32(1.0)))
    code = jnp.clip(nearest_int(mul(np.float32(0.5), mul(id_[:, None], scale) - np.float32(1.0))), 0, 7)
    minus = jnp.stack([bk >= 2, bk % 2 == 1], axis=-1)
    vals = jnp.where(minus[..., None], jnp.asarray(X_M), jnp.asarray(X_P))  # (m, 16, 2, 3)
    lv = t.levels[gidx]  # (m, 16, 2, 8)
    qv = jnp.where(lv == 0, vals[..., 0:1], jnp.where(lv == 1, vals[..., 1:2], vals[..., 2:3]))
    q = mul(qv, (2 * code + 1).astype(jnp.float32)[..., None, None]).reshape(m, 256)
    w = weight.reshape(m, 256)
    sqx = ordered_sum(mul(mul(w, q), xb))
    sq2 = ordered_sum(mul(mul(w, q), q))
    d = jnp.where(sq2 > 0, div(sqx, jnp.where(sq2 > 0, sq2, np.float32(1.0))), d)
    dbits = f16_bits(mul(d, np.float32(1.1125)))
    code = code.astype(jnp.uint32).reshape(m, 4, 4) << (3 * jnp.arange(4, dtype=jnp.uint32))
    sc = code[..., 0] | code[..., 1] | code[..., 2] | code[..., 3]
    sc = sc | (((dbits[:, None] >> (4 * jnp.arange(4, dtype=jnp.uint32))) & 0xF) << 12)
    sc = jnp.where(have[:, None], sc, 0)
    qh = (gidx[..., 0] >> 8) | ((gidx[..., 1] >> 8) << 4)
    qh = qh | jnp.where(have[:, None], jnp.asarray(_MASKS)[bk], 0)
    return pack_fields([(gidx & 255).reshape(m, 32).astype(jnp.uint8), qh.astype(jnp.uint8), le_bytes(sc, 2)])


@jax.jit
def encode_iq1_s(x, importance):
    """IQ1_S encoder: x float32 (..., n), n % 256 == 0, importance float32 (n,) -> uint8 (..., n // 256 * 50)."""
    return encode_rows(_encode_s_blocks, 50, x, importance, chunk=32768)


@jax.jit
def encode_iq1_m(x, importance=None):
    """IQ1_M encoder: x float32 (..., n), n % 256 == 0, importance float32 (n,) or None -> uint8 (..., n/256*56)."""
    return encode_rows(_encode_m_blocks, 56, x, importance, chunk=32768)


decode_iq1_s = jax.jit(decode_iq1_s)
decode_iq1_m = jax.jit(decode_iq1_m)

registry.register("iq1_s", decode=decode_iq1_s, encode=encode_iq1_s, requires_importance=True)
registry.register("iq1_m", decode=decode_iq1_m, encode=encode_iq1_m, requires_importance=False)
