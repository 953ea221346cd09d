"""Error feedback beside plain GPTQ on the trained MoE: KL to the float model paired token by token, and time.

The model, calibration and held-out windows are those of ``peers_quality`` (the trained ``deep`` Qwen3-MoE: 4
layers, hidden 512, 8 experts; ``--calib-seqs`` x ``--calib-len`` calibration bytes; ``--windows`` held-out windows
of ``--n-ctx``), quantized in this process with jgptq's defaults (symmetric, groups of ``--group-size``, batch 16,
scales float32, static order) by ``gptq`` and each method of ``--methods``; every quantized model is evaluated in
memory against the float one (:func:`jgptq_torch.cli.evaluate.evaluate`) and each method's per-token KL is paired
with ``gptq``'s (negative: closer to the float model than GPTQ).

Time: each method's first run compiles its programs; ``--reps`` more rounds quantize again at ``--time-bits``,
the methods taking turns within a round, and the minimum per method is reported beside every run's seconds and
stage totals (the machine may be shared: the load average at each run's start is kept).
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]


def main(argv=None):
    p = common.parser("error_feedback", DOC)
    common.integer_grid_options(p, windows=128, model="deep")
    p.add_argument("--methods", default="gptq_ef,gptq_ef_half", help="methods paired with gptq, comma-separated")
    p.add_argument("--reps", type=int, default=2, help="timing rounds after the measured runs")
    p.add_argument("--time-bits", type=int, default=4)
    args = p.parse_args(argv)
    if args.small:
        args.train_steps = args.train_steps or 4
        args.calib_seqs, args.calib_len, args.windows, args.reps = 8, 128, 4, 1
    import torch
    from transformers import AutoModelForCausalLM

    import jgptq
    from benchmarks.gguf_quality import DEFAULT_CACHE
    from benchmarks.peers_quality import paired
    from benchmarks.quality import corpus, lm
    from jgptq_torch.cli.evaluate import evaluate

    torch.manual_seed(0)
    splits, float_model, info = lm.named_model(args.model, DEFAULT_CACHE, steps=args.train_steps)
    calib = torch.from_numpy(corpus.windows(splits.tokens["calib"], args.calib_len, args.calib_seqs))
    held = corpus.windows(splits.tokens["heldout"], args.n_ctx, args.windows)
    methods = ["gptq"] + [m.strip() for m in args.methods.split(",") if m.strip()]
    out = {"benchmark": "error_feedback", "description": __doc__, "small": bool(args.small),
           "model": {k: v for k, v in info.items() if k != "loss_history"},
           "settings": {"model": args.model, "group_size": args.group_size, "sym": True, "batch_size": 16,
                        "calibration": list(calib.shape), "windows": len(held), "n_ctx": args.n_ctx,
                        "methods": methods, "cpu_threads": torch.get_num_threads()},
           "runs": {}, "timing": {}}

    def quantize(method, bits):
        model = AutoModelForCausalLM.from_pretrained(info["folder"], dtype=torch.float32).eval()
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        result = jgptq.quantize_moe(model, calib, None, device="cpu", bits=bits, group_size=args.group_size,
                                    sym=True, method=method, scale_dtype="float32", batch_size=16, progress=False)
        return model, {"quantize_s": time.perf_counter() - t0, "load_average_at_start": load,
                       "stage_s": result.report.stage_totals(), "act_order": result.config.quant.act_order}

    for bits in [int(b) for b in args.bits.split(",") if b.strip()]:
        rows, per_token = {}, {}
        out["runs"][f"int{bits}"] = rows
        for method in methods:
            model, row = quantize(method, bits)
            s = evaluate(model, float_model, tokens=held)
            per_token[method] = np.asarray(s.per_token["kl"], np.float64)
            s = s.summary
            row.update({"kl_mean": s["kl_mean"], "kl_stderr": s["kl_mean_stderr"], "kl_p99": s["kl_p99"],
                        "top1_agreement": s["same_top_rate"], "ppl": s["ppl"], "tokens_scored": s["tokens"]})
            if method != "gptq":
                row["paired_minus_gptq"] = paired(per_token[method], per_token["gptq"])
                row["kl_ratio_to_gptq"] = s["kl_mean"] / rows["gptq"]["kl_mean"]
            rows[method] = row
            d = row.get("paired_minus_gptq")
            print(f"int{bits} {method}: KL {s['kl_mean']:.4g} +- {s['kl_mean_stderr']:.2g}"
                  + ("" if d is None else f", minus gptq {d['mean']:.3g} +- {d['stderr']:.2g}")
                  + f", {row['quantize_s']:.1f} s", flush=True)
            del model
            common.write(args.out, out)
    runs: dict = {m: [] for m in methods}
    for _ in range(args.reps):
        for method in methods:
            runs[method].append(quantize(method, args.time_bits)[1])
            common.write(args.out, out | {"timing": {"bits": args.time_bits, "runs": runs}})
    out["timing"] = {"bits": args.time_bits, "runs": runs,
                     "min_s": {m: min(r["quantize_s"] for r in rs) for m, rs in runs.items() if rs}}
    if out["timing"]["min_s"]:
        print("timing (min of reps):", {m: round(v, 1) for m, v in out["timing"]["min_s"].items()}, flush=True)
    out["machine"] = common.machine()
    common.write(args.out, out)
    return 0
