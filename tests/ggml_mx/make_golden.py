"""Writes tests/data/ggml_mx/golden.npz: llama.cpp's MXFP4 bytes for fixed inputs (tests/ggml_mx/common.py).

Run from the repository root with llama.cpp's library available (llama-cpp-python or LLAMA_CPP_LIB_PATH)::

    python -m tests.ggml_mx.make_golden [--out tests/data/ggml_mx/golden.npz]

Contents: ``x`` (rows, 512) float32 and ``labels``; ``payload`` (``ggml_quantize_chunk`` without importance) and
``payload_imp`` (with the importance vector ``importance``); ``random_payload`` (random blocks, every scale byte
0..255 present) and ``random_dequant`` (llama.cpp's ``dequantize_row_mxfp4`` of it); ``meta`` (JSON: library
version and commit, machine).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import os
import platform
import sys

import numpy as np

SEED = 20261205
DEFAULT_OUT = os.path.join("tests", "data", "ggml_mx", "golden.npz")


def random_payload(rng: np.random.Generator) -> np.ndarray:
    """uint8 (16, 16 * 17): random MXFP4 blocks whose scale bytes run through 0..255."""
    p = rng.integers(0, 256, (16, 16, 17), dtype=np.uint8)
    p[:, :, 0] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    return p.reshape(16, -1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    from benchmarks.anchors import llama_cpp
    from tests.ggml_mx.common import TYPE_ID, edge_rows, importance

    if not llama_cpp.available():
        print("llama.cpp's library is not available", file=sys.stderr)
        return 1
    rng = np.random.default_rng(SEED)
    x, labels = edge_rows(rng)
    imp = importance(rng)
    rand = random_payload(rng)
    lib = llama_cpp.load()
    facts = {}
    for fn in ("ggml_version", "ggml_commit"):
        f = getattr(lib, fn, None)
        if f is not None:
            f.restype = ctypes.c_char_p
            facts[fn] = f().decode()
    try:
        facts["llama_cpp_python"] = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        facts["llama_cpp_python"] = "unknown"
    facts.update(machine=platform.machine(), seed=SEED)
    out = {
        "x": x, "labels": np.array(labels), "importance": imp,
        "payload": llama_cpp.quantize(x, TYPE_ID, None), "payload_imp": llama_cpp.quantize(x, TYPE_ID, imp),
        "random_payload": rand, "random_dequant": llama_cpp.dequantize(rand, TYPE_ID),
        "meta": np.array(json.dumps(facts)),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes): {json.dumps(facts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
