"""IQ codecs against llama.cpp's C library, live, on fresh random data (skipped without the library)."""

import ctypes
import os
import platform
import shutil
import subprocess

import numpy as np
import pytest

from benchmarks.anchors import llama_cpp
from jgptq.ggml import registry
from tests.ggml_iq.common import COLS, FORMATS, ROWS, block_equal, importances, modes, weighted_block_error, weights

pytestmark = [pytest.mark.llama_cpp,
              pytest.mark.skipif(not llama_cpp.available(), reason="llama.cpp's library is not available")]

CHUNKS = 8  # 8 calls of (8, 2048): 512 blocks per format and importance mode


@pytest.fixture(scope="module")
def fresh():
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    xs = [weights(rng) for _ in range(CHUNKS)]
    return seed, xs, importances(rng)


# random importance, and no importance where llama.cpp allows it (importance with zeros is in the golden tests)
CASES = [(name, mode) for name in sorted(FORMATS) for mode in modes(FORMATS[name]) if mode != "zeros"]


@pytest.mark.parametrize("name,mode", CASES)
def test_encoder_matches_llama_cpp(fresh, name, mode):
    """At least 99.9% of blocks byte-identical; a differing block must not have a larger weighted error."""
    seed, xs, imps = fresh
    fmt = FORMATS[name]
    imp = None if mode == "none" else imps[mode]
    n_same = n_all = 0
    for x in xs:
        ref = llama_cpp.quantize(x, fmt.type_id, imp)
        out = np.asarray(fmt.encode(x, imp))
        same = block_equal(out, ref, fmt.type_size)
        n_same += int(same.sum())
        n_all += same.size
        if not same.all():
            err_ours = weighted_block_error(x, np.asarray(fmt.decode(out)), imp)
            err_ref = weighted_block_error(x, llama_cpp.dequantize(ref, fmt.type_id), imp)
            worse = ~same & (err_ours > err_ref * (1 + 1e-6) + 1e-30)
            assert not worse.any(), f"seed {seed}: {name}/{mode} blocks {np.nonzero(worse)[0]} differ and are worse"
        # our decoder on our bytes equals llama.cpp's dequantization of the same bytes
        assert np.array_equal(np.asarray(fmt.decode(out)).view(np.uint32),
                              llama_cpp.dequantize(out, fmt.type_id).view(np.uint32))
    assert n_same >= 0.999 * n_all, f"seed {seed}: {name}/{mode}: {n_same}/{n_all} blocks identical"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_requires_importance_matches_ggml(name):
    fmt = FORMATS[name]
    assert registry.get_format(name).requires_importance == llama_cpp.requires_importance(fmt.type_id)
    assert fmt.requires_importance == llama_cpp.requires_importance(fmt.type_id)


@pytest.fixture(scope="module")
def flush_denormals(tmp_path_factory):
    """A function setting (or clearing) the x86 FTZ and DAZ bits of the calling thread, from a tiny C helper."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if platform.machine() not in ("x86_64", "AMD64") or cc is None:
        pytest.skip("needs x86-64 and a C compiler")
    d = tmp_path_factory.mktemp("ftz")
    src, lib = d / "ftz.c", d / "libftz.so"
    src.write_text("#include <xmmintrin.h>\n"
                   "void set_ftz_daz(int on) { unsigned c = _mm_getcsr();"
                   " _mm_setcsr(on ? (c | 0x8040u) : (c & ~0x8040u)); }\n")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    fn = ctypes.CDLL(str(lib)).set_ftz_daz
    fn.argtypes = [ctypes.c_int]
    return fn


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tiny_values_match_llama_cpp_without_subnormals(flush_denormals, name):
    """XLA on CPU flushes subnormal floats to zero. Blocks so small that llama.cpp's sums underflow into
    subnormals are the ones that can differ, and they match llama.cpp run with subnormals flushed (FTZ+DAZ)."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    x *= np.float32([3e-13, 1e-9, 1e-7, 3e-6, 3e-13, 1e-9, 1e-7, 1])[:, None]
    imp = importances(rng)["rand"]
    flush_denormals(1)
    try:
        ref = llama_cpp.quantize(x, fmt.type_id, imp, threads=1)
    finally:
        flush_denormals(0)
    assert block_equal(np.asarray(fmt.encode(x, imp)), ref, fmt.type_size).all()
