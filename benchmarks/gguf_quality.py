"""Quality of GGML quantization: jgptq's GPTQ against llama.cpp's own quantizer with the same imatrix, as KL divergence.

The model: a small Qwen3-MoE over bytes (2 layers, 8 experts, top-2, hidden 1024, expert width 512: every quantized
row 2-4 GGML super-blocks long) trained here on Python's documentation prose (``pydoc_data.topics``), cached in
``--cache-dir`` keyed by its settings (see :mod:`benchmarks.quality.corpus` and :mod:`benchmarks.quality.lm`).
Train, calibration and held-out text are disjoint byte ranges of the corpus.

Per format (``--formats``, default Q4_K, IQ4_XS, IQ3_XXS, IQ2_XXS, IQ1_S), starting each time from the float model:
- jgptq: ``quantize_moe`` with the format (GPTQ; the encoders' importance is the imatrix statistic the run collects
  layer by layer, on the inputs each layer sees in that run, or with ``--imatrix-source float`` on the inputs it
  sees when every earlier layer is float, llama.cpp's definition; ``both`` runs each and compares them), exported
  with ``export_gguf`` (token embedding and output head in F32, routers and norms in F32);
- llama.cpp: ``llama_model_quantize`` of the float F32 GGUF (``pure``: every weight tensor at the format; token
  embedding and output head kept in F32), fed with the jgptq run's imatrix written as a GGUF imatrix file and read
  back as ``llama-quantize --imatrix`` does (in_sum2 / counts per expert);
- jgptq RTN (sanity): ``quantize_moe(method="rtn")`` given the same imatrix: a plain encoding with importance, which
  should reproduce llama.cpp's bytes (the share of identical tensors is recorded).
All GGUF files (float included) are evaluated by llama.cpp (llama-cpp-python): held-out text cut into windows of
``--n-ctx`` bytes, each run from an empty context, only the second half of each window scored (llama-perplexity
--kl-divergence). Per scored token KL(p_float || p_quant) in float64: mean (with standard error), median, p90, p99,
max; the rate at which both models rank the same token first; the perplexity of each model. The headline is
KL_llama / KL_jgptq (mean KL) and the relative improvement 1 - KL_jgptq / KL_llama.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]
FORMATS = ("q4_k", "iq4_xs", "iq3_xxs", "iq2_xxs", "iq1_s")
DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jgptq",
                             "gguf_quality")


def _args(argv):
    p = common.parser("gguf_quality", DOC)
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated GGML formats")
    p.add_argument("--train-steps", type=int, default=None, help="training steps of the model (default: 300)")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the trained model is kept")
    p.add_argument("--model-dir", default=None,
                   help="a model trained earlier on this corpus (a folder with train_info.json), used instead of "
                        "training one")
    p.add_argument("--work-dir", default=None, help="keep the GGUF files here (default: a temporary folder)")
    p.add_argument("--n-ctx", type=int, default=256, help="evaluation window in tokens (bytes)")
    p.add_argument("--windows", type=int, default=64, help="held-out windows evaluated (default 64; 0: all)")
    p.add_argument("--calib-seqs", type=int, default=128, help="calibration sequences of --calib-len bytes")
    p.add_argument("--calib-len", type=int, default=256, help="calibration sequence length")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="llama.cpp threads (default: half the cores; busy-waiting threads on shared cores slow it)")
    p.add_argument("--no-rtn", action="store_true", help="skip the jgptq RTN sanity rows")
    p.add_argument("--imatrix-source", choices=("replay", "float", "both"), default="replay",
                   help="inputs jgptq's imatrix statistic is collected on (PipelineConfig.imatrix_source); both: "
                        "each in turn, results per source and compared (default: replay)")
    args = p.parse_args(argv)
    if args.small:  # a smoke run: a briefly trained model, one format, few windows
        args.formats = "q4_k" if args.formats == ",".join(FORMATS) else args.formats
        args.train_steps = args.train_steps or 10
        args.windows, args.calib_seqs = min(args.windows or 8, 8), min(args.calib_seqs, 16)
    return args


def _fresh_model(folder):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(folder, dtype="float32").eval()


def _given_model(folder, digest):
    """A model trained earlier on the same corpus (its train_info.json names the corpus digest)."""
    import json

    with open(os.path.join(folder, "train_info.json")) as f:
        info = json.load(f)
    if info.get("corpus_sha256") != digest:
        raise SystemExit(f"--model-dir {folder}: trained on corpus {info.get('corpus_sha256')}, not {digest}")
    info.update(folder=os.path.abspath(folder), cached=True, given=True)
    return _fresh_model(folder), info


def _quantize_jgptq(folder, calib, fmt, method, batch_size, imatrix=None, imatrix_source="replay"):
    """A fresh float model quantized by jgptq; returns (model, result, seconds)."""
    import jgptq
    from jgptq import PipelineConfig, QuantConfig

    model = _fresh_model(folder)
    cfg = PipelineConfig(quant=QuantConfig(format=fmt), method=method, batch_size=batch_size, progress=False,
                         imatrix_source=imatrix_source)
    t0 = time.perf_counter()
    kwargs = {} if imatrix is None else {"imatrix": imatrix}
    result = jgptq.quantize_moe(model, calib, cfg, device="cpu", **kwargs)
    return model, result, time.perf_counter() - t0


def _evaluate(path, windows, ref, threads):
    from jgptq_torch.cli import llama_logits
    from jgptq import evaluation

    t0 = time.perf_counter()
    logits = llama_logits.logits(path, windows, threads=threads)
    per_token = evaluation.window_stats(ref, logits, windows)
    stats = evaluation.summarize(per_token)
    stats["eval_s"] = time.perf_counter() - t0
    return stats, per_token["kl"]


def _side(path, quantized_names, windows, ref, threads, seconds, per_token: dict, key: str):
    from benchmarks.quality import llama_side

    out, per_token[key] = _evaluate(path, windows, ref, threads)
    out.update(llama_side.weight_bits(path, quantized_names))
    out["quantize_s"] = seconds
    return out


def _paired(kl_a: np.ndarray, kl_b: np.ndarray) -> dict:
    """Mean per-token KL difference a - b over the same tokens, its standard error, and the share of tokens where
    b is lower."""
    d = np.asarray(kl_a, np.float64) - np.asarray(kl_b, np.float64)
    return {"mean": float(d.mean()), "stderr": float(d.std(ddof=1) / math.sqrt(d.size)),
            "share_b_lower": float(np.mean(d > 0))}


def _compare_tensors(path_a, path_b, names):
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


def _row(fmt, entry):
    j, l = entry.get("jgptq_gptq", {}), entry.get("llama_cpp", {})
    r = entry.get("jgptq_rtn", {})
    return (f"{fmt:8s} {j.get('bits_per_weight', float('nan')):5.2f}  "
            f"{l.get('kl_mean', float('nan')):9.5f} {r.get('kl_mean', float('nan')):9.5f} "
            f"{j.get('kl_mean', float('nan')):9.5f}  {entry.get('kl_ratio_llama_over_jgptq', float('nan')):6.2f}  "
            f"{l.get('kl_p99', float('nan')):8.4f} {j.get('kl_p99', float('nan')):8.4f}  "
            f"{l.get('same_top_rate', float('nan')):6.3f} {j.get('same_top_rate', float('nan')):6.3f}  "
            f"{l.get('ppl', float('nan')):7.4f} {j.get('ppl', float('nan')):7.4f}")


HEADER = ("format   bpw   KL llama  KL rtn    KL gptq   llama/  p99 llama p99 gptq  top1 L top1 G  PPL L   PPL G\n"
          "                (mean)    (mean)    (mean)    gptq")


def main(argv=None):
    args = _args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jgptq  # noqa: F401  (sets the JAX allocator before JAX starts)
    import torch

    from benchmarks.quality import corpus, llama_side, lm
    from benchmarks.quality.imatrix_io import llama_imatrix
    from jgptq_torch.cli import llama_logits
    from jgptq_torch.export.gguf.export import export_gguf
    from jgptq import evaluation

    if not llama_logits.available():
        raise SystemExit("gguf_quality needs llama-cpp-python (the llama_cpp package)")
    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in llama_side.FTYPES]
    if unknown:
        raise SystemExit(f"--formats: unknown {unknown}; known: {sorted(llama_side.FTYPES)}")
    torch.manual_seed(0)

    data = corpus.corpus_bytes()
    digest = corpus.corpus_digest(data)
    splits = corpus.split(data)
    if args.model_dir:
        model, info = _given_model(args.model_dir, digest)
    else:
        model, info = lm.trained_model(splits, digest, args.cache_dir, steps=args.train_steps)
    folder = info["folder"]
    held = corpus.windows(splits.tokens["heldout"], args.n_ctx, args.windows or None)
    calib = torch.from_numpy(corpus.windows(splits.tokens["calib"], args.calib_len, args.calib_seqs))
    first = evaluation.first_scored(args.n_ctx)
    torch_loss = lm.mean_loss(model, held, first=first)
    out = {"benchmark": "gguf_quality", "description": __doc__,
           "corpus": {"source": "pydoc_data.topics (sorted keys, joined by blank lines, UTF-8)", "sha256": digest,
                      "bytes": len(data), "split_bytes": {k: int(len(v)) for k, v in splits.tokens.items()}},
           "model": {k: v for k, v in info.items() if k != "loss_history"},
           "evaluation": {"n_ctx": args.n_ctx, "windows": int(len(held)), "first_scored": first,
                          "scored_tokens": int(len(held) * (args.n_ctx - 1 - first)), "threads": args.threads,
                          "torch_float_loss_nats": torch_loss, "torch_float_ppl": math.exp(torch_loss)},
           "calibration": {"sequences": int(calib.shape[0]), "length": int(calib.shape[1])},
           "notes": ["jgptq quantize_s: the whole quantize_moe run (calibration forwards, imatrix statistic, "
                     "solves, JIT compilation); llama_cpp quantize_s: llama_model_quantize alone, given the imatrix",
                     "token embedding, output head, norms and routers are F32 on every side; only the weight "
                     "tensors listed as quantized differ"],
           "formats": {}}
    print(f"model: held-out {info.get('heldout_bits_per_byte', float('nan')):.3f} bits/byte; "
          f"{len(held)} windows of {args.n_ctx}, calibration {tuple(calib.shape)}", flush=True)

    work = args.work_dir or tempfile.mkdtemp(prefix="jgptq_gguf_quality_")
    os.makedirs(work, exist_ok=True)
    try:
        f32 = os.path.join(work, "float-f32.gguf")
        export_gguf(model, None, f32, overwrite=True, float_type="f32")
        ref = llama_logits.logits(f32, held, threads=args.threads)
        with torch.no_grad():  # the F32 GGUF in llama.cpp against the torch model it was written from
            check = model(input_ids=torch.from_numpy(held[:4])).logits.float().numpy()
        out["evaluation"]["float_llama_vs_torch_max_abs_logit_diff"] = float(np.abs(check - ref[:4]).max())
        out["evaluation"]["float_logit_scale"] = float(np.abs(check).max())
        float_stats = evaluation.summarize(evaluation.window_stats(ref, ref, held))
        out["evaluation"].update({"llama_float_ppl": float_stats["ppl"],
                                  "llama_float_loss_nats": math.log(float_stats["ppl"])})
        sources = ("replay", "float") if args.imatrix_source == "both" else (args.imatrix_source,)
        for fmt in formats:
            kls = {}
            for source in sources:
                entry = out["formats"].setdefault(fmt, {})
                entry = entry.setdefault(source, {}) if len(sources) > 1 else entry
                entry["imatrix_source"] = source
                try:
                    kls[source] = _run_format(fmt, entry, model, folder, calib, held, ref, f32, work, args,
                                              export_gguf, llama_imatrix, source)
                except Exception as exc:  # recorded; the other formats still run
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:800]
                    print(f"{fmt} ({source}): {entry['error']}", flush=True)
                common.write(args.out, out)
            if len(kls) == 2:
                out["formats"][fmt]["float_vs_replay"] = _sources_compared(out["formats"][fmt], kls)
                common.write(args.out, out)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print(HEADER)
    for fmt in formats:
        for source in sources:
            e = out["formats"][fmt]
            print(_row(fmt if len(sources) == 1 else f"{fmt}/{source[0]}", e if len(sources) == 1 else e[source]))
    common.write(args.out, out)
    return 0


def _sources_compared(by_source: dict, kls: dict) -> dict:
    """Float against replay imatrix source, per side: mean KL of each, their ratio, and the paired difference
    replay - float over the same tokens (positive: the float source closer to the float model)."""
    out = {}
    for side in ("jgptq_gptq", "llama_cpp"):
        r, f = by_source["replay"].get(side, {}), by_source["float"].get(side, {})
        if "kl_mean" not in r or "kl_mean" not in f:
            continue
        out[side] = {"kl_mean_replay": r["kl_mean"], "kl_mean_float": f["kl_mean"],
                     "ratio_float_over_replay": f["kl_mean"] / r["kl_mean"] if r["kl_mean"] > 0 else float("nan"),
                     "paired_replay_minus_float": _paired(kls["replay"][side], kls["float"][side])}
    return out


def _run_format(fmt, entry, float_model, folder, calib, held, ref, f32, work, args, export_gguf,
               llama_imatrix, source="replay"):
    """One format with jgptq's imatrix collected on ``source``: fills ``entry``, returns the per-token KL of
    each side."""
    import gguf

    from benchmarks.quality import llama_side

    qtype = gguf.GGMLQuantizationType[fmt.upper()].name
    # jgptq GPTQ
    model, result, seconds = _quantize_jgptq(folder, calib, fmt, "gptq", min(32, args.calib_seqs),
                                             imatrix_source=source)
    entry["jgptq_methods"] = {m: sum(r.method == m for r in result.report.records) for m in ("gptq", "rtn")}
    kept = sorted(r.name for r in result.report.records if r.reason.startswith("lower loss"))
    entry["jgptq_plain_kept"] = {"count": len(kept), "first": kept[:24]}
    path_g = os.path.join(work, f"jgptq-gptq-{fmt}.gguf")
    export_gguf(model, result, path_g, overwrite=True, float_type="f32", float_embeddings=True)
    types = llama_side.tensor_types(path_g)
    quantized = sorted(n for n, t in types.items() if t == qtype)
    entry["quantized_tensors"] = len(quantized)
    entry["jgptq_other_types"] = sorted({t for n, t in types.items() if t != qtype})
    imatrix = result.imatrix
    del model, result
    # the imatrix, as llama-quantize would read it from a GGUF imatrix file
    imat_path = os.path.join(work, f"imatrix-{fmt}.gguf")
    entries = llama_imatrix(float_model, imatrix, imat_path)
    entry["imatrix_entries"] = len(entries)
    # llama.cpp
    path_l = os.path.join(work, f"llama-{fmt}.gguf")
    llama_s = llama_side.quantize(f32, path_l, fmt, entries, keep_type="F32", threads=args.threads)
    ltypes = llama_side.tensor_types(path_l)
    entry["llama_types"] = {t: sum(1 for v in ltypes.values() if v == t) for t in sorted(set(ltypes.values()))}
    entry["llama_quantized_same_tensors"] = sorted(n for n, t in ltypes.items() if t == qtype) == quantized
    if not entry["llama_quantized_same_tensors"]:
        entry["type_mismatch"] = {n: [types.get(n), ltypes.get(n)] for n in set(types) | set(ltypes)
                                  if types.get(n) != ltypes.get(n)}
    # jgptq RTN with the same imatrix (sanity: llama.cpp's bytes)
    path_r = None
    if not args.no_rtn:
        model, result, rtn_s = _quantize_jgptq(folder, calib, fmt, "rtn", min(32, args.calib_seqs),
                                               imatrix=imatrix)
        path_r = os.path.join(work, f"jgptq-rtn-{fmt}.gguf")
        export_gguf(model, result, path_r, overwrite=True, float_type="f32", float_embeddings=True)
        del model, result
        entry["rtn_vs_llama_bytes"] = _compare_tensors(path_r, path_l, quantized)
    per_token = {}
    entry["llama_cpp"] = _side(path_l, quantized, held, ref, args.threads, llama_s, per_token, "llama_cpp")
    entry["jgptq_gptq"] = _side(path_g, quantized, held, ref, args.threads, seconds, per_token, "jgptq_gptq")
    if path_r:
        entry["jgptq_rtn"] = _side(path_r, quantized, held, ref, args.threads, rtn_s, per_token, "jgptq_rtn")
    # paired over the same tokens: llama.cpp's KL minus jgptq's (positive: jgptq closer to the float model)
    entry["kl_paired_llama_minus_jgptq"] = _paired(per_token["llama_cpp"], per_token["jgptq_gptq"])
    kl_l, kl_g = entry["llama_cpp"]["kl_mean"], entry["jgptq_gptq"]["kl_mean"]
    entry["kl_ratio_llama_over_jgptq"] = kl_l / kl_g if kl_g > 0 else float("inf")
    entry["kl_relative_improvement"] = 1.0 - kl_g / kl_l if kl_l > 0 else float("nan")
    entry["median_ratio_llama_over_jgptq"] = (entry["llama_cpp"]["kl_median"] / entry["jgptq_gptq"]["kl_median"]
                                              if entry["jgptq_gptq"]["kl_median"] > 0 else float("inf"))
    print(_row(fmt, entry), flush=True)
    return per_token
