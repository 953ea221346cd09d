"""GPTQ solver beside the real peer libraries: jgptq, GPTQModel 7.7.0 and llm-compressor 0.14.0.1 on the same (W, H).

Each peer runs its own code from its installed release (``benchmarks/anchors/gptqmodel_solver.py``,
``llmcompressor_solver.py``) in this process, on the same float32 weights and Hessians as jgptq. Cases: (a) one
4096 x 4096 matrix; (b) one Qwen3-30B-A3B MoE layer's experts: 128 x (gate, up 768 x 2048; down 2048 x 768), the
Hessians of gate/up shared per expert, built from random inputs with a realistic spectrum and routed-token counts
(multinomial over log-normal expert popularities, 128 x 2048 tokens, top-8). All int4, group 128, symmetric,
float32 scales, block 128, damping 0.01, natural column order.

Rows: jgptq with lazy grids (its default: a group's grid fitted when the solve reaches it) and with static grids
(``static_groups=True``: grids fitted from the original weight, as llm-compressor does); GPTQModel's fused CUDA
kernel path and its eager loop (one module at a time, as it runs); llm-compressor's ``quantize_weight`` with its
Triton block kernel and with its eager loop (same-shape modules stacked, batch cap "auto" as GPTQModifier's
default); the textbook eager torch loop (``anchors/torch_gptq.py``), labelled as such. Slow rows are timed on a
subset of experts and scaled linearly (the JSON says so). Per row: first call (compile, kernel build, Triton JIT)
apart, warm median, the float64 loss ``trace((Q - W) H (Q - W)^T)`` summed over the row's matrices (one shared
function, undamped H) and its ratio to jgptq's on the same matrices, and code agreement where grids are the same
(lazy: GPTQModel and textbook vs jgptq lazy; static: llm-compressor vs jgptq static). Codes can still differ at
exact rounding ties (-7.5 steps on a symmetric grid), after which a row drifts.
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]

FULL = {"dense": dict(rows=4096, cols=4096, tokens=16384),
        "moe": dict(experts=128, hidden=2048, width=768, tokens=128 * 2048, top_k=8, subset=16, slow_subset=2)}
SMALL = {"dense": dict(rows=256, cols=256, tokens=1024),
         "moe": dict(experts=4, hidden=256, width=128, tokens=512, top_k=2, subset=2, slow_subset=1)}
BITS, GROUP, SYM, DAMP = 4, 128, True, 0.01


def build_case(kind, s, device, seed):
    """Buckets of one case: name -> (W float32 (E, R, C), H float32 (E, C, C), hessian key)."""
    import torch

    from benchmarks.anchors import side_by_side as sbs

    gen = torch.Generator(device=device).manual_seed(seed)
    rng = np.random.default_rng(seed)

    def weights(e, r, c):
        return (torch.randn(e, r, c, generator=gen, device=device) * 0.02).bfloat16().float()

    if kind == "dense":
        h = sbs.hessian(gen, s["tokens"], s["cols"], device)[None]
        return {"dense": (weights(1, s["rows"], s["cols"]), h)}, {"tokens": s["tokens"]}
    counts = sbs.routed_counts(rng, s["experts"], s["tokens"] * s["top_k"])
    h_in = torch.stack([sbs.hessian(gen, n, s["hidden"], device) for n in counts])
    h_down = torch.stack([sbs.hessian(gen, n, s["width"], device) for n in counts])
    e, hid, wid = s["experts"], s["hidden"], s["width"]
    buckets = {"gate": (weights(e, wid, hid), h_in), "up": (weights(e, wid, hid), h_in),
               "down": (weights(e, hid, wid), h_down)}
    return buckets, {"tokens_per_expert": {"min": min(counts), "median": float(np.median(counts)),
                                           "max": max(counts)}}


def sync_all(out=None):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def jgptq_row(buckets, static):
    """jgptq: one vmapped solve per shape (gate and up solved as the fused gate_up matrix, as the pipeline does)."""
    import jax

    from jgptq_torch.dlpack import to_jax, to_torch
    from jgptq import QuantConfig, gptq

    cfg = QuantConfig(bits=BITS, group_size=GROUP, block_size=128, sym=SYM, damp=DAMP, static_groups=static,
                      scale_dtype="float32", act_order="none")   # natural order, as the peers' rows
    if "dense" in buckets:
        w, h = buckets["dense"]
        jobs = [(("dense",), to_jax(w[0].contiguous()), to_jax(h[0].contiguous()), False)]
    else:
        import torch

        gate_up = torch.cat([buckets["gate"][0], buckets["up"][0]], dim=1)
        jobs = [(("gate", "up"), to_jax(gate_up), to_jax(buckets["gate"][1]), True),
                (("down",), to_jax(buckets["down"][0]), to_jax(buckets["down"][1]), True)]

    def run():
        return [(gptq.solve_experts(w, h, cfg, check=False) if batched else gptq.solve(w, h, cfg, check=False))
                for _, w, h, batched in jobs]

    def collect(results):
        out = {}
        for (names, _, _, batched), r in zip(jobs, results):
            q, c = to_torch(r.weight), to_torch(r.codes)
            if not batched:
                q, c = q[None], c[None]
            rows = q.shape[1] // len(names)
            for i, n in enumerate(names):
                out[n] = (q[:, i * rows:(i + 1) * rows], c[:, i * rows:(i + 1) * rows])
        return out

    return run, lambda r: jax.block_until_ready(r), collect, None


def gptqmodel_row(buckets, fused, experts):
    from benchmarks.anchors import gptqmodel_solver as gm

    def run():
        out = {}
        for name, (w, h) in buckets.items():
            out[name] = [gm.solve(w[e], h[e], bits=BITS, group_size=GROUP, sym=SYM, fused=fused, damp=DAMP)
                         for e in range(experts)]
        return out

    def collect(res):
        import torch

        return {n: (torch.stack([r["weight"] for r in rs]), torch.stack([r["codes"] for r in rs]))
                for n, rs in res.items()}

    return run, sync_all, collect, experts


def llmcompressor_row(buckets, triton):
    """Same-shape modules stacked as GPTQModifier batches them (gate and up of every expert share a shape)."""
    import torch

    from benchmarks.anchors import llmcompressor_solver as lc

    args = lc.quant_args(BITS, GROUP, SYM)
    groups = {}  # shape -> bucket names, in order
    for name, (w, _) in buckets.items():
        groups.setdefault(tuple(w.shape[1:]), []).append(name)
    stacks = []
    for names in groups.values():
        w = torch.cat([buckets[n][0] for n in names])
        h = torch.cat([buckets[n][1] for n in names])
        stacks.append((names, w, h))

    def run():
        # the observer runs in the timed call too: llm-compressor fits its grids as part of its GPTQ step
        return [lc.solve(w, h, bits=BITS, group_size=GROUP, sym=SYM, triton=triton, damp=DAMP, batch="auto",
                         grids=lc.observe(w, args)) for _, w, h in stacks]

    def collect(res):
        out = {}
        for (names, w, _), r in zip(stacks, res):
            e = w.shape[0] // len(names)
            for i, n in enumerate(names):
                out[n] = (r["weight"][i * e:(i + 1) * e], r["codes"][i * e:(i + 1) * e])
        return out

    return run, sync_all, collect, None


def textbook_row(buckets, experts):
    from benchmarks.anchors.torch_gptq import gptq_textbook

    def run():
        return {n: [gptq_textbook(w[e], h[e], BITS, GROUP, SYM, 128, DAMP) for e in range(experts)]
                for n, (w, h) in buckets.items()}

    def collect(res):
        import torch

        return {n: (torch.stack([q for q, _ in rs]), torch.stack([c for _, c in rs])) for n, rs in res.items()}

    return run, sync_all, collect, experts


def _import_peer(label) -> float:
    """Imports the peer package a row uses (seconds; near zero once imported)."""
    t0 = time.perf_counter()
    if label.startswith("gptqmodel"):
        import gptqmodel.quantization.gptq  # noqa: F401
    elif label.startswith("llmcompressor"):
        import llmcompressor.modifiers.gptq.gptq_quantize  # noqa: F401
        import llmcompressor.observers  # noqa: F401
    return time.perf_counter() - t0


def measure(label, make, buckets, repeat, total_experts):
    """Runs one row: first call apart, warm median, outputs of the last call."""
    run, sync, collect, experts = make()
    t0 = time.perf_counter()
    out = sync(run())
    first = time.perf_counter() - t0
    timing = common.time_calls(lambda: run(), sync, warmup=0, repeat=repeat) if repeat else None
    scale = total_experts / experts if experts else 1.0
    warm = timing["median_s"] if timing else first
    row = {"row": label, "first_call_s": first, "warm_measured_s": warm, "runs": timing["runs"] if timing else 1,
           "experts_timed": experts or total_experts, "warm_s": warm * scale, "scaled": scale != 1.0}
    if scale != 1.0:
        row["note"] = f"timed on {experts} of {total_experts} experts (all their matrices), scaled linearly"
    return row, collect(out)


def score(row, outputs, buckets, reference):
    """Float64 losses of a row's matrices, their ratio to jgptq's on the same matrices, and code agreement."""
    from benchmarks.anchors import side_by_side as sbs

    total = ref_lazy = ref_static = 0.0
    agree = {"codes_equal": 0.0, "rows_identical": 0.0, "codes_compared": 0}
    grid = row.get("grid")
    for name, (q, codes) in outputs.items():
        w, h = buckets[name]
        for e in range(q.shape[0]):
            total += sbs.loss64(q[e], w[e], h[e])
            if reference:
                ref_lazy += reference["lazy"]["loss"][name][e]
                ref_static += reference["static"]["loss"][name][e]
        if reference and grid:
            a = sbs.agreement(codes, reference[grid]["codes"][name][:q.shape[0]])
            n = agree["codes_compared"] + a["codes_compared"]
            for k in ("codes_equal", "rows_identical"):
                agree[k] = (agree[k] * agree["codes_compared"] + a[k] * a["codes_compared"]) / n
            agree["codes_compared"] = n
    row["loss64"] = total
    if reference:
        row["loss_vs_jgptq_lazy"] = total / ref_lazy
        row["loss_vs_jgptq_static"] = total / ref_static
    if grid and reference:
        row["agreement_with_jgptq_" + grid] = agree


def per_matrix(outputs, buckets):
    from benchmarks.anchors import side_by_side as sbs

    return ({n: [sbs.loss64(q[e], buckets[n][0][e], buckets[n][1][e]) for e in range(q.shape[0])]
             for n, (q, _) in outputs.items()}, {n: c for n, (_, c) in outputs.items()})


def run_case(kind, s, device, repeat, small):
    import torch

    buckets, info = build_case(kind, s, device, seed=0 if kind == "dense" else 1)
    experts = 1 if kind == "dense" else s["experts"]
    subset, slow = (1, 1) if kind == "dense" else (min(s["subset"], experts), min(s["slow_subset"], experts))
    cuda = device == "cuda"
    rows, reference = [], {}
    for label, static in (("jgptq_lazy", False), ("jgptq_static", True)):
        row, out = measure(label, lambda: jgptq_row(buckets, static), buckets, repeat, experts)
        loss, codes = per_matrix(out, buckets)
        reference["static" if static else "lazy"] = {"loss": loss, "codes": codes}
        rows.append((row, out))
        sync_all()
    for row, out in rows:
        score(row, out, buckets, reference)
    rows = [r for r, _ in rows]
    peers = [("gptqmodel_fused", "lazy", lambda: gptqmodel_row(buckets, True, subset), cuda, "needs CUDA"),
             ("gptqmodel_eager", "lazy", lambda: gptqmodel_row(buckets, False, slow), True, ""),
             ("llmcompressor_triton", "static", lambda: llmcompressor_row(buckets, True), cuda, "needs CUDA"),
             ("llmcompressor_eager", "static", lambda: llmcompressor_row(buckets, False), True, ""),
             ("textbook_torch_loop", "lazy", lambda: textbook_row(buckets, slow), True, "")]
    for label, grid, make, possible, why in peers:
        if not possible:
            rows.append({"row": label, "skipped": why})
            continue
        try:
            import_s = _import_peer(label)  # the package import is not a first-call cost of the solver
            if label == "gptqmodel_fused":
                from benchmarks.anchors import gptqmodel_solver as gm

                built = gm.prepare_fused()
                if not built["ok"]:
                    rows.append({"row": label, "skipped": "fused kernel unavailable: " + built["error"]})
                    continue
            slow_row = label.endswith("eager") or label.startswith("textbook")
            row, out = measure(label, make, buckets, 1 if slow_row else repeat, experts)
            if label == "gptqmodel_fused":
                row["kernel_build_s"] = built["seconds"]
            row["grid"] = grid
            row["import_s"] = import_s
            score(row, out, buckets, reference)
            del out
        except Exception as exc:  # recorded: one peer failing must not lose the other rows
            row = {"row": label, "error": f"{type(exc).__name__}: {exc}"[:800]}
        rows.append(row)
        print({k: v for k, v in row.items() if not isinstance(v, dict)}, flush=True)
        sync_all()
        if cuda:
            torch.cuda.empty_cache()
    real = [r for r in rows if r["row"].split("_")[0] in ("gptqmodel", "llmcompressor") and "warm_s" in r]
    best = min(real, key=lambda r: r["warm_s"]) if real else None
    for r in rows:
        if "warm_s" in r:
            r["time_vs_jgptq_lazy"] = r["warm_s"] / rows[0]["warm_s"]
    out = {"case": kind, "shape": s, **info, "rows": rows,
           "loss_static_over_lazy": rows[1]["loss64"] / rows[0]["loss64"]}
    if best:
        out["best_real_peer"] = best["row"]
        out["jgptq_lazy_vs_best_peer"] = best["warm_s"] / rows[0]["warm_s"]
        out["jgptq_static_vs_best_peer"] = best["warm_s"] / rows[1]["warm_s"]
    return out


def main(argv=None):
    p = common.parser("peers_solver", DOC)
    p.add_argument("--cases", default="dense,moe", help="comma-separated: dense, moe")
    p.add_argument("--repeat", type=int, default=None, help="warm runs per fast row (default 5; --small 2)")
    args = p.parse_args(argv)
    if os.environ.get("OUT") and args.out == os.path.join(common.RESULTS, "peers_solver.json"):
        args.out = os.path.join(os.environ["OUT"], "peers_solver_h200.json")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jgptq  # noqa: F401  (sets the JAX allocator before JAX starts)
    import torch

    from benchmarks.anchors import side_by_side as sbs

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SMALL if args.small else FULL
    repeat = args.repeat or (2 if args.small else 5)
    result = {"benchmark": "peers_solver", "description": __doc__, "small": bool(args.small), "device": device,
              "settings": {"bits": BITS, "group_size": GROUP, "sym": SYM, "damp": DAMP, "block_size": 128,
                           "scale_dtype": "float32", "tf32": False},
              "packages": sbs.package_versions(), "cases": []}
    for kind in [c.strip() for c in args.cases.split(",") if c.strip()]:
        t0 = time.perf_counter()
        case = run_case(kind, shapes[kind], device, repeat, args.small)
        case["case_wall_s"] = time.perf_counter() - t0
        result["cases"].append(case)
        common.write(args.out, result)  # after every case: a later failure keeps what was measured
    return 0
