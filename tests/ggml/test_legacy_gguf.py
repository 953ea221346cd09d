"""Legacy encoders without importance: byte-identical to gguf.quantize (a numpy port of llama.cpp's _ref)."""

import zlib

import gguf
import numpy as np
import pytest

import jgptq.ggml as gg
from tests.ggml.helpers import GGUF_QUANTIZE, identical_blocks


def _rows(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    x[1] *= 1e-4
    x[2] = rng.standard_t(2, 512)
    x[3, ::50] *= 300.0
    x[4] = 1.25
    x[5] = 0.0  # +0 only: gguf and llama.cpp disagree on the sign of d for blocks of -0 (jgptq follows llama.cpp)
    x[6] = np.round(x[6] * 2) / 2
    return x


@pytest.mark.parametrize("name", GGUF_QUANTIZE)
def test_legacy_encoder_matches_gguf(name):
    f = gg.get_format(name)
    x = _rows(seed=zlib.crc32(name.encode()))
    want = gguf.quantize(x, f.qtype)
    got = np.asarray(gg.encode(x, name))
    same = identical_blocks(got, want, f.type_size)
    assert same.all(), f"{name}: {(~same).sum()} of {same.size} blocks differ"


@pytest.mark.parametrize("name", GGUF_QUANTIZE)
def test_legacy_round_trip_error_is_bounded(name):
    # Independent of gguf. A value decodes within half a step d of itself, a full step on the clamped side of
    # Q4_0/Q5_0, plus what storing d (and m) in fp16 costs: at most `levels` times the fp16 error of d.
    f = gg.get_format(name)
    x = _rows(seed=5)
    back = np.asarray(gg.decode(gg.encode(x, name), name)).reshape(16, -1, 32)
    xb = x.reshape(16, -1, 32)
    levels = {"q4_0": 8, "q5_0": 16, "q8_0": 127, "q4_1": 15, "q5_1": 31}[name]
    symmetric = name.endswith("_0")
    span = np.abs(xb).max(-1) if symmetric else xb.max(-1) - xb.min(-1)
    step = span / levels
    half_ulp16 = np.maximum(step * 2.0**-11, 2.0**-25)  # fp16 rounding of d (normal or subnormal)
    slack = (1.0 if symmetric and name != "q8_0" else 0.5) * step + (levels + 1) * half_ulp16
    if not symmetric:
        slack += np.maximum(np.abs(xb.min(-1)) * 2.0**-11, 2.0**-25)  # fp16 rounding of the min
    err = np.abs(back - xb).max(-1)
    assert np.all(err <= slack * 1.0001 + 1e-30)
