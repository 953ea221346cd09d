"""Where the GPTQ solve spends its time: its stages timed one by one on the same problems as ``solver_kernel``.

Per case (one 4096 x 4096 weight; the gate/up and down expert buckets of a Qwen3-30B-A3B-shaped MoE layer), each
stage jitted and vmapped over the experts as the solver runs it, timed warm (median of several calls):

- ``cholesky``: ``jnp.linalg.cholesky`` of the damped Hessians;
- ``triangular_inverse``: ``solve_triangular(L, I)``;
- ``hessian_factor``: the solver's whole factor stage (:func:`jgptq.damping.hessian_factor`: one Cholesky inside
  the damping ladder, plus the inverses of the diagonal blocks);
- ``solve``: the whole solve (:func:`jgptq.gptq.solve_experts`), so ``solve - hessian_factor`` is the column loop
  and the block updates.

The factor stage used to be the inverse Hessian's factor (Cholesky, triangular inverse, a product, a second
Cholesky): on the H200 it took 140 ms of the gate/up bucket's 279 ms and 9.9 ms of the 4096 x 4096 solve's 20.9 ms,
with the triangular inverse alone at 44 ms and 3.9 ms (``results/solver_profile_h200.json`` before the change:
``raw/solver_profile_h200_inverse.json``).

No anchor runs here: this is a profile, not a claim. Writes ``$OUT/solver_profile_h200.json`` when ``OUT`` is set,
else ``benchmarks/results/solver_profile.json``.
"""

from __future__ import annotations

import os

from benchmarks import common
from benchmarks.solver_kernel import make_problem

DOC = __doc__.splitlines()[0]
CASES = (("single_4096x4096", 1, 4096, 4096, 8192),
         ("moe_gate_up_128x1536x2048", 128, 1536, 2048, 4096),
         ("moe_down_128x2048x768", 128, 2048, 768, 4096))
SMALL = (("small_2x64x256", 2, 64, 256, 512),)


def _stages(w, h, cfg, repeat):
    import jax
    import jax.numpy as jnp

    from jgptq import damping, gptq

    def damped(h):
        d = jnp.diagonal(h)
        return h + jnp.diag(cfg.damp * jnp.mean(d) + 0.0 * d)

    def chol(h):
        with jax.default_matmul_precision("highest"):
            return jnp.linalg.cholesky(damped(h))

    def tri_inv(lower):
        with jax.default_matmul_precision("highest"):
            return jax.scipy.linalg.solve_triangular(lower, jnp.eye(lower.shape[-1], dtype=lower.dtype), lower=True)

    def factor(h):
        upper = damping.hessian_factor(h, cfg.damp).upper
        return upper, damping.diagonal_block_inverses(upper, cfg.block_size)

    chol_j, tri_j, fac_j = (jax.jit(jax.vmap(f)) for f in (chol, tri_inv, factor))
    lower = jax.block_until_ready(chol_j(h))
    out = {}
    for name, fn in (("cholesky", lambda: chol_j(h)), ("triangular_inverse", lambda: tri_j(lower)),
                     ("hessian_factor", lambda: fac_j(h)),
                     ("solve", lambda: gptq.solve_experts(w, h, cfg, check=False))):
        out[name] = common.time_calls(fn, jax.block_until_ready, warmup=1, repeat=repeat)
    return out


def _case(text: str) -> tuple:
    name, *sizes = text.split(",")
    if len(sizes) != 4:
        raise SystemExit(f"--case {text!r}: expected NAME,EXPERTS,ROWS,COLS,TOKENS")
    return (name, *(int(v) for v in sizes))


def main(argv=None):
    p = common.parser("solver_profile", DOC)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--case", action="append", default=None, metavar="NAME,EXPERTS,ROWS,COLS,TOKENS",
                   help="profile this problem instead of the built-in cases (repeatable), e.g. "
                        "ds_gate_up_37x2048x7168,37,2048,7168,8192 for a DeepSeek-V3 expert chunk")
    args = p.parse_args(argv)
    import jax

    from jgptq.config import QuantConfig

    cfg = QuantConfig(bits=4, group_size=128)
    results = []
    cases = [_case(c) for c in args.case] if args.case else (SMALL if args.small else CASES)
    for i, (name, experts, rows, cols, tokens) in enumerate(cases):
        w, h = make_problem(jax.random.PRNGKey(i), experts, rows, cols, tokens)
        stages = _stages(w, h, cfg, args.repeat)
        results.append({"case": name, "experts": experts, "rows": rows, "cols": cols, "stages": stages})
        print(name, {k: round(v["median_s"], 5) for k, v in stages.items()}, flush=True)
        del w, h
    on_gpu = jax.default_backend() == "gpu"
    out = os.path.join(os.environ["OUT"], "solver_profile_h200.json") if os.environ.get("OUT") else args.out
    common.write(out, {"benchmark": "solver_profile", "description": __doc__, "on_gpu": on_gpu,
                                       "results": results, "machine": common.machine()})
    return 0
