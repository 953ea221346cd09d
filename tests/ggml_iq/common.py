"""Shared pieces of the IQ codec tests: the formats under test, test inputs, comparisons."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from jgptq.ggml import iq1, iq2, iq3


@dataclasses.dataclass(frozen=True)
class Fmt:
    name: str  # llama.cpp type name, upper case (gguf.GGMLQuantizationType member)
    type_id: int
    type_size: int
    encode: Callable
    decode: Callable
    requires_importance: bool


FORMATS = {
    f.name: f for f in (
        Fmt("IQ2_XXS", 16, 66, iq2.encode_iq2_xxs, iq2.decode_iq2_xxs, True),
        Fmt("IQ2_XS", 17, 74, iq2.encode_iq2_xs, iq2.decode_iq2_xs, True),
        Fmt("IQ2_S", 22, 82, iq2.encode_iq2_s, iq2.decode_iq2_s, False),
        Fmt("IQ3_XXS", 18, 98, iq3.encode_iq3_xxs, iq3.decode_iq3_xxs, False),
        Fmt("IQ3_S", 21, 110, iq3.encode_iq3_s, iq3.decode_iq3_s, False),
        Fmt("IQ1_S", 19, 50, iq1.encode_iq1_s, iq1.decode_iq1_s, True),
        Fmt("IQ1_M", 29, 56, iq1.encode_iq1_m, iq1.decode_iq1_m, False),
    )
}

ROWS, COLS = 8, 2048  # one shape for every encoder call in the tests (one compilation per format and mode)


def weights(rng: np.random.Generator, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    """float32 (rows, cols) test weights: one kind of row per index modulo 8 (normal rows, outliers, heavy
    tails, repeated values, sparse rows with all-zero sub-blocks, an all-zero row, a constant row, signed zeros)."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    for r in range(rows):
        kind = r % 8
        if kind == 1:
            x[r] *= np.float32(0.02)
            x[r, rng.integers(0, cols, 6)] = rng.choice([-1.0, 1.0], 6) * rng.uniform(0.5, 2.0, 6)
        elif kind == 2:
            x[r] = rng.standard_t(2, cols) * rng.uniform(0.01, 10)
        elif kind == 3:
            x[r] = np.round(x[r] * 2) / 2
        elif kind == 4:
            x[r] *= rng.random(cols) < 0.1
            x[r, 64:160] = 0.0  # whole sub-blocks of zeros
        elif kind == 5:
            x[r] = 0.0
        elif kind == 6:
            x[r] = np.float32(rng.uniform(-3, 3))
        elif kind == 7:
            x[r, : cols // 2] = np.where(rng.random(cols // 2) < 0.5, -0.0, 0.0)
            x[r, rng.integers(0, cols // 2)] = 3.0
    return x.astype(np.float32)


def importances(rng: np.random.Generator, cols: int = COLS) -> dict[str, np.ndarray]:
    """Per-column importance vectors: random, and random with 30% exact zeros."""
    return {
        "rand": (rng.uniform(0.0, 3.0, cols) ** 2).astype(np.float32),
        "zeros": np.where(rng.random(cols) < 0.3, 0.0, rng.uniform(0.0, 2.0, cols)).astype(np.float32),
    }


def modes(fmt: Fmt) -> list[str]:
    """Importance modes a format is tested in ("none" = no importance, llama.cpp's no-imatrix path)."""
    return ["rand", "zeros"] + ([] if fmt.requires_importance else ["none"])


def block_equal(a: np.ndarray, b: np.ndarray, type_size: int) -> np.ndarray:
    """bool (n_blocks,): payload blocks of a and b that are byte-identical."""
    return np.all(a.reshape(-1, type_size) == b.reshape(-1, type_size), axis=1)


def float_bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """float32 arrays of one shape equal bit for bit (NaNs included: sign and payload must match too)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def weighted_block_error(x: np.ndarray, y: np.ndarray, importance: Optional[np.ndarray]) -> np.ndarray:
    """float64 (n_blocks,): sum over each 256-value block of importance * (x - y)**2 (importance 1 if None)."""
    w = np.ones(x.shape[-1]) if importance is None else importance.astype(np.float64)
    e = w * (x.astype(np.float64) - y.astype(np.float64)) ** 2
    return e.reshape(-1, 256).sum(-1)
