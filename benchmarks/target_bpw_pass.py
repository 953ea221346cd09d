"""Time of ``target_bpw``'s first pass on a CPU, and the quality of its allocation against the exhaustive measurement.

The model: the ``deep`` model of ``python -m benchmarks target_bpw`` (4 layers, hidden 512, 8 experts of width
512, top-2; trained and cached by :mod:`benchmarks.quality.lm`), its calibration (128 sequences of 256 bytes,
batches of 32), its importance matrix (a jgptq round-to-nearest Q8_0 run, kept beside the cached model) and its
candidates (``target_bpw``'s ``TARGET_FORMATS``). The first budget is that benchmark's Q2_K_S size.

Timed: :func:`jgptq_torch.pipeline.layerwise.choose_formats` as ``quantize_moe(target_bpw=...)`` runs it, from a fresh
compilation cache (a first run on a machine), with its progress lines; its ``seconds`` split the Fisher gain pass
from the measurement. The machine's load (``os.getloadavg``) is recorded before and after: the 2-core machine
this runs on is shared.

With ``--reference``, the same pass also runs with every matrix solved whole (``stride=0``: the measurement the
sampled one replaces) and the allocations of both at every budget (``--budgets``, default the four sizes of the
``target_bpw`` benchmark's deep model) are priced by the exhaustive costs: ``objective_ratio`` is the sampled
allocation's exhaustive objective over the exhaustive allocation's (1 = as good; the sampled estimate of each
group's cost is compared too); ``--reference-from`` takes the exhaustive pass from an earlier result instead
(its costs do not depend on the sampling rules). ``--share``: grid-search candidates solved on one expert in this
many and scaled from a cheaper candidate (:func:`jgptq_torch.pipeline.measure.scaled_by`; 1: each measured
itself, the rule before).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]
# bits per weight of llama.cpp's Q2_K_S, IQ2_M, Q3_K_M and Q4_K_M files of the deep model (results/target_bpw.json)
BUDGETS = (2.8425925925925926, 2.7430555555555554, 4.016203703703703, 4.9907407407407405)


def _args(argv):
    from benchmarks.gguf_quality import DEFAULT_CACHE
    from benchmarks.target_bpw import TARGET_FORMATS

    p = common.parser("target_bpw_pass", DOC)
    p.add_argument("--model", default="deep", choices=("quality", "deep"), help="which trained model")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="bits per weight; the first is timed")
    p.add_argument("--target-formats", default=",".join(TARGET_FORMATS), help="candidate formats")
    p.add_argument("--stride", type=int, default=None, help="experts' row stride (default the library's)")
    p.add_argument("--reference", action="store_true", help="also the exhaustive measurement (every row)")
    p.add_argument("--reference-from", default=None, help="take the exhaustive pass from this earlier result JSON "
                   "(same settings) instead of running it")
    p.add_argument("--share", type=int, default=None, help="grid-search candidates on one expert in this many "
                   "(default the library's; 1: each measured itself)")
    p.add_argument("--sampled-from", default=None, help="take the sampled pass from this earlier result JSON "
                   "(same settings) instead of running it again")
    p.add_argument("--whole-run", action="store_true", help="also time the whole run (quantize_moe with target_bpw: "
                   "the first pass, then the quantization) in the same process, after the passes")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the trained models are kept")
    p.add_argument("--calib-seqs", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--warm-cache", action="store_true", help="keep the machine's compilation cache (default: a "
                   "fresh one, as a first run)")
    args = p.parse_args(argv)
    if args.small:
        args.calib_seqs = min(args.calib_seqs, 8)
    return args


def _setup(args):
    import torch

    from benchmarks.quality import corpus, lm
    from benchmarks.target_bpw import _imatrix

    splits, model, info = lm.named_model(args.model, args.cache_dir, steps=4 if args.small else None)
    calib = torch.from_numpy(corpus.windows(splits.tokens["calib"], args.calib_len, args.calib_seqs))
    batch = min(32, args.calib_seqs)
    imat, _ = _imatrix(os.path.join(info["folder"], f"imatrix-{args.calib_seqs}x{args.calib_len}.npz"),
                       info["folder"], calib, batch, True)
    return model, calib, imat, batch, info


def _pass(model, calib, imat, batch, formats, bpw, stride, share):
    """(allocation record, wall seconds, this process's CPU seconds) of one first pass."""
    from jgptq import PipelineConfig
    from jgptq_torch.pipeline.layerwise import choose_formats

    cfg = PipelineConfig.build(None, format=formats[0], target_bpw=bpw, target_formats=formats, batch_size=batch,
                               progress=True)
    t0, c0 = time.perf_counter(), time.process_time()
    _, allocation = choose_formats(model, calib, cfg, device="cpu", imatrix=imat, stride=stride, share=share)
    return allocation, time.perf_counter() - t0, time.process_time() - c0


def _objective(allocation, costs_of) -> float:
    """Sum over groups of the cost, under ``costs_of`` (group key -> {format: cost}), of each group's format."""
    return sum(costs_of[(g["layer"], g["name"])][g["format"]] for g in allocation["groups"])


def compare(sampled: dict, exhaustive: dict, budgets) -> dict:
    """Per budget: both allocations priced by the exhaustive costs, their ratio, and how many groups differ;
    plus the relative error of the sampled estimate of every group's cost (median, max)."""
    from jgptq_torch.pipeline.sensitivity import reallocate

    exact = {(g["layer"], g["name"]): g["costs"] for g in exhaustive["groups"]}
    est = {(g["layer"], g["name"]): g["costs"] for g in sampled["groups"]}
    rel = [abs(est[k][f] / exact[k][f] - 1) for k in exact for f in exact[k] if exact[k][f] > 0]
    rows = []
    for bpw in budgets:
        a, b = reallocate(sampled, bpw), reallocate(exhaustive, bpw)
        fa, fb = _objective(a, exact), _objective(b, exact)
        rows.append({"target_bpw": bpw, "exhaustive_objective_of_sampled_allocation": fa,
                     "exhaustive_objective_of_exhaustive_allocation": fb, "objective_ratio": fa / fb,
                     "sampled_predicted_objective": a["predicted_objective"],
                     "groups_differing": sum(ga["format"] != gb["format"] for ga, gb in zip(a["groups"], b["groups"])),
                     "groups": len(a["groups"])})
    return {"budgets": rows, "group_cost_relative_error": {"median": float(np.median(rel)), "max": float(max(rel)),
                                                           "count": len(rel)}}


def main(argv=None):
    args = _args(argv)
    import jax

    from jgptq import xla_options
    from jgptq_torch.pipeline import measure

    if args.warm_cache:
        cache = xla_options.enable_compilation_cache()
    else:
        cache = tempfile.mkdtemp(prefix="jgptq_xla_cold_")
        jax.config.update("jax_compilation_cache_dir", cache)
    model, calib, imat, batch, info = _setup(args)
    formats = tuple(s.strip() for s in args.target_formats.split(",") if s.strip())
    budgets = [float(b) for b in args.budgets.split(",")]
    stride = measure.EXPERT_ROW_STRIDE if args.stride is None else args.stride
    out = {"benchmark": "target_bpw_pass", "description": __doc__, "machine": common.machine(),
           "model": {k: v for k, v in info.items() if k != "loss_history"}, "target_formats": list(formats),
           "compilation_cache": "warm (the machine's)" if args.warm_cache else "fresh (a first run)",
           "calibration": {"sequences": int(calib.shape[0]), "length": int(calib.shape[1]), "batch": batch}}
    share = measure.EXPERT_SHARE if args.share is None else args.share
    out["share"] = share
    runs = [("sampled", stride)] + ([("exhaustive", 0)] if args.reference and not args.reference_from else [])
    allocations = {}
    if args.sampled_from:
        with open(args.sampled_from) as f:
            out["sampled"] = dict(json.load(f)["sampled"], taken_from=os.path.basename(args.sampled_from))
        allocations["sampled"] = out["sampled"]["allocation"]
        runs = runs[1:]
    if args.reference_from:
        with open(args.reference_from) as f:
            out["exhaustive"] = dict(json.load(f)["exhaustive"], taken_from=os.path.basename(args.reference_from))
        allocations["exhaustive"] = out["exhaustive"]["allocation"]
    for name, s in runs:
        load_before = os.getloadavg()
        allocation, wall, cpu = _pass(model, calib, imat, batch, formats, budgets[0], s, share)
        allocations[name] = allocation
        out[name] = {"stride": s, "wall_s": wall, "process_cpu_s": cpu, "seconds": allocation["seconds"], "load_before": load_before,
                     "load_after": os.getloadavg(), "allocation": allocation}
        print(f"{name} (stride {s}): {wall:.1f} s, CPU {cpu:.1f} s ({allocation['seconds']}), load {load_before} -> "
              f"{out[name]['load_after']}", flush=True)
        common.write(args.out, out)
    if args.reference or args.reference_from:
        out["comparison"] = compare(allocations["sampled"], allocations["exhaustive"], budgets)
        for row in out["comparison"]["budgets"]:
            print(f"{row['target_bpw']:.4f} bpw: objective ratio {row['objective_ratio']:.4f}, "
                  f"{row['groups_differing']}/{row['groups']} groups differ", flush=True)
        print(f"group cost relative error {out['comparison']['group_cost_relative_error']}")
    if args.whole_run:
        out["whole_run"] = _whole_run(model, calib, imat, batch, formats, budgets[0])
        print(f"whole run: {out['whole_run']['wall_s']:.1f} s, CPU {out['whole_run']['process_cpu_s']:.1f} s",
              flush=True)
    common.write(args.out, out)
    return 0


def _whole_run(model, calib, imat, batch, formats, bpw) -> dict:
    """Seconds of ``quantize_moe(model, calib, target_bpw=bpw)`` as a user runs it (the first pass, then the
    quantization in the chosen formats; the model's weights are overwritten, so it comes last)."""
    import jgptq

    load_before = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    result = jgptq.quantize_moe(model, calib, format=formats[0], target_bpw=bpw, target_formats=formats,
                                batch_size=batch, imatrix=imat, device="cpu", progress=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"target_bpw": bpw, "wall_s": wall, "process_cpu_s": cpu, "load_before": load_before,
            "load_after": os.getloadavg(), "stage_s": result.report.stage_totals()}
