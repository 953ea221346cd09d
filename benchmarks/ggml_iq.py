"""IQ1/IQ2/IQ3 encoders: jgptq's jitted JAX encoders on the accelerator against llama.cpp's C quantizer on all cores.

Weight: 4096 x 14336 float32 (one expert projection; N(0, 0.02) plus rare outliers) with a positive per-column
importance vector (the GPTQ path: every format is encoded with importance). Per format, in one process:
- jgptq encodes the whole weight: the first call (compile + run) and the median of repeated runs are timed;
- llama.cpp's ``ggml_quantize_chunk`` encodes the first ``llama_rows`` rows on ``os.cpu_count()`` threads (rows are
  independent, so its time is linear in rows; its throughput is what is compared), after an untimed one-row call
  that builds its search tables;
- throughputs in weights per second, their ratio (jgptq over llama.cpp), and the share of byte-identical blocks
  between the two on the rows both encoded;
- the latency of one GPTQ-sized call: encoding a (4096, 256) column group.
A format that fails is recorded with its error; formats are skipped (and recorded as such) when the time budget
would be exceeded. llama.cpp's library is found through LLAMA_CPP_LIB_PATH or the llama-cpp-python package.
"""

from __future__ import annotations

import os
import time
import traceback

from benchmarks import common

DOC = __doc__.splitlines()[0]
ORDER = ["iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"]


def _data(rows: int, cols: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)).astype(np.float32)
    hits = rng.random((rows, cols)) < 1e-4
    x[hits] *= np.float32(20.0)
    importance = np.exp(rng.standard_normal(cols)).astype(np.float32)
    return x, importance


def _one_format(name, x, imp, args, llama_cpp, have_llama):
    import jax
    import numpy as np

    from jgptq.ggml import registry

    fmt = registry.get_format(name)
    rows, cols = x.shape
    n_weights = rows * cols
    res = {"type_size": fmt.type_size, "bits_per_weight": fmt.bits_per_weight}
    xj, ij = jax.device_put(x), jax.device_put(imp)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fmt.encode(xj, ij))
    res["jgptq_first_call_s"] = time.perf_counter() - t0
    timing = common.time_calls(lambda: fmt.encode(xj, ij), jax.block_until_ready, warmup=0, repeat=args.repeat)
    res["jgptq_s"] = timing["median_s"]
    res["jgptq_weights_per_s"] = n_weights / timing["median_s"]
    payload = np.asarray(out)

    group = xj[:, :256]
    t0 = time.perf_counter()
    jax.block_until_ready(fmt.encode(group, ij[:256]))
    res["group_first_call_s"] = time.perf_counter() - t0
    g = common.time_calls(lambda: fmt.encode(group, ij[:256]), jax.block_until_ready, warmup=0,
                          repeat=max(3, args.repeat))
    res["group_latency_s"] = g["median_s"]
    res["group_shape"] = [rows, 256]

    if have_llama:
        lr = min(args.llama_rows, rows)
        threads = os.cpu_count() or 1
        llama_cpp.quantize(x[:1], fmt.type_id, imp)  # builds llama.cpp's search tables once, untimed
        t0 = time.perf_counter()
        ref = llama_cpp.quantize(x[:lr], fmt.type_id, imp, threads=threads)
        t_c = time.perf_counter() - t0
        res.update({"llama_rows": lr, "llama_threads": threads, "llama_s": t_c,
                    "llama_weights_per_s": lr * cols / t_c})
        res["speed_ratio_jgptq_over_llama"] = res["jgptq_weights_per_s"] / res["llama_weights_per_s"]
        same = np.all(payload[:lr].reshape(-1, fmt.type_size) == ref.reshape(-1, fmt.type_size), axis=1)
        res["blocks_compared"] = int(same.size)
        res["identical_blocks"] = int(same.sum())
        res["identical_share"] = float(same.mean())
    return res


def main(argv=None):
    p = common.parser("ggml_iq", DOC)
    p.add_argument("--rows", type=int, default=None, help="weight rows (default 4096; --small: 64)")
    p.add_argument("--cols", type=int, default=None, help="weight columns (default 14336; --small: 1024)")
    p.add_argument("--llama-rows", type=int, default=None, help="rows llama.cpp encodes (default 1024; --small 64)")
    p.add_argument("--formats", default=",".join(ORDER), help="comma-separated format names")
    p.add_argument("--repeat", type=int, default=None, help="timed jgptq runs per format (default 3)")
    p.add_argument("--budget", type=float, default=270.0, help="seconds; formats that would overrun are skipped")
    args = p.parse_args(argv)
    small = args.small
    args.rows = args.rows or (64 if small else 4096)
    args.cols = args.cols or (1024 if small else 14336)
    args.llama_rows = args.llama_rows or (64 if small else 1024)
    args.repeat = args.repeat or (1 if small else 3)
    start = time.perf_counter()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jgptq.ggml.iq1  # noqa: F401  (registers the IQ formats)
    import jgptq.ggml.iq2  # noqa: F401
    import jgptq.ggml.iq3  # noqa: F401
    from benchmarks.anchors import llama_cpp

    have_llama = llama_cpp.available()
    x, imp = _data(args.rows, args.cols)
    result = {"benchmark": "ggml_iq", "description": __doc__, "rows": args.rows, "cols": args.cols,
              "llama_cpp": llama_cpp.lib_dir() if have_llama else "unavailable", "formats": {}}
    durations = []
    for name in [f.strip().lower() for f in args.formats.split(",") if f.strip()]:
        elapsed = time.perf_counter() - start
        expected = 1.3 * max(durations) if durations else 0.0
        if elapsed + expected > args.budget or args.budget <= 0:
            result["formats"][name] = {"skipped": f"time budget: {elapsed:.0f}s used of {args.budget:.0f}s"}
            continue
        t0 = time.perf_counter()
        try:
            result["formats"][name] = _one_format(name, x, imp, args, llama_cpp, have_llama)
        except Exception as exc:  # recorded, the other formats still run
            result["formats"][name] = {"error": f"{type(exc).__name__}: {exc}"[:500],
                                       "traceback": traceback.format_exc()[-2000:]}
        durations.append(time.perf_counter() - t0)
        print(name, {k: v for k, v in result["formats"][name].items() if k != "traceback"}, flush=True)
    result["total_s"] = time.perf_counter() - start
    common.write(args.out, result)
    return 0
