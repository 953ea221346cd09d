"""Calibrating the sensitivity proxy of a bits-per-weight allocation against measured KL.

Given one uniform GPTQ run per format (every weight at that format, same calibration and imatrix), an allocation
(model parameter -> format) is turned into a GGUF file without another run by taking each parameter's tensors
from the run of its format (:func:`benchmarks.quality.bpw_parts.assemble`; the layers after a parameter were solved
on inputs of the uniform run, not of the allocation, a second-order difference). Each file is evaluated as the
benchmark evaluates every file (mean KL to the float model).

Proxies of an allocation's output error, compared by Spearman rank correlation with the measured KL over random
allocations:
- ``bits``: minus the allocation's total bits (more bits, less error: the baseline any proxy must beat);
- ``gptq_loss``: the sum over parameters of the solver's GPTQ loss at the chosen format;
- ``gptq_loss_x_gain``: the same with each parameter's loss weighted by a measured gain: the KL of the file with
  that parameter alone at the lowest format (all others at the highest) above the all-highest file's KL, divided
  by the parameter's loss increase between the two formats (how much of its output error reaches the logits);
- ``library_fisher_cost``: what ``target_bpw`` minimises: the sum of its measured per-group costs (GPTQ objective
  on float inputs, times token share, times the Fisher gain; the report's ``allocation``) at the chosen formats;
  ``library_unweighted_cost``: the same costs divided by each group's gain (``target_gain="one"``);
- ``single_kl_additive``: the all-highest KL plus, per parameter at the lowest format, its one-at-a-time KL
  increase, interpolated for middle formats by the parameter's GPTQ loss (additive, measured at the ends).
"""

from __future__ import annotations

import os

import numpy as np


def calibrate(ctx, float_model, imat, side, export_gguf, formats, n_alloc, quantize, allocation=None, seed=0):
    """Runs the calibration on one model; returns the JSON section (allocations, proxies, correlations)."""
    import types

    from benchmarks.quality import bpw_parts

    work, name = ctx["work"], ctx["name"]
    runs, losses, uniform = {}, {}, {}
    for fmt in formats:
        model, result, seconds = quantize(ctx["folder"], ctx["calib"], imat, ctx["batch"], format=fmt)
        runs[fmt] = types.SimpleNamespace(weights=result.weights, param_keys=result.param_keys)
        losses[fmt] = bpw_parts.param_losses(result)
        path = os.path.join(work, f"{name}-uniform-{fmt}.gguf")
        export_gguf(float_model, runs[fmt], path, overwrite=True, float_type="f32", float_embeddings=True)
        del model, result
        stats = side.measure(f"uniform-{fmt}", path, seconds)
        uniform[fmt] = {k: stats[k] for k in ("kl_mean", "kl_mean_stderr", "bits_per_weight", "bytes",
                                              "quantize_s")}
        print(f"[{name}] proxy: uniform {fmt} KL {stats['kl_mean']:.5f}", flush=True)
    params = sorted(runs[formats[0]].param_keys)
    missing = [p for p in params if any(p not in losses[f] for f in formats)]
    elements = {p: _elements(runs[formats[0]], p) for p in params}
    bpw = {f: uniform[f]["bits_per_weight"] for f in formats}
    low, high = min(formats, key=bpw.get), max(formats, key=bpw.get)

    def measure(alloc, tag):
        path = os.path.join(work, f"{name}-alloc-{tag}.gguf")
        export_gguf(float_model, bpw_parts.assemble(runs, alloc), path, overwrite=True, float_type="f32",
                    float_embeddings=True)
        stats = side.measure(tag, path)
        os.remove(path)
        return stats

    kl_high = uniform[high]["kl_mean"]
    single = {}
    for p in params:  # one parameter at the lowest format, every other at the highest
        stats = measure({q: (low if q == p else high) for q in params}, f"single-{len(single)}")
        single[p] = stats["kl_mean"] - kl_high
    gain = {}
    for p in params:
        d = losses[low].get(p, np.nan) - losses[high].get(p, np.nan)
        gain[p] = single[p] / d if d > 0 else 0.0

    def predicted(alloc):
        bits = sum(elements[p] * bpw[f] for p, f in alloc.items())
        loss = sum(losses[f].get(p, np.nan) for p, f in alloc.items())
        weighted = sum(gain[p] * losses[f].get(p, np.nan) for p, f in alloc.items())
        additive = kl_high
        for p, f in alloc.items():
            span = losses[low].get(p, np.nan) - losses[high].get(p, np.nan)
            frac = (losses[f].get(p, np.nan) - losses[high].get(p, np.nan)) / span if span > 0 else 0.0
            additive += single[p] * frac
        out = {"bits": -bits, "gptq_loss": loss, "gptq_loss_x_gain": weighted, "single_kl_additive": additive}
        if groups:
            out["library_fisher_cost"] = sum(g["costs"][alloc[g["params"][0]]] for g in groups)
            out["library_unweighted_cost"] = sum(g["costs"][alloc[g["params"][0]]] / (g["gain"] or 1.0)
                                                 for g in groups)
        return out

    groups = [g for g in (allocation or {}).get("groups", [])
              if all(f in g["costs"] for f in formats) and all(p in params for p in g["params"])]
    if allocation and len(groups) != len(allocation.get("groups", [])):
        groups = []  # the library's costs cover other formats or parameters: its proxy is left out
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_alloc):
        alloc = {p: formats[int(rng.integers(len(formats)))] for p in params}
        for g in groups:  # a layer's group takes one format
            for p in g["params"][1:]:
                alloc[p] = alloc[g["params"][0]]
        stats = measure(alloc, f"random-{i}")
        rows.append({"allocation": alloc, "kl_mean": stats["kl_mean"], "kl_mean_stderr": stats["kl_mean_stderr"],
                     "bits_per_weight": stats["bits_per_weight"], "predicted": predicted(alloc)})
        print(f"[{name}] proxy: allocation {i} {stats['bits_per_weight']:.3f} bpw KL {stats['kl_mean']:.5f}",
              flush=True)
    measured = [r["kl_mean"] for r in rows]
    corr = {k: bpw_parts.spearman([r["predicted"][k] for r in rows], measured) for k in rows[0]["predicted"]}
    best = max((k for k in corr if np.isfinite(corr[k])), key=corr.get, default=None)
    return {"formats": list(formats), "uniform": uniform, "params": params, "params_missing_loss": missing,
            "losses": {f: {p: losses[f].get(p) for p in params} for f in formats},
            "single_param_kl_increase": single, "gain": gain, "low": low, "high": high, "allocations": rows,
            "spearman_vs_measured_kl": corr, "best_proxy": best, "library_costs_used": bool(groups),
            "note": "files assembled from uniform runs' tensors (see benchmarks/quality/proxy_calibration.py)"}


def _elements(run, param) -> int:
    total = 0
    for k in run.param_keys[param]:
        rec = run.weights[k]
        total += int(np.prod(rec.shape))
    return total
