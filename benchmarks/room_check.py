"""Room check against the allocator: predicted per-device peak of a GPTQ solve vs measured ``peak_bytes_in_use``.

For each shape (default: a wide 65536 x 256 expert, a long 1024 x 16384 one, a typical 768 x 2048 one) a fresh
child process (the allocator's peak counter only grows) compiles the per-device program of
:mod:`jgptq.parallel` for E experts at lax.map batch 1 and 2, reads the predicted peak from
``memory_analysis()``, then runs each program and reads ``peak_bytes_in_use`` minus the bytes in use before the
inputs were placed (a run whose peak stays below an earlier one is marked ``measurement_masked``). Each child
runs twice: the first fills a persistent compilation cache and the measured second one loads its programs from
it, so compile-time allocations (XLA:GPU's autotuning buffers) do not mask the run's peak (``--no-warm``: one
child, compiling). The predicted peak is the engine's: the memory analysis plus its runtime slack on
accelerators (``analysis_peak`` is the analysis alone). It also checks whether batch 1 and batch 2 give the same
bytes on this device. A last child gives the typical shape (8 experts) a simulated limit with room for three
experts at batch 2 (CPU: 1): the plan must run in chunks, its measured peak must stay within that room, and its bytes
must equal an unchunked run (batch 8 on accelerators).

    python -m benchmarks.room_check --out room_check.json            # one GPU, about 1-2 minutes
    python -m benchmarks.room_check --out /tmp/rc.json --small       # CPU smoke test (no allocator figures)

Writes JSON: ``shapes`` (per shape: runs with predicted_peak, measured_peak, bound_holds, compile/run seconds,
the raw memory analysis; batch1_equals_batch2), ``chunked``, ``all_unmasked_bounds_hold``, ``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(65536, 256), (1024, 16384), (768, 2048)]
SMALL = [(512, 64), (32, 512), (48, 256)]


def _stats(dev) -> dict:
    st = dev.memory_stats() or {}
    return {k: int(st[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in st}


def _hessian(rng, c, np):
    """A symmetric, diagonally dominant (so positive definite) float32 Hessian, made on the host."""
    a = rng.standard_normal((c, c), dtype=np.float32) * np.float32(0.5 / c)
    a += a.T
    a[np.diag_indices(c)] += np.float32(1.0) + rng.uniform(0, 1, c).astype(np.float32)
    return a


def _setup(rows: int, cols: int, experts: int):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import numpy as np

    from jgptq import QuantConfig
    from jgptq.parallel import engine, experts as pexp

    dev = jax.devices()[0]
    cfg = QuantConfig(bits=4, group_size=128 if cols % 128 == 0 else -1)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((experts, rows, cols), dtype=np.float32)
    h0 = _hessian(rng, cols, np)
    h = np.stack([h0 * np.float32(1 + 0.1 * e) for e in range(experts)])
    spec, _ = engine.make_spec(pexp._Solver(cfg), (w, h, None), (0, 0, None))
    info = {"rows": rows, "cols": cols, "experts": experts, "device": str(dev), "platform": dev.platform,
            "jax": jax.__version__, "config": repr(cfg)}
    return dev, cfg, w, h, spec, info


def _fields(res) -> dict:
    import numpy as np

    return {f: np.asarray(v) for f, v in res._asdict().items() if v is not None}


def child_peaks(rows: int, cols: int, experts: int) -> dict:
    """Predicted vs measured peak of the per-device program for all experts, at batch 1 then batch 2."""
    import jax

    from jgptq.parallel import engine, memory

    dev, cfg, w, h, spec, out = _setup(rows, cols, experts)
    base = _stats(dev)
    mesh = engine.expert_mesh([dev])
    runs, results, programs = {}, {}, {}
    for k in (1, 2):
        t = time.perf_counter()
        programs[k] = engine.compiled_program(spec, mesh, experts, k)
        ma = programs[k].memory_analysis()
        runs[k] = {"batch_size": k, "compile_s": round(time.perf_counter() - t, 3),
                   "predicted_peak": engine.program_peak(spec, mesh, experts, k),
                   "analysis_peak": memory.program_peak(programs[k]),
                   "analysis": {f: int(getattr(ma, f)) for f in dir(ma) if f.endswith("_in_bytes")}}
    out["bytes_in_use_before_inputs"] = base.get("bytes_in_use")
    out["peak_after_compiles"] = _stats(dev).get("peak_bytes_in_use")
    last_peak = out["peak_after_compiles"] or 0
    for k in (1, 2):
        plan_k = engine.Plan((dev,), experts, k, experts, 1, 0, {})
        placed = jax.block_until_ready(engine._place(spec, (w, h, None), plan_k, mesh, 0))
        t = time.perf_counter()
        res = jax.block_until_ready(programs[k](*placed))
        runs[k]["run_s"] = round(time.perf_counter() - t, 3)
        st = _stats(dev)
        if "peak_bytes_in_use" in st:
            measured = st["peak_bytes_in_use"] - base.get("bytes_in_use", 0)
            runs[k]["measured_peak"] = measured
            runs[k]["measurement_masked"] = st["peak_bytes_in_use"] <= last_peak   # an earlier peak was higher
            runs[k]["predicted_over_measured"] = round(runs[k]["predicted_peak"] / max(measured, 1), 4)
            runs[k]["bound_holds"] = runs[k]["predicted_peak"] >= measured
            runs[k]["analysis_bound_holds"] = runs[k]["analysis_peak"] >= measured
            last_peak = st["peak_bytes_in_use"]
        results[k] = _fields(res)
        del placed, res
    out["runs"] = [runs[1], runs[2]]
    out["batch1_equals_batch2"] = {f: results[1][f].tobytes() == results[2][f].tobytes() for f in results[1]}
    return out


def child_chunked(rows: int, cols: int, experts: int) -> dict:
    """A simulated limit with room for three experts at batch 2: the plan runs in chunks; measured peak vs limit."""
    import jgptq.parallel as jp
    from jgptq.parallel import engine, memory

    dev, cfg, w, h, spec, out = _setup(rows, cols, experts)
    mesh = engine.expert_mesh([dev])
    st = _stats(dev)
    in_use = st.get("bytes_in_use", memory.live_bytes([dev])[dev])
    kc = 1 if dev.platform == "cpu" else 2                   # CPU solves run at batch 1
    room = engine.program_peak(spec, mesh, 4, kc) - 1      # four experts at that batch just do not fit
    t = time.perf_counter()
    plan = jp.plan_solve(w, h, cfg, devices=[dev], memory_limit=in_use + room, gather_to="host")
    out["plan_s"] = round(time.perf_counter() - t, 3)
    out.update(room=room, chunks=plan.num_chunks, per_device=plan.per_device, batch_size=plan.batch_size,
               predicted_peak=plan.predicted_peak)
    before = _stats(dev)
    t = time.perf_counter()
    res = _fields(jp.solve_experts(w, h, cfg, devices=[dev], plan=plan, gather_to="host"))
    out["run_s"] = round(time.perf_counter() - t, 3)
    after = _stats(dev)
    if "peak_bytes_in_use" in after:
        out["measured_peak"] = after["peak_bytes_in_use"] - in_use
        out["measurement_masked"] = after["peak_bytes_in_use"] <= before["peak_bytes_in_use"]
        out["within_room"] = out["measured_peak"] <= room
    full = _fields(jp.solve_experts(w, h, cfg, devices=[dev], gather_to="host"))
    out["same_bytes_as_one_chunk"] = all(res[f].tobytes() == full[f].tobytes() for f in full)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="small shapes (CPU smoke test)")
    ap.add_argument("--timeout", type=int, default=100, help="seconds per shape")
    ap.add_argument("--no-warm", action="store_true",
                    help="measure in the first child (compile-time allocations then count in the peaks)")
    ap.add_argument("--child", nargs=2, type=int, metavar=("ROWS", "COLS"), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["peaks", "chunked"], default="peaks", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, ROOT)
        fn = child_peaks if args.mode == "peaks" else child_chunked
        res = fn(*args.child, args.experts)
        with open(args.child_out, "w") as f:
            json.dump(res, f)
        return 0
    shapes = SMALL if args.small else SHAPES
    jobs = [("peaks", r, c, args.experts) for r, c in shapes] + [("chunked", *shapes[-1], 8)]
    report = {"benchmark": "room_check", "shapes": [], "chunked": None, "programs_from_cache": not args.no_warm}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for mode, r, c, e in jobs:
            path = os.path.join(tmp, f"{mode}_{r}x{c}.json")
            cmd = [sys.executable, "-m", "benchmarks.room_check", "--out", args.out, "--child", str(r), str(c),
                   "--experts", str(e), "--mode", mode, "--child-out", path]
            try:
                # A first child fills a compilation cache; the measured one loads its programs from it, so that
                # no compile-time allocation (GEMM autotuning buffers) sits in the allocator's peak.
                env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, "cache"),
                           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                           JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
                if not args.no_warm:
                    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, env=env)
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, env=env)
                if proc.returncode == 0:
                    with open(path) as f:
                        item = json.load(f)
                else:
                    item = {"rows": r, "cols": c, "error": proc.stderr[-4000:]}
            except subprocess.TimeoutExpired:
                item = {"rows": r, "cols": c, "error": f"timed out after {args.timeout} s"}
            if mode == "peaks":
                report["shapes"].append(item)
            else:
                report["chunked"] = item
            print(mode, json.dumps(item)[:1500], flush=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    bounds = [run.get("bound_holds") for s in report["shapes"] for run in s.get("runs", [])
              if not run.get("measurement_masked", True)]
    report["all_unmasked_bounds_hold"] = all(bounds) if bounds else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0 if all("error" not in s for s in report["shapes"] + [report["chunked"]]) else 1


if __name__ == "__main__":
    sys.exit(main())
