"""IQ encoders and decoders against golden llama.cpp output committed in tests/data/ggml_iq/golden.npz.

The golden payloads are ``ggml_quantize_chunk`` output of llama-cpp-python 0.3.36 (x86-64) for fixed inputs;
``tests/ggml_iq/make_golden.py`` regenerates them. These tests need no llama.cpp.
"""

import hashlib
import os

import numpy as np
import pytest

from tests.ggml_iq.common import FORMATS, block_equal, modes

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "ggml_iq", "golden.npz")


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as data:
        return {k: data[k] for k in data.files}


CASES = [(name, mode) for name in sorted(FORMATS) for mode in modes(FORMATS[name])]


@pytest.mark.parametrize("name,mode", CASES)
def test_encoder_bytes_match_llama_cpp(golden, name, mode):
    fmt = FORMATS[name]
    imp = None if mode == "none" else golden[f"imp_{mode}"]
    ref = golden[f"payload_{name}_{mode}"]
    out = np.asarray(fmt.encode(golden["x"], imp))
    assert out.dtype == np.uint8 and out.shape == ref.shape
    same = block_equal(out, ref, fmt.type_size)
    assert same.all(), f"{name}/{mode}: blocks {np.nonzero(~same)[0].tolist()} differ from llama.cpp"


@pytest.mark.parametrize("name,mode", CASES)
def test_decoder_matches_llama_cpp_dequantization(golden, name, mode):
    fmt = FORMATS[name]
    out = np.asarray(fmt.decode(golden[f"payload_{name}_{mode}"]))
    assert out.dtype == np.float32 and out.shape == golden["x"].shape
    assert hashlib.sha256(out.tobytes()).hexdigest() == str(golden[f"dequant_sha256_{name}_{mode}"])


def test_golden_covers_edge_rows(golden):
    """The inputs hold the rows the encoders must get right: all-zero, constant, signed zeros, outliers."""
    x = golden["x"]
    assert np.all(x[5] == 0) and len(np.unique(x[6])) == 1
    assert np.any(np.signbit(x[7]) & (x[7] == 0))
    assert np.any(np.all(x[4].reshape(-1, 32) == 0, axis=1))
    assert (golden["imp_zeros"] == 0).mean() > 0.2
