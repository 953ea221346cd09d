"""Smallest file at a given quality: jgptq's per-tensor formats under a bits-per-weight budget (``target_bpw``)
against llama.cpp's own mixes and jgptq with the same fixed mixes, at equal bytes of the same tensors.

Models (``--models``, both trained here on Python's documentation prose and cached, see
:mod:`benchmarks.quality.lm`):
- ``quality``: the ``gguf_quality`` model (2 layers, hidden 1024, 8 experts of width 512, top-2);
- ``deep``: a MoE-deeper model (4 layers, hidden 512, 8 experts of width 512, top-2) trained without the
  load-balancing loss, so that its router uses the experts unevenly (recorded per layer: token share of the most
  and least used expert, normalised entropy of the usage).

One importance matrix per model feeds every side: the statistic of a jgptq round-to-nearest Q8_0 run (each layer's
inputs in that run are the float model's up to Q8_0 rounding of the layers before), written as a GGUF imatrix file
and read back as ``llama-quantize --imatrix`` does. Per mix (``--mixes``, default Q2_K_S, IQ2_M, Q3_K_M, Q4_K_M):
- llama.cpp: ``llama_model_quantize`` of the float F32 GGUF with the mix's ftype (its own per-tensor rules, not
  ``pure``), token embedding and output head kept in F32;
- jgptq mix: ``quantize_moe(mix=...)`` (GPTQ) given the same imatrix, exported with ``export_gguf``; the tensor
  types are checked to equal llama.cpp's file, tensor by tensor;
- jgptq target_bpw: ``quantize_moe(target_bpw=B, target_formats=...)`` with B the bits per weight measured on
  llama.cpp's file over the same tensors (every tensor stored in a GGML block type), so equal bytes.
Sizes are the bytes of the quantized tensors read from each file. Every file is evaluated by llama.cpp
(llama-cpp-python) as ``llama-perplexity --kl-divergence`` does (windows of ``--n-ctx`` from an empty context, the
second half scored): mean KL with its standard error, median, p99, top-1 agreement, perplexity; per pair the mean
per-token KL difference over the same tokens with its standard error.

The sensitivity proxy (``quality`` model, ``--proxy-allocations`` random allocations over ``--proxy-formats``): one
uniform GPTQ run per format; each random allocation's file is assembled from those runs' tensors and evaluated;
its predicted objective under each proxy (bits alone, summed GPTQ loss, GPTQ loss weighted by a gain per tensor
measured from one-tensor-at-a-time KL) is ranked against its measured KL (Spearman).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time

import numpy as np

from benchmarks import common
from benchmarks.gguf_quality import DEFAULT_CACHE, _evaluate, _paired

DOC = __doc__.splitlines()[0]
MIXES = ("q2_k_s", "iq2_m", "q3_k_m", "q4_k_m")
TARGET_FORMATS = ("iq2_xxs", "iq2_s", "iq3_xxs", "q3_k", "iq4_xs", "q5_k", "q6_k", "q8_0")
PROXY_FORMATS = ("iq2_xxs", "iq3_xxs", "iq4_xs", "q6_k")  # within TARGET_FORMATS: the library's costs apply


def _args(argv):
    p = common.parser("target_bpw", DOC)
    p.add_argument("--models", default="quality,deep", help="comma-separated: quality, deep")
    p.add_argument("--mixes", default=",".join(MIXES), help="llama.cpp mixes whose sizes are the budgets")
    p.add_argument("--target-formats", default=",".join(TARGET_FORMATS), help="candidate formats of target_bpw")
    p.add_argument("--proxy-formats", default=",".join(PROXY_FORMATS), help="formats of the proxy calibration")
    p.add_argument("--proxy-allocations", type=int, default=8, help="random allocations measured (0: no proxy)")
    p.add_argument("--proxy-model", default="quality", help="the model the proxy is calibrated on")
    p.add_argument("--train-steps", type=int, default=None, help="training steps of each model (default: its own)")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the trained models are kept")
    p.add_argument("--work-dir", default=None, help="keep the GGUF files here (default: a temporary folder)")
    p.add_argument("--n-ctx", type=int, default=256, help="evaluation window in tokens (bytes)")
    p.add_argument("--windows", type=int, default=64, help="held-out windows evaluated (0: all)")
    p.add_argument("--calib-seqs", type=int, default=128, help="calibration sequences of --calib-len bytes")
    p.add_argument("--calib-len", type=int, default=256, help="calibration sequence length")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    p.add_argument("--no-target", action="store_true", help="skip the target_bpw rows")
    p.add_argument("--reuse", action="store_true", help="with --work-dir: take the imatrix, llama.cpp and jgptq "
                   "mix files an earlier run left there (they are evaluated again), quantize only what is missing")
    args = p.parse_args(argv)
    if args.small:
        args.train_steps = args.train_steps or 4
        args.windows, args.calib_seqs = min(args.windows or 4, 4), min(args.calib_seqs, 8)
        args.proxy_allocations = min(args.proxy_allocations, 3)
    return args


def _split(text):
    return [s.strip().lower() for s in text.split(",") if s.strip()]


def has_target_bpw() -> bool:
    """True when this jgptq's PipelineConfig takes ``target_bpw``."""
    from jgptq import PipelineConfig

    return "target_bpw" in {f.name for f in dataclasses.fields(PipelineConfig)}


def _quantize(folder, calib, imatrix, batch_size, **fields):
    """A fresh float model from ``folder`` quantized by jgptq with config ``fields``: (model, result, seconds)."""
    import jgptq
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype="float32").eval()
    t0 = time.perf_counter()
    result = jgptq.quantize_moe(model, calib, None, device="cpu", imatrix=imatrix, batch_size=batch_size,
                                progress=False, **fields)
    return model, result, time.perf_counter() - t0


def _imatrix(path, folder, calib, batch, reuse):
    """The run's imatrix ({param: ImatrixEntry}) from a jgptq RTN Q8_0 run, kept in ``path`` (npz) for --reuse."""
    from jgptq.imatrix import ImatrixEntry

    if reuse and os.path.exists(path):
        with np.load(path) as z:
            names = sorted({k.rsplit("/", 1)[0] for k in z.files})
            return {n: ImatrixEntry(z[n + "/sums"], z[n + "/counts"]) for n in names}, None
    model, result, seconds = _quantize(folder, calib, None, batch, format="q8_0", method="rtn")
    imat = result.imatrix
    np.savez(path, **{f"{n}/{part}": np.asarray(getattr(e, part)) for n, e in imat.items()
                      for part in ("sums", "counts")})
    return imat, seconds


def _reused(path, reuse):
    return reuse and os.path.exists(path)


class Side:
    """Evaluates GGUF files of one model against its float reference, keeping per-token KL for paired figures."""

    def __init__(self, held, ref, threads):
        self.held, self.ref, self.threads, self.per_token = held, ref, threads, {}

    def measure(self, key, path, seconds=None):
        from benchmarks.quality.bpw_parts import quantized_bits

        stats, self.per_token[key] = _evaluate(path, self.held, self.ref, self.threads)
        size = quantized_bits(path)
        stats.update({k: size[k] for k in ("bytes", "weights", "bits_per_weight", "types")})
        stats["tensor_names"] = size["tensors"]
        if seconds is not None:
            stats["quantize_s"] = seconds
        return stats

    def paired(self, a, b):
        return _paired(self.per_token[a], self.per_token[b])


def _mix_entry(mix, ctx, float_model, imat, entries, side, export_gguf):
    """llama.cpp's mix, jgptq's same mix, jgptq target_bpw at llama.cpp's size, for one mix."""
    from benchmarks.quality import llama_side

    args, work, folder, calib = ctx["args"], ctx["work"], ctx["folder"], ctx["calib"]
    entry = {}
    path_l = os.path.join(work, f"{ctx['name']}-llama-{mix}.gguf")
    seconds = None if _reused(path_l, args.reuse) else llama_side.quantize(ctx["f32"], path_l, mix, entries,
                                                                           keep_type="F32", threads=args.threads)
    entry["llama_cpp"] = side.measure("llama", path_l, seconds)
    bpw = entry["llama_cpp"]["bits_per_weight"]
    print(f"[{ctx['name']}] {mix}: llama.cpp {bpw:.4f} bpw, KL {entry['llama_cpp']['kl_mean']:.5f}", flush=True)

    path_m, seconds = os.path.join(work, f"{ctx['name']}-jgptq-{mix}.gguf"), None
    if not _reused(path_m, args.reuse):
        model, result, seconds = _quantize(folder, calib, imat, ctx["batch"], mix=mix)
        export_gguf(model, result, path_m, overwrite=True, float_type="f32", float_embeddings=True)
        del model, result
    entry["jgptq_mix"] = side.measure("mix", path_m, seconds)
    lt, mt = llama_side.tensor_types(path_l), llama_side.tensor_types(path_m)
    entry["mix_types_equal_llama"] = lt == mt
    if lt != mt:
        entry["mix_type_differences"] = {n: [lt.get(n), mt.get(n)] for n in sorted(set(lt) | set(mt))
                                         if lt.get(n) != mt.get(n)}
    entry["kl_ratio_llama_over_mix"] = entry["llama_cpp"]["kl_mean"] / entry["jgptq_mix"]["kl_mean"]
    entry["paired_llama_minus_mix"] = side.paired("llama", "mix")
    print(f"[{ctx['name']}] {mix}: jgptq mix KL {entry['jgptq_mix']['kl_mean']:.5f}", flush=True)

    if args.no_target or not has_target_bpw():
        entry["jgptq_target"] = {"skipped": "--no-target" if args.no_target else
                                 "this jgptq has no target_bpw (PipelineConfig field)"}
        return entry
    formats = tuple(_split(args.target_formats))
    first = ctx.get("allocation")
    path_t = os.path.join(work, f"{ctx['name']}-jgptq-target-{mix}.gguf")
    kept = path_t + ".allocation.json"
    if _reused(path_t, args.reuse) and os.path.exists(kept):
        with open(kept) as f:
            alloc, source = json.load(f), "an earlier run's file (--reuse)"
        ctx.setdefault("allocation", alloc)
        seconds, model = None, None
    elif first is None:  # the first budget measures every candidate (the sensitivity pass) and allocates
        model, result, seconds = _quantize(folder, calib, imat, ctx["batch"], format=formats[0], target_bpw=bpw,
                                           target_formats=formats)
        alloc, source = result.report.allocation, "target_bpw run (sensitivity pass and allocation)"
        ctx["allocation"] = alloc
    else:  # later budgets: the library's reallocation of the same measurement, then the normal pipeline
        from jgptq_torch.pipeline.sensitivity import assignment_of, reallocate

        alloc = reallocate(first, bpw)
        model, result, seconds = _quantize(folder, calib, imat, ctx["batch"], format=formats[0],
                                           assignment=tuple(assignment_of(alloc)))
        source = "jgptq_torch.pipeline.sensitivity.reallocate of the first budget's measurement, run with its assignment"
    if model is not None:
        export_gguf(model, result, path_t, overwrite=True, float_type="f32", float_embeddings=True)
        with open(kept, "w") as f:
            json.dump(alloc, f)
        del model, result
    t = side.measure("target", path_t, seconds)
    t["target_bpw"] = bpw
    t["allocation_source"] = source
    t["allocation"] = alloc
    entry["jgptq_target"] = t
    entry["same_tensors"] = t["tensor_names"] == entry["llama_cpp"]["tensor_names"]
    entry["bytes_target_over_llama"] = t["bytes"] / entry["llama_cpp"]["bytes"]
    entry["kl_ratio_llama_over_target"] = entry["llama_cpp"]["kl_mean"] / t["kl_mean"]
    entry["kl_ratio_mix_over_target"] = entry["jgptq_mix"]["kl_mean"] / t["kl_mean"]
    entry["kl_reduction_vs_llama"] = 1.0 - t["kl_mean"] / entry["llama_cpp"]["kl_mean"]
    entry["kl_reduction_vs_mix"] = 1.0 - t["kl_mean"] / entry["jgptq_mix"]["kl_mean"]
    entry["paired_llama_minus_target"] = side.paired("llama", "target")
    entry["paired_mix_minus_target"] = side.paired("mix", "target")
    print(f"[{ctx['name']}] {mix}: target_bpw {t['bits_per_weight']:.4f} bpw, KL {t['kl_mean']:.5f} "
          f"(llama/target {entry['kl_ratio_llama_over_target']:.2f})", flush=True)
    return entry


def _run_model(name, args, splits, digest, work, out):
    import torch

    from benchmarks.quality import corpus, lm
    from benchmarks.quality.imatrix_io import llama_imatrix
    from jgptq_torch.cli import llama_logits
    from jgptq import evaluation
    from jgptq_torch.export.gguf.export import export_gguf

    arch, train_cfg = lm.MODELS[name]
    model, info = lm.trained_model(splits, digest, args.cache_dir, steps=args.train_steps, arch=arch,
                                   train_cfg=train_cfg)
    held = corpus.windows(splits.tokens["heldout"], args.n_ctx, args.windows or None)
    calib_np = corpus.windows(splits.tokens["calib"], args.calib_len, args.calib_seqs)
    calib = torch.from_numpy(calib_np)
    res = out["models"][name] = {"model": {k: v for k, v in info.items() if k != "loss_history"},
                                 "expert_usage_calibration": lm.expert_usage(model, calib_np),
                                 "calibration": {"sequences": int(calib.shape[0]), "length": int(calib.shape[1])},
                                 "mixes": {}}
    usage = res["expert_usage_calibration"]
    print(f"[{name}] expert usage: max/mean per layer {[round(v, 2) for v in usage['max_over_mean']]}, "
          f"min share {[round(v, 3) for v in usage['min_share']]}", flush=True)
    f32 = os.path.join(work, f"{name}-float-f32.gguf")
    export_gguf(model, None, f32, overwrite=True, float_type="f32")
    ref = llama_logits.logits(f32, held, threads=args.threads)
    with torch.no_grad():
        check = model(input_ids=torch.from_numpy(held[:2])).logits.float().numpy()
    float_stats = evaluation.summarize(evaluation.window_stats(ref, ref, held))
    res["evaluation"] = {"n_ctx": args.n_ctx, "windows": int(len(held)), "first_scored": evaluation.first_scored(args.n_ctx),
                         "float_llama_vs_torch_max_abs_logit_diff": float(np.abs(check - ref[:2]).max()),
                         "llama_float_ppl": float_stats["ppl"]}
    batch = min(32, args.calib_seqs)
    imat, seconds = _imatrix(os.path.join(work, f"{name}-imatrix.npz"), info["folder"], calib, batch, args.reuse)
    entries = llama_imatrix(model, imat, os.path.join(work, f"{name}-imatrix.gguf"))
    res["imatrix"] = {"source": "jgptq RTN Q8_0 run over the calibration set", "entries": len(entries),
                      "seconds": seconds}
    side = Side(held, ref, args.threads)
    ctx = {"args": args, "work": work, "folder": info["folder"], "calib": calib, "name": name, "f32": f32,
           "batch": batch}
    for mix in _split(args.mixes):
        try:
            res["mixes"][mix] = _mix_entry(mix, ctx, model, imat, entries, side, export_gguf)
        except Exception as exc:  # recorded; the other mixes still run
            res["mixes"][mix] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
            print(f"[{name}] {mix}: {res['mixes'][mix]['error']}", flush=True)
        common.write(args.out, {k: v for k, v in out.items() if k != "previous"})
    if name == args.proxy_model and args.proxy_allocations > 0:
        from benchmarks.quality.proxy_calibration import calibrate

        try:
            res["proxy_calibration"] = calibrate(ctx, model, imat, side, export_gguf, _split(args.proxy_formats),
                                                 args.proxy_allocations, _quantize,
                                                 allocation=ctx.get("allocation"))
        except Exception as exc:
            res["proxy_calibration"] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
            print(f"[{name}] proxy calibration: {res['proxy_calibration']['error']}", flush=True)
    elif "proxy_calibration" in out.get("previous", {}).get(name, {}):
        res["proxy_calibration"] = dict(out["previous"][name]["proxy_calibration"], reused_from_earlier_run=True)
    _chart(name, res, args.out)
    return res


def _chart(name, res, out_path):
    from benchmarks.quality.bpw_parts import kl_size_chart

    series = {"llama.cpp mixes": [], "jgptq fixed mixes": [], "jgptq target_bpw": []}
    keys = {"llama.cpp mixes": "llama_cpp", "jgptq fixed mixes": "jgptq_mix", "jgptq target_bpw": "jgptq_target"}
    for mix, entry in res["mixes"].items():
        for label, key in keys.items():
            side = entry.get(key) or {}
            if "kl_mean" in side:
                series[label].append((side["bytes"] / 1e6, side["kl_mean"], f"{mix}: {side['bits_per_weight']:.3f} bpw"))
    series = {k: v for k, v in series.items() if v}
    if not series:
        return
    svg = kl_size_chart(series, title=f"KL to the float model against size ({name} model)",
                        xlabel="quantized tensors (MB)")
    path = os.path.splitext(out_path)[0] + f"_{name}.svg"
    with open(path, "w") as f:
        f.write(svg)
    res["chart"] = os.path.basename(path)
    print(f"wrote {path}")


def _table(res):
    lines = ["mix      bpw    KL llama.cpp        KL jgptq mix        KL target_bpw       llama/tgt mix/tgt"]
    for mix, e in res["mixes"].items():
        if "error" in e:
            lines.append(f"{mix:8s} error: {e['error'][:80]}")
            continue
        cell = [e.get(k) or {} for k in ("llama_cpp", "jgptq_mix", "jgptq_target")]
        text = " ".join(f"{c.get('kl_mean', math.nan):9.5f}±{c.get('kl_mean_stderr', math.nan):.5f}" for c in cell)
        lines.append(f"{mix:8s} {cell[0].get('bits_per_weight', math.nan):5.3f}  {text}  "
                     f"{e.get('kl_ratio_llama_over_target', math.nan):6.2f} {e.get('kl_ratio_mix_over_target', math.nan):6.2f}")
    return "\n".join(lines)


def main(argv=None):
    args = _args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jgptq  # noqa: F401
    import torch

    from benchmarks.quality import corpus, llama_side, lm
    from jgptq_torch.cli import llama_logits

    if not llama_logits.available():
        raise SystemExit("target_bpw needs llama-cpp-python (the llama_cpp package)")
    names = _split(args.models)
    unknown = [n for n in names if n not in lm.MODELS] + [m for m in _split(args.mixes) if m not in
                                                          llama_side.MIX_FTYPES]
    if unknown:
        raise SystemExit(f"unknown models or mixes {unknown}; models {sorted(lm.MODELS)}, mixes "
                         f"{sorted(llama_side.MIX_FTYPES)}")
    torch.manual_seed(0)
    data = corpus.corpus_bytes()
    digest = corpus.corpus_digest(data)
    splits = corpus.split(data)
    out = {"benchmark": "target_bpw", "description": __doc__, "target_bpw_available": has_target_bpw(),
           "corpus": {"sha256": digest, "bytes": len(data)},
           "settings": {"mixes": _split(args.mixes), "target_formats": _split(args.target_formats),
                        "proxy_formats": _split(args.proxy_formats), "threads": args.threads},
           "models": {}}
    if args.reuse and os.path.exists(args.out):  # an earlier run's proxy calibration is kept when not redone
        with open(args.out) as f:
            out["previous"] = json.load(f).get("models", {})
    work = args.work_dir or tempfile.mkdtemp(prefix="jgptq_target_bpw_")
    os.makedirs(work, exist_ok=True)
    try:
        for name in names:
            _run_model(name, args, splits, digest, work, out)
            common.write(args.out, {k: v for k, v in out.items() if k != "previous"})
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    for name in names:
        print(f"\n{name} model:\n{_table(out['models'][name])}")
    out.pop("previous", None)
    common.write(args.out, out)
    return 0
