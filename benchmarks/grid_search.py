"""GPTQ with searched grids against plain GPTQ (and round-to-nearest), measured on the model's output: KL to the
float model on held-out text.

``gptq`` fits each group's integer grid from the group's min/max when the solve reaches it; ``gptq_search``
searches the clip factor of that grid on the Hessian-weighted rounding error (``T_jj^2``, what the GPTQ objective
charges each column; :mod:`jgptq.methods.gptq_search`), ``gptq_search_diag`` on the Hessian diagonal ``H_jj``
(the imatrix weighting); ``rtn`` is the floor. Every run uses the same calibration windows and settings (integer
grids of ``--bits`` bits, groups of ``--group-size``, symmetric) and differs only in the method.

The model: a trained byte-level Qwen3-MoE of the quality benchmark (``benchmarks/quality/lm.py``, ``--model``:
``quality``, 2 layers of hidden 1024, or ``deep``, 4 layers of hidden 512 that trains in minutes on a CPU; cached
in ``~/.cache/jgptq``, trained first when missing). Each quantized model is compared with the float one in torch
(:func:`jgptq_torch.cli.evaluate.evaluate`, llama-perplexity's definition: windows from an empty context, second
half scored): mean KL per token with its standard error, p99, top-1 agreement, perplexity, and the paired
per-token KL difference of every method against ``gptq`` over the same tokens (negative: the method is closer
to the float model). The sum of the solver's layer losses and the quantization seconds are reported beside it.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]


def main(argv=None):
    p = common.parser("grid_search", DOC)
    common.integer_grid_options(p, windows=64, model="quality")
    p.add_argument("--methods", default="rtn,gptq,gptq_search,gptq_search_diag", help="methods compared")
    args = p.parse_args(argv)
    if args.small:
        args.train_steps = args.train_steps or 4
        args.calib_seqs, args.windows = min(args.calib_seqs, 8), min(args.windows, 4)
    import jgptq
    import torch

    from benchmarks.gguf_quality import DEFAULT_CACHE, _paired
    from benchmarks.quality import corpus, lm
    from jgptq_torch.cli.evaluate import evaluate

    torch.manual_seed(0)
    data = corpus.corpus_bytes()
    digest = corpus.corpus_digest(data)
    splits = corpus.split(data)
    arch, train_cfg = lm.MODELS[args.model]
    float_model, info = lm.trained_model(splits, digest, DEFAULT_CACHE, steps=args.train_steps, arch=arch,
                                         train_cfg=train_cfg)
    folder = info["folder"]
    calib = torch.from_numpy(corpus.windows(splits.tokens["calib"], args.calib_len, args.calib_seqs))
    held = corpus.windows(splits.tokens["heldout"], args.n_ctx, args.windows)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    out = {"benchmark": "grid_search", "description": __doc__, "small": bool(args.small),
           "model": {k: v for k, v in info.items() if k != "loss_history"},
           "settings": {"model": args.model, "group_size": args.group_size, "sym": True, "calibration": list(calib.shape),
                        "windows": int(len(held)), "n_ctx": args.n_ctx, "methods": names}, "runs": {}}
    from transformers import Qwen3MoeForCausalLM

    for bits in [int(b) for b in args.bits.split(",") if b.strip()]:
        runs, per_token = {}, {}
        for method in names:
            model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype="float32").eval()
            t0 = time.perf_counter()
            result = jgptq.quantize_moe(model, calib, None, device="cpu", bits=bits, group_size=args.group_size,
                                        sym=True, method=method, batch_size=16, progress=False)
            seconds = time.perf_counter() - t0
            ev = evaluate(model, float_model, tokens=held)
            per_token[method] = np.asarray(ev.per_token["kl"], np.float64)
            s = ev.summary
            losses = [r.loss for r in result.report.records if np.isfinite(r.loss)]
            runs[method] = {"kl_mean": s["kl_mean"], "kl_stderr": s["kl_mean_stderr"], "kl_p99": s["kl_p99"],
                            "top1_agreement": s["same_top_rate"], "ppl": s["ppl"], "ppl_float": s["ppl_ref"],
                            "ln_ppl_ratio": s["ln_ppl_ratio"],
                            "layer_loss_sum": float(sum(losses)) if losses else None,
                            "quantize_s": seconds, "tokens_scored": s["tokens"]}
            r = runs[method]
            print(f"int{bits} g{args.group_size} {method}: KL {r['kl_mean']:.6f} +- {r['kl_stderr']:.6f}, "
                  f"p99 {r['kl_p99']:.5f}, top1 {r['top1_agreement']:.4f}, ppl {r['ppl']:.4f}, "
                  f"{seconds:.1f} s", flush=True)
            del model, result
        if "gptq" in per_token:
            runs["paired_minus_gptq"] = {m: _paired(per_token[m], per_token["gptq"]) for m in names if m != "gptq"}
            for m, d in runs["paired_minus_gptq"].items():
                print(f"int{bits} {m} - gptq: {d['mean']:.3g} +- {d['stderr']:.2g} per token", flush=True)
        out["runs"][f"int{bits}"] = runs
        common.write(args.out, out)
    out["machine"] = common.machine()
    common.write(args.out, out)
    return 0
