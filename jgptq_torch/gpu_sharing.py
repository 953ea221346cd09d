"""JAX beside torch on one GPU: the torch side's entry points call :func:`share_gpu_with_torch` before their
first JAX computation.

JAX takes 75% of a GPU's memory when its backends start, unless ``XLA_PYTHON_CLIENT_PREALLOCATE`` says otherwise;
torch then has too little left. ``import jgptq`` changes no setting of the process; the torch side, which runs both
frameworks in one process, asks JAX not to preallocate, once, at its entry points (:func:`jgptq.quantize_moe`,
:func:`jgptq.evaluate`, the exporters, the ``jgptq`` command). The variable is read when JAX starts its backends,
so it still takes effect if jax was imported but has run nothing yet; a value the user set is kept.
"""

from __future__ import annotations

import os
import sys
import warnings

VARIABLE = "XLA_PYTHON_CLIENT_PREALLOCATE"
_done = False


def _jax_started() -> bool:
    """Whether JAX has started its backends in this process (jax imported is not enough)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # pragma: no cover - private layout changed
        return True


def share_gpu_with_torch() -> None:
    """Sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the user set it, when JAX has not started yet; when it
    has, and preallocated an accelerator's memory, warns once (torch may then run out of memory). Idempotent: only
    the first call looks."""
    global _done
    if _done:
        return
    _done = True
    if not _jax_started():
        os.environ.setdefault(VARIABLE, "false")
        return
    if os.environ.get(VARIABLE) is None:
        import jax

        if any(d.platform != "cpu" for d in jax.devices()):
            warnings.warn(
                "JAX started before jgptq's torch side ran and preallocated most of the GPU memory; set "
                f"{VARIABLE}=false before the first JAX computation if torch shares the GPU", stacklevel=3)
