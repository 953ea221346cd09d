"""llama.cpp's side of the benchmark, through the ``llama_cpp`` package (llama-cpp-python's ctypes bindings).

- :func:`read_imatrix`: the importance vectors ``llama-quantize --imatrix FILE`` would load from a GGUF imatrix file
  (``<tensor>.in_sum2`` / ``<tensor>.counts``; per matrix ``sums / count``, or 1.0 where count is 0, in float32).
- :func:`quantize`: ``llama_model_quantize`` of a float GGUF at one format with those vectors as
  ``params.imatrix`` entries, every weight tensor at the format (``pure``) or by the rules of one of llama.cpp's mixes
  (Q4_K_M, MXFP4_MOE...), token embedding and output head kept at the given type, named tensors at a type of their
  own (``params.tt_overrides``, what ``llama-quantize --tensor-type`` sets).
- :func:`tensor_types` / :func:`weight_bits`: what a GGUF holds, read back with ``gguf.GGUFReader``.

Running the files (every position's logits of every window, each from an empty context) is the library's
:mod:`jgptq_torch.cli.llama_logits`; the statistics are :mod:`jgptq.evaluation`.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

# llama_ftype of each format: with ``pure`` every quantizable tensor gets the ftype's base type.
FTYPES = {"q4_k": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
          "iq3_xxs": "LLAMA_FTYPE_MOSTLY_IQ3_XXS", "iq2_xxs": "LLAMA_FTYPE_MOSTLY_IQ2_XXS",
          "iq1_s": "LLAMA_FTYPE_MOSTLY_IQ1_S", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
          "q5_k": "LLAMA_FTYPE_MOSTLY_Q5_K_S", "q3_k": "LLAMA_FTYPE_MOSTLY_Q3_K_S", "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
          "iq2_xs": "LLAMA_FTYPE_MOSTLY_IQ2_XS", "iq3_s": "LLAMA_FTYPE_MOSTLY_IQ3_XS",
          "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL", "iq1_m": "LLAMA_FTYPE_MOSTLY_IQ1_M"}
# llama.cpp's own mixes (``pure`` off: its per-tensor rules, ``llama_tensor_get_type``, pick each tensor's type).
MIX_FTYPES = {"q2_k_s": "LLAMA_FTYPE_MOSTLY_Q2_K_S", "iq2_m": "LLAMA_FTYPE_MOSTLY_IQ2_M",
              "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
              "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
              "mxfp4_moe": "LLAMA_FTYPE_MOSTLY_MXFP4_MOE", "q5_k_s": "LLAMA_FTYPE_MOSTLY_Q5_K_S"}


def read_imatrix(path: str) -> dict:
    """Importance vectors from a GGUF imatrix file, as llama.cpp's quantize tool derives them.

    Returns {tensor name: float32 (n_mat * ne0,)}: for each of the n_mat matrices (experts) of the tensor,
    ``in_sum2 / count`` when count > 0, else 1.0, concatenated matrix after matrix.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    sums, counts = {}, {}
    for t in reader.tensors:
        if t.name.endswith(".in_sum2"):
            sums[t.name[:-len(".in_sum2")]] = np.asarray(t.data, dtype=np.float32).reshape(-1, int(t.shape[0]))
        elif t.name.endswith(".counts"):
            counts[t.name[:-len(".counts")]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if set(sums) != set(counts):
        raise ValueError(f"{path}: tensors without both in_sum2 and counts: {sorted(set(sums) ^ set(counts))}")
    out = {}
    for name, s in sums.items():
        c = counts[name]
        if c.shape[0] != s.shape[0]:
            raise ValueError(f"{path}: {name}.counts has {c.shape[0]} entries for {s.shape[0]} matrices")
        v = np.ones_like(s)
        live = c > 0
        v[live] = s[live] / c[live, None]
        out[name] = np.ascontiguousarray(v.reshape(-1), dtype=np.float32)
    return out


def quantize(src: str, dst: str, fmt: str, imatrix: dict | None, *, keep_type: str = "F32", threads: int = 2,
             overrides: dict | None = None, mix: bool = False) -> float:
    """``llama_model_quantize(src -> dst)`` at ``fmt`` for every weight tensor, or with llama.cpp's own per-tensor
    rules when ``fmt`` names one of its mixes; returns the seconds it took.

    Args:
      src: a float GGUF (F32 or F16 tensors).
      fmt: a jgptq/GGML format name (see :data:`FTYPES`) or a llama.cpp mix (see :data:`MIX_FTYPES`).
      imatrix: {tensor name: float32 importance (already divided by counts, experts concatenated)} or None.
      keep_type: GGML type name the token embedding and output head are stored in (``"F32"`` keeps the float
        model's; the output head is never quantized).
      overrides: {regular expression: GGML type name}: the tensors whose name the expression finds get that type
        instead of the mix's or the format's (``llama-quantize --tensor-type``; the first match wins).
      mix: take ``fmt`` as llama.cpp's mix of that name where it also names a plain format (``q6_k``: the Q6_K
        file type with its per-tensor rules, not ``pure``).
    """
    import gguf
    import llama_cpp

    ftype = FTYPES.get(fmt) or MIX_FTYPES.get(fmt)
    if ftype is None:
        raise ValueError(f"format {fmt!r}: no llama.cpp ftype known (known: {sorted(FTYPES)} and the mixes "
                         f"{sorted(MIX_FTYPES)})")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = int(threads)
    params.ftype = getattr(llama_cpp, ftype)
    params.pure = fmt in FTYPES and not mix
    params.quantize_output_tensor = False
    keep = int(gguf.GGMLQuantizationType[keep_type.upper()])
    params.output_tensor_type = keep
    params.token_embedding_type = keep
    keep_alive = []
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(sorted(imatrix.items())):
            arr = np.ascontiguousarray(values, dtype=np.float32)
            encoded = name.encode()
            keep_alive += [arr, encoded]
            entries[i].name = encoded
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        entries[len(imatrix)].name = None  # the list ends with a null name
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep_alive.append(entries)
    if overrides:
        table = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pattern, type_name) in enumerate(overrides.items()):
            encoded = pattern.encode()
            keep_alive.append(encoded)
            table[i].pattern = encoded
            table[i].type = int(gguf.GGMLQuantizationType[type_name.upper()])
        table[len(overrides)].pattern = None  # the table ends with a null pattern
        params.tt_overrides = ctypes.cast(table, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
        keep_alive.append(table)
    if os.path.exists(dst):
        os.remove(dst)
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    del keep_alive
    if rc != 0 or not os.path.exists(dst):
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {fmt}) failed with status {rc}")
    return seconds


def tensor_types(path: str) -> dict:
    """{tensor name: GGML type name} of a GGUF file."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def tensor_bytes(path: str, names) -> dict:
    """{name: uint8 bytes} of the named tensors of a GGUF file."""
    import gguf

    wanted = set(names)
    return {t.name: np.array(t.data).view(np.uint8).reshape(-1) for t in gguf.GGUFReader(path).tensors
            if t.name in wanted}


def weight_bits(path: str, names=None) -> dict:
    """Bits per weight over the named tensors (default: every tensor of more than one dimension)."""
    import gguf

    bits = elements = 0
    for t in gguf.GGUFReader(path).tensors:
        if (names is None and len(t.shape) > 1) or (names is not None and t.name in names):
            bits += int(t.n_bytes) * 8
            elements += int(t.n_elements)
    return {"bits": bits, "weights": elements, "bits_per_weight": bits / max(elements, 1)}

