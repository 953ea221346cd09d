"""GPTQ solver: jgptq's jitted blockwise solve against the textbook eager torch loop, on the same Hessians.

Cases: one 4096 x 4096 weight (int4, group 128) and a batch of 32 experts of 1536 x 2048 solved in one vmapped call
(the torch loop runs them one after another). Reports wall times (compile excluded, reported apart), the speed
ratio, and the share of identical codes. With the symmetric grid, the most negative weight of every group sits on
an exact rounding tie (-7.5 grid steps), so the two float32 programs may round it differently and the row then
drifts; the benchmark therefore also reports, for every row where codes differ, whether the first difference is
such a tie, and the agreement with an asymmetric grid, where exact ties are rare.
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks import common

DOC = __doc__.splitlines()[0]


def _problem(rng, rows, cols, tokens):
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
    mix = rng.standard_normal((cols, cols)).astype(np.float32) / np.sqrt(cols) + np.eye(cols, dtype=np.float32)
    scale = np.exp(rng.uniform(-1.5, 1.5, cols)).astype(np.float32)
    x = (rng.standard_normal((tokens, cols)).astype(np.float32) @ mix) * scale
    return w, x


def tie_analysis(codes_anchor, codes_jgptq, ratios_anchor, tol=1e-3):
    """Rows where the codes differ, and how many of those first differ where the anchor rounded an exact tie.

    Until the first difference both programs have made the same decisions, so their weights agree to float32
    rounding; if the anchor's ``w / scale`` there is within ``tol`` of a half-integer, the difference is a tie
    broken by the last bit, not a difference in the algorithm.
    """
    diff = codes_anchor != codes_jgptq
    rows = np.nonzero(diff.any(axis=1))[0]
    first = np.argmax(diff[rows], axis=1)
    x = ratios_anchor[rows, first]
    at_tie = np.abs(np.abs(x - np.floor(x)) - 0.5) < tol
    return {"rows_with_differences": int(rows.size), "first_difference_at_a_tie": int(np.sum(at_tie)),
            "rows": int(codes_anchor.shape[0])}


def run_case(name, rows, cols, experts, tokens, bits, group, sym, repeat, rng):
    import jax
    import jax.numpy as jnp
    import torch

    from benchmarks.anchors.torch_gptq import gptq_textbook
    from jgptq import QuantConfig, gptq
    from jgptq import hessian as hs

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # float32 scales: the textbook loop keeps float32 scales too
    cfg = QuantConfig(bits=bits, group_size=group, sym=sym, block_size=128, scale_dtype="float32")
    ws, hs_list = [], []
    for _ in range(experts):
        w, x = _problem(rng, rows, cols, tokens)
        ws.append(w)
        hs_list.append(np.asarray(hs.finalize(hs.from_activations(x))))
    w_j = jnp.asarray(np.stack(ws))
    h_j = jnp.asarray(np.stack(hs_list))

    if experts == 1:
        fn = lambda: gptq.solve(w_j[0], h_j[0], cfg, check=False)  # noqa: E731
    else:
        fn = lambda: gptq.solve_experts(w_j, h_j, cfg, check=False)  # noqa: E731
    t0 = time.perf_counter()
    res = jax.block_until_ready(fn())
    compile_s = time.perf_counter() - t0
    jg = common.time_calls(fn, jax.block_until_ready, warmup=0, repeat=repeat)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w_t = [torch.from_numpy(w).to(dev) for w in ws]
    h_t = [torch.from_numpy(h).to(dev) for h in hs_list]

    def anchor():
        return [gptq_textbook(w_t[e], h_t[e], bits, group, sym, 128) for e in range(experts)]

    def sync(out):
        if dev == "cuda":
            torch.cuda.synchronize()
        return out

    sync(gptq_textbook(w_t[0], h_t[0], bits, group, sym, 128))  # warm-up: kernels, cuBLAS handles
    t0 = time.perf_counter()
    anchor_out = sync(anchor())
    anchor_s = time.perf_counter() - t0

    codes_j = np.asarray(res.codes).reshape(experts, rows, cols)
    codes_t = np.stack([c.cpu().numpy() for _, c in anchor_out])
    agree = float(np.mean(codes_j == codes_t))
    # tie analysis on a few experts, re-running the anchor with the rounded ratios recorded
    n_an = min(experts, 4)
    recorded = [gptq_textbook(w_t[e], h_t[e], bits, group, sym, 128, record_ratios=True) for e in range(n_an)]
    ties = tie_analysis(np.concatenate([r[1].cpu().numpy() for r in recorded]),
                        codes_j[:n_an].reshape(-1, cols),
                        np.concatenate([r[2].cpu().numpy() for r in recorded]))
    ties["experts_analysed"] = n_an
    return {
        "case": name, "experts": experts, "rows": rows, "cols": cols, "bits": bits, "group_size": group,
        "sym": sym, "calibration_tokens": tokens,
        "jgptq_s": jg["median_s"], "jgptq_min_s": jg["min_s"], "jgptq_compile_s": compile_s,
        "torch_textbook_s": anchor_s, "speedup": anchor_s / jg["median_s"],
        "code_agreement": agree, "tie_analysis": ties,
    }


def main(argv=None):
    args = common.parser("solver", DOC).parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    rng = np.random.default_rng(0)
    if args.small:
        cases = [("single", 256, 256, 1, 512), ("experts", 64, 256, 4, 512)]
        repeat = 2
    else:
        cases = [("single_4096x4096", 4096, 4096, 1, 8192), ("experts_32x1536x2048", 1536, 2048, 32, 4096)]
        repeat = 3
    results = []
    for name, rows, cols, experts, tokens in cases:
        for sym in (True, False):
            r = run_case(name, rows, cols, experts, tokens, 4, 128, sym, repeat, rng)
            print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()})
            results.append(r)
    common.write(args.out, {"benchmark": "solver", "description": __doc__, "results": results})
    return 0
