"""One Qwen3-30B-A3B-shaped MoE decoder layer end to end through jgptq.quantize_moe, against the textbook torch loop.

The layer: 128 experts, hidden 2048, expert width 768, top-8 routing, 32 query / 4 key-value heads of 128, random
bf16 weights; calibration 128 sequences x 2048 random tokens (bf16 Hessian operands, float32 sums: exact for
bf16 activations). jgptq runs the whole pipeline (capture, calibration forwards, Hessians, one batched solve per
shape, write-back); the anchor is the textbook eager torch GPTQ loop (``benchmarks.anchors.torch_gptq``) applied
expert by expert to the same Hessians and the same original weights: gate, up and down of every expert, three
matrices each. The anchor is timed on a subset of experts and extrapolated linearly to all of them (the JSON says
so). Reported: jgptq's end-to-end and per-stage seconds (compilation included), a warm re-run of jgptq's solves
alone, the anchor's seconds, their ratios, and the share of identical codes on the timed experts (4-bit, group
128 = block size, symmetric, float32 scales on both sides).
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]

FULL = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, width=768, top_k=8, vocab=4096,
            sequences=128, length=2048, batch=8, group=128, anchor_experts=16)
SMALL = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, experts=8, width=64, top_k=2, vocab=256,
             sequences=16, length=128, batch=8, group=32, anchor_experts=8)


def build_layer(s, device):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=1,
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                         intermediate_size=4 * s["hidden"], moe_intermediate_size=s["width"],
                         num_experts=s["experts"], num_experts_per_tok=s["top_k"], norm_topk_prob=True,
                         max_position_embeddings=max(4096, s["length"]))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def expert_codes(weights, e, name, rows=None):
    """Codes (R, C) of expert e's ``gate``/``up``/``down`` from the result's checkpoint tensors."""
    per_expert = f"model.layers.0.mlp.experts.{e}.{name}_proj.weight"
    if per_expert in weights:
        return weights[per_expert].codes
    fused = weights["model.layers.0.mlp.experts." + ("down_proj" if name == "down" else "gate_up_proj")]
    return fused.codes[e] if rows is None else fused.codes[e][rows]


def main(argv=None):
    p = common.parser("moe_layer", DOC)
    p.add_argument("--anchor-experts", type=int, default=None, help="experts the textbook loop is timed on")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jgptq  # noqa: F401  (sets the JAX allocator before JAX starts)
    import jax
    import torch

    from benchmarks.anchors.torch_gptq import gptq_textbook
    from jgptq_torch.dlpack import to_torch
    from jgptq import QuantConfig, gptq

    s = SMALL if args.small else FULL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_layer(s, device)
    experts = model.model.layers[0].mlp.experts
    n_anchor = min(args.anchor_experts or s["anchor_experts"], s["experts"])
    original_up = experts.gate_up_proj.detach().clone()
    original_down = experts.down_proj.detach().clone()
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, s["vocab"], (s["sequences"], s["length"]), generator=g)
    # block = group: the textbook loop fits a group's grid from the weights as of the block start, jgptq from the
    # in-block updated weights; with one group per block both mean the same
    quant = QuantConfig(bits=4, group_size=s["group"], block_size=s["group"], sym=True, scale_dtype="float32")
    bs = s["group"]

    def sync(x=None):
        if device == "cuda":
            torch.cuda.synchronize()
        return jax.block_until_ready(x) if x is not None else None

    sync()
    t0 = time.perf_counter()
    result = jgptq.quantize_moe(model, calib, quant, device=device, batch_size=s["batch"],
                                hessian_dtype="bfloat16", keep_hessians=True, progress=False)
    sync()
    end_to_end = time.perf_counter() - t0
    report = result.report
    coverage = report.coverage["model.layers.0.mlp.experts"]
    assert sum(coverage) == calib.numel() * s["top_k"], "capture did not see every routed token"
    h_up, n_up = result.hessians[(0, ("mlp.experts", "gate_up"))]
    h_down, _ = result.hessians[(0, ("mlp.experts", "down"))]

    # warm re-run of jgptq's two expert solves on the original weights (compiled programs reused)
    def solve_all():
        return (gptq.solve_experts(original_up, h_up, quant, check=False),
                gptq.solve_experts(original_down, h_down, quant, check=False))

    from jgptq_torch.dlpack import to_jax

    original_up, original_down = to_jax(original_up), to_jax(original_down)
    warm = common.time_calls(solve_all, jax.block_until_ready, warmup=0, repeat=2)

    # the textbook loop, expert by expert, on the same Hessians and original weights
    h_up_t, h_down_t = to_torch(h_up), to_torch(h_down)
    w_up_t, w_down_t = to_torch(original_up), to_torch(original_down)
    inter = s["width"]
    gptq_textbook(w_up_t[0, :inter], h_up_t[0], 4, s["group"], True, bs)  # warm-up
    sync()
    t0 = time.perf_counter()
    anchor_codes = []
    for e in range(n_anchor):
        _, cg = gptq_textbook(w_up_t[e, :inter], h_up_t[e], 4, s["group"], True, bs)
        _, cu = gptq_textbook(w_up_t[e, inter:], h_up_t[e], 4, s["group"], True, bs)
        _, cd = gptq_textbook(w_down_t[e], h_down_t[e], 4, s["group"], True, bs)
        anchor_codes.append((cg, cu, cd))
    sync()
    anchor_measured = time.perf_counter() - t0
    anchor_all = anchor_measured * s["experts"] / n_anchor

    equal = total = 0
    for e, (cg, cu, cd) in enumerate(anchor_codes):
        for name, codes_t in (("gate", cg), ("up", cu), ("down", cd)):
            rows = slice(0, inter) if name == "gate" else slice(inter, 2 * inter) if name == "up" else None
            ours = expert_codes(result.weights, e, name, rows)
            theirs = codes_t.cpu().numpy()
            equal += int(np.sum(ours == theirs))
            total += theirs.size
    stages = report.stage_totals()
    out = {
        "benchmark": "moe_layer", "description": __doc__, "small": bool(args.small), "shape": s,
        "device": device, "calibration_tokens": report.calibration_tokens,
        "tokens_per_expert": {"min": min(coverage), "median": float(np.median(coverage)), "max": max(coverage)},
        "jgptq_end_to_end_s": end_to_end, "jgptq_stage_s": stages,
        "jgptq_solve_warm_s": warm["median_s"],
        "anchor_experts_timed": n_anchor, "anchor_measured_s": anchor_measured,
        "anchor_all_experts_s": anchor_all,
        "anchor_extrapolated": n_anchor < s["experts"],
        "anchor_note": (f"textbook loop timed on {n_anchor} of {s['experts']} experts (3 matrices each) and "
                        f"scaled linearly" if n_anchor < s["experts"] else "textbook loop timed on every expert"),
        "speedup_solve_warm": anchor_all / warm["median_s"],
        "speedup_solve_stage": anchor_all / stages["solve"],
        "speedup_end_to_end": anchor_all / end_to_end,
        "code_agreement": equal / total, "codes_compared": total,
        "hessian_tokens_checked": int(sum(n_up)),
    }
    print({k: v for k, v in out.items() if k not in ("description", "shape")})
    common.write(args.out, out)
    return 0
