"""Pieces of the ``target_bpw`` benchmark: sizes of the quantized tensors, GGUF files assembled from several runs,
the sensitivity-proxy calibration, and a KL-against-size chart.

- :func:`quantized_bits`: bits and weights of the tensors a GGUF holds in a GGML block format (not F32/F16).
- :func:`assemble`: a result-like object whose every quantized parameter comes from the run of the format an
  allocation gives it, for :func:`jgptq_torch.export.gguf.export.export_gguf` (one file per random allocation without a new
  quantization run).
- :func:`param_losses`: per model parameter, the sum of the solver's GPTQ losses of its matrices (experts summed).
- :func:`spearman`: rank correlation with average ranks for ties.
- :func:`kl_size_chart`: an SVG of mean KL (log axis) against size, one line per series, each with its own x.
"""

from __future__ import annotations

import html
import math
import types

import numpy as np

from jgptq.plot import COLORS, Frame

FLOAT_TYPES = ("F32", "F16", "BF16")


def quantized_bits(path: str) -> dict:
    """{"bits", "weights", "bits_per_weight", "bytes", "tensors", "types"} over the tensors of a GGUF stored in a
    GGML block format (every type but F32/F16/BF16); ``types`` counts the tensors of each type."""
    import gguf

    bits = weights = 0
    names, kinds = [], {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name in FLOAT_TYPES:
            continue
        bits += int(t.n_bytes) * 8
        weights += int(t.n_elements)
        names.append(t.name)
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    return {"bits": bits, "bytes": bits // 8, "weights": weights, "bits_per_weight": bits / max(weights, 1),
            "tensors": sorted(names), "types": dict(sorted(kinds.items()))}


def assemble(runs: dict, allocation: dict):
    """A QuantizeResult-like object taking each parameter's records from ``runs[allocation[param]]``.

    Args:
      runs: format -> a :class:`jgptq.QuantizeResult` of the same model with that format everywhere.
      allocation: model parameter name -> format (every parameter the runs quantized).
    """
    weights, param_keys = {}, {}
    for param, fmt in allocation.items():
        run = runs[fmt]
        keys = run.param_keys[param]
        param_keys[param] = list(keys)
        for k in keys:
            weights[k] = run.weights[k]
    return types.SimpleNamespace(weights=weights, param_keys=param_keys, config=None)


def param_losses(result) -> dict:
    """Model parameter name -> the summed GPTQ loss of its matrices in ``result.report`` (experts of a stacked
    parameter summed), matched by the record's module name being the parameter's owner."""
    by_owner = {}
    for rec in result.report.records:
        if np.isfinite(rec.loss):
            owner = rec.name
            if rec.kind.startswith("expert_"):  # "…experts.<e>.<proj>" or "…experts" + kind
                owner = owner.split(".experts")[0] + ".experts"
            key = (owner, "down" if rec.kind == "expert_down" else "gate_up" if rec.kind == "expert_gate_up"
                   else "")
            by_owner[key] = by_owner.get(key, 0.0) + float(rec.loss)
    out = {}
    for param in result.param_keys:
        owner = param.rpartition(".")[0]
        if owner.endswith(".experts"):
            kind = "down" if "down" in param.rpartition(".")[2] else "gate_up"
            key = (owner, kind)
        else:
            key = (owner, "")
        if key in by_owner:
            out[param] = by_owner[key]
    return out


def _ranks(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=np.float64)
    for v in np.unique(x):  # average rank for ties
        tie = x == v
        ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equal-length sequences (NaN when either is constant)."""
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


FRAME = Frame(width=700, height=420, right=200)   # a wider legend than the per-layer charts


def kl_size_chart(series: dict, *, title: str, xlabel: str, ylabel: str = "mean KL to the float model") -> str:
    """SVG chart: series name -> list of (x, y, label); y on a log axis, each series drawn in x order."""
    pts = [(x, y) for s in series.values() for x, y, _ in s if y and y > 0 and math.isfinite(y)]
    if not pts:
        raise ValueError("kl_size_chart: nothing to draw")
    xs, ys = [p[0] for p in pts], [math.log10(p[1]) for p in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pad = 0.06 * (x1 - x0)
    x0, x1 = x0 - pad, x1 + pad
    lo, hi = math.floor(min(ys)), math.ceil(max(ys)) if math.ceil(max(ys)) > math.floor(min(ys)) else \
        math.floor(min(ys)) + 1
    left, top, pw, ph = FRAME.left, FRAME.top, FRAME.pw, FRAME.ph

    def px(v):
        return left + (v - x0) / (x1 - x0) * pw

    def py(v):
        return top + ph - (v - lo) / (hi - lo) * ph

    out = FRAME.head(title)
    for k in range(lo, hi + 1):
        for m in (1, 2, 5):
            v = k + math.log10(m)
            if v > hi + 1e-9:
                break
            y = py(v)
            out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="'
                       f'{"#ccc" if m == 1 else "#eee"}"/>')
            out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{m}e{k}</text>')
    raw = (x1 - x0) / 6
    step = next(s * 10 ** math.floor(math.log10(raw)) for s in (1, 2, 5, 10)
                if s * 10 ** math.floor(math.log10(raw)) >= raw)
    t = math.ceil(x0 / step) * step
    while t <= x1:
        out.append(f'<text x="{px(t):.1f}" y="{top + ph + 18}" text-anchor="middle">{t:.3g}</text>')
        t += step
    out += FRAME.axes(xlabel, ylabel)
    for k, (name, points) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        good = sorted((x, y, lab) for x, y, lab in points if y and y > 0 and math.isfinite(y))
        xy = [(px(x), py(math.log10(y)), lab) for x, y, lab in good]
        if len(xy) > 1:
            out.append(f'<polyline points="{" ".join(f"{a:.1f},{b:.1f}" for a, b, _ in xy)}" fill="none" '
                       f'stroke="{color}" stroke-width="2"/>')
        for a, b, lab in xy:
            out.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3.5" fill="{color}"><title>{html.escape(lab)}'
                       f'</title></circle>')
        out += FRAME.legend(k, name, color)
    out.append("</svg>")
    return "\n".join(out) + "\n"
