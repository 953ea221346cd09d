"""Encoders against llama.cpp's bytes recorded in tests/data/ggml/golden.npz (no llama.cpp needed).

The golden rows cover Gaussian rows at several scales, heavy tails, outliers, all-zero, negative-zero and
constant rows, ties, a lone spike and zero sub-blocks; each format is encoded without importance and with two
importance vectors. See tests/data/ggml/make_golden.py for how the file was made.
"""

import numpy as np
import pytest

import jgptq.ggml as gg
from tests.ggml.helpers import FORMATS, identical_blocks, load_golden


@pytest.fixture(scope="module")
def golden():
    return load_golden()


def test_golden_file_records_its_origin(golden):
    arrays, meta = golden
    assert meta["ggml_version"] == "0.25.3" and meta["ggml_commit"].startswith("0c1e570")
    assert meta["compiler"] and meta["machine"] == "x86_64"
    assert sorted(meta["formats"]) == sorted(FORMATS)
    assert arrays["x"].shape == (len(meta["labels"]), 512) and arrays["importance"].shape == (2, 512)


@pytest.mark.parametrize("path", ["none", "imp0", "imp1"])
@pytest.mark.parametrize("name", FORMATS)
def test_encoder_bytes_match_llama_cpp(golden, name, path):
    arrays, meta = golden
    x = arrays["x"]
    imp = None if path == "none" else arrays["importance"][int(path[-1])]
    f = gg.get_format(name)
    got = np.asarray(gg.encode(x, name, imp))
    want = arrays[f"{name}/{path}"]
    assert got.shape == want.shape
    same = identical_blocks(got, want, f.type_size)
    bad_rows = sorted({meta["labels"][r] for r in np.nonzero(~same.all(axis=1))[0]})
    assert same.all(), f"{name}/{path}: {same.mean():.4%} identical blocks; differing rows: {bad_rows}"
