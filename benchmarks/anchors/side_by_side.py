"""What the peer-library benchmarks share: the problems, the one float64 loss, code agreement, package versions.

Every solver of ``benchmarks.peers_solver`` is scored by :func:`loss64` on the same undamped Hessians, so their
losses are comparable whatever each library reports of itself.
"""

from __future__ import annotations

import math

PACKAGES = ("jax", "jaxlib", "torch", "triton", "transformers", "accelerate", "gptqmodel", "llmcompressor",
            "compressed-tensors", "pydantic", "datasets", "numpy", "gguf")


def package_versions() -> dict:
    """Installed version of each package that bears on these benchmarks (None when absent)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def hessian(gen, tokens: int, cols: int, device, chunk: int = 8192):
    """``2/N X^T X`` float32 (cols, cols) of random inputs with a realistic spectrum (the normalisation both
    peers and jgptq use).

    Inputs: correlated columns (a random mixing matrix near the identity) with per-column scales spread over
    e^-1.5..e^1.5, so the diagonal spans about 20x and the eigenvalues several decades, as real layer inputs do;
    generated ``chunk`` tokens at a time on ``device``.
    """
    import torch

    h = torch.zeros(cols, cols, device=device)
    mix = torch.randn(cols, cols, generator=gen, device=device) / math.sqrt(cols) + torch.eye(cols, device=device)
    scale = torch.exp(torch.empty(cols, device=device).uniform_(-1.5, 1.5, generator=gen))
    for s in range(0, tokens, chunk):
        n = min(chunk, tokens - s)
        x = (torch.randn(n, cols, generator=gen, device=device) @ mix) * scale
        h += x.T @ x
    return h * (2.0 / tokens)


def routed_counts(rng, experts: int, routed_tokens: int, min_tokens: int = 64):
    """Tokens each expert receives: a multinomial draw over log-normal expert popularities (sigma 0.6), as a
    trained router spreads ``routed_tokens = tokens x top_k``; int list (experts,), each at least ``min_tokens``."""
    import numpy as np

    p = np.exp(0.6 * rng.standard_normal(experts))
    counts = rng.multinomial(routed_tokens, p / p.sum())
    return [int(max(min_tokens, c)) for c in counts]


def loss64(quantized, weight, hessian) -> float:
    """``trace((Q - W) H (Q - W)^T)`` in float64 for one matrix: Q, W torch (R, C), H torch (C, C)."""
    import torch

    d = quantized.to(torch.float64) - weight.to(torch.float64)
    return float(torch.sum((d @ hessian.to(torch.float64)) * d))


def agreement(codes_a, codes_b) -> dict:
    """Share of identical codes and of rows identical throughout: two torch uint8 tensors of one shape."""
    import torch

    eq = codes_a.to(codes_b.device) == codes_b
    rows = eq.reshape(-1, eq.shape[-1]).all(dim=-1)
    return {"codes_equal": float(eq.float().mean()), "rows_identical": float(rows.float().mean()),
            "codes_compared": int(eq.numel())}
