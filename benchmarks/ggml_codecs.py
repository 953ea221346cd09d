"""GGML codecs: jgptq's jitted encoders/decoders on the accelerator against llama.cpp's C quantizer on all cores.

For a 4096 x 14336 float32 weight (``--small``: 64 x 1024; ``--rows``/``--cols`` override) and each of the 12
formats (Q4_0 ... Q6_K, IQ4_NL, IQ4_XS), without and with per-column importance:

- jgptq: compile time, then the median wall time of ``encode`` and of ``decode`` on the default JAX device
  (input already on the device, ``block_until_ready``), as values per second;
- llama.cpp: ``ggml_quantize_chunk`` over ``os.cpu_count()`` threads (rows split between threads) in the same
  process, and the ratio llama.cpp time / jgptq time;
- agreement: the share of blocks byte-identical between the device encode and llama.cpp, and the share of
  values bit-identical between the device decode of llama.cpp's bytes and ``dequantize_row_*``;
- with ``--cpu-check``, the share of blocks byte-identical between the device encode and jgptq's encode on the
  host CPU (the tested reference backend), which needs no llama.cpp.

Each (format, importance) case runs in its own try/except (a failure is recorded, the rest still run), and no
new case starts once ``--budget-s`` seconds have passed. jgptq.ggml needs the pure-python ``gguf`` package (block
geometry); llama.cpp is found through LLAMA_CPP_LIB_PATH or the llama-cpp-python package and is optional.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from benchmarks import common

DOC = __doc__.splitlines()[0]
ORDER = ["q4_k", "q6_k", "q8_0", "q4_0", "iq4_xs", "q5_k", "q3_k", "q2_k", "iq4_nl", "q4_1", "q5_0", "q5_1"]


def make_weight(rows: int, cols: int, seed: int = 0):
    """A weight-like float32 (rows, cols): Gaussian rows of varying scale, a few large outliers, and the
    per-column importance (float32 (cols,), exponential with some zeros), both deterministic."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    x *= (0.02 * np.exp(rng.uniform(-1.0, 1.0, (rows, 1)))).astype(np.float32)
    idx = rng.integers(0, x.size, max(1, x.size // 20000))
    x.reshape(-1)[idx] *= np.float32(25.0)
    imp = rng.exponential(1.0, cols).astype(np.float32)
    imp[rng.uniform(size=cols) < 0.02] = 0.0
    return x, imp


def _block_share(a, b, type_size):
    import numpy as np

    same = np.all(a.reshape(a.shape[0], -1, type_size) == b.reshape(b.shape[0], -1, type_size), axis=-1)
    return float(same.mean()), int(same.size - same.sum()), int(same.size)


def _value_share(a, b):
    import numpy as np

    nan_a, nan_b = np.isnan(a), np.isnan(b)
    same = (a.view(np.uint32) == b.view(np.uint32)) | (nan_a & nan_b)
    return float(same.mean())


def _timed(fn, sync, min_seconds):
    t0 = time.perf_counter()
    out = sync(fn())
    first = time.perf_counter() - t0
    stats = common.time_calls(fn, sync, warmup=0, repeat=1 if first > 2.0 else 3, min_seconds=min_seconds)
    return out, first, stats


def _first_differing(a, b, type_size):
    import numpy as np

    rows, blk = np.nonzero(~np.all(a.reshape(a.shape[0], -1, type_size) == b.reshape(b.shape[0], -1, type_size),
                                   axis=-1))
    return [[int(r), int(c)] for r, c in zip(rows[:8], blk[:8])]


def _cpu_encode(fmt, x_host, imp):
    import jax

    cpu = jax.devices("cpu")[0]
    x = jax.device_put(x_host, cpu)
    out = fmt.encode(x) if imp is None else fmt.encode(x, jax.device_put(imp, cpu))
    return jax.device_get(out)


def run_case(fmt, x_host, x_dev, imp, llama, threads, min_seconds, cpu_check=False):
    """One (format, importance) case -> dict of timings and agreement figures."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    values = x_host.size
    res = {}
    imp_dev = None if imp is None else jnp.asarray(imp)
    call = (lambda: fmt.encode(x_dev)) if imp is None else (lambda: fmt.encode(x_dev, imp_dev))
    payload_dev, first, enc = _timed(call, jax.block_until_ready, min_seconds)
    res["jax_encode_first_call_s"] = first  # compile + one run
    res["jax_encode_s"] = enc["median_s"]
    res["jax_encode_values_per_s"] = values / enc["median_s"]
    back_dev, first, dec = _timed(lambda: fmt.decode(payload_dev), jax.block_until_ready, min_seconds)
    res["jax_decode_first_call_s"] = first
    res["jax_decode_s"] = dec["median_s"]
    res["jax_decode_values_per_s"] = values / dec["median_s"]
    payload = np.asarray(jax.device_get(payload_dev))
    back = np.asarray(jax.device_get(back_dev))
    res["jax_roundtrip_rmse"] = float(np.sqrt(np.mean((back.astype(np.float64) - x_host) ** 2)))
    if cpu_check:
        t0 = time.perf_counter()
        on_cpu = np.asarray(_cpu_encode(fmt, x_host, imp))
        res["cpu_encode_first_call_s"] = time.perf_counter() - t0
        share, differing, _ = _block_share(payload, on_cpu, fmt.type_size)
        res.update(identical_blocks_vs_cpu_share=share, differing_blocks_vs_cpu=differing)
        if differing:
            res["first_differing_blocks_vs_cpu"] = _first_differing(payload, on_cpu, fmt.type_size)
    if llama is None:
        return res
    t0 = time.perf_counter()
    want = llama.quantize(x_host, fmt.type_id, imp, threads=threads)
    res["llama_encode_s"] = time.perf_counter() - t0
    res["llama_encode_values_per_s"] = values / res["llama_encode_s"]
    res["speedup_encode_vs_llama"] = res["llama_encode_s"] / res["jax_encode_s"]
    share, differing, total = _block_share(payload, want, fmt.type_size)
    res.update(identical_blocks_share=share, differing_blocks=differing, total_blocks=total)
    if differing:
        res["first_differing_blocks"] = _first_differing(payload, want, fmt.type_size)
    ref_back = llama.dequantize(want, fmt.type_id)
    dev_back = np.asarray(jax.device_get(fmt.decode(jnp.asarray(want))))
    res["decode_identical_values_share"] = _value_share(dev_back, ref_back)
    return res


def main(argv=None):
    p = common.parser("ggml_codecs", DOC)
    p.add_argument("--budget-s", type=float, default=240.0, help="start no new case after this many seconds")
    p.add_argument("--formats", default=",".join(ORDER), help="comma-separated formats, in run order")
    p.add_argument("--min-seconds", type=float, default=0.5, help="minimum timing window per measurement")
    p.add_argument("--rows", type=int, default=None, help="weight rows (default 4096, --small 64)")
    p.add_argument("--cols", type=int, default=None, help="weight columns, a multiple of 256 (default 14336, "
                   "--small 1024)")
    p.add_argument("--cpu-check", action="store_true", help="also compare the device bytes with jgptq's encode on "
                   "the host CPU")
    args = p.parse_args(argv)
    return run(args)


def run(args):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    start = time.perf_counter()
    rows, cols = (64, 1024) if args.small else (4096, 14336)
    rows, cols = args.rows or rows, args.cols or cols
    result = {"benchmark": "ggml_codecs", "shape": [rows, cols], "small": bool(args.small),
              "budget_s": args.budget_s, "formats": {}}
    try:
        import jax
        import jax.numpy as jnp

        import jgptq.ggml as gg
    except Exception as exc:  # e.g. the gguf package missing on this machine
        result["error"] = f"cannot import jgptq.ggml: {exc!r} (it needs the pure-python gguf package)"
        common.write(args.out, result)
        return 1
    result["jax_backend"] = jax.default_backend()
    llama = None
    try:
        from benchmarks.anchors import llama_cpp

        if llama_cpp.available():
            llama = llama_cpp
            result["llama_cpp"] = {"lib_dir": llama_cpp.lib_dir(), "threads": os.cpu_count()}
            try:
                import ctypes

                lib = llama_cpp.load()
                for fn in ("ggml_version", "ggml_commit"):
                    f = getattr(lib, fn)
                    f.restype = ctypes.c_char_p
                    result["llama_cpp"][fn] = f().decode()
            except Exception:  # noqa: BLE001 - description only
                pass
        else:
            result["llama_cpp"] = "unavailable (set LLAMA_CPP_LIB_PATH to the folder of libggml-base.so)"
    except Exception as exc:  # noqa: BLE001
        result["llama_cpp"] = f"unavailable: {exc!r}"

    x, imp = make_weight(rows, cols)
    x_dev = jax.device_put(jnp.asarray(x))
    result["setup_s"] = time.perf_counter() - start
    for name in [s.strip() for s in args.formats.split(",") if s.strip()]:
        entry = result["formats"].setdefault(name, {})
        for label, importance in (("none", None), ("importance", imp)):
            if time.perf_counter() - start > args.budget_s:
                entry[label] = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
                continue
            try:
                entry[label] = run_case(gg.get_format(name), x, x_dev, importance, llama, os.cpu_count(),
                                        args.min_seconds, cpu_check=args.cpu_check)
            except Exception as exc:  # noqa: BLE001 - recorded, the other cases still run
                entry[label] = {"error": repr(exc), "traceback": traceback.format_exc(limit=6)}
            print(f"{name:7s} {label:10s} {_line(entry[label])}", flush=True)
    result["summary"] = _summary(result["formats"])
    result["elapsed_s"] = time.perf_counter() - start
    common.write(args.out, result)
    return 0


def _line(r):
    if "error" in r or "skipped" in r:
        return r.get("error") or r.get("skipped")
    s = (f"encode {r['jax_encode_values_per_s'] / 1e6:9.1f} Mval/s"
         f"  decode {r['jax_decode_values_per_s'] / 1e6:9.1f} Mval/s")
    if "llama_encode_s" in r:
        s += (f"  llama.cpp {r['llama_encode_values_per_s'] / 1e6:8.1f} Mval/s  x{r['speedup_encode_vs_llama']:.2f}"
              f"  identical blocks {r['identical_blocks_share']:.4%}")
    if "identical_blocks_vs_cpu_share" in r:
        s += f"  vs CPU {r['identical_blocks_vs_cpu_share']:.4%}"
    return s


def _summary(formats):
    out = {}
    for name, entry in formats.items():
        for label, r in entry.items():
            keys = ("identical_blocks_share", "speedup_encode_vs_llama", "identical_blocks_vs_cpu_share")
            if any(k in r for k in keys):
                out[f"{name}/{label}"] = {k: r[k] for k in keys if k in r}
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
