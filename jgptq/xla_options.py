"""XLA compile options jgptq's programs use: GEMMs from cuBLAS on GPUs rather than autotuned Triton kernels.

Autotuning Triton GEMM kernels is most of the compile time of jgptq's programs on a GPU; with cuBLAS GEMMs the
solve programs compile several times faster, run as fast and give the same bytes (``benchmarks/compile_time.py``;
README "Benchmarks"). Other backends ignore the option. ``JGPTQ_TRITON_GEMM=1``
(read when :mod:`jgptq.hessian` is first imported, and by the expert engine each time it compiles) keeps XLA's
default.
"""

from __future__ import annotations

import os
from typing import Optional

ENV_TRITON_GEMM = "JGPTQ_TRITON_GEMM"


def triton_gemm_wanted() -> bool:
    """Whether the user asked for XLA's default GEMMs (``JGPTQ_TRITON_GEMM=1``)."""
    return os.environ.get(ENV_TRITON_GEMM, "").strip().lower() in ("1", "true", "yes", "on")


def gemm_options() -> Optional[dict]:
    """``compiler_options`` for ``jax.jit`` / ``Lowered.compile``: cuBLAS GEMMs unless Triton is wanted."""
    return None if triton_gemm_wanted() else {"xla_gpu_enable_triton_gemm": False}


ENV_COMPILE_CACHE = "JGPTQ_COMPILATION_CACHE"


def compilation_cache_dir() -> Optional[str]:
    """Where compiled programs persist between runs: ``JGPTQ_COMPILATION_CACHE`` (a folder, or ``0``/``off`` for
    none), by default ``$XDG_CACHE_HOME/jgptq/xla`` (``~/.cache/jgptq/xla``)."""
    value = os.environ.get(ENV_COMPILE_CACHE, "").strip()
    if value.lower() in ("0", "off", "false", "no", "none"):
        return None
    if value:
        return value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jgptq", "xla")


# Programs compiling faster than this are not written to the persistent cache. JAX's default (1 s) left out the
# Hessian accumulation programs (0.2-0.5 s each, a few dozen shapes in a MoE run): every run compiled them again,
# 6 s of a 48-layer run's first layers on the H200.
CACHE_MIN_COMPILE_S = 0.1


def enable_compilation_cache() -> Optional[str]:
    """Turns on JAX's persistent compilation cache in :func:`compilation_cache_dir` (unless the user set
    ``jax_compilation_cache_dir`` already or opted out), so that a layer's solve programs compile once per machine,
    not once per run. Programs that compile in under :data:`CACHE_MIN_COMPILE_S` are not kept. Returns the folder
    in use, or None."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    folder = compilation_cache_dir()
    if folder is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None  # an unwritable cache folder only costs compile time
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)
    return folder
