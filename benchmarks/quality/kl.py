"""KL divergence of a quantized model's next-token distributions to the float model's, as llama.cpp measures it.

llama.cpp's ``llama-perplexity --kl-divergence`` cuts the evaluation text into windows of ``n_ctx`` tokens, runs
each window from an empty context, and scores only the second half: the logits at positions
``first = n_ctx // 2 .. n_ctx - 2`` predicting tokens ``first + 1 .. n_ctx - 1`` (``n_ctx - 1 - first`` tokens per
window), so every scored token has at least ``n_ctx / 2`` tokens of context. Per scored token it computes
KL(p_float || p_quant) = sum_v p_float(v) (log p_float(v) - log p_quant(v)), whether both models pick the same
most likely token, and each model's negative log likelihood of the actual next token (for the perplexities).

Here every quantity is computed in float64 numpy from the float32 logits (llama.cpp stores the reference's
log-probabilities in 16-bit form; float64 avoids that rounding).
"""

from __future__ import annotations

import math

import numpy as np


def first_scored(n_ctx: int) -> int:
    """The first logit position scored in a window of ``n_ctx`` tokens (llama.cpp: ``n_ctx / 2``)."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx: {n_ctx} must be at least 4 tokens")
    return n_ctx // 2


def scored_slice(n_ctx: int) -> slice:
    """Positions of the logits that are scored in a window: ``first .. n_ctx - 2``."""
    return slice(first_scored(n_ctx), n_ctx - 1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_stats(ref_logits: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> dict:
    """Per-token statistics of one block of scored positions.

    Args:
      ref_logits, logits: float (T, V) logits of the reference (float) and the evaluated model at the same
        positions.
      targets: int (T,) the actual next tokens.
    Returns:
      float64/bool arrays (T,): ``kl`` = KL(p_ref || p), ``nll_ref``, ``nll`` (negative log likelihoods of the
      targets, nats) and ``same_top`` (argmax of both agree).
    """
    ref_logits = np.asarray(ref_logits)
    logits = np.asarray(logits)
    targets = np.asarray(targets, dtype=np.int64)
    if ref_logits.shape != logits.shape or ref_logits.ndim != 2 or targets.shape != ref_logits.shape[:1]:
        raise ValueError(f"logits {logits.shape}, reference {ref_logits.shape} and targets {targets.shape} must be "
                         "(T, V), (T, V) and (T,)")
    lp_ref = log_softmax(ref_logits)
    lp = log_softmax(logits)
    kl = np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1)
    rows = np.arange(len(targets))
    return {"kl": np.maximum(kl, 0.0), "nll_ref": -lp_ref[rows, targets], "nll": -lp[rows, targets],
            "same_top": np.argmax(ref_logits, -1) == np.argmax(logits, -1)}


def window_stats(ref_windows: np.ndarray, windows: np.ndarray, tokens: np.ndarray) -> dict:
    """:func:`token_stats` over whole windows, scoring only each window's second half.

    Args:
      ref_windows, windows: float (n, n_ctx, V) logits of every position of every window (positions before
        :func:`first_scored` are never read and may hold anything).
      tokens: int (n, n_ctx) the windows' tokens.
    Returns:
      the per-token arrays of :func:`token_stats`, concatenated over windows (n * (n_ctx - 1 - first),).
    """
    n, n_ctx = np.shape(tokens)
    s = scored_slice(n_ctx)
    parts = [token_stats(ref_windows[i][s], windows[i][s], np.asarray(tokens[i])[s.start + 1:]) for i in range(n)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def summarize(stats: dict) -> dict:
    """Mean (with its standard error), median, p90, p99 and max of the KL; same-top-token rate; perplexities."""
    kl = np.asarray(stats["kl"], dtype=np.float64)
    n = kl.size
    if n == 0:
        raise ValueError("no scored tokens")
    nll, nll_ref = np.asarray(stats["nll"]), np.asarray(stats["nll_ref"])
    same = np.asarray(stats["same_top"], dtype=np.float64)
    return {
        "tokens": int(n),
        "kl_mean": float(kl.mean()),
        "kl_mean_stderr": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
        "kl_median": float(np.median(kl)),
        "kl_p90": float(np.quantile(kl, 0.90)),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "same_top_rate": float(same.mean()),
        "same_top_stderr": float(math.sqrt(same.mean() * (1 - same.mean()) / n)),
        "ppl": float(math.exp(nll.mean())),
        "ppl_ref": float(math.exp(nll_ref.mean())),
        "ln_ppl_ratio": float(nll.mean() - nll_ref.mean()),
    }
