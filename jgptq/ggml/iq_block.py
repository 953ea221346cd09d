"""Block-level pieces shared by the IQ1/IQ2/IQ3 codecs: weights, signs, super-block scales, drivers.

All functions are pure jnp on batches of super-blocks (leading axis m) and reproduce llama.cpp's float32 order of
operations (see :mod:`jgptq.ggml.common`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jgptq.ggml.common import QK_K, div, mul, nearest_int, ordered_sum, seq_max, sqrt
from jgptq.ggml.iq_grids import get_grid

CHUNK = 8192  # default super-blocks per lax.map step of an encoder (bounds peak memory)


def payload_blocks(payload, type_size):
    """uint8 (m, type_size) blocks of a payload (..., nb * type_size), and its leading shape."""
    payload = jnp.asarray(payload, jnp.uint8)
    lead = payload.shape[:-1]
    return payload.reshape(-1, type_size), lead


def grid_values(name):
    """float32 (n_grid, dim) decoded values of the grid points of ``name``."""
    return jnp.asarray(get_grid(name).values)


def sign_bits(sign_bytes):
    """float32 (..., 8): -1 where bit j of the sign byte is set, else +1.

    Built from the bits of 1.0 with the sign bit set, so that the compiler keeps the multiplication (a NaN times
    -1 then keeps its sign, as in C) instead of turning it into a negation.
    """
    bits = (sign_bytes[..., None].astype(jnp.uint32) >> jnp.arange(8, dtype=jnp.uint32)) & 1
    return lax.bitcast_convert_type(jnp.uint32(0x3F800000) | (bits << 31), jnp.float32)


def pack_fields(parts, zero=None):
    """uint8 (m, sum of widths): the byte fields ``parts`` (each uint8 (m, width)) side by side.

    Written field by field into a zero buffer (not one concatenation): XLA then fuses each field with its own
    producers instead of recomputing every per-block value for every output byte. Rows where ``zero`` (bool (m,))
    is set stay all zero.
    """
    m = parts[0].shape[0]
    out = jnp.zeros((m, sum(p.shape[1] for p in parts)), jnp.uint8)
    at = 0
    for p in parts:
        if zero is not None:
            p = jnp.where(zero[:, None], jnp.uint8(0), p)
        out = out.at[:, at:at + p.shape[1]].set(p.astype(jnp.uint8))
        at += p.shape[1]
    return out


def row_sigma2(xb, factor: float):
    """``factor * sum(x**2) / 256`` per super-block (m,), summed in order like llama.cpp."""
    sumx2 = ordered_sum(mul(xb, xb))
    if factor != 1:
        sumx2 = mul(np.float32(factor), sumx2)
    return div(sumx2, np.float32(QK_K))


def imatrix_weights(x, qw, sigma2):
    """``qw * sqrtf(sigma2 + x*x)``; x, qw (m, k, B), sigma2 (m,)."""
    return mul(qw, sqrt(sigma2[:, None, None] + mul(x, x)))


def parity_signs(x, weight):
    """Absolute values with even-parity signs per group of 8, as llama.cpp's IQ2_XXS/IQ2_XS/IQ3_XXS encoders do.

    Args:
      x, weight: float32 (..., 8).
    Returns:
      (xval float32 (..., 8), 7-bit sign code uint32 (...)). When the count of negatives is odd, the element with
      the smallest weight * x * x keeps its sign flipped in ``xval`` (it is negative there) and in the code.
    """
    neg = ~(x >= 0)
    xval = jnp.where(neg, -x, x)
    bits = neg.astype(jnp.uint32) << jnp.arange(8, dtype=jnp.uint32)
    s = bits[..., 0]
    for i in range(1, 8):
        s = s | bits[..., i]
    odd = (jnp.sum(neg, axis=-1) % 2) == 1
    imin = jnp.argmin(mul(mul(weight, x), x), axis=-1)
    hit = (jnp.arange(8) == imin[..., None]) & odd[..., None]
    xval = jnp.where(hit, -xval, xval)
    s = jnp.where(odd, s ^ (jnp.uint32(1) << imin.astype(jnp.uint32)), s)
    return xval, s & 127


def explicit_signs(x):
    """(xval, sign byte uint32) per group of 8: bit i set where x_i < 0 (llama.cpp's IQ2_S/IQ3_S)."""
    neg = ~(x >= 0)
    bits = neg.astype(jnp.uint32) << jnp.arange(8, dtype=jnp.uint32)
    s = bits[..., 0]
    for i in range(1, 8):
        s = s | bits[..., i]
    return jnp.where(neg, -x, x), s


def super_scale_codes(scales, nmax: int):
    """(d float32 (m,), codes int32 (m, nsub), max_scale (m,)) with d = max_scale / 31 and
    codes = clamp(nearest_int(0.5 * (scale / d - 1)), 0, nmax)."""
    ms = seq_max(jnp.concatenate([jnp.zeros_like(scales[:, :1]), scales], axis=1))
    d = div(ms, np.float32(31.0))
    id_ = div(np.float32(1.0), jnp.where(ms > 0, d, np.float32(1.0)))
    codes = jnp.clip(nearest_int(mul(np.float32(0.5), mul(id_[:, None], scales) - np.float32(1.0))), 0, nmax)
    return d, codes, ms


def superblocks(x, importance):
    """Cuts rows into 256-value super-blocks.

    Args:
      x: float32 (..., n), n a multiple of 256.
      importance: float32 (n,) or None.
    Returns:
      (xb float32 (m, 256), qw float32 (m, 256) or None, lead shape, n).
    """
    x = jnp.asarray(x, jnp.float32)
    lead, n = x.shape[:-1], x.shape[-1]
    nb = n // QK_K
    xb = x.reshape(-1, QK_K)
    qw = None
    if importance is not None:
        imp = jnp.asarray(importance, jnp.float32).reshape(nb, QK_K)
        rows = xb.shape[0] // nb if nb else 0
        qw = jnp.broadcast_to(imp[None], (rows, nb, QK_K)).reshape(-1, QK_K)
    return xb, qw, lead, n


def map_chunks(fn, args, chunk: int):
    """Applies ``fn`` to row chunks of every array in ``args`` (leading axis m) with lax.map; bounds peak memory.

    ``fn`` maps arrays (c, ...) to one array (c, ...). Rows are padded with zeros to a multiple of the chunk.
    """
    m = args[0].shape[0]
    if m <= chunk:
        return fn(*args)
    n_chunks = -(-m // chunk)
    pad = n_chunks * chunk - m

    def prep(a):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(n_chunks, chunk, *a.shape[1:])

    out = lax.map(lambda t: fn(*t), tuple(prep(a) for a in args))
    return out.reshape(n_chunks * chunk, *out.shape[2:])[:m]


def encode_rows(block_fn, type_size, x, importance, chunk=CHUNK):
    """Runs ``block_fn`` over the super-blocks of ``x`` (..., n), ``chunk`` super-blocks at a time.

    Returns uint8 (..., n // 256 * type_size).
    """
    xb, qw, lead, n = superblocks(x, importance)
    if qw is None:
        out = map_chunks(lambda a: block_fn(a, None), (xb,), chunk)
    else:
        out = map_chunks(block_fn, (xb, qw), chunk)
    return out.reshape(*lead, n // QK_K * type_size)
