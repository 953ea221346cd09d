"""Shared facts for the GGML codec tests."""

from __future__ import annotations

import json
import os

import numpy as np

FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
GGUF_QUANTIZE = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "ggml", "golden.npz")


def load_golden():
    """(arrays dict, metadata dict) of tests/data/ggml/golden.npz."""
    with np.load(GOLDEN) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads(str(arrays.pop("meta")))


def identical_blocks(a, b, type_size: int) -> np.ndarray:
    """bool (rows, blocks): which blocks of two payloads (rows, nbytes) are byte-identical."""
    a = np.asarray(a).reshape(a.shape[0], -1, type_size)
    b = np.asarray(b).reshape(b.shape[0], -1, type_size)
    return np.all(a == b, axis=-1)


def same_floats(a, b) -> bool:
    """float32 equality bit for bit, except that any NaN equals any NaN (payload bits may differ)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))
