"""An independent float64 numpy GPTQ: the textbook column loop, used as the reference in tests.

Semantics match jgptq's documented choices: dead columns (zero Hessian diagonal) zeroed; relative damping
``damp * mean(diag)``; ``U = chol(inv(H))^T``; act orders none/desc/static/group_aware; a lazy group's grid is
fitted from the error-updated weights when the solve reaches its first column; static grids from the original
weight. Column updates are applied to the whole remaining matrix at once (no lazy blocks), which is the same
computation in exact arithmetic.
"""

from __future__ import annotations

import numpy as np


def storable(scale, scale_dtype):
    """Scales rounded to their storage dtype (computed in float32 first, as the solver does)."""
    if scale_dtype == "float32":
        return scale
    import ml_dtypes

    dt = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[scale_dtype]
    tiny = float(ml_dtypes.finfo(dt).smallest_subnormal)
    return np.maximum(scale.astype(np.float32).astype(dt).astype(np.float64), tiny)


def grid_fit(w, bits, sym, mse=0.0, grid=100, maxshrink=0.8, scale_dtype="float32"):
    """Per-row (scale, zero) of w (R, n), float64 (scales rounded to ``scale_dtype``)."""
    maxq = 2 ** bits - 1
    xmin = np.minimum(w.min(axis=1), 0.0)
    xmax = np.maximum(w.max(axis=1), 0.0)
    if sym:
        xmax = np.maximum(np.abs(xmin), xmax)
        xmin = np.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = np.where(empty, -1.0, xmin)
    xmax = np.where(empty, 1.0, xmax)

    def params(lo, hi):
        if scale_dtype == "float32":
            scale = (hi - lo) / maxq
        else:  # the storage rounding is only reproducible from the same float32 arithmetic
            f32 = np.float32
            scale = storable((hi.astype(f32) - lo.astype(f32)) * f32(1.0 / maxq), scale_dtype)
        zero = np.full_like(scale, (maxq + 1) / 2) if sym else np.round(-lo / scale)
        return scale, zero

    scale, zero = params(xmin, xmax)
    if mse > 0:
        best = np.full(w.shape[0], np.inf)
        for i in range(int(maxshrink * grid)):
            p = 1 - i / grid
            s1, z1 = params(p * xmin, p * xmax)
            q = s1[:, None] * (np.clip(np.round(w / s1[:, None]) + z1[:, None], 0, maxq) - z1[:, None])
            err = np.sum(np.abs(q - w) ** mse, axis=1)
            better = err < best
            best = np.where(better, err, best)
            scale = np.where(better, s1, scale)
            zero = np.where(better, z1, zero)
    return scale, zero


def quant(w, scale, zero, bits, tie_codes=None, tie_tol=1e-4):
    """Codes and dequantized values; at near-ties (|w/scale| within ``tie_tol`` of a half-integer) the code given
    by ``tie_codes`` is taken when it is one of the two nearest codes. Returns (q, dq, number of ties taken)."""
    maxq = 2 ** bits - 1
    x = w / scale
    q = np.clip(np.round(x) + zero, 0, maxq)
    taken = 0
    if tie_codes is not None:
        near = np.abs(np.abs(x - np.floor(x)) - 0.5) < tie_tol
        lo = np.clip(np.floor(x) + zero, 0, maxq)
        hi = np.clip(np.floor(x) + 1 + zero, 0, maxq)
        ok = near & ((tie_codes == lo) | (tie_codes == hi))
        q = np.where(ok, tie_codes, q)
        taken = int(np.sum(ok & (tie_codes != np.clip(np.round(x) + zero, 0, maxq))))
    return q, scale * (q - zero), taken


def column_order(diag, act_order, group_size):
    c = diag.shape[0]
    if act_order == "none":
        return np.arange(c)
    if act_order in ("desc", "static") or group_size == -1:
        return np.argsort(-diag, kind="stable")
    groups = diag.reshape(c // group_size, group_size)
    order = np.argsort(-groups.max(axis=1), kind="stable")
    return np.concatenate([g * group_size + np.argsort(-groups[g], kind="stable") for g in order])


def gptq(W, H, bits=4, group_size=128, sym=True, act_order="none", static_groups=False, damp=0.01, mse=0.0,
         tie_codes=None, scale_dtype="float32"):
    """Returns dict(codes (R, C), weight (R, C), scales (R, G), zeros (R, G), g_idx (C,), perm, loss, ties, ratios),
    ``ratios`` (R, C) being ``w / scale`` of every weight when it was rounded.

    ``tie_codes`` (R, C) in original column order: codes to follow where a weight sits on a rounding tie (float32
    and float64 legitimately round those differently); ``ties`` counts the entries where that changed the code.
    """
    W = np.array(W, np.float64)
    H = np.array(H, np.float64)
    r, c = W.shape
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = column_order(np.diag(H), act_order, group_size)
    gs = c if group_size == -1 else group_size
    n_groups = c // gs
    precomputed = static_groups or act_order == "static" or group_size == -1
    scales = np.zeros((r, n_groups))
    zeros = np.zeros((r, n_groups))
    if precomputed:
        for g in range(n_groups):
            scales[:, g], zeros[:, g] = grid_fit(W[:, g * gs:(g + 1) * gs], bits, sym, mse, scale_dtype=scale_dtype)
        gid = perm // gs
    elif act_order == "desc":
        gid = np.arange(c) // gs
    else:
        gid = perm // gs
    Wp = W[:, perm]
    Hp = H[perm][:, perm]
    Hp = Hp + damp * np.mean(np.diag(Hp)) * np.eye(c)
    U = np.linalg.cholesky(np.linalg.inv(Hp)).T
    codes = np.zeros((r, c))
    Q = np.zeros((r, c))
    ratios = np.zeros((r, c))
    loss = 0.0
    ties = 0
    tie_p = None if tie_codes is None else np.asarray(tie_codes, np.float64)[:, perm]
    for i in range(c):
        if not precomputed and i % gs == 0:
            scales[:, gid[i]], zeros[:, gid[i]] = grid_fit(Wp[:, i:i + gs], bits, sym, mse, scale_dtype=scale_dtype)
        w = Wp[:, i]
        q, dq, taken = quant(w, scales[:, gid[i]], zeros[:, gid[i]], bits,
                             None if tie_p is None else tie_p[:, i])
        ties += taken
        ratios[:, i] = w / scales[:, gid[i]]
        err = (w - dq) / U[i, i]
        Wp[:, i:] -= np.outer(err, U[i, i:])
        codes[:, i], Q[:, i] = q, dq
        loss += np.sum(err ** 2) / 2
    inv = np.argsort(perm)
    g_idx = gid[inv]
    return dict(codes=codes[:, inv], weight=Q[:, inv], scales=scales, zeros=zeros, g_idx=g_idx, perm=perm,
                loss=loss, ties=ties, ratios=ratios[:, inv])
