"""Bit-exact float32 numerics shared by every GGML codec (llama.cpp's C arithmetic, reproduced under XLA).

llama.cpp's quantizers are plain IEEE float32 C, built without multiply-add contraction on x86-64: every product
is rounded before it is added, every sum runs left to right, every division and square root is correctly rounded,
and integers come from three different roundings. XLA promises none of that, and its GPU compiler rewrites more
than its CPU compiler does. Each hazard and the construction here that defeats it:

- **Contraction.** XLA contracts ``a * b + c`` into a fused multiply-add on CPU and GPU (LLVM's ``contract``
  fusion). :func:`settle` returns a value behind a select on its integer bits whose two arms are both non-constant:
  no compiler can fold that select (it would need the bits) nor push a following addition into its arms, whatever
  fast-math flags it sets, so ``settle(a * b) + c`` adds the rounded product. :func:`mul` is the settled product;
  every product that C rounds before an addition goes through it.
- **Division and square root.** XLA:GPU lowers float32 division to ``div.full.f32`` (up to 2 ulps off) and may
  approximate square roots. :func:`div` and :func:`sqrt` compute in float64 from operands widened *bit by bit*
  (integer shifts and masks) and round once to float32. For p = 24-bit operands and a q = 53-bit intermediate,
  q >= 2p + 2, so one float64 operation rounded to float32 equals the correctly rounded float32 operation (the
  exact quotient or root of float32 numbers never lies on, or within 2**-49 relative of, a float32 rounding
  boundary, so even a float64 result a few ulps off would round the same way; GPUs round float64 ``/`` and
  ``sqrt`` correctly). A plain ``x.astype(float64)`` would not do: LLVM narrows ``fptrunc(fdiv(fpext a, fpext
  b))`` back to a float32 division, which XLA:GPU then lowers to its approximation; the compiler cannot see that
  the bit-built widening is one. float64 is enabled only while these few operations are traced
  (:func:`x64_scope`), whatever ``jax_enable_x64`` says; the results are settled (next point).
- **Conversion chains.** XLA:GPU runs ``SimplifyFPConversions`` whenever ``xla_allow_excess_precision`` is on (the
  default): any chain of two or more floating-point ``convert``s collapses to one, *even when a link rounds*. So
  ``v.astype(float16).astype(float32)`` is ``v`` on the GPU (the bitcasts of a half round trip through uint16 are
  folded away first), and ``x64 -> float32 -> float16`` skips the float32 rounding. Hence :func:`f16_value`
  decodes half bits with integer arithmetic only, :func:`f16_bits` settles its input, and :func:`div` and
  :func:`sqrt` settle their float32 result. XLA:CPU does not run that pass; ``tests/ggml/test_gpu_proxy.py``
  checks every codec's optimized HLO for float-convert chains instead.
- **Reductions.** XLA reductions are trees. :func:`ordered_sum` adds left to right, one float32 addition at a
  time, like a C loop; :func:`prefix_sums` keeps every running sum. Maxima may use reductions (the result does not
  depend on the order, up to the sign of zero, see :func:`seq_max`).
- **Roundings.** :func:`nearest_int` (llama.cpp's 1.5 * 2**23 trick), :func:`roundf` (C ``roundf``) and
  :func:`trunc_int` (C float -> int conversion).

Every function is pure jnp, traceable under ``jit``/``vmap``/``lax`` loops. Functions that take a float value
expect a rounded one: a product must come from :func:`mul` (or be settled) before it reaches them.

Where results can still differ from llama.cpp:

- XLA:CPU flushes float32 subnormals to zero (inputs and results of float32 arithmetic); C does not. Blocks whose
  C computation passes through subnormals can differ on CPU: blocks whose values are all tiny (max |x| below about
  1e-8 to 1e-5, depending on the format), or importance values so small that weighted sums fall below 2**-126.
  Such blocks match llama.cpp run with subnormals flushed. XLA:GPU keeps subnormals unless ``--xla_gpu_ftz=true``.
- Overflowing blocks (|x| above about 1e19, whose squares overflow float32) follow C's NaN/Inf propagation where
  it is cheap to do so, without a guarantee.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
I32 = jnp.int32
QK_K = 256

GROUP_MAX_EPS = np.float32(1e-15)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23
_NAN_PATTERN = np.uint32(0x7FC00001)  # the one bit pattern settle() changes (a NaN, to another NaN)


def x64_scope():
    """Context manager in which float64 arrays can be built, whatever the global ``jax_enable_x64`` setting."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # older jax
        from jax.experimental import enable_x64 as enable
    try:
        return enable(True)
    except TypeError:  # a context manager taking no argument
        return enable()


# ----------------------------------------------------------------------------------------------- rounding guards

def settle(v):
    """float32 ``v`` unchanged, as a value the compiler can neither fuse into a multiply-add nor convert again.

    A select on the integer bits whose arms are both non-constant (``v`` and ``v`` with its lowest bit flipped,
    taken only for one NaN bit pattern, which becomes another NaN). Every non-NaN value passes bit for bit.
    """
    v = jnp.asarray(v, F32)
    bits = lax.bitcast_convert_type(v, jnp.uint32)
    other = lax.bitcast_convert_type(bits ^ jnp.uint32(1), F32)
    return lax.select(bits != _NAN_PATTERN, v, other)


def where(cond, a, b):
    """``jnp.where(cond, a, b)`` as one ``select`` (operands broadcast and promoted as ``jnp.where`` does).

    ``jnp.where`` is a program of its own in the trace; the codecs call it hundreds of times, and every nested
    program is one more to batch and lower."""
    dtype = jnp.result_type(a, b)
    shape = jnp.broadcast_shapes(jnp.shape(cond), jnp.shape(a), jnp.shape(b))

    def fit(v, dt):
        v = jnp.asarray(v, dt)
        if v.shape == shape:
            return v
        return lax.broadcast_in_dim(v, shape, tuple(range(len(shape) - v.ndim, len(shape))))

    return lax.select(fit(cond, jnp.bool_), fit(a, dtype), fit(b, dtype))


def mul(a, b):
    """float32 product ``a * b``, rounded before any later use (never contracted into a multiply-add)."""
    return settle(jnp.multiply(jnp.asarray(a, F32), jnp.asarray(b, F32)))


def _widen(a):
    """float32 -> float64 exactly, built from the bits (the compiler cannot tell that it is a plain widening)."""
    bits = lax.bitcast_convert_type(jnp.asarray(a, F32), jnp.uint32).astype(jnp.uint64)
    sign = bits >> np.uint64(31)
    exp = (bits >> np.uint64(23)) & np.uint64(0xFF)
    mant = bits & np.uint64(0x7FFFFF)
    wide_exp = where(exp == 0xFF, np.uint64(0x7FF), exp + np.uint64(896))  # Inf/NaN keep an all-ones exponent
    normal = lax.bitcast_convert_type((sign << np.uint64(63)) | (wide_exp << np.uint64(52)) | (mant << np.uint64(29)),
                                      jnp.float64)
    small = mant.astype(jnp.float64) * np.float64(2.0 ** -149)  # zero or subnormal: exact
    small = where(sign == 1, -small, small)
    return where(exp == 0, small, normal)


def _div64(a, b):
    return a / b


def _sqrt64(a):
    return jnp.sqrt(a)


def div(a, b):
    """Correctly rounded float32 ``a / b`` on every backend (IEEE special cases included)."""
    a, b = jnp.asarray(a, F32), jnp.asarray(b, F32)
    with x64_scope():
        q = _div64(_widen(a), _widen(b)).astype(F32)
    return settle(q)


def sqrt(a):
    """Correctly rounded float32 square root (C ``sqrtf``) on every backend."""
    with x64_scope():
        r = _sqrt64(_widen(a)).astype(F32)
    return settle(r)


# ----------------------------------------------------------------------------------------------- integer roundings

def nearest_int(v):
    """llama.cpp's ``nearest_int``: adds 1.5 * 2**23 in float32 and reads the low mantissa bits -> int32.

    Round half to even for ``|v| <= 4194303``; outside that range it reproduces the same bit pattern as C.
    """
    t = jnp.asarray(v, F32) + _MAGIC
    return (lax.bitcast_convert_type(t, I32) & 0x7FFFFF) - 0x400000


def roundf(v):
    """C ``roundf`` (half away from zero), exactly, as float32."""
    v = jnp.asarray(v, F32)
    a = jnp.abs(v)
    fl = jnp.floor(a)
    r = fl + where(a - fl >= np.float32(0.5), np.float32(1), np.float32(0))
    return where(v < 0, -r, r)


def trunc_int(v):
    """C conversion of a float to an integer (toward zero) -> int32, for values inside the int32 range."""
    return jnp.trunc(jnp.asarray(v, F32)).astype(I32)


def as_f32(i):
    """int -> float32 conversion (exact for the small integers of the codecs)."""
    return jnp.asarray(i).astype(F32)


# ----------------------------------------------------------------------------------------------- ordered reductions

def ordered_sum(terms, start=None, unroll: int = 256):
    """``sum(terms[..., i] for i in range(n))`` added left to right in float32, like a C loop.

    Args:
      terms: float32 (..., n), already rounded values (products from :func:`mul`).
      start: None to start from ``terms[..., 0]`` (a C sum seeded with the first term); ``0.0`` for a C sum
        initialized to zero (``0 + t`` turns ``-0`` into ``+0``); or an array broadcastable to (...,).
      unroll: sums of up to this many terms are written out (XLA fuses them into one kernel); longer ones run in a
        ``fori_loop`` (a small program; the order is the same).
    Returns:
      float32 (...,).
    """
    terms = jnp.asarray(terms, F32)
    n = terms.shape[-1]
    if n <= unroll:
        parts = columns(terms)
        acc = _first_term(parts[0], start, keepdims=True)
        for i in range(1, n):
            acc = acc + parts[i]
        return _drop_last(acc)
    acc = _first_term(terms[..., 0], start, keepdims=False)

    def add(i, acc):
        return acc + lax.dynamic_index_in_dim(terms, i, axis=-1, keepdims=False)

    return lax.fori_loop(1, n, add, acc)


def columns(x) -> list:
    """The n entries of ``x`` (..., n) along its last axis as n arrays (..., 1), cut by one split.

    Written-out loops over a group's elements use these instead of ``x[..., i]`` (a slice and a squeeze each): a
    codec's program has thousands of such steps, and each is a step to trace, batch and lower."""
    n = x.shape[-1]
    return list(lax.split(x, (1,) * n, axis=x.ndim - 1))


def _drop_last(x):
    return lax.squeeze(x, (x.ndim - 1,))


def _first_term(t0, start, keepdims: bool):
    if start is None:
        return t0
    if isinstance(start, (int, float)) and start == 0:
        return where(t0 == 0, jnp.zeros_like(t0), t0)
    start = jnp.asarray(start, F32)
    return (start[..., None] if keepdims and start.ndim else start) + t0


def prefix_sums(p):
    """Running sums along the last axis, from 0, one float32 addition at a time (a ``lax.scan``).

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


def first_absmax(x):
    """C's ``if (fabsf(v) > amax) { amax = fabsf(v); max = v; }`` scan from ``amax = max = 0``.

    Returns (amax, max): float32 (...,) each; ``max`` is the signed value of the first element of largest
    magnitude, and ``+0`` when every element is zero. NaN elements are skipped, as C's ``>`` skips them.
    """
    ax = jnp.abs(x)
    ax = where(ax == ax, ax, jnp.zeros_like(ax))
    idx = jnp.argmax(ax, axis=-1)
    amax = jnp.max(ax, axis=-1)
    m = jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    return amax, where(amax > 0, m, jnp.zeros_like(m))


def scan_min_max(x):
    """C's ``min = max = x[0]; for i >= 1: if (x[i] < min) min = x[i]; if (x[i] > max) max = x[i];``.

    Sequential on purpose: it keeps C's choice between ``-0`` and ``+0``. Returns (min, max), float32 (...,).
    """
    parts = columns(jnp.asarray(x))
    lo = hi = parts[0]
    for v in parts[1:]:
        lo = lax.select(v < lo, v, lo)
        hi = lax.select(v > hi, v, hi)
    return _drop_last(lo), _drop_last(hi)


def scan_max_gt(x, start=0.0):
    """C's ``m = start; for each v: if (v > m) m = v;`` -> float32 (...,)."""
    x = jnp.asarray(x, F32)
    m = jnp.full(x.shape[:-1] + (1,), start, F32)
    for v in columns(x):
        m = lax.select(v > m, v, m)
    return _drop_last(m)


# ----------------------------------------------------------------------------------------------- fp16 and bytes

def f16_bits(v):
    """``GGML_FP32_TO_FP16``: float32 -> IEEE half bits (round to nearest even, subnormals kept) as uint16.

    The input is settled first, so that the one conversion really starts from the float32 value.
    """
    return lax.bitcast_convert_type(settle(v).astype(jnp.float16), jnp.uint16)


def f16_value(bits):
    """``GGML_FP16_TO_FP32``: half bits (uint16 or any unsigned int below 2**16) -> float32, exactly.

    Integer arithmetic only (no float16 conversion the compiler could pair with another and drop): normal halves
    rebias their exponent, subnormal ones are normalized with a leading-zero count, Inf and NaN keep their payload
    with the quiet bit set (what the hardware conversion does).
    """
    h = jnp.asarray(bits).astype(jnp.uint32) & 0xFFFF
    sign = (h >> 15) << 31
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    normal = ((exp + 112) << 23) | (mant << 13)
    special = jnp.uint32(0x7F800000) | (mant << 13) | where(mant != 0, jnp.uint32(0x400000), jnp.uint32(0))
    shift = lax.clz(mant) - 21  # mant << shift has its leading one at bit 10
    sub = ((113 - shift) << 23) | (((mant << shift) & 0x3FF) << 13)
    sub = where(mant == 0, jnp.uint32(0), sub)
    out = where(exp == 0, sub, where(exp == 0x1F, special, normal))
    return lax.bitcast_convert_type(sign | out, F32)


def f16_round(v):
    """(bits, value): the half bits of ``v`` and their float32 value (what a decoder will read)."""
    bits = f16_bits(v)
    return bits, f16_value(bits)


def u16_le(bits):
    """uint16 (...,) -> its two little-endian bytes, uint8 (..., 2)."""
    bits = jnp.asarray(bits).astype(jnp.uint32)
    return jnp.stack([bits & 0xFF, bits >> 8], axis=-1).astype(jnp.uint8)


def u32_le(bits):
    """uint32 (...,) -> its four little-endian bytes, uint8 (..., 4)."""
    bits = jnp.asarray(bits).astype(jnp.uint32)
    return jnp.stack([(bits >> s) & 0xFF for s in (0, 8, 16, 24)], axis=-1).astype(jnp.uint8)


def read_u16(b):
    """uint8 (..., 2) little-endian -> uint16 (...,)."""
    b = b.astype(jnp.uint32)
    return (b[..., 0] | (b[..., 1] << 8)).astype(jnp.uint16)


def read_u32(b):
    """uint8 (..., 4) little-endian -> uint32 (...,)."""
    b = b.astype(jnp.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def read_f16(b):
    """uint8 (..., 2) little-endian half -> float32 (...,)."""
    return f16_value(read_u16(b))


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


def pack_nibbles(lo, hi):
    """Two int arrays of 4-bit codes -> uint8 ``lo | hi << 4`` (C's byte store keeps the low 8 bits)."""
    return ((lo | (hi << 4)) & 0xFF).astype(jnp.uint8)


def unpack_nibbles(qs):
    """uint8 (..., m) -> int32 (..., 2m): low nibbles of every byte, then high nibbles (Q4_0 element order)."""
    q = qs.astype(I32)
    return jnp.concatenate([q & 0xF, q >> 4], axis=-1)


def blocks(x, qk):
    """float (..., n) -> (..., n // qk, qk) (the caller has checked ``n % qk == 0``)."""
    return x.reshape(x.shape[:-1] + (x.shape[-1] // qk, qk))


def unblock(p):
    """(..., nb, size) -> (..., nb * size)."""
    return p.reshape(p.shape[:-2] + (p.shape[-2] * p.shape[-1],))
