"""Quality of GGML quantization: jgptq's GPTQ against llama.cpp's own quantizer with the same imatrix, as KL divergence.

The model: a small Qwen3-MoE over bytes (2 layers, 8 experts, top-2, hidden 1024, expert width 512: every quantized
row 2-4 GGML super-blocks long) trained here on Python's documentation prose (``pydoc_data.topics``), cached in
``--cache-dir`` keyed by its settings (see :mod:`benchmarks.quality.corpus` and :mod:`benchmarks.quality.lm`).
Train, calibration and held-out text are disjoint byte ranges of the corpus. ``--arch deepseek_v3`` and ``--arch
gpt_oss`` take instead a model of that family's shape trained the same way (latent attention and a shared expert;
attention sinks, biases and the clamped SwiGLU: :mod:`benchmarks.quality.lm`), with their own default formats and
results file (``gguf_quality_deepseek2.json``, ``gguf_quality_gpt_oss.json``).

Per format (``--formats``, default Q4_K, IQ4_XS, IQ3_XXS, IQ2_XXS, IQ1_S; a GGML type, every weight tensor at it,
or one of llama.cpp's mixes such as Q4_K_M or MXFP4_MOE, which jgptq runs as the same ``mix`` preset; see
:mod:`benchmarks.quality.gguf_run`), starting each time from the float model:
- jgptq: ``quantize_moe`` with the format (GPTQ; the encoders' importance is the imatrix statistic the run collects
  layer by layer, on the inputs each layer sees in that run, or with ``--imatrix-source float`` on the inputs it
  sees when every earlier layer is float, llama.cpp's definition; ``both`` runs each and compares them), exported
  with ``export_gguf`` (token embedding and output head in F32, routers and norms in F32);
- llama.cpp: ``llama_model_quantize`` of the float F32 GGUF (``pure``: every weight tensor at the format, or the
  mix's own rules; token embedding and output head kept in F32), fed with the jgptq run's imatrix written as a GGUF imatrix file and read
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

import numpy as np

from benchmarks import common
from benchmarks.quality.gguf_run import evaluate as _evaluate  # noqa: F401  (target_bpw's import)
from benchmarks.quality.gguf_run import paired as _paired

DOC = __doc__.splitlines()[0]
FORMATS = ("q4_k", "iq4_xs", "iq3_xxs", "iq2_xxs", "iq1_s")
# --arch: the trained model (benchmarks.quality.lm.MODELS), its default formats and results file
ARCHES = {"qwen3_moe": ("quality", FORMATS, "gguf_quality.json"),
          "deepseek_v3": ("deepseek_v3", ("q4_k_m", "q3_k_m", "q2_k_s", "q4_k", "iq2_xxs"),
                          "gguf_quality_deepseek2.json"),
          "gpt_oss": ("gpt_oss", ("mxfp4_moe", "q4_k_m", "q3_k_m", "q2_k_s", "q4_k", "iq2_xxs"),
                      "gguf_quality_gpt_oss.json")}
DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jgptq",
                             "gguf_quality")


def _args(argv):
    p = common.parser("gguf_quality", DOC)
    p.add_argument("--arch", choices=sorted(ARCHES), default="qwen3_moe",
                   help="the trained model's family: qwen3_moe (the quality model), deepseek_v3 (llama.cpp's "
                        "deepseek2: latent attention, a shared expert) or gpt_oss (sinks, biases, clamped SwiGLU)")
    p.add_argument("--formats", default=None,
                   help="comma-separated GGML formats (every weight at it) and llama.cpp mixes (q4_k_m, mxfp4_moe...; "
                        "default: the arch's list)")
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
    model_name, formats, results = ARCHES[args.arch]
    args.model = model_name
    if args.out == os.path.join(common.RESULTS, "gguf_quality.json"):  # the default: one results file per arch
        args.out = os.path.join(common.RESULTS, results)
    if args.small:  # a smoke run: a briefly trained model, one format, few windows
        args.formats = args.formats or formats[0]
        args.train_steps = args.train_steps or 10
        args.windows, args.calib_seqs = min(args.windows or 8, 8), min(args.calib_seqs, 16)
    args.formats = args.formats or ",".join(formats)
    return args


def _given_model(folder, digest):
    """A model trained earlier on the same corpus (its train_info.json names the corpus digest and the arch)."""
    import json

    from benchmarks.quality import lm

    with open(os.path.join(folder, "train_info.json")) as f:
        info = json.load(f)
    if info.get("corpus_sha256") != digest:
        raise SystemExit(f"--model-dir {folder}: trained on corpus {info.get('corpus_sha256')}, not {digest}")
    info.update(folder=os.path.abspath(folder), cached=True, given=True)
    return lm.load(folder, info.get("arch", lm.ARCH)), info


def _row(fmt, entry):
    j, l = entry.get("jgptq_gptq", {}), entry.get("llama_cpp", {})
    r, nan = entry.get("jgptq_rtn", {}), float("nan")
    return (f"{fmt:9s} {j.get('bits_per_weight', nan):5.2f} {l.get('bytes', 0):9d} {j.get('bytes', 0):9d}  "
            f"{l.get('kl_mean', nan):9.5f}±{l.get('kl_mean_stderr', nan):8.5f} {r.get('kl_mean', nan):9.5f} "
            f"{j.get('kl_mean', nan):9.5f}±{j.get('kl_mean_stderr', nan):8.5f}  "
            f"{entry.get('kl_ratio_llama_over_jgptq', nan):6.2f}  "
            f"{l.get('same_top_rate', nan):6.3f} {j.get('same_top_rate', nan):6.3f}  "
            f"{l.get('ppl', nan):7.4f} {j.get('ppl', nan):7.4f}  {entry.get('types_equal', '-')}")


HEADER = ("format    bpw   bytes L   bytes G    KL llama (mean ± se) KL rtn    KL gptq (mean ± se)  llama/  "
          "top1 L top1 G  PPL L   PPL G   same\n"
          "                                                                                       gptq"
          "                          types")


def main(argv=None):
    args = _args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    import jgptq  # noqa: F401  (sets the JAX allocator before JAX starts)
    from benchmarks.quality import corpus, gguf_run, llama_side, lm
    from jgptq import evaluation
    from jgptq_torch.cli import llama_logits
    from jgptq_torch.export.gguf.export import export_gguf

    if not llama_logits.available():
        raise SystemExit("gguf_quality needs llama-cpp-python (the llama_cpp package)")
    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in llama_side.FTYPES and f not in llama_side.MIX_FTYPES]
    if unknown:
        raise SystemExit(f"--formats: unknown {unknown}; known: {sorted(llama_side.FTYPES)}, mixes "
                         f"{sorted(llama_side.MIX_FTYPES)}")
    torch.manual_seed(0)

    data = corpus.corpus_bytes()
    digest = corpus.corpus_digest(data)
    splits = corpus.split(data)
    if args.model_dir:
        model, info = _given_model(args.model_dir, digest)
    else:
        arch, train_cfg = lm.MODELS[args.model]
        model, info = lm.trained_model(splits, digest, args.cache_dir, steps=args.train_steps, arch=arch,
                                       train_cfg=train_cfg)
    folder = info["folder"]
    held = corpus.windows(splits.tokens["heldout"], args.n_ctx, args.windows or None)
    calib = torch.from_numpy(corpus.windows(splits.tokens["calib"], args.calib_len, args.calib_seqs))
    first = evaluation.first_scored(args.n_ctx)
    torch_loss = lm.mean_loss(model, held, first=first)
    out = {"benchmark": "gguf_quality", "description": __doc__, "arch": args.arch,
           "corpus": {"source": "pydoc_data.topics (sorted keys, joined by blank lines, UTF-8)", "sha256": digest,
                      "bytes": len(data), "split_bytes": {k: len(v) for k, v in splits.tokens.items()}},
           "model": {k: v for k, v in info.items() if k != "loss_history"},
           "evaluation": {"n_ctx": args.n_ctx, "windows": len(held), "first_scored": first,
                          "scored_tokens": int(len(held) * (args.n_ctx - 1 - first)), "threads": args.threads,
                          "torch_float_loss_nats": torch_loss, "torch_float_ppl": math.exp(torch_loss)},
           "calibration": {"sequences": int(calib.shape[0]), "length": int(calib.shape[1])},
           "notes": [("jgptq quantize_s: the whole quantize_moe run (calibration forwards, imatrix statistic, "
                      "solves, JIT compilation); llama_cpp quantize_s: llama_model_quantize alone, given the imatrix"),
                     ("token embedding, output head, norms and routers are F32 on every side; only the weight "
                      "tensors listed as quantized differ"),
                     ("a format is a GGML type (every weight tensor at it, llama.cpp's pure) or a llama.cpp mix "
                      "(jgptq runs the same preset, PipelineConfig.mix); types_equal: every tensor of the two files "
                      "has the same type"),
                     ("llama_overrides: tensors llama.cpp is told to keep in the float type jgptq writes them in "
                      "(benchmarks.quality.gguf_run.KEEP_FLOAT), so that their bytes are equal too")],
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
                ctx = {"float_model": model, "folder": folder, "arch": info.get("arch", lm.ARCH), "calib": calib,
                       "held": held, "ref": ref, "f32": f32, "work": work, "args": args}
                try:
                    kls[source] = gguf_run.run_format(fmt, entry, ctx, source)
                    print(_row(fmt, entry), flush=True)
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
