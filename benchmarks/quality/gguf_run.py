"""One format of the ``gguf_quality`` benchmark: jgptq GPTQ, llama.cpp given jgptq's imatrix, jgptq RTN, each file
evaluated against the float model in llama.cpp.

A format is a GGML type (every weight tensor at it: llama.cpp's ``pure``) or one of llama.cpp's mixes (its per-tensor
rules; jgptq runs the same preset, ``PipelineConfig.mix``). The quantized tensors are those jgptq's file stores in a
GGML block type; sizes are their bytes read from each file; the tensor types of the two files are compared one by
one (``types_equal``), so a rule that differs shows as a type mismatch, not as a quality difference.

Tensors in :data:`KEEP_FLOAT` are the exception: jgptq writes them in the float type by design, and llama.cpp is
told to do the same (``--tensor-type``), so that every tensor has the same type and bytes on both sides.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

# {regex: why}: weights jgptq's GGUF export keeps in the float type, which llama.cpp is told to keep too.
KEEP_FLOAT = {r"\.attn_k_b\.weight$": "deepseek2's attn_k_b, the transposed key rows of kv_b_proj: jgptq writes it "
                                      "in the float type from its quantized kv_b_proj values (no block survives the "
                                      "transpose); llama.cpp would encode it anew from the float weights"}


def evaluate(path, windows, ref, threads):
    """llama.cpp's logits of ``path`` on ``windows`` against ``ref``: (summary statistics, per-token KL)."""
    from jgptq import evaluation
    from jgptq_torch.cli import llama_logits

    t0 = time.perf_counter()
    logits = llama_logits.logits(path, windows, threads=threads)
    per_token = evaluation.window_stats(ref, logits, windows)
    stats = evaluation.summarize(per_token)
    stats["eval_s"] = time.perf_counter() - t0
    return stats, per_token["kl"]


def paired(kl_a: np.ndarray, kl_b: np.ndarray) -> dict:
    """Mean per-token KL difference a - b over the same tokens, its standard error, and the share of tokens where
    b is lower."""
    d = np.asarray(kl_a, np.float64) - np.asarray(kl_b, np.float64)
    return {"mean": float(d.mean()), "stderr": float(d.std(ddof=1) / math.sqrt(d.size)),
            "share_b_lower": float(np.mean(d > 0))}


def quantize_jgptq(folder, arch, calib, fmt, method, batch_size, imatrix=None, imatrix_source="replay"):
    """A fresh float model (``arch``'s family, from ``folder``) quantized by jgptq at ``fmt`` (a GGML format or a
    mix preset); returns (model, result, seconds)."""
    import jgptq
    from benchmarks.quality import lm
    from jgptq import PipelineConfig
    from jgptq.mixes import PRESETS

    model = lm.load(folder, arch)
    which = {"mix": fmt} if fmt in PRESETS else {"format": fmt}
    cfg = PipelineConfig.build(None, method=method, batch_size=batch_size, progress=False,
                               imatrix_source=imatrix_source, **which)
    t0 = time.perf_counter()
    kwargs = {} if imatrix is None else {"imatrix": imatrix}
    result = jgptq.quantize_moe(model, calib, cfg, device="cpu", **kwargs)
    return model, result, time.perf_counter() - t0


def _side(path, quantized_names, windows, ref, threads, seconds, per_token: dict, key: str):
    from benchmarks.quality import llama_side

    out, per_token[key] = evaluate(path, windows, ref, threads)
    out.update(llama_side.weight_bits(path, quantized_names))
    out["bytes"] = out["bits"] // 8
    out["quantize_s"] = seconds
    return out


def compare_tensors(path_a, path_b, names):
    """How many of the named tensors two GGUF files hold byte for byte alike."""
    from benchmarks.quality import llama_side

    a = llama_side.tensor_bytes(path_a, names)
    b = llama_side.tensor_bytes(path_b, names)
    same = [n for n in names if n in a and n in b and np.array_equal(a[n], b[n])]
    blocks = {}
    for n in names:
        if n in a and n in b and a[n].size == b[n].size:
            blocks[n] = float(np.mean(a[n] == b[n]))
    return {"tensors": len(names), "identical_tensors": len(same),
            "identical_byte_share_min": min(blocks.values()) if blocks else None,
            "differing": sorted(set(names) - set(same))[:8]}


def _counts(types: dict) -> dict:
    return {t: sum(1 for v in types.values() if v == t) for t in sorted(set(types.values()))}


def keep_float_overrides(types: dict) -> dict:
    """llama.cpp's tensor-type overrides for the :data:`KEEP_FLOAT` tensors jgptq's file (``types``: name -> GGML
    type) holds in a float type: {pattern: that type}."""
    import re

    out = {}
    for pattern in KEEP_FLOAT:
        kinds = {t for n, t in types.items() if re.search(pattern, n)}
        if len(kinds) == 1 and next(iter(kinds)) in ("F32", "F16", "BF16"):
            out[pattern] = next(iter(kinds))
    return out


def run_format(fmt, entry, ctx, source="replay"):
    """One format with jgptq's imatrix collected on ``source``: fills ``entry``, returns the per-token KL of each
    side. ``ctx``: float_model, folder, arch, calib, held, ref, f32, work, args."""
    from benchmarks.quality import llama_side
    from benchmarks.quality.bpw_parts import FLOAT_TYPES
    from benchmarks.quality.imatrix_io import llama_imatrix
    from jgptq_torch.export.gguf.export import export_gguf

    args, work = ctx["args"], ctx["work"]
    batch = min(32, args.calib_seqs)
    # jgptq GPTQ
    model, result, seconds = quantize_jgptq(ctx["folder"], ctx["arch"], ctx["calib"], fmt, "gptq", batch,
                                            imatrix_source=source)
    entry["mix"] = fmt in llama_side.MIX_FTYPES
    entry["jgptq_methods"] = {m: sum(r.method == m for r in result.report.records) for m in ("gptq", "rtn")}
    kept = sorted(r.name for r in result.report.records if r.reason.startswith("lower loss"))
    entry["jgptq_plain_kept"] = {"count": len(kept), "first": kept[:24]}
    path_g = os.path.join(work, f"jgptq-gptq-{fmt}.gguf")
    export_gguf(model, result, path_g, overwrite=True, float_type="f32", float_embeddings=True)
    types = llama_side.tensor_types(path_g)
    quantized = sorted(n for n, t in types.items() if t not in FLOAT_TYPES)
    entry["quantized_tensors"] = len(quantized)
    entry["jgptq_types"] = _counts({n: types[n] for n in quantized})
    imatrix = result.imatrix
    del model, result
    # the imatrix, as llama-quantize would read it from a GGUF imatrix file
    entries = llama_imatrix(ctx["float_model"], imatrix, os.path.join(work, f"imatrix-{fmt}.gguf"))
    entry["imatrix_entries"] = len(entries)
    # llama.cpp
    overrides = keep_float_overrides(types)
    entry["llama_overrides"] = {p: {"type": t, "why": KEEP_FLOAT[p]} for p, t in overrides.items()}
    path_l = os.path.join(work, f"llama-{fmt}.gguf")
    llama_s = llama_side.quantize(ctx["f32"], path_l, fmt, entries, keep_type="F32", threads=args.threads,
                                  overrides=overrides)
    ltypes = llama_side.tensor_types(path_l)
    entry["llama_types"] = _counts({n: t for n, t in ltypes.items() if t not in FLOAT_TYPES})
    entry["types_equal"] = ltypes == types
    entry["llama_quantized_same_tensors"] = sorted(n for n, t in ltypes.items() if t not in FLOAT_TYPES) == quantized
    if not entry["types_equal"]:
        entry["type_mismatch"] = {n: [types.get(n), ltypes.get(n)] for n in sorted(set(types) | set(ltypes))
                                  if types.get(n) != ltypes.get(n)}
    # jgptq RTN with the same imatrix (sanity: llama.cpp's bytes)
    path_r = None
    if not args.no_rtn:
        model, result, rtn_s = quantize_jgptq(ctx["folder"], ctx["arch"], ctx["calib"], fmt, "rtn", batch,
                                              imatrix=imatrix)
        path_r = os.path.join(work, f"jgptq-rtn-{fmt}.gguf")
        export_gguf(model, result, path_r, overwrite=True, float_type="f32", float_embeddings=True)
        del model, result
        entry["rtn_vs_llama_bytes"] = compare_tensors(path_r, path_l, quantized)
    per_token = {}
    held, ref, threads = ctx["held"], ctx["ref"], args.threads
    entry["llama_cpp"] = _side(path_l, quantized, held, ref, threads, llama_s, per_token, "llama_cpp")
    entry["jgptq_gptq"] = _side(path_g, quantized, held, ref, threads, seconds, per_token, "jgptq_gptq")
    if path_r:
        entry["jgptq_rtn"] = _side(path_r, quantized, held, ref, threads, rtn_s, per_token, "jgptq_rtn")
    entry["bytes_jgptq_over_llama"] = entry["jgptq_gptq"]["bytes"] / entry["llama_cpp"]["bytes"]
    # paired over the same tokens: llama.cpp's KL minus jgptq's (positive: jgptq closer to the float model)
    entry["kl_paired_llama_minus_jgptq"] = paired(per_token["llama_cpp"], per_token["jgptq_gptq"])
    kl_l, kl_g = entry["llama_cpp"]["kl_mean"], entry["jgptq_gptq"]["kl_mean"]
    entry["kl_ratio_llama_over_jgptq"] = kl_l / kl_g if kl_g > 0 else float("inf")
    entry["kl_relative_improvement"] = 1.0 - kl_g / kl_l if kl_l > 0 else float("nan")
    entry["median_ratio_llama_over_jgptq"] = (entry["llama_cpp"]["kl_median"] / entry["jgptq_gptq"]["kl_median"]
                                              if entry["jgptq_gptq"]["kl_median"] > 0 else float("inf"))
    return per_token
