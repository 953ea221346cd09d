"""Live comparison with llama.cpp's C library on fresh random data (skipped when the library is absent).

Every run draws new rows and importance vectors (the seed is printed, and named in any failure), encodes them
with jgptq and with ``ggml_quantize_chunk``, and requires byte-identical blocks; decoders are compared with
``dequantize_row_*``.
"""

import os

import numpy as np
import pytest

import jgptq.ggml as gg
from benchmarks.anchors import llama_cpp
from tests.ggml.helpers import FORMATS, identical_blocks, same_floats

pytestmark = [
    pytest.mark.llama_cpp,
    pytest.mark.skipif(not llama_cpp.available(), reason="llama.cpp's libggml-base is not available"),
]

SEED = int.from_bytes(os.urandom(4), "little")


def _fresh_rows(seed):
    rng = np.random.default_rng(seed)
    kinds = [
        lambda: rng.standard_normal(512),
        lambda: rng.standard_t(2.5, 512) * 0.05,
        lambda: rng.laplace(0, 1, 512) + rng.normal(0, 0.5),
        lambda: np.round(rng.standard_normal(512) * 3) / 3,
        lambda: rng.standard_normal(512) * (rng.uniform(size=512) < 0.3),
        lambda: rng.uniform(-2, 5, 512),
    ]
    x = np.stack([kinds[i % len(kinds)]() * np.exp(rng.uniform(-6, 6)) for i in range(16)]).astype(np.float32)
    imp = (rng.exponential(1.0, 512) * (rng.uniform(size=512) > 0.05)).astype(np.float32)
    return x, imp


@pytest.fixture(scope="module")
def shares():
    table = {}
    yield table
    print(f"\nidentical blocks vs llama.cpp (seed {SEED}):")
    for key in sorted(table):
        print(f"  {key:<16} {table[key]:.4%}")


@pytest.mark.parametrize("with_importance", [False, True], ids=["none", "imp"])
@pytest.mark.parametrize("name", FORMATS)
def test_encoder_matches_ggml_quantize_chunk(name, with_importance, shares):
    x, imp = _fresh_rows(SEED)
    imp = imp if with_importance else None
    f = gg.get_format(name)
    want = llama_cpp.quantize(x, f.type_id, imp)
    got = np.asarray(gg.encode(x, name, imp))
    same = identical_blocks(got, want, f.type_size)
    shares[f"{name}/{'imp' if with_importance else 'none'}"] = float(same.mean())
    assert same.all(), f"seed {SEED}: {name}: {same.mean():.4%} identical blocks"


@pytest.mark.parametrize("name", FORMATS)
def test_decoder_matches_dequantize_row(name):
    f = gg.get_format(name)
    rng = np.random.default_rng(SEED + 1)
    payload = rng.integers(0, 256, size=(16, 512 // f.block_size * f.type_size), dtype=np.uint8)
    want = llama_cpp.dequantize(payload, f.type_id)
    assert same_floats(gg.decode(payload, name), want), f"seed {SEED + 1}"
