"""GPTQModel's own GPTQ solver (``gptqmodel.quantization.gptq.GPTQ``, release 7.7.0) on a given (W, H).

An adapter for side-by-side timing: it hands GPTQModel's ``GPTQ`` class a weight and a Hessian and runs its
``quantize()``; it solves nothing itself. What it relies on, read from GPTQModel 7.7.0's source:

- ``GPTQ(module, qcfg)`` wraps an ``nn.Linear``; ``quantize(blocksize)`` reads the Hessian from ``self.H`` (taken
  as given when no per-device partials were accumulated), damps and factors it, and returns the dequantized
  weight, the per-group ``scale`` and ``zero`` (R, G), ``g_idx``, seconds and its own average loss.
- Two paths inside ``quantize()``: the fused CUDA block kernel (``gptqmodel_ext/gptq_block``, compiled by the
  package's JIT loader with nvcc and ninja at first use, ``gptq_cuda.block_update_available()``) whenever the
  weight is on CUDA, the block is 128 columns, the grid is a plain integer grid and the environment variable
  ``GPTQMODEL_DISABLE_GPTQ_CUDA`` is unset; else its eager torch loop, one column at a time. The variable is read
  at every call, so :func:`solve` sets it for the eager path and clears it for the fused one, and the fused path
  is refused unless the kernel loaded (``quantize()`` would otherwise fall back to eager silently).
- Grids are lazy: a group's grid is fitted at its first column from the weight as earlier blocks left it.
  Symmetric grids use ``scale = (xmax - xmin) / maxq`` over a range mirrored to ``[-max|w|, max|w|]`` and
  ``zero = (maxq + 1) / 2``, so codes run 0..maxq as in jgptq.
- The quantizer is configured per channel, as GPTQModel's own GPTQ processor does before ``quantize()``.
- Settings matched to jgptq's solver: ``desc_act=False``, ``act_group_aware=False`` (GPTQModel's own default for
  GPTQ is True), ``damp_percent=0.01`` with no automatic increase, ``static_groups=False``, ``mse=0``, no
  low-sample fallback.

The package is imported whole (its ``__init__`` runs); beside the GPU machine's own packages it needs pypcre,
logbar, device-smi, tokenicer and defuser (``benchmarks/anchors/fetch_wheels.sh``).
"""

from __future__ import annotations

import os
import time

DISABLE_FUSED_ENV = "GPTQMODEL_DISABLE_GPTQ_CUDA"


def version() -> str:
    """The installed GPTQModel version (raises if it is not installed)."""
    from importlib.metadata import version as _version

    return _version("gptqmodel")


def prepare_fused() -> dict:
    """Builds (or loads) GPTQModel's fused block kernel through its own loader.

    Returns:
      ``{"ok": bool, "seconds": float, "error": str}``; ``ok`` False on a machine without CUDA or when the build
      failed (``error`` says why).
    """
    import torch

    if not torch.cuda.is_available():
        return {"ok": False, "seconds": 0.0, "error": "no CUDA device"}
    from gptqmodel.quantization import gptq_cuda

    os.environ.pop(DISABLE_FUSED_ENV, None)
    t0 = time.perf_counter()
    ok = bool(gptq_cuda.block_update_available())
    seconds = time.perf_counter() - t0
    error = "" if ok else str(getattr(gptq_cuda._EXTENSION, "last_error_message", lambda: "")() or "build failed")
    return {"ok": ok, "seconds": seconds, "error": error}


def _config(bits: int, group_size: int, sym: bool, damp: float):
    from gptqmodel.quantization import QuantizeConfig

    return QuantizeConfig(bits=bits, group_size=group_size, sym=sym, desc_act=False, act_group_aware=False,
                          damp_percent=damp, damp_auto_increment=0.0, static_groups=False, mse=0.0,
                          fallback=None)


def solve(weight, hessian, *, bits: int = 4, group_size: int = 128, sym: bool = True, fused: bool = True,
          damp: float = 0.01, nsamples: int = 1):
    """Quantizes one matrix with GPTQModel's ``GPTQ.quantize`` (block size 128).

    Args:
      weight: torch float32 (R, C) on the device the solve runs on.
      hessian: torch float32 (C, C), same device (any positive scale; copied, not modified).
      bits, group_size, sym: the integer grid.
      fused: True for the fused CUDA kernel path (call :func:`prepare_fused` first), False for the eager loop.
      damp: relative damping.
      nsamples: calibration token count (only GPTQModel's reported average loss uses it).
    Returns:
      dict with ``weight`` float32 (R, C) dequantized, ``scale``/``zero`` float32 (R, G), ``codes`` uint8 (R, C)
      (recovered from the weight and the grids), ``avg_loss`` (GPTQModel's own figure).
    """
    import torch

    from gptqmodel.quantization.gptq import GPTQ

    if fused:
        os.environ.pop(DISABLE_FUSED_ENV, None)
    else:
        os.environ[DISABLE_FUSED_ENV] = "1"
    rows, cols = weight.shape
    with torch.no_grad():
        linear = torch.nn.Linear(cols, rows, bias=False, device=weight.device, dtype=torch.float32)
        linear.weight.data = weight
        solver = GPTQ(linear, _config(bits, group_size, sym, damp))
        solver.quantizer.configure(perchannel=True)  # as GPTQModel's GPTQ processor sets it up
        solver.H = hessian.detach().to(torch.float32).clone()
        solver.nsamples = int(nsamples)
        q, scale, zero, _g_idx, _seconds, avg_loss, _damp, _n = solver.quantize(blocksize=128)
        q = q.float()
        groups = torch.arange(cols, device=q.device) // (group_size if group_size > 0 else cols)
        s_cols, z_cols = scale.float()[:, groups], zero.float()[:, groups]
        codes = torch.clamp(torch.round(q / s_cols) + z_cols, 0, 2 ** bits - 1).to(torch.uint8)
    return {"weight": q, "scale": scale.float(), "zero": zero.float(), "codes": codes, "avg_loss": avg_loss}


def solve_many(weights, hessians, **kwargs) -> list:
    """:func:`solve` on each ``(weights[i], hessians[i])`` in turn (GPTQModel solves one module at a time).

    Args:
      weights: sequence of torch float32 (R, C); hessians: a sequence of matching torch float32 (C, C).
    Returns:
      list of :func:`solve` results.
    """
    return [solve(w, h, **kwargs) for w, h in zip(weights, hessians)]
