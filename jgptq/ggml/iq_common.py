"""Bit-exact float32 building blocks for the IQ encoders (llama.cpp's C arithmetic, reproduced under XLA).

llama.cpp's encoders are plain IEEE float32 code: every product is rounded before it is added, every sum is a
sequential loop, divisions and square roots are correctly rounded. XLA breaks each of these unless told otherwise:

- it contracts ``a * b + c`` into a fused multiply-add inside a fusion (CPU and GPU). :func:`mul` returns a
  product behind a select that the compiler cannot see through, so it is always rounded on its own;
- its float32 division on GPU is not correctly rounded. :func:`div` and :func:`sqrt` compute in float64 (inside a
  scoped x64 context, so callers need not enable x64) from operands widened bit by bit with integer operations,
  which the compiler cannot narrow back to float32, then round once to float32. One float64 operation rounded to
  float32 equals the correctly rounded float32 operation;
- its reductions are trees. :func:`seq_sum` adds along an axis left to right, like a C loop.

Every function is pure jnp, traceable under jit and vmap.

One difference is left: XLA on CPU flushes subnormal float32 results to zero, C does not. Blocks whose values are
so small (around 1e-7 and below, depending on the importance) that llama.cpp's products and sums fall below
2**-126 can encode differently on CPU; they match llama.cpp run with subnormals flushed (FTZ+DAZ), which the
tests check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

QK_K = 256
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23


def _x64():
    """A context in which float64 arrays can be built, whatever the global jax_enable_x64 setting."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # older jax
        from jax.experimental import enable_x64 as enable
    try:
        return enable(True)
    except TypeError:  # a context manager taking no argument
        return enable()


def opaque(p):
    """``p`` unchanged (bit for bit, NaNs included but one NaN pattern), hidden from contraction and narrowing.

    A select on the integer bits whose arms are both non-constant: the compiler can neither fold it (that would
    need the bits to be known) nor push a following addition into its arms, so a product passed through it is
    rounded before any addition, whatever fast-math flags the backend sets on floating-point operations.
    """
    bits = lax.bitcast_convert_type(p, jnp.uint32)
    other = lax.bitcast_convert_type(bits ^ jnp.uint32(1), p.dtype)
    return jnp.where(bits != jnp.uint32(0x7FC00001), p, other)


def mul(a, b):
    """float32 product rounded on its own (never fused into a following addition)."""
    return opaque(jnp.multiply(a, b))


def _widen(a):
    """float32 -> float64, exactly, built from the bits (the compiler cannot tell it is a plain widening)."""
    a = jnp.asarray(a, jnp.float32)
    bits = lax.bitcast_convert_type(a, jnp.uint32).astype(jnp.uint64)
    sign = bits >> np.uint64(31)
    exp = (bits >> np.uint64(23)) & np.uint64(0xFF)
    mant = bits & np.uint64(0x7FFFFF)
    normal = lax.bitcast_convert_type((sign << np.uint64(63)) | ((exp + np.uint64(896)) << np.uint64(52))
                                      | (mant << np.uint64(29)), jnp.float64)
    small = mant.astype(jnp.float64) * np.float64(2.0 ** -149)  # zero or subnormal
    small = jnp.where(sign == 1, -small, small)
    special = a.astype(jnp.float64)  # inf, nan
    return jnp.where(exp == 0, small, jnp.where(exp == 0xFF, special, normal))


def div(a, b):
    """Correctly rounded float32 quotient a / b on every backend."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    with _x64():
        q = _widen(a) / _widen(b)
        return q.astype(jnp.float32)


def sqrt(a):
    """Correctly rounded float32 square root on every backend."""
    with _x64():
        return jnp.sqrt(_widen(a)).astype(jnp.float32)


def nearest_int(f):
    """llama.cpp's ``nearest_int``: round half to even through the 1.5 * 2**23 trick; int32 (valid for |f| < 2**22)."""
    v = jnp.asarray(f, jnp.float32) + _MAGIC
    i = lax.bitcast_convert_type(v, jnp.int32)
    return (i & 0x7FFFFF) - 0x400000


def seq_sum(p, axis=-1):
    """Sum of ``p`` along ``axis`` in index order, one float32 addition at a time."""
    p = jnp.moveaxis(p, axis, -1)
    s = p[..., 0]
    for i in range(1, p.shape[-1]):
        s = s + p[..., i]
    return s


def prefix_sums(p):
    """Running sums along the last axis, from 0, one float32 addition at a time (a lax.scan).

    Args:
      p: float32 (..., n).
    Returns:
      float32 (n + 1, ...): entry j is p[..., 0] + ... + p[..., j - 1] summed left to right (entry 0 is zeros).
    """
    def step(c, v):
        c = c + v
        return c, c

    zero = jnp.zeros(p.shape[:-1], p.dtype)
    _, sums = lax.scan(step, zero, jnp.moveaxis(p, -1, 0))
    return jnp.concatenate([zero[None], sums], axis=0)


def seq_max(p, axis=-1):
    """llama.cpp's ``max = p[0]; max = MAX(max, p[i])`` along ``axis``.

    For non-NaN input this is the plain maximum, except that C may return -0.0 where this returns +0.0; every
    caller only compares the result with a positive threshold or with zero, or divides by it after such a test.
    A reduction (not a chain of selects): XLA keeps it in its own kernel.
    """
    return jnp.max(p, axis=axis)


def fp16_bits(x):
    """uint16 bits of float32 ``x`` rounded to IEEE half (round to nearest even, like GGML_FP32_TO_FP16)."""
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32).astype(jnp.float16), jnp.uint16)


def fp16_to_f32(bits):
    """float32 value of uint16 half bits (exact)."""
    return lax.bitcast_convert_type(jnp.asarray(bits, jnp.uint16), jnp.float16).astype(jnp.float32)


def le_bytes(v, nbytes: int):
    """uint8 (..., k * nbytes): little-endian bytes of the unsigned integers ``v`` (..., k)."""
    v = jnp.asarray(v).astype(jnp.uint32)
    parts = [((v >> (8 * i)) & 0xFF).astype(jnp.uint8) for i in range(nbytes)]
    return jnp.stack(parts, axis=-1).reshape(*v.shape[:-1], v.shape[-1] * nbytes)


def from_le(b, nbytes: int):
    """uint32 (..., k): little-endian unsigned integers from bytes ``b`` (..., k * nbytes)."""
    b = jnp.asarray(b, jnp.uint8).astype(jnp.uint32).reshape(*b.shape[:-1], -1, nbytes)
    v = b[..., 0]
    for i in range(1, nbytes):
        v = v | (b[..., i] << (8 * i))
    return v


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
