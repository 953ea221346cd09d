"""GPTQ against the plain GGML encode on a Hessian estimated from few tokens: calibration loss and held-out loss.

GPTQ minimises trace((W - Q) H (W - Q)^T) for the calibration Hessian H, a sample estimate. Where H is estimated
from few tokens per input column (a routed expert sees about k/E of the calibration tokens), part of what GPTQ
"gains" is fitting the estimate's noise, and the same solve can be worse than the plain encode on the population
Hessian. This benchmark measures it on synthetic inputs x = z diag(s) V (V a random rotation, two outlier channels
scaled 10x) for spectra s (flat, exp(-i/200), exp(-i/50)) and calibration token counts, per format: the ratios
loss(GPTQ) / loss(plain) on the calibration Hessian and on a held-out Hessian of 100,000 tokens (the anchor is the
plain encode: llama.cpp's bytes). A third figure solves GPTQ on the calibration Hessian shrunk toward its diagonal
with the Schafer-Strimmer intensity (estimated from the same tokens: the variance of each off-diagonal entry's
mean over the sum of their squares), a candidate remedy. Ratios below 1: GPTQ better.
"""

from __future__ import annotations

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]


def _args(argv):
    p = common.parser("hessian_overfit", DOC)
    p.add_argument("--formats", default="q8_0,q4_k", help="comma-separated GGML formats")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--cols", type=int, default=512)
    p.add_argument("--tokens", default="1024,4096,32768", help="calibration token counts")
    args = p.parse_args(argv)
    if args.small:
        args.rows, args.cols, args.tokens = 8, 256, "512,2048"
    return args


def shrunk_to_diagonal(x: np.ndarray) -> tuple:
    """(intensity a, (1 - a) S + a diag(S)) for S = x^T x / n, float64; a = sum_{i != j} Var(S_ij) / S_ij^2
    (Schafer and Strimmer 2005), clipped to [0, 1]."""
    n = x.shape[0]
    s = x.T @ x / n
    x2 = x * x
    var = (x2.T @ x2 / n - s * s) / n
    off = ~np.eye(s.shape[0], dtype=bool)
    a = float(min(1.0, var[off].sum() / (s[off] ** 2).sum()))
    return a, (1 - a) * s + a * np.diag(np.diag(s))


def _loss(w, q, h):
    d = np.asarray(q, np.float64) - w
    return float(np.sum((d @ h) * d))


def main(argv=None):
    args = _args(argv)
    from jgptq import gptq
    from jgptq.config import QuantConfig
    from jgptq.ggml import decode, encode

    rng = np.random.default_rng(0)
    c = args.cols
    rot = np.linalg.qr(rng.standard_normal((c, c)))[0]
    spectra = {"flat": np.ones(c), "exp(-i/200)": np.exp(-np.arange(c) / 200.0),
               "exp(-i/50)": np.exp(-np.arange(c) / 50.0)}
    out = {"benchmark": "hessian_overfit", "description": __doc__, "rows": args.rows, "cols": c, "cases": []}
    for name, spec in spectra.items():
        for n in [int(t) for t in args.tokens.split(",")]:
            def inputs(m):
                x = (rng.standard_normal((m, c)) * spec) @ rot
                x[:, :2] *= 10
                return x
            xc, xt = inputs(n), inputs(100_000)
            hc, ht = xc.T @ xc / n, xt.T @ xt / len(xt)
            a, hs = shrunk_to_diagonal(xc)
            w = (rng.standard_normal((args.rows, c)) * 0.02).astype(np.float32)
            case = {"spectrum": name, "tokens": n, "tokens_per_column": n / c, "shrink_intensity": a}
            for fmt in args.formats.split(","):
                imp = np.diag(hc).astype(np.float32) if fmt != "q8_0" else None
                plain = np.asarray(decode(encode(w, fmt, imp), fmt))
                row = {}
                for label, h in (("gptq", hc), ("gptq_shrunk", hs)):
                    res = np.asarray(gptq.solve(w, h.astype(np.float32), QuantConfig(format=fmt), importance=imp).weight)
                    row[label] = {"calib_ratio": _loss(w, res, hc) / _loss(w, plain, hc),
                                  "heldout_ratio": _loss(w, res, ht) / _loss(w, plain, ht)}
                case[fmt] = row
                print(f"{name:12s} {n:6d} {fmt:6s} gptq calib {row['gptq']['calib_ratio']:.3f} held-out "
                      f"{row['gptq']['heldout_ratio']:.3f} | shrunk ({a:.2f}) held-out "
                      f"{row['gptq_shrunk']['heldout_ratio']:.3f}", flush=True)
            out["cases"].append(case)
    common.write(args.out, out)
    return 0
