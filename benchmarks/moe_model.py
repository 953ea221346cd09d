"""A whole Qwen3-30B-A3B-shaped MoE model through jgptq.quantize_moe on one GPU: wall time, stages, peak memory.

The model: 48 decoder layers, 128 experts of width 768 (top-8), hidden 2048, 32 query / 4 key-value heads of 128,
vocabulary 151,936, random bf16 weights built on the GPU from its config. ``--offload none`` (default, as
``quantize_moe``) keeps every layer on the GPU (61 GB); with ``--offload cpu`` the pipeline moves the decoder layers
to host memory first and brings one at a time to the GPU; ``--offload disk`` keeps each layer in a file
(``--offload-dir``) and host memory holds one layer; ``--device-budget 40GB`` checks each layer's estimated need
first. Calibration: 128 sequences x 2048
random tokens, bf16 Hessian operands with float32 sums, int4 group 128 (symmetric, float16 scales), every expert
of a layer in one vmapped solve per shape; ``--format q4_k`` (any GGML format) runs GGML group updates instead, and
with ``--export`` writes a GGUF file: layer by layer while the run goes (:class:`jgptq_torch.export.gguf.stream.GGUFSink`;
its time is inside the total, the wait for the last tensors and the header is the ``export`` stage), or after
the run with ``--export-after``.

Reported: total wall time and per-stage seconds summed over layers (capture, calibrate = forward + Hessian
accumulation, solve, write-back, store = waiting for the checkpoint records made beside the next layer, replay =
forward with quantized weights; the Hessian share is estimated as calibrate - replay, since both run the same
forward), the host<->GPU layer moves (those that run beside the work count only where the pipeline waited for
them; ``memory.prepare_s`` is the placement before the first layer), the export of a
compressed-tensors checkpoint when asked, the peak GPU memory of torch and of JAX, and the pipeline's memory record
(``report.memory``: estimated need of the largest layer, peak parameter bytes on the GPU and in host memory).

With ``--anchor-experts N`` (used with a reduced depth, e.g. ``--layers 4``) the textbook torch GPTQ loop that
GPTQModel runs is applied to the same Hessians and original weights: every attention matrix and N experts of
every layer (gate, up and down), timed and scaled linearly to all experts; the JSON gives the solve-stage ratio
and the end-to-end time the pipeline would take with the textbook solve in place of jgptq's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]

FULL = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, width=768, top_k=8, vocab=151936,
            sequences=128, length=2048, batch=16, group=128, layers=48)
SMALL = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, width=128, top_k=2, vocab=512,
             sequences=8, length=64, batch=4, group=128, layers=2)


def build_model(s, layers, device):
    """The model with random bf16 weights, built directly on ``device`` in bf16 (no float32 copy)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=layers,
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                         intermediate_size=6144, moe_intermediate_size=s["width"], num_experts=s["experts"],
                         num_experts_per_tok=s["top_k"], norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=max(4096, s["length"]), tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def _anchor(result, originals, s, n_experts, sync):
    """The textbook loop on the same Hessians: every attention matrix, ``n_experts`` experts of every layer."""
    from benchmarks.anchors.torch_gptq import gptq_textbook
    from jgptq_torch.dlpack import to_torch

    bs = s["group"]
    inter = s["width"]
    measured = {"attention_s": 0.0, "experts_s": 0.0}
    for (layer, key), (h, _) in sorted(result.hessians.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        h_t = to_torch(h)
        if isinstance(key, tuple):  # experts: stacked (E, C, C)
            name = "gate_up" if key[1] == "gate_up" else "down"
            w = originals[(layer, name)]
            sync()
            t0 = time.perf_counter()
            for e in range(n_experts):
                if name == "gate_up":
                    gptq_textbook(w[e, :inter].to(h_t.device), h_t[e], 4, s["group"], True, bs)
                    gptq_textbook(w[e, inter:].to(h_t.device), h_t[e], 4, s["group"], True, bs)
                else:
                    gptq_textbook(w[e].to(h_t.device), h_t[e], 4, s["group"], True, bs)
            sync()
            measured["experts_s"] += (time.perf_counter() - t0) * s["experts"] / n_experts
        else:  # attention: the matrices sharing this Hessian
            sync()
            t0 = time.perf_counter()
            for mat, tie in originals["ties"][layer].items():
                if tie == key:
                    gptq_textbook(originals[(layer, mat)].to(h_t.device), h_t, 4, s["group"], True, bs)
            sync()
            measured["attention_s"] += time.perf_counter() - t0
    return measured


def main(argv=None):
    p = common.parser("moe_model", DOC)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 48; --small: 2)")
    p.add_argument("--anchor-experts", type=int, default=0, help="experts per layer the textbook loop runs on")
    p.add_argument("--export", action="store_true", help="also export a checkpoint (--export-kind)")
    p.add_argument("--export-kind", choices=("compressed-tensors", "gptq", "gguf"), default=None,
                   help="checkpoint kind of --export (default: gguf for a GGML --format, else compressed-tensors)")
    p.add_argument("--export-after", action="store_true",
                   help="write a GGUF --export after the run instead of layer by layer during it")
    p.add_argument("--format", default="int", metavar="FORMAT",
                   help="int (int4 group 128, the default) or a GGML format such as q4_k (GGML group updates)")
    p.add_argument("--offload", choices=("none", "cpu", "disk"), default="none",
                   help="where layers wait: none (on the GPU, the default), cpu (host memory), disk (files)")
    p.add_argument("--no-offload", dest="offload", action="store_const", const="none", help="--offload none")
    p.add_argument("--offload-dir", help="folder of the layer files of --offload disk (default: a temporary one)")
    p.add_argument("--device-budget", help="bytes the run may place on the GPU, e.g. 60GB (default: no check)")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jgptq  # noqa: F401  (sets the JAX allocator before JAX starts)
    import jax
    import torch

    from jgptq import QuantConfig

    s = SMALL if args.small else FULL
    layers = args.layers or s["layers"]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False

    def sync():
        if cuda:
            torch.cuda.synchronize()

    out = {"benchmark": "moe_model", "description": __doc__, "small": bool(args.small), "shape": s,
           "layers": layers, "device": device}
    t0 = time.perf_counter()
    model = build_model(s, layers, device)
    sync()
    out["build_s"] = time.perf_counter() - t0
    out["parameters"] = sum(p.numel() for p in model.parameters())
    originals = {"ties": {}}
    if args.anchor_experts:
        for i, layer in enumerate(model.model.layers):
            originals[(i, "gate_up")] = layer.mlp.experts.gate_up_proj.detach().float().cpu()
            originals[(i, "down")] = layer.mlp.experts.down_proj.detach().float().cpu()
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                originals[(i, f"self_attn.{n}")] = getattr(layer.self_attn, n).weight.detach().float().cpu()
    out["offload"] = args.offload
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, s["vocab"], (s["sequences"], s["length"]), generator=g)
    quant = (QuantConfig(bits=4, group_size=s["group"], block_size=s["group"], sym=True) if args.format == "int"
             else QuantConfig(format=args.format, block_size=s["group"]))
    out["format"] = quant.format
    kind = args.export_kind or ("gguf" if quant.is_ggml else "compressed-tensors")

    sink = None
    target = tempfile.mkdtemp(prefix="jgptq_export_") if args.export else None
    if args.export and kind == "gguf" and not args.export_after:
        from jgptq_torch.export.gguf.stream import GGUFSink

        sink = GGUFSink(os.path.join(target, "out.gguf"))
    t0 = time.perf_counter()
    result = jgptq.quantize_moe(model, calib, quant, device=device, batch_size=s["batch"],
                                hessian_dtype="bfloat16", keep_hessians=bool(args.anchor_experts), progress=True,
                                offload=args.offload, offload_dir=args.offload_dir, device_budget=args.device_budget,
                                sink=sink, **({"block_fallback": "llama.cpp"} if quant.is_ggml else {}))
    sync()
    total = time.perf_counter() - t0
    if sink is not None:   # written during the run: its time is in the total, the wait at the end in stage_s
        out.update({"export_kind": kind, "export_mode": "during the run (GGUFSink)",
                    "export_bytes": os.path.getsize(sink.written), "total_with_export_s": total})
        shutil.rmtree(target, ignore_errors=True)
    report = result.report
    stages = report.stage_totals()
    out.update({
        "calibration_tokens": report.calibration_tokens,
        "quantize_total_s": total, "stage_s": stages,
        "hessian_estimate_s": max(0.0, stages.get("calibrate", 0.0) - stages.get("replay", 0.0)),
        "forward_estimate_s": 2 * stages.get("replay", 0.0),
        "other_s": total - sum(stages.values()),
        "memory": report.memory,
        "offload_s": report.stage_totals().get("offload", 0.0) + report.memory.get("prepare_s", 0.0)
        + report.memory.get("finish_s", 0.0),
        "matrices": len(report.records),
        "fallbacks": sum(r.fallback for r in report.records),
        "rtn_experts": sum(r.method != "gptq" for r in report.records),
        "seconds_per_layer": total / layers,
        "per_layer_s": {str(i): report.timings.get(i, {}) for i in range(layers)},
    })
    warm = [report.timings.get(i, {}).get("solve", 0.0) for i in range(1, layers)]
    if warm:  # the first layer's solve includes compiling every shape's program
        out["solve_warm_mean_s"] = float(np.mean(warm))
    if cuda:
        out["peak_gpu_torch_bytes"] = int(torch.cuda.max_memory_allocated())
        stats = jax.devices()[0].memory_stats() or {}
        out["peak_gpu_jax_bytes"] = int(stats.get("peak_bytes_in_use", 0))
        out["peak_gpu_bytes_upper_bound"] = out["peak_gpu_torch_bytes"] + out["peak_gpu_jax_bytes"]
        out["gpu_total_bytes"] = int(torch.cuda.get_device_properties(0).total_memory)
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    print({k: v for k, v in out.items() if k not in ("description", "shape")}, flush=True)
    common.write(args.out, out)  # written now so that a failure below keeps the pipeline's figures

    if args.anchor_experts:
        for r in report.records:  # which Hessian each attention matrix was solved with
            if r.kind == "linear":
                base = f"model.layers.{r.layer}."
                originals["ties"].setdefault(r.layer, {})[r.name[len(base):]] = r.hessian[len(base):]
        measured = _anchor(result, originals, s, min(args.anchor_experts, s["experts"]), sync)
        anchor_solve = measured["attention_s"] + measured["experts_s"]
        out.update({
            "anchor_experts_timed_per_layer": min(args.anchor_experts, s["experts"]),
            "anchor_solve_s": anchor_solve, "anchor_detail_s": measured,
            "anchor_note": "textbook loop on every attention matrix and a subset of experts per layer, experts "
                           "scaled linearly to all experts",
            "speedup_solve_stage": anchor_solve / stages["solve"],
            "speedup_solve_warm_layers": (anchor_solve / layers / out["solve_warm_mean_s"]
                                          if "solve_warm_mean_s" in out else None),
            "pipeline_with_textbook_solve_s": total - stages["solve"] + anchor_solve,
            "speedup_end_to_end": (total - stages["solve"] + anchor_solve) / total,
        })
        print({k: out[k] for k in ("anchor_solve_s", "speedup_solve_stage", "speedup_end_to_end")}, flush=True)
        common.write(args.out, out)

    if args.export and sink is None:
        from jgptq_torch.export.checkpoint import export_model

        out["export_mode"] = "after the run (export_model)"
        try:
            t0 = time.perf_counter()
            export_model(model, result, kind, os.path.join(target, "out.gguf" if kind == "gguf" else "out"))
            out["export_kind"] = kind
            out["export_s"] = time.perf_counter() - t0
            out["export_bytes"] = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(target)
                                      for f in fs)
        except Exception as exc:  # recorded: the pipeline's figures above stand on their own
            out["export_error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            shutil.rmtree(target, ignore_errors=True)
        out["total_with_export_s"] = total + out.get("export_s", float("nan"))
        common.write(args.out, out)
    return 0
