"""Lazy against static group grids, measured on the model's output: KL to the float model on held-out text.

GPTQ fits each group's grid either lazily (from the group's weights as the solve reaches them, already updated by
the error of earlier columns; jgptq's default, GPTQModel's and the reference implementation's) or statically (once
from the original weights before the solve, ``static_groups=True``, as llm-compressor does). On real Hessians the
static grids gave a lower layer loss (``peers_solver``); this benchmark asks whether that reaches the logits.

The model: the quality benchmark's trained byte-level Qwen3-MoE (``benchmarks/quality/lm.py``, cached in
``~/.cache/jgptq``; trained first when missing). Both runs use the same calibration windows and settings (integer
grids of ``--bits`` bits, groups of ``--group-size``, symmetric, GPTQ), differing only in ``static_groups``. Each
quantized model is compared with the float one in torch (:func:`jgptq_torch.cli.evaluate.evaluate`, llama-perplexity's
definition: windows from an empty context, second half scored): mean KL per token with its standard error, p99,
top-1 agreement, and the paired per-token difference (lazy - static) over the same tokens. The sum of the solver's
layer losses is reported beside it.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]


def main(argv=None):
    p = common.parser("static_grids", DOC)
    common.integer_grid_options(p, windows=64)
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
    arch, train_cfg = lm.MODELS["quality"]
    float_model, info = lm.trained_model(splits, digest, DEFAULT_CACHE, steps=args.train_steps, arch=arch,
                                         train_cfg=train_cfg)
    folder = info["folder"]
    calib = torch.from_numpy(corpus.windows(splits.tokens["calib"], args.calib_len, args.calib_seqs))
    held = corpus.windows(splits.tokens["heldout"], args.n_ctx, args.windows)
    out = {"benchmark": "static_grids", "description": __doc__, "small": bool(args.small),
           "model": {k: v for k, v in info.items() if k != "loss_history"},
           "settings": {"group_size": args.group_size, "sym": True, "calibration": list(calib.shape),
                        "windows": int(len(held)), "n_ctx": args.n_ctx}, "runs": {}}
    from transformers import Qwen3MoeForCausalLM

    for bits in [int(b) for b in args.bits.split(",") if b.strip()]:
        runs, per_token = {}, {}
        for grids, static in (("lazy", False), ("static", True)):
            model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype="float32").eval()
            t0 = time.perf_counter()
            result = jgptq.quantize_moe(model, calib, None, device="cpu", bits=bits, group_size=args.group_size,
                                        sym=True, static_groups=static, batch_size=16, progress=False)
            seconds = time.perf_counter() - t0
            ev = evaluate(model, float_model, tokens=held)
            kl = np.asarray(ev.per_token["kl"], np.float64)
            per_token[grids] = kl
            s = ev.summary
            runs[grids] = {"kl_mean": s["kl_mean"], "kl_stderr": s["kl_mean_stderr"], "kl_p99": s["kl_p99"],
                           "top1_agreement": s["same_top_rate"], "ln_ppl_ratio": s["ln_ppl_ratio"],
                           "layer_loss_sum": float(sum(r.loss for r in result.report.records
                                                       if np.isfinite(r.loss))),
                           "quantize_s": seconds, "tokens_scored": s["tokens"]}
            print(f"int{bits} g{args.group_size} {grids}: KL {runs[grids]['kl_mean']:.5f} "
                  f"+- {runs[grids]['kl_stderr']:.5f}, layer loss {runs[grids]['layer_loss_sum']:.4g}", flush=True)
            del model, result
        runs["paired_lazy_minus_static"] = _paired(per_token["lazy"], per_token["static"])
        runs["kl_ratio_lazy_over_static"] = runs["lazy"]["kl_mean"] / runs["static"]["kl_mean"]
        out["runs"][f"int{bits}"] = runs
        common.write(args.out, out)
    out["machine"] = common.machine()
    common.write(args.out, out)
    return 0
