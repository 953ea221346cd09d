"""jgptq: GPTQ for Mixture-of-Experts language models, with every numerical step as jitted JAX.

Entry points:
- :func:`jgptq.quantize_moe` quantizes a Hugging Face transformers model (torch side, imported lazily);
- :mod:`jgptq.hessian`, :mod:`jgptq.gptq`, :mod:`jgptq.quantizers`, :mod:`jgptq.ggml`: pure JAX functions;
- the ``jgptq`` command line (:mod:`jgptq.cli`).

This package never imports torch at import time.
"""

from __future__ import annotations

import os
import sys
import warnings

# When torch shares the GPU, JAX must not grab 75% of it up front. The variable is read when JAX starts its
# backends, so it still takes effect if jax was imported but has not run anything yet.
def _disable_preallocation() -> None:
    started = False
    if "jax" in sys.modules:
        try:
            from jax._src import xla_bridge

            started = bool(getattr(xla_bridge, "_backends", {}))
        except Exception:  # pragma: no cover - private layout changed
            started = True
    if not started:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    elif os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") is None:
        import jax

        if any(d.platform != "cpu" for d in jax.devices()):
            warnings.warn(
                "JAX started before jgptq was imported and preallocated most of the GPU memory; set "
                "XLA_PYTHON_CLIENT_PREALLOCATE=false before the first JAX computation if torch shares the GPU",
                stacklevel=3,
            )


_disable_preallocation()

from jgptq.config import MoEConfig, PipelineConfig, QuantConfig  # noqa: E402

__version__ = "0.1.0"
__all__ = ["MoEConfig", "PipelineConfig", "QuantConfig", "quantize_moe", "__version__"]


def quantize_moe(torch_model, calib, config=None, **kwargs):
    """Quantizes a transformers model layer by layer with GPTQ, in place (see :func:`interop.layerwise.quantize_moe`).

    ``result = jgptq.quantize_moe(model, calib, bits=4, group_size=128, device="cuda")``; ``print(result.report)``;
    ``result.weights[checkpoint_key]`` holds codes/scales/zeros/g_idx for exporters.
    """
    from interop.layerwise import quantize_moe as _quantize_moe

    return _quantize_moe(torch_model, calib, config, **kwargs)
