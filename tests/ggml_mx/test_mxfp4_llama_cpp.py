"""MXFP4 against llama.cpp's C library on fresh rows (skipped without the library): ``ggml_quantize_chunk`` with
and without importance, ``dequantize_row_mxfp4`` on random blocks."""

import os

import numpy as np
import pytest

import jgptq.ggml as gg
from benchmarks.anchors import llama_cpp
from tests.ggml_mx.common import TYPE_ID, block_equal, edge_rows, importance

pytestmark = [
    pytest.mark.llama_cpp,
    pytest.mark.skipif(not llama_cpp.available(), reason="llama.cpp's libggml-base is not available"),
]

SEED = int.from_bytes(os.urandom(4), "little")


@pytest.mark.parametrize("with_importance", [False, True], ids=["none", "imp"])
def test_encoder_matches_ggml_quantize_chunk(with_importance):
    rng = np.random.default_rng(SEED)
    x, labels = edge_rows(rng)
    imp = importance(rng) if with_importance else None
    same = block_equal(np.asarray(gg.encode(x, "mxfp4", imp)), llama_cpp.quantize(x, TYPE_ID, imp))
    bad = sorted({labels[r] for r in np.nonzero(~same.all(axis=1))[0]})
    assert same.all(), f"seed {SEED}: {same.mean():.4%} identical blocks; differing rows: {bad}"


def test_llama_cpp_ignores_importance():
    rng = np.random.default_rng(SEED + 2)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    assert np.array_equal(llama_cpp.quantize(x, TYPE_ID, importance(rng)), llama_cpp.quantize(x, TYPE_ID, None))


def test_decoder_matches_dequantize_row():
    rng = np.random.default_rng(SEED + 1)
    p = rng.integers(0, 256, (16, 16, 17), dtype=np.uint8)
    p[:, :, 0] = rng.permutation(256).reshape(16, 16)
    p = p.reshape(16, -1)
    got = np.asarray(gg.decode(p, "mxfp4"))
    want = llama_cpp.dequantize(p, TYPE_ID)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"seed {SEED + 1}"
