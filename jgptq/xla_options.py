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
