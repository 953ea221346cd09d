"""ctypes binding to llama.cpp's C quantizer (``libggml-base``), the byte-exact oracle for the GGML codecs.

The library comes from the ``llama-cpp-python`` package (``llama_cpp/lib``) or from the folder named by the
``LLAMA_CPP_LIB_PATH`` environment variable. Nothing here imports the ``llama_cpp`` Python module itself, so the
binding works with a lib folder carried to another machine (any Python version).

Calling ``quantize`` without importance for a type that requires it aborts the C library (GGML_ASSERT) and with it
the whole process: :func:`quantize` refuses that case with a ValueError first.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

_LIB = None
_LOCK = threading.Lock()


def lib_dir() -> Optional[str]:
    """The folder holding libggml-base, or None when llama.cpp's library is not available."""
    env = os.environ.get("LLAMA_CPP_LIB_PATH")
    if env and glob.glob(os.path.join(env, "libggml-base.*")):
        return env
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        d = os.path.join(base, "lib")
        if glob.glob(os.path.join(d, "libggml-base.*")):
            return d
    return None


def available() -> bool:
    """True when llama.cpp's libggml-base can be loaded."""
    return lib_dir() is not None


def load():
    """Loads libggml-base once and declares the signatures used here."""
    global _LIB
    with _LOCK:
        if _LIB is not None:
            return _LIB
        d = lib_dir()
        if d is None:
            raise RuntimeError("llama.cpp's libggml-base was not found: install llama-cpp-python or set "
                               "LLAMA_CPP_LIB_PATH to the folder holding libggml-base.so")
        path = sorted(glob.glob(os.path.join(d, "libggml-base.*")))[0]
        lib = ctypes.CDLL(path)
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        lib.ggml_quantize_init.restype = None
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        _LIB = lib
        return lib


def requires_importance(type_id: int) -> bool:
    """llama.cpp's ``ggml_quantize_requires_imatrix`` for the type."""
    return bool(load().ggml_quantize_requires_imatrix(int(type_id)))


def _type_geometry(type_id: int):
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(type_id))]


def quantize(x: np.ndarray, type_id: int, importance: Optional[np.ndarray] = None, threads: int = 1) -> np.ndarray:
    """``ggml_quantize_chunk`` on rows of ``x``.

    Args:
      x: float32 (rows, n), n a multiple of the type's block size.
      type_id: ggml type id.
      importance: float32 (n,) per-column importance (llama.cpp's imatrix values), or None.
      threads: split the rows over this many threads (the C call releases the GIL).
    Returns:
      uint8 (rows, n // block * type_size).
    """
    lib = load()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (rows, n), got shape {x.shape}")
    rows, n = x.shape
    block, size = _type_geometry(type_id)
    if n % block:
        raise ValueError(f"row length {n} is not a multiple of the block size {block}")
    if importance is None and requires_importance(type_id):
        raise ValueError(f"llama.cpp requires importance weights for ggml type {type_id}")
    imp = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    if imp is not None and imp.shape != (n,):
        raise ValueError(f"importance must have shape ({n},), got {imp.shape}")
    lib.ggml_quantize_init(int(type_id))
    out = np.zeros((rows, n // block * size), dtype=np.uint8)
    imp_ptr = None if imp is None else imp.ctypes.data

    def run(r0, r1):
        if r1 <= r0:
            return
        # ggml_quantize_chunk takes the source base pointer and writes at the same row offset of dst.
        lib.ggml_quantize_chunk(int(type_id), x.ctypes.data, out.ctypes.data, r0 * n, r1 - r0, n, imp_ptr)

    threads = max(1, min(int(threads), rows))
    if threads == 1:
        run(0, rows)
    else:
        bounds = np.linspace(0, rows, threads + 1).astype(int)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: run(bounds[i], bounds[i + 1]), range(threads)))
    return out


def _c_name(type_id: int) -> str:
    """The type's name as ggml's C symbols spell it (``q4_0``, ``q4_K``, ``iq2_xxs``)."""
    import gguf

    name = gguf.GGMLQuantizationType(int(type_id)).name.lower()
    return name[:-2] + "_K" if name.endswith("_k") else name


def dequantize(payload: np.ndarray, type_id: int) -> np.ndarray:
    """llama.cpp's ``dequantize_row_<type>`` on every row of ``payload`` (uint8 (rows, nbytes)) -> float32."""
    lib = load()
    fn = getattr(lib, f"dequantize_row_{_c_name(type_id)}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    payload = np.ascontiguousarray(payload, dtype=np.uint8)
    block, size = _type_geometry(type_id)
    rows, nbytes = payload.shape
    n = nbytes // size * block
    out = np.zeros((rows, n), dtype=np.float32)
    fn(payload.ctypes.data, out.ctypes.data, rows * n)
    return out
