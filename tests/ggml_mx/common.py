"""Shared inputs of the MXFP4 tests: rows that reach every branch of llama.cpp's encoder, and an independent
float64 reference of that encoder built on the C library's own ``log2f``."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

import numpy as np

import gguf

TYPE_ID = int(gguf.GGMLQuantizationType.MXFP4)
COLS = 512
KVALUES = np.array(gguf.quants.MXFP4.kvalues, dtype=np.float64)


def from_bits(b) -> np.ndarray:
    return np.asarray(b, np.uint32).view(np.float32)


def below_power_of_two(k: int, steps) -> np.ndarray:
    """float32: the floats ``steps`` (ints >= 0) positions below 2**k (k in -149..128; 2**128 stands for Inf),
    or 0 where there are not that many positive floats below it."""
    top = 0x7F800000 if k == 128 else ((k + 127) << 23 if k >= -126 else 1 << (k + 149))
    return from_bits(np.maximum(top - np.asarray(steps, np.int64), 0).astype(np.uint32))


def edge_rows(rng: np.random.Generator) -> tuple[np.ndarray, list[str]]:
    """(float32 (rows, 512), labels): the rows every MXFP4 encoder test runs, one kind per label.

    Gaussian rows from 1e-38 to 1e38, rows near the largest finite float, all-zero and negative-zero rows, values
    on the half-level grid (ties between two levels), maxima just below and at powers of two (where C's rounded
    log2f decides the scale), subnormal and near-subnormal blocks (llama.cpp's scale byte wraps below 2**-125),
    and one value per block far above the rest (the others round to zero)."""
    rows, labels = [], []

    def add(label, v):
        rows.append(np.asarray(v, np.float32).reshape(COLS))
        labels.append(label)

    for scale in (1.0, 1e-3, 1e3, 1e-20, 1e20, 1e-37, 1e37):
        add(f"randn*{scale:g}", np.clip(rng.standard_normal(COLS), -30, 30) * scale)
    add("near_max_float", np.clip(rng.standard_normal(COLS), -1, 1) * np.float32(3.4028235e38))
    add("zeros", np.zeros(COLS))
    add("negative_zeros", -np.zeros(COLS))
    add("half_level_ties", np.round(rng.standard_normal(COLS) * 16) / 4)
    add("quarter_level_ties", np.round(rng.standard_normal(COLS) * 32) / 8)
    for part in range(2):
        v = np.empty(COLS, np.float32)
        for b in range(COLS // 32):
            k = int(rng.integers(-120, 129)) if part == 0 else int(rng.integers(-148, -120))
            blk = rng.uniform(-1, 1, 32) * float(below_power_of_two(k, [1])[0]) / 2
            step = int(rng.integers(0 if k < 128 else 1, 60))  # step 0: the power of two itself
            blk[rng.integers(32)] = below_power_of_two(k, [step])[0] * rng.choice([-1, 1])
            v[b * 32:(b + 1) * 32] = blk
        add("max_below_power_of_two" if part == 0 else "tiny_max_below_power_of_two", v)
    add("powers_of_two", np.exp2(rng.integers(-60, 60, COLS).astype(np.float64)) * rng.choice([-1, 1], COLS))
    for sub in (-149, -140, -128, -124, -122):
        add(f"ints*2**{sub}", np.round(rng.standard_normal(COLS) * 24) * 2.0**sub)
    spikes = rng.standard_normal(COLS) * 1e-3
    spikes[::32] = rng.choice([-1, 1], COLS // 32) * 50.0
    add("one_spike_per_block", spikes)
    return np.stack(rows).astype(np.float32), labels


def libm_log2f():
    """The C library's ``log2f`` through ctypes, or None where it cannot be found."""
    name = ctypes.util.find_library("m")
    if name is None:
        return None
    fn = ctypes.CDLL(name).log2f
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


def reference_encode(x: np.ndarray, log2f) -> np.ndarray:
    """llama.cpp's MXFP4 encoder written independently in float64 numpy: uint8 (rows, n // 32 * 17).

    The scale byte comes from ``log2f`` (the C library's, via ctypes), wrapped to 8 bits as x86-64 converts;
    the levels are float32 products (so Inf where they overflow); codes are the nearest level in exact arithmetic
    (every |level - x| that decides a code is exact in float32 as well: neighbouring levels are within a factor 2
    of each other), ties to the smaller magnitude."""
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, 32)
    out = np.zeros(xb.shape[:2] + (17,), np.uint8)
    for r in range(xb.shape[0]):
        for b in range(xb.shape[1]):
            blk = xb[r, b].astype(np.float64)
            amax = float(np.max(np.abs(blk)))
            e = (int(np.floor(log2f(amax))) + 125) % 256 if amax > 0 else 0
            with np.errstate(over="ignore"):  # C's float32 product: 8 d and 12 d overflow to Inf for e = 253
                levels = (KVALUES.astype(np.float32) * np.float32(2.0 ** (e - 128))).astype(np.float64)
            err = np.abs(levels[None, :] - blk[:, None])
            codes = np.argmin(err, axis=-1)  # first index of the least error: the smaller magnitude on ties
            out[r, b, 0] = e
            out[r, b, 1:] = codes[:16] | (codes[16:] << 4)
    return out.reshape(x.shape[0], -1)


def block_equal(a, b) -> np.ndarray:
    """bool (rows, blocks): which 17-byte blocks of two payloads (rows, nbytes) are identical."""
    a, b = np.asarray(a), np.asarray(b)
    return np.all(a.reshape(a.shape[0], -1, 17) == b.reshape(b.shape[0], -1, 17), axis=-1)


def importance(rng: np.random.Generator, zeros: Optional[float] = 0.2) -> np.ndarray:
    """float32 (512,) importance with some exact zeros."""
    return (rng.exponential(1.0, COLS) * (rng.uniform(size=COLS) > zeros)).astype(np.float32)
