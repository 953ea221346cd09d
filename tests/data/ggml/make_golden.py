"""Regenerates ``golden.npz``: llama.cpp's bytes for every GGML encoder implemented in jgptq.ggml.

Run from the repository root with llama.cpp's library available (llama-cpp-python installed, or
LLAMA_CPP_LIB_PATH set)::

    python tests/data/ggml/make_golden.py [--out tests/data/ggml/golden.npz]

The inputs are built deterministically (:func:`golden_inputs`); the outputs come from ``ggml_quantize_chunk``
without and with importance. The file records the ggml version and commit, the compiler that built the library
(from its ELF ``.comment``), and the llama-cpp-python version; ``tests/ggml/test_golden.py`` checks jgptq's
encoders against it without llama.cpp.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import platform
import re
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.anchors import llama_cpp  # noqa: E402

FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
N_COLS = 512


def golden_inputs(seed: int = 20260901):
    """(x float32 (rows, 512), importance float32 (2, 512), row labels): the golden test rows.

    Rows cover plain Gaussian rows at several scales, heavy tails, uniform, outliers, all-zero and constant rows,
    negative zeros, values on a coarse grid (ties), a lone spike in zeros, and a row with zero sub-blocks.
    """
    rng = np.random.default_rng(seed)
    rows, labels = [], []

    def add(label, v):
        rows.append(np.asarray(v, np.float32).reshape(N_COLS))
        labels.append(label)

    add("randn", rng.standard_normal(N_COLS))
    add("randn", rng.standard_normal(N_COLS))
    add("randn_small", rng.standard_normal(N_COLS) * 1e-3)
    add("randn_large", rng.standard_normal(N_COLS) * 1e3)
    add("student_t3", rng.standard_t(3, N_COLS))
    add("uniform", rng.uniform(-1, 1, N_COLS))
    add("positive", np.abs(rng.standard_normal(N_COLS)) + 0.25)
    spikes = rng.standard_normal(N_COLS)
    spikes[rng.choice(N_COLS, 6, replace=False)] *= 80.0
    add("outliers", spikes)
    add("zeros", np.zeros(N_COLS))
    add("negative_zeros", -np.zeros(N_COLS))
    add("constant", np.full(N_COLS, 0.5))
    add("constant_negative", np.full(N_COLS, -3.0))
    add("grid_ties", np.round(rng.standard_normal(N_COLS) * 4) / 4)
    lone = np.zeros(N_COLS)
    lone[77] = -5.0
    add("lone_spike", lone)
    part = rng.standard_normal(N_COLS)
    part[:40] = 0.0
    part[256:300] = 0.0
    add("zero_subblocks", part)
    add("randn_shifted", rng.standard_normal(N_COLS) + 2.0)
    x = np.stack(rows).astype(np.float32)
    imp = np.stack([rng.exponential(1.0, N_COLS), rng.uniform(0.0, 4.0, N_COLS)]).astype(np.float32)
    imp[0, ::9] = 0.0
    return x, imp, labels


def compiler_of(path: str) -> str:
    """The compiler recorded in a shared library's ELF ``.comment`` section ('' if none is found)."""
    with open(path, "rb") as fh:
        data = fh.read()
    pattern = rb"GCC: \([^\x00]{0,80}|clang version [^\x00]{0,80}"
    found = sorted(set(m.decode("ascii", "replace") for m in re.findall(pattern, data)))
    return "; ".join(found)


def library_facts() -> dict:
    lib = llama_cpp.load()
    facts = {}
    for fn in ("ggml_version", "ggml_commit"):
        f = getattr(lib, fn, None)
        if f is not None:
            f.restype = ctypes.c_char_p
            facts[fn] = f().decode()
    path = sorted(glob.glob(os.path.join(llama_cpp.lib_dir(), "libggml-base.*")))[0]
    facts["compiler"] = compiler_of(os.path.realpath(path))
    facts["machine"] = platform.machine()
    try:
        from importlib.metadata import version

        facts["llama_cpp_python"] = version("llama-cpp-python")
    except Exception:  # noqa: BLE001 - a carried lib folder has no package metadata
        facts["llama_cpp_python"] = "unknown"
    return facts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden.npz"))
    args = ap.parse_args(argv)
    if not llama_cpp.available():
        print("llama.cpp's library is not available (install llama-cpp-python or set LLAMA_CPP_LIB_PATH)")
        return 1
    import gguf

    x, imp, labels = golden_inputs()
    arrays = {"x": x, "importance": imp}
    for name in FORMATS:
        tid = int(gguf.GGMLQuantizationType[name.upper()])
        arrays[f"{name}/none"] = llama_cpp.quantize(x, tid, None)
        for k in range(imp.shape[0]):
            arrays[f"{name}/imp{k}"] = llama_cpp.quantize(x, tid, imp[k])
    meta = dict(library_facts(), formats=FORMATS, labels=labels, seed=20260901)
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes): {json.dumps(meta)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
