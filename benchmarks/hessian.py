"""Hessian accumulation: jgptq's donated jitted X^T X against torch's GEMM paths, and the device's GEMM peak.

For d = 4096 features and 32K tokens per batch, each side accumulates into a float32 (d, d) sum in place:
- bf16 inputs: jgptq ``accumulate(input_dtype="bfloat16")`` vs torch ``H += torch.mm(x.T, x, out_dtype=float32)``
  and ``torch.addmm(H, x.T, x, out_dtype=float32)`` (the faster torch path is the anchor);
- float32 inputs: jgptq at precision HIGHEST vs torch ``H.addmm_(x.T, x)`` with TF32 off.
The GEMM peak is the best of a square bf16 8192^3 product in torch and in JAX, measured in the same run; the
efficiency of a path is its 2 * tokens * d^2 FLOP per second over that peak.
"""

from __future__ import annotations

import os
import time

from benchmarks import common

DOC = __doc__.splitlines()[0]


def _torch_time(fn, iters, cuda):
    import torch

    fn()
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _jax_loop(step, state, iters):
    import jax

    state = jax.block_until_ready(step(state))
    t0 = time.perf_counter()
    for _ in range(iters):
        state = step(state)
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) / iters, state


def main(argv=None):
    args = common.parser("hessian", DOC).parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    import torch

    from jgptq import hessian as hs

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    d, tokens, iters, peak_n = (256, 2048, 3, 1024) if args.small else (4096, 32768, 20, 8192)
    flop = 2.0 * tokens * d * d
    rng = np.random.default_rng(0)
    x32 = rng.standard_normal((tokens, d), dtype=np.float32)
    xbf = x32.astype(ml_dtypes.bfloat16)

    # GEMM peak (bf16 in, bf16 out), best of torch and JAX
    a_t = torch.randn(peak_n, peak_n, device=dev, dtype=torch.bfloat16)
    t_peak = _torch_time(lambda: a_t @ a_t, 10, cuda)
    a_j = jnp.asarray(np.asarray(a_t.float().cpu()).astype(ml_dtypes.bfloat16))
    mm = jax.jit(lambda a: a @ a)
    jax.block_until_ready(mm(a_j))
    t0 = time.perf_counter()
    for _ in range(10):
        out = mm(a_j)
    jax.block_until_ready(out)
    j_peak = (time.perf_counter() - t0) / 10
    peak = 2.0 * peak_n ** 3 / min(t_peak, j_peak)
    del a_t, a_j, out

    res = {"d": d, "tokens": tokens, "flop_per_batch": flop, "gemm_peak_tflops": peak / 1e12,
           "gemm_peak_torch_tflops": 2.0 * peak_n ** 3 / t_peak / 1e12,
           "gemm_peak_jax_tflops": 2.0 * peak_n ** 3 / j_peak / 1e12}

    # bf16 inputs
    xj = jnp.asarray(xbf)
    step = lambda s: hs.accumulate(s, xj, input_dtype="bfloat16", check_finite=False)  # noqa: E731
    t_j, st = _jax_loop(step, hs.init(d), iters)
    ref_bf = np.asarray(hs.finalize(st))
    del st
    xt = torch.from_numpy(x32).to(dev).to(torch.bfloat16)
    xtt = xt.t()
    h_t = torch.zeros(d, d, device=dev, dtype=torch.float32)
    anchors = {}
    try:
        anchors["mm_out_dtype_add"] = _torch_time(lambda: h_t.add_(torch.mm(xtt, xt, out_dtype=torch.float32)),
                                                  iters, cuda)
    except Exception as exc:  # out_dtype needs a recent torch (and a GPU for bf16 -> f32)
        res["mm_out_dtype_error"] = str(exc).splitlines()[0][:200]
    try:
        anchors["addmm_out_dtype"] = _torch_time(
            lambda: h_t.copy_(torch.addmm(h_t, xtt, xt, out_dtype=torch.float32)), iters, cuda)
    except Exception as exc:
        res["addmm_out_dtype_error"] = str(exc).splitlines()[0][:200]
    if anchors:
        best = min(anchors, key=anchors.get)
        res["bf16"] = {"jgptq_s": t_j, "torch_s_by_path": anchors, "torch_path": best, "torch_s": anchors[best],
                       "speed_ratio_jgptq_over_torch": anchors[best] / t_j,
                       "jgptq_tflops": flop / t_j / 1e12, "torch_tflops": flop / anchors[best] / 1e12,
                       "jgptq_fraction_of_gemm_peak": flop / t_j / peak}
    del xt, xtt, xj

    # float32 inputs, HIGHEST precision (no TF32)
    xj = jnp.asarray(x32)
    step = lambda s: hs.accumulate(s, xj, input_dtype="float32", check_finite=False)  # noqa: E731
    t_j32, st = _jax_loop(step, hs.init(d), iters)
    h32 = np.asarray(hs.finalize(st))
    del st
    xt = torch.from_numpy(x32).to(dev)
    xtt = xt.t()
    h_t = torch.zeros(d, d, device=dev, dtype=torch.float32)
    t_t32 = _torch_time(lambda: h_t.addmm_(xtt, xt), iters, cuda)
    res["float32"] = {"jgptq_s": t_j32, "torch_addmm_s": t_t32, "speed_ratio_jgptq_over_torch": t_t32 / t_j32,
                      "jgptq_tflops": flop / t_j32 / 1e12, "torch_tflops": flop / t_t32 / 1e12}

    # accuracy of both jgptq paths against float64 (one batch of the same data)
    x64 = x32[: min(tokens, 8192)].astype(np.float64)
    ref = 2.0 / x64.shape[0] * x64.T @ x64
    h1 = np.asarray(hs.finalize(hs.from_activations(jnp.asarray(x32[: x64.shape[0]]))), np.float64)
    res["float32"]["relative_error_vs_float64"] = float(np.max(np.abs(h1 - ref)) / np.max(np.abs(ref)))
    xb64 = xbf[: x64.shape[0]].astype(np.float64)
    refb = 2.0 / xb64.shape[0] * xb64.T @ xb64
    hb = np.asarray(hs.finalize(hs.from_activations(jnp.asarray(xbf[: x64.shape[0]]), input_dtype="bfloat16")),
                    np.float64)
    if "bf16" in res:
        res["bf16"]["relative_error_vs_float64_of_bf16_inputs"] = float(np.max(np.abs(hb - refb)) /
                                                                       np.max(np.abs(refb)))
    # memory: donation makes the accumulate alias its input; the compiled program's temporaries
    comp = hs._accumulate.lower(hs.init(d), jnp.zeros((tokens, d), jnp.bfloat16), None, "bfloat16").compile()
    ma = comp.memory_analysis()
    res["bf16_accumulate_memory"] = {"alias_bytes": ma.alias_size_in_bytes, "temp_bytes": ma.temp_size_in_bytes,
                                     "hessian_bytes": 4 * d * d}
    del ref_bf, h32
    print(res)
    common.write(args.out, {"benchmark": "hessian", "description": __doc__, "results": res})
    return 0
