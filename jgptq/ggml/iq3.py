"""IQ3_XXS and IQ3_S: 3-bit codebook formats on a D4-lattice grid (4 values per grid point).

Blocks of 256 values, sub-blocks of 32, grid points of 4 values with levels l in 0..7:

- IQ3_XXS (98 bytes): fp16 d; 64 bytes of 8-bit grid indices (256-point grid, decoded 4, 12, ..., 52, 62); then per
  32 values a uint32 of four 7-bit sign codes (8th sign = parity) and a 4-bit scale s: value = d * (0.5 + s) * 0.5
  * grid * sign.
- IQ3_S (110 bytes): fp16 d; 64 low index bytes; 8 bytes of 9th index bits (512-point grid, decoded 1, 3, ..., 15);
  32 explicit sign bytes; 4 bytes of two 4-bit scales: value = d * (1 + 2 s) * grid * sign.

Encoders reproduce llama.cpp's ``quantize_iq3_xxs`` / ``quantize_iq3_s`` bit for bit, with or without importance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jgptq.ggml import registry
from jgptq.ggml.common import div, f16_bits, f16_value, from_le, le_bytes, mul, seq_max, sqrt
from jgptq.ggml.iq_block import (encode_rows, explicit_signs, grid_values, imatrix_weights, pack_fields,
                                 parity_signs, payload_blocks, row_sigma2, sign_bits, super_scale_codes)
from jgptq.ggml.iq_grids import get_grid, ksigns
from jgptq.ggml.iq_search import scale_search, tables, trial_numerators


def decode_iq3_xxs(payload):
    """IQ3_XXS payload uint8 (..., nb * 98) -> float32 (..., nb * 256)."""
    blk, lead = payload_blocks(payload, 98)
    d = f16_value(from_le(blk[:, :2], 2)[:, 0])
    idx = blk[:, 2:66].reshape(-1, 8, 4, 2)  # (m, ib32, group of 8, two grid points)
    aux = from_le(blk[:, 66:98], 4)  # (m, 8)
    db = (d[:, None] * (np.float32(0.5) + (aux >> 28).astype(jnp.float32))) * np.float32(0.5)
    codes = (aux[..., None] >> (7 * jnp.arange(4, dtype=jnp.uint32))) & 127
    signs = sign_bits(jnp.asarray(ksigns())[codes])  # (m, 8, 4, 8)
    vals = grid_values("iq3xxs")[idx].reshape(-1, 8, 4, 8)
    y = (db[..., None, None] * vals) * signs
    return y.reshape(*lead, -1)


def decode_iq3_s(payload):
    """IQ3_S payload uint8 (..., nb * 110) -> float32 (..., nb * 256)."""
    blk, lead = payload_blocks(payload, 110)
    d = f16_value(from_le(blk[:, :2], 2)[:, 0])
    lo = blk[:, 2:66].astype(jnp.uint32).reshape(-1, 8, 8)  # (m, ib32, grid point)
    qh = blk[:, 66:74].astype(jnp.uint32)
    sgn = blk[:, 74:106].reshape(-1, 8, 4)
    sc = blk[:, 106:110].astype(jnp.uint32)
    idx = lo | (((qh[..., None] >> jnp.arange(8, dtype=jnp.uint32)) & 1) << 8)
    s = jnp.stack([sc & 15, sc >> 4], axis=-1).reshape(-1, 8)  # per ib32
    db = d[:, None] * (1 + 2 * s).astype(jnp.float32)
    vals = grid_values("iq3s")[idx].reshape(-1, 8, 4, 8)
    y = (db[..., None, None] * vals) * sign_bits(sgn)
    return y.reshape(*lead, -1)


def _iq3_core(xb, qw, *, name: str):
    """Per 32-value sub-block: (scale (m, 8), grid indices (m, 8, 8), sign codes (m, 8, 4), skip (m, 8))."""
    m = xb.shape[0]
    t = tables(get_grid(name))
    x = xb.reshape(m, 8, 32)
    if qw is not None:
        weight = imatrix_weights(x, qw.reshape(m, 8, 32), row_sigma2(xb, 2.0))
    else:
        weight = mul(x, x)
    waux = sqrt(weight)
    xg, wg = x.reshape(m, 8, 4, 8), weight.reshape(m, 8, 4, 8)
    if name == "iq3xxs":
        xval, signs = parity_signs(xg, wg)
    else:
        xval, signs = explicit_signs(xg)
    xval, weight, waux = (a.reshape(m * 8, 32) for a in (xval, weight, waux))
    fmax = seq_max(xval)
    if name == "iq3xxs":
        skip = fmax < np.float32(1e-8)
        search = dict(numerators=trial_numerators(8, 0.2, -15, 15), on_grid_init=True, requant="offgrid")
    else:
        skip = fmax == 0
        search = dict(numerators=trial_numerators(8, 0.2, -9, 9), on_grid_init=False, requant="all_if_offgrid")
    base = jnp.where(skip, np.float32(1.0), fmax)
    scale, gidx = scale_search(xval, weight, waux, base, div(base, np.float32(15.0)), t, g=4, kmax=8, **search)
    signs = signs.reshape(m * 8, 4)
    signs = jnp.where((scale < 0)[:, None], (~signs) & (127 if name == "iq3xxs" else 255), signs)
    scale = jnp.where(skip, np.float32(0.0), jnp.abs(scale))
    skip = skip.reshape(m, 8)
    gidx = jnp.where(skip[..., None], 0, gidx.reshape(m, 8, 8))
    signs = jnp.where(skip[..., None], 0, signs.reshape(m, 8, 4))
    return scale.reshape(m, 8), gidx.astype(jnp.uint32), signs.astype(jnp.uint32), skip


def _encode_xxs_blocks(xb, qw):
    m = xb.shape[0]
    scale, gidx, signs, _ = _iq3_core(xb, qw, name="iq3xxs")
    d, codes, ms = super_scale_codes(scale, 15)
    aux = signs[..., 0] | (signs[..., 1] << 7) | (signs[..., 2] << 14) | (signs[..., 3] << 21)
    aux = aux | (codes.astype(jnp.uint32) << 28)
    return pack_fields([le_bytes(f16_bits(mul(d, np.float32(1.0125)))[:, None], 2),
                        gidx.reshape(m, 64).astype(jnp.uint8), le_bytes(aux, 4)], zero=ms == 0)


def _encode_s_blocks(xb, qw):
    m = xb.shape[0]
    scale, gidx, signs, skip = _iq3_core(xb, qw, name="iq3s")
    d, codes, _ = super_scale_codes(scale, 15)
    hi = (gidx >> 8) << jnp.arange(8, dtype=jnp.uint32)
    qh = hi[..., 0]
    for k in range(1, 8):
        qh = qh | hi[..., k]
    sc = codes[:, 0::2] | (codes[:, 1::2] << 4)
    # llama.cpp advances its index-byte and sign-byte pointers only past sub-blocks it encoded: the bytes of
    # encoded sub-blocks are packed to the front (all-zero sub-blocks leave no slot), the rest stay zero.
    src = jnp.argsort(skip, axis=1, stable=True)
    kept = jnp.arange(8)[None, :] < jnp.sum(~skip, axis=1, keepdims=True)
    lo = jnp.where(kept[..., None], jnp.take_along_axis(gidx & 255, src[..., None], axis=1), 0)
    sg = jnp.where(kept[..., None], jnp.take_along_axis(signs, src[..., None], axis=1), 0)
    return pack_fields([le_bytes(f16_bits(mul(d, np.float32(1.033)))[:, None], 2),
                        lo.reshape(m, 64).astype(jnp.uint8), qh.astype(jnp.uint8),
                        sg.reshape(m, 32).astype(jnp.uint8), sc.astype(jnp.uint8)])


@jax.jit
def encode_iq3_xxs(x, importance=None):
    """IQ3_XXS encoder: x float32 (..., n), n % 256 == 0, importance float32 (n,) or None -> uint8 (..., n/256*98)."""
    return encode_rows(_encode_xxs_blocks, 98, x, importance, chunk=16384)


@jax.jit
def encode_iq3_s(x, importance=None):
    """IQ3_S encoder: x float32 (..., n), n % 256 == 0, importance float32 (n,) or None -> uint8 (..., n/256*110)."""
    return encode_rows(_encode_s_blocks, 110, x, importance, chunk=16384)


decode_iq3_xxs = jax.jit(decode_iq3_xxs)
decode_iq3_s = jax.jit(decode_iq3_s)

registry.register("iq3_xxs", decode=decode_iq3_xxs, encode=encode_iq3_xxs, requires_importance=False)
registry.register("iq3_s", decode=decode_iq3_s, encode=encode_iq3_s, requires_importance=False)
