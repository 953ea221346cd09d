"""Compile time of the expert solve under XLA flag settings, and what each setting does to run time and bytes.

The first decoder layer of a whole-model run spends most of its time compiling the solve programs (one per
shape bucket). On GPU much of that is XLA's GEMM autotuning. Each setting runs in a fresh child process (flags
are read once, at backend start): it compiles the vmapped expert solve for the given shapes, times the compile
and three warm runs, and hashes the result bytes, so a faster setting that changes the numerics shows.

Shapes (default: those of a Qwen3-30B-A3B layer, int4 g128): experts' gate/up (E, 1536, 2048), experts' down
(E, 2048, 768), attention q (1, 4096, 2048).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

from benchmarks import common

SETTINGS = {
    "default": "",
    "autotune_0": "--xla_gpu_autotune_level=0",
    "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    "autotune_0_no_triton_gemm": "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false",
}


def _shapes(small: bool, experts: int) -> list:
    if small:
        return [(experts, 96, 128), (experts, 128, 64), (1, 256, 128)]
    return [(experts, 1536, 2048), (experts, 2048, 768), (1, 4096, 2048)]


def child(shapes: list) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jgptq import gptq
    from jgptq.config import QuantConfig

    cfg = QuantConfig(bits=4, group_size=128)
    out = []
    for e, r, c in shapes:
        key = jax.random.PRNGKey(e * 7 + r + c)
        k1, k2 = jax.random.split(key)
        w = jax.random.normal(k1, (e, r, c), jnp.float32) * 0.02
        x = jax.random.normal(k2, (e, 4 * c // 4, c), jnp.float32)
        h = jnp.einsum("eti,etj->eij", x, x, precision="highest") * (2.0 / x.shape[1])
        del x
        if e == 1:
            fn, args = gptq._solve_jit, (w[0], h[0], None, cfg, None)
        else:
            fn, args = gptq._solve_experts_jit, (w, h, None, cfg, False)
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        call_args = args[:3]
        runs = []
        res = None
        for _ in range(3):
            t0 = time.perf_counter()
            res = compiled(*call_args)
            jax.block_until_ready(res)
            runs.append(time.perf_counter() - t0)
        digest = hashlib.sha256()
        for a in (res.codes, res.scales, res.weight):
            digest.update(np.asarray(a).tobytes())
        out.append({"shape": [e, r, c], "compile_s": compile_s, "run_s": sorted(runs)[1],
                    "sha256": digest.hexdigest()[:16]})
    return {"shapes": out}


def main(argv=None):
    p = common.parser("compile_time", __doc__)
    p.add_argument("--experts", type=int, default=128, help="experts per stack (default 128; --small 4)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated settings: " + ", ".join(SETTINGS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    experts = 4 if args.small and args.experts == 128 else args.experts
    shapes = _shapes(args.small, experts)
    if args.child:
        print(json.dumps(child(shapes)))
        return
    results = {}
    for name in args.settings.split(","):
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + SETTINGS[name]).strip()
        cmd = [sys.executable, "-m", "benchmarks", "compile_time", "--child", name, "--experts", str(experts)]
        cmd += ["--small"] if args.small else []
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            results[name] = {"error": proc.stderr[-2000:]}
        else:
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        results[name]["process_s"] = time.perf_counter() - t0
        results[name]["xla_flags"] = SETTINGS[name]
        print(name, json.dumps(results[name]), flush=True)
    base = results.get("default", {}).get("shapes")
    for name, r in results.items():
        if base and "shapes" in r:
            r["same_bytes_as_default"] = [a["sha256"] == b["sha256"] for a, b in zip(r["shapes"], base)]
            r["compile_total_s"] = sum(s["compile_s"] for s in r["shapes"])
            r["run_total_s"] = sum(s["run_s"] for s in r["shapes"])
    doc = {"benchmark": "compile_time", "description": __doc__, "small": args.small, "settings": results,
           "machine": common.machine()}
    common.write(args.out, doc)


if __name__ == "__main__":
    main()
