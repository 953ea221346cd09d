"""Dead columns, damping, and the triangular factor of the damped Hessian, with a recorded fallback ladder.

GPTQ is usually written with ``U``, the upper triangular factor with ``H^-1 = U^T U``, which the reference
implementations compute as ``L = chol(H + lambda I)``, ``H^-1`` from ``L``, then ``U = chol(H^-1)^T``: a Cholesky,
a triangular inverse, a product and a second Cholesky. The same ``U`` is the inverse of ``T``, the upper
triangular factor with ``H = T T^T`` (the Cholesky factor of ``H`` with its rows and columns taken in reverse
order: ``J H J = M M^T`` gives ``T = J M J``; ``U = T^-1`` has a positive diagonal, and the Cholesky factor of
``H^-1`` is unique). :func:`hessian_factor` computes only ``T``, one Cholesky; the solver needs ``U`` only on its
diagonal blocks, which are the inverses of ``T``'s (:func:`diagonal_block_inverses`), and works with ``T`` for
the rest (:mod:`jgptq.gptq`).

JAX's Cholesky returns NaNs instead of raising on a matrix that is not positive definite, so success is tested
explicitly (every entry of the factor finite) and a ladder of stages is tried in order inside a
``lax.while_loop`` (vmappable over experts):

1. relative damping ``damp``, then ``damp`` raised by factors of sqrt(10) up to 1: ``lambda = d * mean(diag H)``;
2. diagonal floors: ``diag = max(diag0 + f, f)`` with ``f = 1e-6 * max|diag0| * 10^(k-1)``, k = 1..6, at damping 1;
3. if every stage fails: ``U = I`` (the solve degenerates to round-to-nearest), reported as ``fallback``.

The result says which stage succeeded and the damping actually used; nothing falls back silently.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Factor(NamedTuple):
    """Upper triangular factor of the damped Hessian and how it was obtained.

    Attributes:
      upper: float32 (C, C), upper triangular ``T`` with ``H + damping = T @ T^T`` (identity on fallback).
      damp_used: float32 scalar, the relative damping of the successful stage.
      floor_used: float32 scalar, the absolute diagonal floor of the successful stage (0 if none).
      stage: int32 scalar, index of the successful ladder stage (0 = the configured damping).
      fallback: bool scalar, True when no stage gave a finite factor (``upper`` is then the identity).
    """

    upper: jax.Array
    damp_used: jax.Array
    floor_used: jax.Array
    stage: jax.Array
    fallback: jax.Array


def ladder(damp: float) -> tuple[np.ndarray, np.ndarray]:
    """The (relative damping, floor exponent) stages tried in order; floor exponent -1 means no floor."""
    damps = [float(damp)]
    while damps[-1] < 1.0:
        damps.append(min(1.0, damps[-1] * math.sqrt(10.0)))
    floors = [-1] * len(damps) + list(range(1, 7))
    damps = damps + [1.0] * 6
    return np.asarray(damps, np.float32), np.asarray(floors, np.int32)


def fix_dead_columns(hessian: jax.Array, weight: jax.Array, zero_weight: bool = True):
    """Makes columns with no calibration signal harmless.

    A column j is dead when ``H[j, j] == 0``: no calibration input ever reached it. Its row and column of H are
    cleared and ``H[j, j] = 1``, so it is solved on its own; with ``zero_weight`` it is also set to zero in W (its
    value never affects the calibration output), as the reference implementations do. H stays independent of W,
    so experts sharing one Hessian share one factor.

    Args:
      hessian: float32 (C, C).
      weight: float32 (R, C).
    Returns:
      (hessian, weight, dead) with ``dead`` a bool (C,) mask.
    """
    dead = jnp.diagonal(hessian) == 0
    keep = ~dead
    hessian = jnp.where(keep[:, None] & keep[None, :], hessian, 0.0)
    hessian = hessian + jnp.diag(dead.astype(hessian.dtype))
    if zero_weight:
        weight = jnp.where(dead[None, :], 0.0, weight)
    return hessian, weight, dead


def _reversed_cholesky(h: jax.Array) -> jax.Array:
    return jnp.linalg.cholesky(h[::-1, ::-1])[::-1, ::-1]


def diagonal_block_inverses(upper: jax.Array, block: int) -> jax.Array:
    """The inverses of the (block, block) diagonal blocks of an upper triangular (C, C) matrix, C a multiple of
    ``block``: float32 (C / block, block, block). For ``upper = T`` these are the diagonal blocks of ``U = T^-1``.
    """
    n = upper.shape[-1] // block
    blocks = jnp.moveaxis(jnp.diagonal(upper.reshape(n, block, n, block), axis1=0, axis2=2), -1, 0)
    eye = jnp.broadcast_to(jnp.eye(block, dtype=upper.dtype), blocks.shape)
    with jax.default_matmul_precision("highest"):
        return jax.scipy.linalg.solve_triangular(blocks, eye, lower=False)


def hessian_factor(hessian: jax.Array, damp: float) -> Factor:
    """``T`` (upper triangular) with ``H + damping = T T^T`` through the ladder of :func:`ladder` (see module
    docstring); ``T^-1`` is GPTQ's ``U`` (``(H + damping)^-1 = U^T U``).

    Args:
      hessian: float32 (C, C), symmetric, dead columns already fixed (:func:`fix_dead_columns`).
      damp: relative damping of the first stage.
    """
    with jax.default_matmul_precision("highest"):
        damps, floors = ladder(damp)
        damps, floors = jnp.asarray(damps), jnp.asarray(floors)
        n_stages = damps.shape[0]
        diag0 = jnp.diagonal(hessian)
        scale = jnp.max(jnp.abs(diag0))

        def attempt(k):
            f = jnp.where(floors[k] < 0, 0.0, 1e-6 * scale * 10.0 ** (floors[k] - 1).astype(jnp.float32))
            diag = jnp.where(floors[k] < 0, diag0, jnp.maximum(diag0 + f, f))
            diag = diag + damps[k] * jnp.mean(diag)
            h = hessian - jnp.diag(diag0) + jnp.diag(diag)
            u = _reversed_cholesky(h)
            return u, jnp.all(jnp.isfinite(u)), f

        def cond(carry):
            k, _, ok, _ = carry
            return (~ok) & (k < n_stages)

        def body(carry):
            k, _, _, _ = carry
            u, ok, f = attempt(k)
            return k + 1, u, ok, f

        u0 = jnp.zeros_like(hessian)
        k, u, ok, f = jax.lax.while_loop(cond, body, (jnp.int32(0), u0, jnp.bool_(False), jnp.float32(0)))
        stage = k - 1
        eye = jnp.eye(hessian.shape[-1], dtype=hessian.dtype)
        upper = jnp.where(ok, u, eye)
        damp_used = jnp.where(ok, damps[jnp.clip(stage, 0, n_stages - 1)], jnp.nan)
        return Factor(upper, damp_used, jnp.where(ok, f, jnp.nan), stage, ~ok)
