"""MXFP4 (OCP microscaling FP4, GGML type 39): blocks of 32 values, one E8M0 scale byte + 16 bytes of E2M1 codes.

A block stores ``e`` (a power-of-two scale, ``d = 2**(e - 128)`` in llama.cpp's convention, where the 4-bit codes
select ``tables.KVALUES_MXFP4`` = twice the E2M1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives) and
``qs[j] = code[j] | code[j + 16] << 4``; the weight is ``kvalues[code] * d``.

The encoder is llama.cpp's ``quantize_row_mxfp4_ref`` (what ``ggml_quantize_chunk`` runs; its ``quantize_mxfp4``
ignores the importance matrix, and so does this encoder: ``importance`` is accepted and has no effect, which keeps
the bytes llama.cpp's with or without an imatrix):

- ``e = (uint8_t)(floorf(log2f(amax)) - 2 + 127)`` for the block's max |x| (0 for an all-zero block). C's
  ``log2f`` rounds to float32, so for a max just below a power of two (up to 44 floats below it) ``floorf`` gives
  that power's exponent; :data:`LOG2F_FLOOR_STARTS` records, per result, the first float that reaches it (float64
  ``log2`` rounded to float32, which tests check against the C library's ``log2f``). For a max below 2**-125 the
  value is negative, a conversion C leaves undefined; llama.cpp's x86-64 build keeps its low 8 bits (e = 255 for
  2**-126, 232 for 2**-149) and writes such blocks (its own row validator calls e = 255 invalid), and so does this
  encoder, byte for byte.
- each value takes the first level of least float32 ``|kvalues[i] * d - x|`` (ties go to the lower index, so to the
  smaller magnitude; code 8, the second zero, is never written). For e = 253 (a block max within 44 floats of the
  largest float, where log2f rounds up to 128) the levels 8 d and 12 d overflow to Inf in C, so the block's
  values take at most 6 d, as there.

Everything runs on integer bits: the levels are compared with ``x * 2**(128 - e)`` (the block scaled so that
``d = 1``, built exactly from the bits), which rounds every difference exactly as C's unscaled one does. So the
bytes do not depend on whether the backend flushes subnormals (XLA:CPU does), and tiny blocks match too. The
decoder builds ``kvalues[code] * d`` from bits as well (subnormal and infinite products included, as C's float
multiply gives them).

``x`` float32 (..., n) -> payload uint8 (..., n // 32 * 17); :func:`decode_mxfp4` inverts the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jgptq.ggml.common import F32, I32, blocks, pack_nibbles, unblock, unpack_nibbles
from jgptq.ggml.registry import register
from jgptq.ggml.tables import KVALUES_MXFP4

QK = 32
_U32 = jnp.uint32
_MIN_LOG2 = -149  # log2 of the smallest positive float32
_MAX_LOG2 = 128  # floorf(log2f(x)) of the largest finite floats


def _log2f_floor_starts() -> np.ndarray:
    """int32 (278,): entry k + 149 is the bit pattern of the smallest positive float32 x with
    ``floor(log2f(x)) >= k``, k = -149..128; the entries increase strictly.

    ``log2f`` is modelled as float64 ``log2`` rounded to float32 (correctly rounded wherever it matters here: the
    candidates are the 64 floats below each power of two, none of whose logarithms lies near a float32 midpoint)."""
    starts = []
    for k in range(_MIN_LOG2, _MAX_LOG2 + 1):
        if k == _MAX_LOG2:
            top = 0x7F800000  # 2**128 is not a float32; its bit pattern is Inf's
        elif k >= -126:
            top = (k + 127) << 23
        else:
            top = 1 << (k + 149)
        cand = np.arange(max(top - 64, 1), top, dtype=np.int64)
        vals = cand.astype(np.uint32).view(np.float32).astype(np.float64)
        reach = np.floor(np.log2(vals).astype(np.float32)) >= k
        if reach.size and reach[0] and cand[0] > 1:
            raise ImportError(f"the float32 log2 table needs more than 64 candidates below 2**{k}")
        starts.append(int(cand[np.argmax(reach)]) if reach.any() else top)
    out = np.array(starts, dtype=np.int64)
    if not np.all(np.diff(out) > 0) or out[-1] >= 2**31:
        raise ImportError("the float32 log2 table is not strictly increasing")
    return out.astype(np.int32)


#: int32 (278,): see :func:`_log2f_floor_starts`.
LOG2F_FLOOR_STARTS: np.ndarray = _log2f_floor_starts()
LOG2F_FLOOR_STARTS.setflags(write=False)


def _magnitude_parts():
    """Per code: (log2 of the level's power of two, 1 if the level is 1.5 times it, 1 if negative, 1 if zero)."""
    k = KVALUES_MXFP4.astype(np.int64)
    mag = np.abs(k)
    shift = np.where(mag > 0, np.floor(np.log2(np.maximum(mag, 1))), 0).astype(np.int32)
    ratio = np.where(mag > 0, mag / np.exp2(shift.astype(np.float64)), 1.0)
    if not np.all(np.isin(ratio, (1.0, 1.5))):
        raise ImportError("an MXFP4 level is not 1 or 1.5 times a power of two")
    return shift, (ratio == 1.5).astype(np.int32), (k < 0).astype(np.int32), (mag == 0).astype(np.int32)


_SHIFT, _HALF, _NEG, _ZERO = _magnitude_parts()


def block_exponent(xb):
    """llama.cpp's E8M0 byte of each block: float32 (..., 32) -> int32 (...,) in 0..255 (see the module notes)."""
    amax_bits = jnp.max(lax.bitcast_convert_type(jnp.asarray(xb, F32), I32) & 0x7FFFFFFF, axis=-1)
    floor_log2 = jnp.searchsorted(jnp.asarray(LOG2F_FLOOR_STARTS), amax_bits, side="right").astype(I32) - 150
    return jnp.where(amax_bits > 0, (floor_log2 + 125) & 0xFF, 0)


def scaled_values(xb, e):
    """``xb * 2**(128 - e)`` exactly, float32 (..., 32), for every |value| >= 2**-126 (smaller ones become +-0 or
    a subnormal: they take code 0 either way, being less than half the smallest level)."""
    bits = lax.bitcast_convert_type(jnp.asarray(xb, F32), _U32)
    sign = bits & _U32(0x80000000)
    expo = ((bits >> 23) & 0xFF).astype(I32)
    mant = bits & _U32(0x7FFFFF)
    t = (128 - e)[..., None]
    new_expo = expo + t
    normal = lax.bitcast_convert_type(sign | (jnp.clip(new_expo, 0, 254).astype(_U32) << 23) | mant, F32)
    # A subnormal x is mant * 2**-149: its scaled value is float(mant) * 2**(t - 149), exact when normal.
    factor = lax.bitcast_convert_type((jnp.clip(t - 22, 1, 254).astype(_U32) << 23), F32)
    sub = mant.astype(F32) * factor
    sub = jnp.where(sign != 0, -sub, sub)
    zero = lax.bitcast_convert_type(sign, F32)
    return jnp.where(expo > 0, jnp.where(new_expo >= 1, normal, zero), jnp.where(t >= 23, sub, zero))


def mxfp4_codes(xs, e):
    """Index of the first nearest level: block-scaled values float32 (..., 32) (``x * 2**(128 - e)``) and scale
    bytes int (...,) -> int32 (..., 32) in 0..15. A level whose product with ``d`` overflows float32 is Inf in C
    and so never nearest (levels 8 and 12 for e = 253)."""
    levels = jnp.asarray(KVALUES_MXFP4.astype(np.float32))
    err = jnp.abs(levels - xs[..., None])
    overflow = (jnp.asarray(e, I32)[..., None] - 128 + jnp.asarray(_SHIFT)) >= 128  # (..., 16)
    err = jnp.where(overflow[..., None, :], jnp.inf, err)
    return jnp.argmin(err, axis=-1).astype(I32)


def encode_mxfp4(x, importance=None):
    """MXFP4: x float32 (..., n) -> uint8 (..., n // 32 * 17); ``importance`` is ignored, as llama.cpp does."""
    del importance
    xb = blocks(jnp.asarray(x, F32), QK)
    e = block_exponent(xb)
    codes = mxfp4_codes(scaled_values(xb, e), e)
    qs = pack_nibbles(codes[..., :16], codes[..., 16:])
    return unblock(jnp.concatenate([e.astype(jnp.uint8)[..., None], qs], axis=-1))


def level_values(e, codes):
    """``kvalues[codes] * 2**(e - 128)`` as C's float32 multiply gives it, built from bits: e int (...,) and codes
    int (..., m) -> float32 (..., m) (subnormal products kept, overflowing ones +-Inf, code 0 and 8 give +0)."""
    codes = jnp.asarray(codes, I32)
    q = jnp.asarray(e, I32)[..., None] - 128 + jnp.asarray(_SHIFT)[codes]
    half = jnp.asarray(_HALF)[codes].astype(_U32)
    normal = (jnp.clip(q + 127, 0, 255).astype(_U32) << 23) | (half << 22)
    normal = jnp.where(q + 127 >= 255, _U32(0x7F800000), normal)
    sub = ((_U32(1) << 23) | (half << 22)) >> jnp.clip(-126 - q, 0, 31).astype(_U32)
    mag = jnp.where(q >= -126, normal, sub)
    mag = jnp.where(jnp.asarray(_ZERO)[codes] != 0, _U32(0), mag)
    sign = jnp.asarray(_NEG)[codes].astype(_U32) << 31
    return lax.bitcast_convert_type(mag | sign, F32)


def decode_mxfp4(payload):
    """MXFP4 payload uint8 (..., nb*17) -> float32 (..., nb*32), bit for bit llama.cpp's ``dequantize_row_mxfp4``."""
    p = blocks(jnp.asarray(payload, jnp.uint8), 17)
    e = p[..., 0].astype(I32)
    return unblock(level_values(e, unpack_nibbles(p[..., 1:17])))


register("mxfp4", decode=jax.jit(decode_mxfp4), encode=jax.jit(encode_mxfp4))


def from_packed(packed, scales) -> np.ndarray:
    """MX-packed FP4 weights (the OCP layout of gpt-oss's ``*_blocks``/``*_scales`` and compressed-tensors'
    ``mxfp4-pack-quantized``) as GGML MXFP4 blocks, losslessly (bits moved, nothing rounded).

    Args:
      packed: uint8 (..., cols // 2) or (..., cols // 32, 16): two E2M1 codes a byte, element 2i in the low
        nibble and 2i + 1 in the high one.
      scales: uint8 (..., cols // 32): one E8M0 exponent per 32 values (value = E2M1 * 2**(scale - 127)).
    Returns:
      uint8 (..., cols // 32 * 17): GGML MXFP4 payload rows (``decode`` gives the same values: GGML's levels are
      twice E2M1's and its scale half, the codes index the same table).
    Raises:
      ValueError: a dtype other than uint8, or shapes that do not match.
    """
    p, s = np.asarray(packed), np.asarray(scales)
    if p.dtype != np.uint8 or s.dtype != np.uint8:
        raise ValueError(f"MX-packed FP4 needs uint8 codes and scales, got {p.dtype} and {s.dtype}")
    if p.ndim >= 2 and p.shape[-1] == 16 and p.shape[:-1] == s.shape:
        p = p.reshape(p.shape[:-2] + (p.shape[-2] * 16,))
    if p.ndim < 1 or s.shape != p.shape[:-1] + (p.shape[-1] // 16,) or p.shape[-1] % 16:
        raise ValueError(f"MX-packed FP4 codes of shape {np.shape(packed)} do not match scales of shape "
                         f"{s.shape}: need (..., cols // 2) or (..., cols // 32, 16) codes and (..., cols // 32) "
                         f"scales")
    pb = p.reshape(s.shape + (16,))
    codes = np.stack([pb & 0x0F, pb >> 4], axis=-1).reshape(s.shape + (32,))  # element order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([s[..., None], qs.astype(np.uint8)], axis=-1).reshape(s.shape[:-1] + (-1,))
