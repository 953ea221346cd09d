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

# When torch shares the GPU, JAX must not grab 75% of it up front. This only works before jax is imported.
if "jax" in sys.modules:
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") is None and "jax._src.xla_bridge" in sys.modules:
        warnings.warn(
            "jax was imported before jgptq: GPU memory preallocation could not be turned off; set "
            "XLA_PYTHON_CLIENT_PREALLOCATE=false before importing jax if torch shares the GPU",
            stacklevel=2,
        )
else:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from jgptq.config import QuantConfig  # noqa: E402

__version__ = "0.1.0"
__all__ = ["QuantConfig", "quantize_moe", "__version__"]


def quantize_moe(torch_model, calib, config=None, **kwargs):
    """Quantizes a transformers model layer by layer with GPTQ (see :func:`interop.layerwise.quantize_moe`)."""
    from interop.layerwise import quantize_moe as _quantize_moe

    return _quantize_moe(torch_model, calib, config, **kwargs)
