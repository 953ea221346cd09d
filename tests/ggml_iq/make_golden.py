"""Writes tests/data/ggml_iq/golden.npz: llama.cpp's IQ1/IQ2/IQ3 payloads for fixed inputs.

Run from the repository root with llama.cpp's library available (llama-cpp-python or LLAMA_CPP_LIB_PATH):

    python -m tests.ggml_iq.make_golden [--out tests/data/ggml_iq/golden.npz]

Contents: the inputs ``x`` (8, 2048) and importance vectors ``imp_<mode>``; for every format and importance mode
``payload_<FMT>_<mode>`` (``ggml_quantize_chunk`` output) and ``dequant_sha256_<FMT>_<mode>`` (sha256 of
llama.cpp's ``dequantize_row_*`` float32 output of that payload); ``meta`` (JSON: library version, machine).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import sys

import numpy as np

SEED = 20261202
DEFAULT_OUT = os.path.join("tests", "data", "ggml_iq", "golden.npz")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    from benchmarks.anchors import llama_cpp
    from tests.ggml_iq.common import FORMATS, importances, modes, weights

    if not llama_cpp.available():
        print("llama.cpp's library is not available", file=sys.stderr)
        return 1
    rng = np.random.default_rng(SEED)
    x = weights(rng)
    imps = importances(rng)
    out = {"x": x}
    out.update({f"imp_{k}": v for k, v in imps.items()})
    for fmt in FORMATS.values():
        for mode in modes(fmt):
            payload = llama_cpp.quantize(x, fmt.type_id, None if mode == "none" else imps[mode])
            deq = llama_cpp.dequantize(payload, fmt.type_id)
            out[f"payload_{fmt.name}_{mode}"] = payload
            out[f"dequant_sha256_{fmt.name}_{mode}"] = np.array(hashlib.sha256(deq.tobytes()).hexdigest())
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    out["meta"] = np.array(json.dumps({"llama_cpp_python": version, "machine": platform.machine(), "seed": SEED}))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
