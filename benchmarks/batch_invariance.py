"""Does a solve's result depend on how the experts were batched, chunked or compiled? And what does batching buy?

:mod:`jgptq.parallel` runs each device's ``m`` experts with ``lax.map`` over vmaps of width ``k``, in chunks when
memory is short; on more devices each device gets fewer experts, so ``m``, ``k`` and the chunking change with the
device count. Bytes identical on any mesh need each expert's result to be independent of them. On CPU it is (the
test suite checks 1/2/4/8 devices); on a GPU the batched linear algebra (cuSOLVER's batched Cholesky, batched
GEMMs whose kernels are autotuned per shape) may not be. Here, on one device, for one expert shape, each child
process (a fresh compile, no compilation cache) solves the same E experts under several plans ``m:k`` (m experts
per device per chunk, vmap width k; E/m chunks) and records a digest of every expert's result; the parent
compares every expert's digest with the reference plan's (the first of the first child):

- ``default``: every plan, default XLA flags;
- ``recompile``: the reference and one other plan again in a fresh process (is compilation itself deterministic?);
- ``autotune0``: ``--xla_gpu_autotune_level=0`` (no timing-based kernel choice), GPU only;
- ``timing``: 128 experts at several widths: the solve time that wider vmaps buy (inputs and results stay on
  the device; the committed H200 result predates this and its run times include moving ~3 GB each way).

    python -m benchmarks batch_invariance --out benchmarks/results/batch_invariance_h200.json   # GPU, ~3 min
    python -m benchmarks batch_invariance --small --out /tmp/bi.json                           # CPU smoke run

Writes JSON: per child its plans (compile_s, run_s, identical: experts whose bytes equal the reference's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(rows: int, cols: int, experts: int, plans: list[tuple[int, int]]) -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import numpy as np

    from benchmarks.room_check import _fields, _hessian
    from jgptq import QuantConfig
    from jgptq.parallel import engine, experts as pexp

    dev = jax.devices()[0]
    cfg = QuantConfig(bits=4, group_size=128 if cols % 128 == 0 else -1)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((experts, rows, cols), dtype=np.float32) * np.float32(0.02)
    h0 = _hessian(rng, cols, np)
    h = np.stack([h0 * np.float32(1 + 0.05 * e) for e in range(experts)])
    spec, _ = engine.make_spec(pexp._Solver(cfg), (w, h, None), (0, 0, None))
    mesh = engine.expert_mesh([dev])
    w, h = jax.device_put(w, dev), jax.device_put(h, dev)     # on the device: the timings are of the solve
    out = {"rows": rows, "cols": cols, "experts": experts, "device": str(dev), "platform": dev.platform,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "plans": []}
    for m, k in plans:
        t = time.perf_counter()
        program = engine.compiled_program(spec, mesh, m, k)
        compile_s = time.perf_counter() - t
        plan = engine.Plan((dev,), m, k, experts, -(-experts // m), 0, {})
        times, res = [], None
        for _ in range(3):
            t = time.perf_counter()
            res = jax.block_until_ready(engine.run(spec, (w, h, None), plan, gather_to=dev))
            times.append(time.perf_counter() - t)
        fields = _fields(res)
        digests = []
        for e in range(experts):
            hsh = hashlib.sha256()
            for f in sorted(fields):
                hsh.update(np.ascontiguousarray(fields[f][e]).tobytes())
            digests.append(hsh.hexdigest()[:16])
        out["plans"].append({"per_device": m, "batch": k, "chunks": plan.num_chunks,
                             "compile_s": round(compile_s, 3), "run_s": round(sorted(times)[1], 4),
                             "digests": digests})
        print(f"  {rows}x{cols} m={m} k={k}: compile {compile_s:.1f} s, run {sorted(times)[1]:.3f} s", flush=True)
    return out


def _plans(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.split(":")) for p in text.split(",")]


def main(argv=None) -> int:
    ap = common.parser("batch_invariance", __doc__.split("\n")[0])
    ap.add_argument("--timeout", type=int, default=300, help="seconds per child")
    ap.add_argument("--child", nargs=3, type=int, metavar=("ROWS", "COLS", "E"), help=argparse.SUPPRESS)
    ap.add_argument("--plans", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, ROOT)
        res = child(*args.child, _plans(args.plans))
        with open(args.child_out, "w") as f:
            json.dump(res, f)
        return 0
    if args.small:
        shape, e, big = (48, 256), 8, 16
        full, sub = "8:8,8:4,8:2,8:1,4:4,2:2", "8:8,8:2"
        timing = "16:16,16:4"
    else:
        shape, e, big = (768, 2048), 16, 128
        full, sub = "16:16,16:8,16:2,16:1,8:8,4:4,2:2", "16:16,16:2"
        timing = "128:128,128:32,128:16,128:8"
    jobs = [("default", shape, e, full, ""), ("recompile", shape, e, sub, "")]
    if not args.small:                                   # the flag means something on GPUs only
        jobs.append(("autotune0", shape, e, "16:16,16:2,16:1,2:2", "--xla_gpu_autotune_level=0"))
    jobs.append(("timing", shape, big, timing, ""))
    report = {"benchmark": "batch_invariance", "description": __doc__, "children": []}
    ref = None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, (r, c), n, plans, flags in jobs:
            path = os.path.join(tmp, f"{name}.json")
            env = dict(os.environ)
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            if flags:
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
            cmd = [sys.executable, "-m", "benchmarks", "batch_invariance", "--child", str(r), str(c), str(n),
                   "--plans", plans, "--child-out", path]
            print(name, flush=True)
            try:
                proc = subprocess.run(cmd, cwd=ROOT, text=True, timeout=args.timeout, env=env,
                                      stdout=sys.stdout, stderr=subprocess.PIPE)
                if proc.returncode != 0:
                    item = {"name": name, "error": proc.stderr[-3000:]}
                else:
                    with open(path) as f:
                        item = dict(json.load(f), name=name)
            except subprocess.TimeoutExpired:
                item = {"name": name, "error": f"timed out after {args.timeout} s"}
            for p in item.get("plans", []):
                digests = p.pop("digests")
                if ref is None or (name == "timing" and p is item["plans"][0]):
                    ref = digests                       # the timing child has its own experts: own reference
                p["identical"] = sum(a == b for a, b in zip(digests, ref))
                p["experts"] = len(digests)
            report["children"].append(item)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["all_identical"] = all(p["identical"] == p["experts"] for ch in report["children"]
                                  for p in ch.get("plans", []))
    common.write(args.out, report)
    return 0 if all("error" not in ch for ch in report["children"]) else 1


if __name__ == "__main__":
    sys.exit(main())
