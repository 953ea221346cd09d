"""IQ2_XXS, IQ2_XS and IQ2_S: 2-bit codebook formats on an E8-lattice grid (8 values per grid point).

Blocks of 256 values. Each group of 8 values is one grid point (levels l in {0,1,2}, decoded 8/25/43) times a
sub-block scale times signs:

- IQ2_XXS (66 bytes): fp16 d; per 32 values two uint32: four 8-bit grid indices, then four 7-bit sign codes and a
  4-bit scale s (value = d * (0.5 + s) * 0.25 * grid * sign). The 8th sign of each group is the parity of the 7.
- IQ2_XS (74 bytes): fp16 d; 32 uint16 = 9-bit grid index + 7-bit sign code; 8 bytes of two 4-bit scales (one per
  16 values).
- IQ2_S (82 bytes): fp16 d; 32 low index bytes; 32 explicit sign bytes; 8 bytes of 2-bit index highs (10-bit
  indices); 8 scale bytes.

Encoders reproduce llama.cpp's ``quantize_iq2_xxs/xs/s`` bit for bit (see :mod:`jgptq.ggml.iq_search`). IQ2_XXS and
IQ2_XS need importance weights (llama.cpp refuses to encode them without); IQ2_S has a no-importance path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jgptq.ggml import registry
from jgptq.ggml.common import QK_K, div, f16_bits, f16_value, from_le, le_bytes, mul, seq_max, sqrt
from jgptq.ggml.iq_block import (encode_rows, explicit_signs, grid_values, imatrix_weights, pack_fields,
                                 parity_signs, payload_blocks, row_sigma2, sign_bits, super_scale_codes)
from jgptq.ggml.iq_grids import get_grid, ksigns
from jgptq.ggml.iq_search import make_qp_quants, scale_search, tables, trial_numerators

# ----------------------------------------------------------------------------------------------- decoders

def decode_iq2_xxs(payload):
    """IQ2_XXS payload uint8 (..., nb * 66) -> float32 (..., nb * 256)."""
    blk, lead = payload_blocks(payload, 66)
    d = f16_value(from_le(blk[:, :2], 2)[:, 0])
    q = from_le(blk[:, 2:], 4).reshape(-1, 8, 2)
    idx = le_bytes(q[..., :1], 4).reshape(-1, 8, 4)
    aux = q[..., 1]
    db = (d[:, None] * (np.float32(0.5) + (aux >> 28).astype(jnp.float32))) * np.float32(0.25)
    codes = (aux[..., None] >> (7 * jnp.arange(4, dtype=jnp.uint32))) & 127
    signs = sign_bits(jnp.asarray(ksigns())[codes])
    y = (db[..., None, None] * grid_values("iq2xxs")[idx]) * signs
    return y.reshape(*lead, -1)


def decode_iq2_xs(payload):
    """IQ2_XS payload uint8 (..., nb * 74) -> float32 (..., nb * 256)."""
    blk, lead = payload_blocks(payload, 74)
    d = f16_value(from_le(blk[:, :2], 2)[:, 0])
    qs = from_le(blk[:, 2:66], 2).reshape(-1, 8, 4)
    sc = blk[:, 66:74].astype(jnp.uint32)
    nib = jnp.stack([sc & 15, sc >> 4], axis=-1).astype(jnp.float32)  # (m, 8, 2)
    db = (d[:, None, None] * (np.float32(0.5) + nib)) * np.float32(0.25)
    db = jnp.repeat(db, 2, axis=-1)  # group l uses db[l // 2]
    signs = sign_bits(jnp.asarray(ksigns())[qs >> 9])
    y = (db[..., None] * grid_values("iq2xs")[qs & 511]) * signs
    return y.reshape(*lead, -1)


def decode_iq2_s(payload):
    """IQ2_S payload uint8 (..., nb * 82) -> float32 (..., nb * 256)."""
    blk, lead = payload_blocks(payload, 82)
    d = f16_value(from_le(blk[:, :2], 2)[:, 0])
    lo = blk[:, 2:34].astype(jnp.uint32).reshape(-1, 8, 4)
    sgn = blk[:, 34:66].reshape(-1, 8, 4)
    qh = blk[:, 66:74].astype(jnp.uint32)
    sc = blk[:, 74:82].astype(jnp.uint32)
    shifts = 8 - 2 * jnp.arange(4, dtype=jnp.uint32)
    idx = lo | ((qh[..., None] << shifts) & 0x300)
    nib = jnp.stack([sc & 15, sc >> 4], axis=-1).astype(jnp.float32)
    db = jnp.repeat((d[:, None, None] * (np.float32(0.5) + nib)) * np.float32(0.25), 2, axis=-1)
    y = (db[..., None] * grid_values("iq2s")[idx]) * sign_bits(sgn)
    return y.reshape(*lead, -1)


# ----------------------------------------------------------------------------------------------- encoders

def _iq2_core(xb, qw, *, name: str, bsize: int, sigma_factor: float, eps: float):
    """Shared IQ2_XS / IQ2_S path: (m, 256) -> per 16-value sub-block scale, grid indices, signs, skip mask."""
    m = xb.shape[0]
    nsub = QK_K // bsize
    t = tables(get_grid(name))
    x = xb.reshape(m, nsub, bsize)
    sigma2 = row_sigma2(xb, sigma_factor)
    if qw is not None:
        weight = imatrix_weights(x, qw.reshape(m, nsub, bsize), sigma2)
    else:  # only IQ2_S gets here
        weight = mul(np.float32(0.25), sigma2)[:, None, None] + mul(x, x)
    waux = sqrt(weight)
    xg, wg = x.reshape(m, nsub, bsize // 8, 8), weight.reshape(m, nsub, bsize // 8, 8)
    if name == "iq2s":
        xval, signs = explicit_signs(xg)
    else:
        xval, signs = parity_signs(xg, wg)
    xval = xval.reshape(m * nsub, bsize)
    fmax = seq_max(xval)
    skip = fmax < np.float32(eps)
    base = jnp.where(skip, np.float32(1.0), fmax)
    scale, gidx = scale_search(
        xval, weight.reshape(m * nsub, bsize), waux.reshape(m * nsub, bsize), base, div(base, np.float32(5.0)), t,
        g=8, kmax=3, numerators=trial_numerators(3, 0.1, -9, 9), on_grid_init=True, requant="offgrid")
    flip = (scale < 0)[:, None]
    mask = 127 if name != "iq2s" else 255
    signs = signs.reshape(m * nsub, -1)
    signs = jnp.where(flip, (~signs) & mask, signs)
    scale = jnp.where(skip, np.float32(0.0), jnp.abs(scale))
    skip = skip.reshape(m, nsub)
    return (scale.reshape(m, nsub), jnp.where(skip[..., None], 0, gidx.reshape(m, nsub, -1)),
            jnp.where(skip[..., None], 0, signs.reshape(m, nsub, -1)), skip)


def _encode_xs_blocks(xb, qw):
    m = xb.shape[0]
    scale, gidx, signs, _ = _iq2_core(xb, qw, name="iq2xs", bsize=16, sigma_factor=1.0, eps=1e-15)
    d, codes, ms = super_scale_codes(scale, 15)
    q2 = (gidx.astype(jnp.uint32) | (signs << 9)).reshape(m, 32)
    sc = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(jnp.uint32)
    return pack_fields([le_bytes(f16_bits(d)[:, None], 2), le_bytes(q2, 2), sc.astype(jnp.uint8)], zero=ms == 0)


def _encode_s_blocks(xb, qw):
    m = xb.shape[0]
    scale, gidx, signs, _ = _iq2_core(xb, qw, name="iq2s", bsize=16, sigma_factor=2.0, eps=1e-8)
    d, codes, _ = super_scale_codes(scale, 15)
    gidx = gidx.reshape(m, 32).astype(jnp.uint32)
    hi = (gidx >> 8).reshape(m, 8, 4) << (2 * jnp.arange(4, dtype=jnp.uint32))
    qh = hi[..., 0] | hi[..., 1] | hi[..., 2] | hi[..., 3]
    sc = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return pack_fields([le_bytes(f16_bits(mul(d, np.float32(0.9875)))[:, None], 2),
                        (gidx & 255).astype(jnp.uint8), signs.reshape(m, 32).astype(jnp.uint8),
                        qh.astype(jnp.uint8), sc.astype(jnp.uint8)])


def _encode_xxs_blocks(xb, qw):
    m = xb.shape[0]
    t = tables(get_grid("iq2xxs"))
    x = xb.reshape(m, 8, 32)
    weight = imatrix_weights(x, qw.reshape(m, 8, 32), row_sigma2(xb, 1.0))
    waux = sqrt(weight)
    xval, signs = parity_signs(x.reshape(m, 8, 4, 8), weight.reshape(m, 8, 4, 8))
    xval, weight, waux = (a.reshape(m * 8, 32) for a in (xval, weight, waux))
    fmax = seq_max(xval)
    qp = make_qp_quants(xval, weight, 4)
    eff_max = mul(qp, np.float32(3.0))
    skip = (fmax < np.float32(1e-15)) | ~(eff_max > 0)
    base = jnp.where(skip, np.float32(1.0), eff_max)
    scale, gidx = scale_search(xval, weight, waux, base, qp, t, g=8, kmax=3,
                               numerators=trial_numerators(3, 0.1, -6, 6), on_grid_init=True, requant="all")
    signs = signs.reshape(m * 8, 4)
    signs = jnp.where((scale < 0)[:, None], (~signs) & 127, signs)
    scale = jnp.where(skip, np.float32(0.0), jnp.abs(scale)).reshape(m, 8)
    skip = skip.reshape(m, 8, 1)
    gidx = jnp.where(skip, 0, gidx.reshape(m, 8, 4)).astype(jnp.uint32)
    signs = jnp.where(skip, 0, signs.reshape(m, 8, 4))
    d, codes, ms = super_scale_codes(scale, 15)
    w0 = gidx[..., 0] | (gidx[..., 1] << 8) | (gidx[..., 2] << 16) | (gidx[..., 3] << 24)
    w1 = signs[..., 0] | (signs[..., 1] << 7) | (signs[..., 2] << 14) | (signs[..., 3] << 21)
    w1 = w1 | (codes.astype(jnp.uint32) << 28)
    q2 = jnp.stack([w0, w1], axis=-1).reshape(m, 16)
    return pack_fields([le_bytes(f16_bits(d)[:, None], 2), le_bytes(q2, 4)], zero=ms == 0)


@jax.jit
def encode_iq2_xxs(x, importance):
    """IQ2_XXS encoder: x float32 (..., n), n % 256 == 0, importance float32 (n,) -> uint8 (..., n // 256 * 66)."""
    return encode_rows(_encode_xxs_blocks, 66, x, importance)


@jax.jit
def encode_iq2_xs(x, importance):
    """IQ2_XS encoder: x float32 (..., n), n % 256 == 0, importance float32 (n,) -> uint8 (..., n // 256 * 74)."""
    return encode_rows(_encode_xs_blocks, 74, x, importance)


@jax.jit
def encode_iq2_s(x, importance=None):
    """IQ2_S encoder: x float32 (..., n), n % 256 == 0, importance float32 (n,) or None -> uint8 (..., n // 256 * 82)."""
    return encode_rows(_encode_s_blocks, 82, x, importance, chunk=16384)


decode_iq2_xxs = jax.jit(decode_iq2_xxs)
decode_iq2_xs = jax.jit(decode_iq2_xs)
decode_iq2_s = jax.jit(decode_iq2_s)

registry.register("iq2_xxs", decode=decode_iq2_xxs, encode=encode_iq2_xxs, requires_importance=True)
registry.register("iq2_xs", decode=decode_iq2_xs, encode=encode_iq2_xs, requires_importance=True)
registry.register("iq2_s", decode=decode_iq2_s, encode=encode_iq2_s, requires_importance=False)

