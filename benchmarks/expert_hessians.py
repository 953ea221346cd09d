"""Routed-expert Hessian accumulation: one call per expert (the former capture path) vs grouped calls.

One calibration forward of an MoE layer hands the capture its routed rows sorted by expert. The former path added
each expert's rows with two JAX calls (``hessian.accumulate_at`` and ``hessian.accumulate_squares``) per expert
and projection; the grouped path (the capture's) scatters the rows of a group of experts into one padded (G, P, C)
stack and adds it with one call per statistic of the capture's chain (:func:`jgptq.statistics.calibration`: Hessian
sums and token counts, sums of squares) per group. Both run here on
the same rows (a skewed routing: expert loads drawn from a Dirichlet); reported are the seconds per forward of
each, their ratio, and the largest relative difference of the resulting Hessians (float32 summation order only).
"""

from __future__ import annotations

import numpy as np

from benchmarks import common

FULL = dict(experts=128, cols=512, tokens=4096, top_k=8, input_dtype="bfloat16", repeat=5)
SMALL = dict(experts=16, cols=64, tokens=256, top_k=2, input_dtype="float32", repeat=2)


def main(argv=None):
    p = common.parser("expert_hessians", __doc__)
    args = p.parse_args(argv)
    s = SMALL if args.small else FULL

    import jax
    import jax.numpy as jnp
    import torch

    from jgptq_torch.pipeline import capture, routed_groups
    from jgptq import hessian, statistics

    rng = np.random.default_rng(0)
    e, c, rows = s["experts"], s["cols"], s["tokens"] * s["top_k"]
    load = rng.dirichlet(np.full(e, 2.0))
    counts = np.bincount(rng.choice(e, size=rows, p=load), minlength=e)
    x = torch.from_numpy(rng.standard_normal((rows, c)).astype(np.float32))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])

    def per_expert():
        state, sums = hessian.init_stacked(e, c), jnp.zeros((e, c), jnp.float32)
        for i in range(e):
            if counts[i] == 0:
                continue
            piece = x[starts[i]:starts[i] + counts[i]]
            m = piece.shape[0]
            padded = torch.nn.functional.pad(piece, (0, 0, 0, routed_groups.padded_rows(m) - m))
            mask = torch.arange(padded.shape[0]) < m
            xj, mj = jnp.asarray(padded.numpy()), jnp.asarray(mask.numpy())
            state = hessian.accumulate_at(state, i, xj, mj, input_dtype=s["input_dtype"], check_finite=False)
            sums = hessian.accumulate_squares(sums, i, xj, mj)
        return state, sums

    collector = capture.Collector({}, {}, statistics.calibration(s["input_dtype"]))

    def grouped():
        collector.release()
        collector._add_grouped("k", x, counts.tolist(), None, e, "bench")
        return collector.states_of["hessian"]["k"], collector.states_of["imatrix"]["k"].sums

    sync = jax.block_until_ready
    old = common.time_calls(per_expert, sync, warmup=1, repeat=s["repeat"])
    new = common.time_calls(grouped, sync, warmup=1, repeat=s["repeat"])
    (h_old, _), (h_new, _) = per_expert(), grouped()
    a, b = np.asarray(h_old.hessian_sum), np.asarray(h_new.hessian_sum)
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    same_counts = h_old.token_count.tolist() == h_new.token_count.tolist()
    result = {"benchmark": "expert_hessians", "description": __doc__, "small": args.small, "shape": s,
              "rows_per_expert": {"min": int(counts.min()), "max": int(counts.max()), "mean": float(counts.mean())},
              "per_expert_s": old["median_s"], "grouped_s": new["median_s"],
              "speedup": old["median_s"] / new["median_s"], "max_relative_hessian_difference": rel,
              "same_token_counts": same_counts, "device": jax.devices()[0].platform}
    print(f"per expert {old['median_s']:.3f} s  grouped {new['median_s']:.3f} s  x{result['speedup']:.1f}  "
          f"max rel diff {rel:.2e}  counts equal {same_counts}")
    common.write(args.out, result)


if __name__ == "__main__":
    main()
