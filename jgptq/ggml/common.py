"""Bit-exact float32 numerics shared by the GGML codecs.

llama.cpp's quantizers are plain IEEE float32 C: every product is rounded before it is added, every sum runs
left to right, every division and square root is correctly rounded, and integers come from three different
roundings. XLA does not promise any of that: it contracts ``a * b + c`` into a fused multiply-add (CPU and GPU),
its GPU float32 division is not correctly rounded, and a tree reduction changes the low bits of a sum. The helpers
here restore the C semantics by construction:

- :func:`settle` makes a value opaque to multiply-add contraction, so a product is rounded to float32 before use;
- :func:`div` and :func:`sqrt` compute a float32 result and then pick, among its neighbours, the correctly
  rounded one with exact float64 residuals (float64 is enabled locally, whatever ``jax_enable_x64`` says);
- :func:`ordered_sum` adds terms in index order, one at a time;
- :func:`nearest_int`, :func:`roundf` and :func:`trunc_int` are the three integer roundings of the C code;
- fp16 conversion and byte packing helpers.

All functions are pure ``jnp`` and traceable under ``jit``/``vmap``/``lax`` loops.

Where results can still differ from llama.cpp:

- XLA:CPU flushes float32 subnormals to zero (inputs and results). Blocks whose C computation itself passes
  through subnormals differ: blocks whose values are all tiny (max |x| below about 1e-8 to 1e-5, depending on the
  format; lower powers of x are involved in the legacy and Q4_K/Q5_K reference paths), or importance values so
  small that weighted sums fall below 1.2e-38. Normal-range weights, including blocks that merely contain tiny
  values, are unaffected. XLA:GPU keeps subnormals unless ``--xla_gpu_ftz=true``.
- Corrections assume the backend's division and square root are within 2 ulps (XLA:GPU's approximations are);
  a GPU approximate division returns garbage for divisors above 2**126, far outside the codecs' range.
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

GROUP_MAX_EPS = np.float32(1e-15)


def x64_scope():
    """Context manager that enables 64-bit types while tracing the enclosed code (restores the setting after)."""
    ctx = getattr(jax, "enable_x64", None)
    if ctx is not None:
        return ctx(True)
    from jax.experimental import enable_x64  # older jax

    return enable_x64()


def _require_f64(v):
    if v.dtype != jnp.float64:  # pragma: no cover - guards against a jax that ignores the scope
        raise RuntimeError("float64 is unavailable inside jgptq.ggml's x64 scope: exact rounding cannot be ensured")
    return v


def settle(v):
    """``v`` unchanged, as a value the compiler cannot fuse into a multiply-add with the operation that uses it.

    The select on ``v == v`` is an identity (a NaN stays a NaN), but code generators do not look through it, so
    ``settle(a * b) + c`` adds the float32-rounded product, as C does.
    """
    v = jnp.asarray(v)
    return jnp.where(v == v, v, v + v)


def mul(a, b):
    """float32 product ``a * b``, rounded before any later use (never contracted into an FMA)."""
    return settle(jnp.asarray(a, F32) * jnp.asarray(b, F32))


def _neighbours(v, k):
    """``v`` and its float32 neighbours up to ``k`` steps below and above, ascending."""
    lo, hi = [v], [v]
    for _ in range(k):
        lo.append(jnp.nextafter(lo[-1], jnp.asarray(-jnp.inf, F32)))
        hi.append(jnp.nextafter(hi[-1], jnp.asarray(jnp.inf, F32)))
    return lo[::-1][:-1] + hi


def correct_quotient(a, b, q, k: int = 2):
    """The correctly rounded float32 ``a / b``, given an approximation ``q`` within ``k`` ulps of it.

    Each candidate ``c`` is scored by the exact residual ``|a - c*b|`` in float64 (``c*b`` has at most 48
    significant bits); the nearest representable quotient has the smallest residual and ties cannot occur.
    Non-finite or zero divisors keep ``q`` (IEEE semantics of the plain division).
    """
    a, b, q = (jnp.asarray(v, F32) for v in (a, b, q))
    cands = _neighbours(q, k)
    with x64_scope():
        a64 = _require_f64(a.astype(jnp.float64))
        b64 = b.astype(jnp.float64)
        best = q
        best_err = jnp.abs(a64 - q.astype(jnp.float64) * b64)
        for c in cands:
            err = jnp.abs(a64 - c.astype(jnp.float64) * b64)
            take = err < best_err
            best = jnp.where(take, c, best)
            best_err = jnp.where(take, err, best_err)
    ok = jnp.isfinite(q) & jnp.isfinite(a) & jnp.isfinite(b) & (b != 0)
    return jnp.where(ok, best, q)


def _plain_div(a, b):
    return a / b


def _plain_sqrt(a):
    return jnp.sqrt(a)


def div(a, b):
    """Correctly rounded float32 ``a / b`` on every backend (XLA:GPU's own float32 division is not)."""
    a = jnp.asarray(a, F32)
    b = jnp.asarray(b, F32)
    return settle(correct_quotient(a, b, _plain_div(a, b)))


def correct_sqrt(a, s, k: int = 2):
    """The correctly rounded float32 ``sqrt(a)``, given an approximation ``s`` within ``k`` ulps of it.

    Walking up the ascending candidates, the next one wins while the square of the midpoint between the two is
    below ``a`` (midpoints have 25 significant bits, so their squares are exact in float64; ties cannot occur).
    """
    a, s = jnp.asarray(a, F32), jnp.asarray(s, F32)
    cands = _neighbours(s, k)
    with x64_scope():
        a64 = _require_f64(a.astype(jnp.float64))
        best = cands[0]
        for lo, hi in zip(cands[:-1], cands[1:]):
            mid = (lo.astype(jnp.float64) + hi.astype(jnp.float64)) * 0.5
            best = jnp.where(mid * mid < a64, hi, best)
    ok = jnp.isfinite(a) & (a > 0) & jnp.isfinite(s)
    return jnp.where(ok, best, s)


def sqrt(a):
    """Correctly rounded float32 square root (C ``sqrtf``) on every backend."""
    a = jnp.asarray(a, F32)
    return settle(correct_sqrt(a, _plain_sqrt(a)))


def nearest_int(v):
    """llama.cpp's ``nearest_int``: adds 1.5 * 2**23 in float32 and reads the low mantissa bits -> int32.

    Round half to even for ``|v| <= 4194303``; outside that range it reproduces the same bit pattern as C.
    """
    t = settle(jnp.asarray(v, F32)) + np.float32(12582912.0)
    bits = lax.bitcast_convert_type(t, I32)
    return (bits & 0x7FFFFF) - 0x400000


def roundf(v):
    """C ``roundf`` (half away from zero), exactly, as float32."""
    v = settle(jnp.asarray(v, F32))
    a = jnp.abs(v)
    fl = jnp.floor(a)
    r = fl + jnp.where(a - fl >= np.float32(0.5), np.float32(1), np.float32(0))
    return jnp.where(v < 0, -r, r)


def trunc_int(v):
    """C conversion of a float to an integer (toward zero) -> int32, for values inside the int32 range."""
    return jnp.trunc(settle(jnp.asarray(v, F32))).astype(I32)


def as_f32(i):
    """int -> float32 conversion (exact for the small integers of the codecs)."""
    return jnp.asarray(i).astype(F32)


def ordered_sum(terms, start=None):
    """``sum(terms[..., i] for i in range(n))`` added left to right in float32, like a C loop.

    Args:
      terms: float32 (..., n).
      start: None to start from ``terms[..., 0]``; ``0.0`` for a C sum initialized to zero (``0 + t`` turns
        ``-0`` into ``+0``), or an array broadcastable to (...,).
    Returns:
      float32 (...,).
    """
    terms = settle(jnp.asarray(terms, F32))
    n = terms.shape[-1]
    if start is None:
        acc = terms[..., 0]
    elif isinstance(start, (int, float)) and start == 0:
        t0 = terms[..., 0]
        acc = jnp.where(t0 == 0, jnp.zeros_like(t0), t0)
    else:
        acc = settle(jnp.asarray(start, F32)) + terms[..., 0]
    if n <= 64:
        for i in range(1, n):
            acc = acc + terms[..., i]
        return acc

    def add(i, acc):  # long sums: a loop keeps the program small; the order is the same
        return acc + lax.dynamic_index_in_dim(terms, i, axis=-1, keepdims=False)

    return lax.fori_loop(1, n, add, acc)


def first_absmax(x):
    """C's ``if (fabsf(v) > amax) { amax = fabsf(v); max = v; }`` scan from ``amax = max = 0``.

    Returns (amax, max): float32 (...,) each; ``max`` is the signed value of the first element of largest
    magnitude, and ``+0`` when every element is zero. NaN elements are skipped, as C's ``>`` skips them.
    """
    ax = jnp.abs(x)
    ax = jnp.where(ax == ax, ax, jnp.zeros_like(ax))
    idx = jnp.argmax(ax, axis=-1)
    amax = jnp.max(ax, axis=-1)
    m = jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    return amax, jnp.where(amax > 0, m, jnp.zeros_like(m))


def scan_min_max(x):
    """C's ``min = max = x[0]; for i >= 1: if (x[i] < min) min = x[i]; if (x[i] > max) max = x[i];``.

    Sequential on purpose: it keeps C's choice between ``-0`` and ``+0``. Returns (min, max), float32 (...,).
    """
    lo = x[..., 0]
    hi = x[..., 0]
    for i in range(1, x.shape[-1]):
        v = x[..., i]
        lo = jnp.where(v < lo, v, lo)
        hi = jnp.where(v > hi, v, hi)
    return lo, hi


def scan_max_gt(x, start=0.0):
    """C's ``m = start; for each v: if (v > m) m = v;`` -> float32 (...,)."""
    m = jnp.full(x.shape[:-1], start, F32)
    for i in range(x.shape[-1]):
        m = jnp.where(x[..., i] > m, x[..., i], m)
    return m


def f16_bits(v):
    """``GGML_FP32_TO_FP16``: float32 -> IEEE half bits (round to nearest even, subnormals kept) as uint16."""
    return lax.bitcast_convert_type(jnp.asarray(v, F32).astype(jnp.float16), jnp.uint16)


def f16_value(bits):
    """``GGML_FP16_TO_FP32``: uint16 half bits -> float32 (exact)."""
    return lax.bitcast_convert_type(jnp.asarray(bits, jnp.uint16), jnp.float16).astype(F32)


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
