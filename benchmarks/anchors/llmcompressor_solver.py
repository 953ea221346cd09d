"""llm-compressor's own GPTQ solver (``quantize_weight``, release 0.14.0.1) on a given stack of (W, H).

An adapter for side-by-side timing: it builds the inputs GPTQModifier would hand to
``llmcompressor.modifiers.gptq.gptq_quantize.quantize_weight`` and calls it; it solves nothing itself. What it
relies on, read from llm-compressor 0.14.0.1 and compressed-tensors 0.19.0:

- ``quantize_weight(weights (B, R, C), hessians (B, C, C), scale, zero_point, global_scale, quant_args,
  blocksize, percdamp)`` solves a stack of same-shape modules at once: batched Cholesky (per item below 16),
  ``torch.bmm`` for the lazy block update, and per 128-column block either the fused Triton kernel or the eager
  torch loop. It uses the stacked weight and Hessian as working buffers, so the adapter hands it copies (as
  GPTQModifier's ``prepare_batch`` does by stacking).
- The Triton kernel is chosen when the block is on CUDA, Triton is present, the scheme maps to the kernel and
  ``LLMCOMPRESSOR_DISABLE_GPTQ_TRITON`` is not ``"1"``; the variable is read at every block, so :func:`solve`
  sets it for the eager path and clears it for the Triton one.
- Grids are static: ``scale`` and ``zero_point`` come from the weight observer on the original weights
  (``Observer.get_qparams()``, min-max by default) before the solve. For symmetric int4 that is
  ``scale = max|w| / 7.5`` and codes -8..7, the same grid as jgptq's ``static_groups=True`` (codes shifted by 8).
- ``batched_quantization="auto"`` caps a batch at 75% of free GPU memory (``helpers.max_batch_size``); the
  adapter asks that same function for the cap.

The package is imported whole (``llmcompressor.modifiers.gptq`` runs the package init, which pulls in its
entrypoints and ``datasets``); beside the GPU machine's own packages it needs compressed-tensors 0.19.0,
pydantic, loguru, datasets, dill and multiprocess (``benchmarks/anchors/fetch_wheels.sh``).
"""

from __future__ import annotations

import os

DISABLE_TRITON_ENV = "LLMCOMPRESSOR_DISABLE_GPTQ_TRITON"


def versions() -> dict:
    """Installed versions of llm-compressor and compressed-tensors."""
    from importlib.metadata import version

    return {"llmcompressor": version("llmcompressor"), "compressed-tensors": version("compressed-tensors")}


def quant_args(bits: int = 4, group_size: int = 128, sym: bool = True):
    """compressed-tensors ``QuantizationArgs`` of an integer group grid, no activation ordering (W4A16's weights
    for bits=4, group 128, symmetric)."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=group_size,
                            actorder=None)


def observe(weights, args) -> tuple:
    """Per-module grids from llm-compressor's weight observer on the original weights.

    Args:
      weights: torch float (B, R, C).
      args: ``QuantizationArgs``.
    Returns:
      (scale (B, R, G), zero_point (B, R, G)) in the weights' dtype / the observer's zero-point dtype.
    """
    import torch

    from llmcompressor.observers import Observer

    name = args.observer or "memoryless_minmax"
    scales, zeros = [], []
    with torch.no_grad():
        for w in weights:
            obs = Observer.load_from_registry(name, base_name="weight", args=args)
            obs(w)
            qp = obs.get_qparams()
            scales.append(qp["scale"])
            zeros.append(qp["zero_point"])
    return torch.stack(scales), torch.stack(zeros)


def auto_batch(rows: int, cols: int, device, block_size: int = 128) -> int:
    """The batch cap of ``batched_quantization="auto"`` for (rows, cols) modules on ``device`` (their formula)."""
    import torch

    from llmcompressor.modifiers.gptq.helpers import max_batch_size

    probe = torch.nn.Linear(cols, rows, bias=False, device=device)
    try:
        return int(max_batch_size(probe, "auto", block_size))
    finally:
        del probe


def triton_expected(weights, args) -> bool:
    """Whether ``quantize_weight`` will take the Triton block kernel for these inputs (its own requirement)."""
    from compressed_tensors.utils.triton import triton_req

    from llmcompressor.modifiers.gptq.helpers import get_triton_gptq_config

    return bool(triton_req(weights) and os.environ.get(DISABLE_TRITON_ENV, "0") != "1"
                and get_triton_gptq_config(args) is not None)


def solve(weights, hessians, *, bits: int = 4, group_size: int = 128, sym: bool = True, triton: bool = True,
          damp: float = 0.01, batch=None, grids=None):
    """GPTQ of a stack of same-shape matrices with llm-compressor's ``quantize_weight``.

    Args:
      weights: torch float32 (B, R, C) on the solving device (not modified).
      hessians: torch float32 (B, C, C), same device (not modified; any positive scale).
      bits, group_size, sym: the integer grid.
      triton: True for the Triton block kernel (CUDA only), False for the eager loop.
      damp: relative damping (``dampening_frac``).
      batch: modules per ``quantize_weight`` call: None for all at once, an int cap, or ``"auto"`` (their cap).
      grids: (scale, zero_point) from :func:`observe` (computed here when None).
    Returns:
      dict with ``weight`` float32 (B, R, C) dequantized, ``codes`` uint8 (B, R, C) (0..2^bits-1, i.e. their
      signed codes plus 2^(bits-1)), ``scale`` and ``zero_point`` (B, R, G), ``losses`` float32 (B,)
      (their own figure), ``rtn_fallback`` bool (B,), ``batch`` (the cap used).
    """
    import torch

    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    if triton:
        os.environ.pop(DISABLE_TRITON_ENV, None)
    else:
        os.environ[DISABLE_TRITON_ENV] = "1"
    args = quant_args(bits, group_size, sym)
    count, rows, cols = weights.shape
    scale, zero_point = grids if grids is not None else observe(weights, args)
    if batch == "auto":
        batch = auto_batch(rows, cols, weights.device)
    cap = count if batch is None else max(1, int(batch))
    outs, losses, fallbacks = [], [], []
    with torch.no_grad():
        for s in range(0, count, cap):
            e = min(count, s + cap)
            q, loss, fb = quantize_weight(weights[s:e].clone(), hessians[s:e].clone(), scale[s:e], zero_point[s:e],
                                          None, args, blocksize=128, percdamp=damp)
            outs.append(q)
            losses.append(loss)
            fallbacks.append(fb)
        q = torch.cat(outs).float()
        groups = torch.arange(cols, device=q.device) // group_size
        s_cols = scale.float()[..., groups]
        z_cols = zero_point.float()[..., groups]
        offset = 2 ** (bits - 1)  # compressed-tensors' integer codes are signed
        codes = (torch.round(q / s_cols) + z_cols + offset).clamp(0, 2 ** bits - 1).to(torch.uint8)
    return {"weight": q, "codes": codes, "scale": scale, "zero_point": zero_point, "losses": torch.cat(losses),
            "rtn_fallback": torch.cat(fallbacks), "batch": cap}
