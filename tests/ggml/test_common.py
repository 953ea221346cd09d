"""The bit-exact float32 helpers against numpy (IEEE float32, no contraction) and C's libm."""

import ctypes
import ctypes.util

import jax
import jax.numpy as jnp
import numpy as np

from jgptq.ggml import common as c


def _wide_floats(rng, n):
    return (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)


def test_div_is_correctly_rounded():
    rng = np.random.default_rng(0)
    a, b = _wide_floats(rng, 100_000), _wide_floats(rng, 100_000)
    got = np.asarray(jax.jit(c.div)(a, b))
    assert np.array_equal(got.view(np.uint32), (a / b).view(np.uint32))


def test_div_reads_subnormal_operands_exactly():
    # Widened bit by bit: a subnormal numerator is not flushed to zero before the division (normal quotients).
    rng = np.random.default_rng(9)
    a = (rng.uniform(1, 2 ** 23, 20_000).astype(np.int64).astype(np.float64) * 2.0 ** -149).astype(np.float32)
    a *= np.where(rng.uniform(size=a.size) < 0.5, -1, 1).astype(np.float32)
    b = np.exp2(rng.uniform(-140, -20, a.size)).astype(np.float32)
    want = (a.astype(np.float64) / b.astype(np.float64)).astype(np.float32)
    assert np.all(np.abs(want) >= np.finfo(np.float32).tiny)
    got = np.asarray(jax.jit(c.div)(a, b))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_widening_is_exact_for_every_kind_of_float():
    rng = np.random.default_rng(10)
    bits = np.concatenate([rng.integers(0, 1 << 32, 50_000, dtype=np.uint64).astype(np.uint32),
                           np.uint32([0, 0x80000000, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
                                      0x7F800001, 0x7F7FFFFF, 0x00800000])])
    a = bits.view(np.float32)
    with c.x64_scope():
        got = np.asarray(jax.jit(c._widen)(a))
    with np.errstate(invalid="ignore"):
        want = a.astype(np.float64)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint64), want[~nan].view(np.uint64))


def test_div_keeps_ieee_special_cases():
    a = np.float32([1, -1, 0, 0, 3, np.inf, -np.inf, np.nan, 2])
    b = np.float32([0, 0, 0, 5, -0.0, 2, np.inf, 1, np.inf])
    with np.errstate(all="ignore"):
        want = a / b
    got = np.asarray(c.div(a, b))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


def test_sqrt_is_correctly_rounded():
    rng = np.random.default_rng(2)
    a = np.abs(_wide_floats(rng, 100_000))
    a[:4] = np.float32([0.0, -0.0, np.inf, 2.0 ** -140])
    got = np.asarray(jax.jit(c.sqrt)(a))
    assert np.array_equal(got.view(np.uint32), np.sqrt(a).view(np.uint32))
    assert np.isnan(np.asarray(c.sqrt(np.float32(-1.0))))


def _c_nearest_int(v):
    t = (v.astype(np.float32) + np.float32(12582912.0)).astype(np.float32)
    return (t.view(np.int32) & 0x7FFFFF) - 0x400000


def test_nearest_int_matches_the_c_bit_trick():
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(100_000) * 50).astype(np.float32)
    v[:2000] = np.round(v[:2000]) + np.float32(0.5)  # exact halves: round half to even
    v[2000:3000] *= np.float32(1e6)  # beyond the documented range: same bits as C anyway
    got = np.asarray(jax.jit(c.nearest_int)(v))
    assert np.array_equal(got, _c_nearest_int(v))
    assert np.array_equal(got[:2000], np.round(v[:2000]).astype(np.int32))


def test_roundf_matches_libm():
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.roundf.restype = ctypes.c_float
    libm.roundf.argtypes = [ctypes.c_float]
    rng = np.random.default_rng(4)
    v = np.concatenate([(rng.standard_normal(3000) * 100).astype(np.float32),
                        np.float32([0.5, -0.5, 1.5, 2.5, -2.5, 0.49999997, -0.49999997, 8388607.5, 0.0, -0.0])])
    want = np.array([libm.roundf(float(t)) for t in v], np.float32)
    got = np.asarray(jax.jit(c.roundf)(v))
    assert np.array_equal(got, want)


def test_cpu_backend_contracts_multiply_adds():
    # The golden tests prove the contraction guard on CPU only because XLA:CPU does fuse a * b + c (as XLA:GPU
    # does); if this ever stops, they no longer would.
    rng = np.random.default_rng(5)
    x, y, z = (rng.standard_normal(1 << 14).astype(np.float32) for _ in range(3))
    got = np.asarray(jax.jit(lambda a, b, d: a * b + d)(x, y, z))
    fused = (x.astype(np.float64) * y + z).astype(np.float32)
    assert np.array_equal(got, fused) and not np.array_equal(got, x * y + z)


def test_settle_keeps_products_out_of_fused_multiply_adds():
    rng = np.random.default_rng(5)
    x, y, z = (rng.standard_normal(1 << 16).astype(np.float32) for _ in range(3))
    want = (x * y) + z  # numpy rounds the product first
    got = np.asarray(jax.jit(lambda a, b, d: c.settle(a * b) + d)(x, y, z))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(np.asarray(jax.jit(lambda a, b, d: c.mul(a, b) - d)(x, y, z)), (x * y) - z)


def test_settle_is_an_identity_on_every_value():
    rng = np.random.default_rng(12)
    bits = np.concatenate([rng.integers(0, 1 << 32, 100_000, dtype=np.uint64).astype(np.uint32),
                           np.uint32([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 1])])
    v = bits.view(np.float32)
    got = np.asarray(jax.jit(c.settle)(v))
    nan = np.isnan(v)
    assert np.array_equal(got[~nan].view(np.uint32), bits[~nan]) and np.all(np.isnan(got[nan]))


def test_ordered_sum_adds_left_to_right():
    rng = np.random.default_rng(6)
    t = (rng.standard_normal((500, 32)) * np.exp(rng.uniform(-8, 8, (500, 32)))).astype(np.float32)
    acc = np.zeros(500, np.float32)
    for i in range(32):
        acc = (acc + t[:, i]).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: c.ordered_sum(v, 0.0))(t))
    assert np.array_equal(got.view(np.uint32), acc.view(np.uint32))
    neg = np.full((1, 4), -0.0, np.float32)
    assert np.signbit(np.asarray(c.ordered_sum(neg)))[0]  # a C sum seeded with x[0]: stays -0
    assert not np.signbit(np.asarray(c.ordered_sum(neg, 0.0)))[0]  # 0 + (-0) = +0, as in C


def test_scans_keep_c_signed_zero_choices():
    v = np.float32([[-0.0, 0.0, -0.0], [0.0, -0.0, 0.0]])
    amax, mx = c.first_absmax(jnp.asarray(v))
    assert np.all(np.asarray(amax) == 0) and not np.any(np.signbit(np.asarray(mx)))
    lo, hi = c.scan_min_max(jnp.asarray(v))
    assert list(np.signbit(np.asarray(lo))) == [True, False]
    x = np.float32([[1, -3, 3, 2]])
    assert float(c.first_absmax(jnp.asarray(x))[1][0]) == -3.0  # first element of largest magnitude


def test_fp16_conversion_matches_numpy():
    rng = np.random.default_rng(7)
    v = (rng.standard_normal(100_000) * np.exp(rng.uniform(-20, 12, 100_000))).astype(np.float32)
    with np.errstate(over="ignore"):
        half = v.astype(np.float16)
    bits = np.asarray(c.f16_bits(v))
    assert np.array_equal(bits, half.view(np.uint16))
    assert np.array_equal(np.asarray(c.f16_value(bits)), half.astype(np.float32))


def test_fp16_decoding_of_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.asarray(jax.jit(c.f16_value)(bits)).view(np.uint32)
    want = bits.view(np.float16).astype(np.float32).view(np.uint32)
    snan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x3FF) != 0) & ((bits & 0x200) == 0)
    assert np.array_equal(got[~snan], want[~snan])
    assert np.array_equal(got[snan], want[snan] | 0x400000)  # signalling NaNs come back quiet, as hardware does


def test_byte_helpers_round_trip():
    rng = np.random.default_rng(8)
    w16 = rng.integers(0, 1 << 16, 100, dtype=np.uint32).astype(np.uint16)
    w32 = rng.integers(0, 1 << 32, 100, dtype=np.uint64).astype(np.uint32)
    assert np.array_equal(np.asarray(c.u16_le(w16)), w16.view(np.uint8).reshape(-1, 2))
    assert np.array_equal(np.asarray(c.u32_le(w32)), w32.view(np.uint8).reshape(-1, 4))
    assert np.array_equal(np.asarray(c.read_u32(c.u32_le(w32))), w32)
    assert np.array_equal(np.asarray(c.read_u16(c.u16_le(w16))), w16)
