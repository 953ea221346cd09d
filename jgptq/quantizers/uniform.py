"""Uniform integer grids: per-row scale and zero point over a group of columns.

A grid maps a weight ``w`` to a code ``q = clamp(round(w / scale) + zero, 0, maxq)`` and back to
``scale * (q - zero)``; rounding is half-to-even. Ranges always include 0 (so a zero weight stays exactly zero).

- Symmetric: ``xmax = max(|min|, max)``, ``xmin = -xmax`` when the group has a negative value (a group of only
  non-negative values keeps ``xmin = 0``, as the reference GPTQ quantizer does), ``zero = (maxq + 1) / 2``.
- Asymmetric: ``zero = round(-xmin / scale)``.
- A row whose range is empty (all zeros) gets the range [-1, 1].
- The scale is rounded to the dtype it will be stored in (``QuantConfig.scale_dtype``) before the zero point and
  the codes are computed from it.
- Optional MSE clip search: shrink the range by ``p = 1 - i / grid`` for ``i < maxshrink * grid`` and keep, per
  row, the factor with the smallest ``sum |dequant - w| ** norm`` (first minimum wins).
- Weighted clip search (``col_weights`` given): the same factors, keeping per row the one with the smallest
  ``sum_j d_j (dequant_j - w_j) ** 2`` for per-column weights ``d`` (e.g. what the GPTQ objective charges each
  column's rounding); ``p = 1`` (min/max) is the first candidate, so the kept grid never scores worse than it.

All functions are pure jnp and vmappable; shapes are (R, n) with rows as output channels.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jgptq.config import QuantConfig


class Grid(NamedTuple):
    """Per-row grid parameters: ``scale`` and ``zero``, float32 (R,) (``zero`` holds integers)."""

    scale: jax.Array
    zero: jax.Array


def _range(w: jax.Array, sym: bool):
    return range_from_extremes(w.min(axis=-1), w.max(axis=-1), sym)


def range_from_extremes(wmin: jax.Array, wmax: jax.Array, sym: bool):
    """The grid range ``(xmin, xmax)`` (float32, same shape) of rows whose smallest and largest weights are
    ``wmin`` and ``wmax``: widened to include 0, mirrored when symmetric, [-1, 1] when empty."""
    zeros = jnp.zeros_like(wmin)
    xmin = jnp.minimum(wmin, zeros)
    xmax = jnp.maximum(wmax, zeros)
    if sym:
        xmax = jnp.maximum(jnp.abs(xmin), xmax)
        xmin = jnp.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = jnp.where(empty, -1.0, xmin)
    xmax = jnp.where(empty, 1.0, xmax)
    return xmin, xmax


def storable_scale(scale: jax.Array, scale_dtype: str) -> jax.Array:
    """``scale`` rounded to ``scale_dtype`` (kept in float32) and kept positive (at least the dtype's smallest
    subnormal), so a grid never divides by zero."""
    if scale_dtype == "float32":
        return scale
    dt = jnp.dtype(scale_dtype)
    tiny = jnp.asarray(jnp.finfo(dt).smallest_subnormal, jnp.float32)
    return jnp.maximum(_rounded_through(scale, dt), tiny)


def _rounded_through(v: jax.Array, dt) -> jax.Array:
    """float32 ``v`` rounded to the 16-bit float ``dt`` and widened back, without a float conversion back.

    A plain ``v.astype(dt).astype(float32)`` is a chain of two float conversions, which XLA:GPU collapses into
    one (dropping the rounding): the scales would not be representable in their storage dtype. The widening
    here works on the integer bits instead.
    """
    from jgptq.ggml.common import f16_value, settle

    bits = lax.bitcast_convert_type(settle(v).astype(dt), jnp.uint16)
    if dt == jnp.dtype(jnp.float16):
        return f16_value(bits)
    return lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)  # bfloat16: the high half


def _grid_from_range(xmin, xmax, maxq: int, sym: bool, scale_dtype: str = "float32") -> Grid:
    # An explicit reciprocal: XLA rewrites a division by a constant into this product on some backends and not
    # on others; writing it out gives the same scale everywhere.
    scale = storable_scale((xmax - xmin) * np.float32(1.0 / maxq), scale_dtype)
    if sym:
        zero = jnp.full_like(scale, (maxq + 1) / 2)
    else:
        zero = jnp.round(-xmin / scale)
    return Grid(scale, zero)


def quantize(w: jax.Array, scale: jax.Array, zero: jax.Array, maxq: int) -> jax.Array:
    """Integer codes (float32 holding integers) of ``w`` on the grid; scale/zero broadcast against ``w``."""
    return jnp.clip(jnp.round(w / scale) + zero, 0, maxq)


def dequantize(q: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
    """Float32 values of codes ``q`` on the grid."""
    return scale * (q - zero)


def fake_quantize(w, scale, zero, maxq: int):
    """``dequantize(quantize(w))``."""
    return dequantize(quantize(w, scale, zero, maxq), scale, zero)


def fit(w: jax.Array, config: QuantConfig, col_weights: jax.Array | None = None) -> Grid:
    """Fits one grid per row of ``w`` (R, n) (float32) by min/max, then by the MSE clip search if enabled.

    ``col_weights`` float32 (n,) (non-negative): the clip search minimises the weighted squared error
    ``sum_j col_weights[j] * (dequant - w)[:, j] ** 2`` instead (whatever ``config.mse``), over the same factors.
    """
    w = w.astype(jnp.float32)
    maxq, sym = config.maxq, config.sym
    xmin, xmax = _range(w, sym)
    grid = _grid_from_range(xmin, xmax, maxq, sym, config.scale_dtype)
    if config.mse <= 0 and col_weights is None:
        return grid
    norm = float(config.mse)
    steps = int(config.mse_maxshrink * config.mse_grid)

    def body(i, carry):
        best, scale, zero = carry
        p = 1.0 - i.astype(jnp.float32) / config.mse_grid
        cand = _grid_from_range(p * xmin, p * xmax, maxq, sym, config.scale_dtype)
        diff = fake_quantize(w, cand.scale[..., None], cand.zero[..., None], maxq) - w
        if col_weights is None:
            err = jnp.sum(jnp.abs(diff) ** norm, axis=-1)
        else:
            err = jnp.sum(col_weights.astype(jnp.float32) * (diff * diff), axis=-1)
        better = err < best
        return (jnp.where(better, err, best), jnp.where(better, cand.scale, scale),
                jnp.where(better, cand.zero, zero))

    best0 = jnp.full(xmin.shape, jnp.inf, jnp.float32)
    _, scale, zero = jax.lax.fori_loop(0, steps, body, (best0, grid.scale, grid.zero))
    return Grid(scale, zero)


def fit_groups(w: jax.Array, config: QuantConfig, col_weights: jax.Array | None = None) -> Grid:
    """Grids for every group of ``group_size`` consecutive columns of ``w`` (R, C) -> scale, zero (R, G).

    ``group_size = -1`` gives one grid per row (G = 1). ``col_weights`` float32 (C,): the weighted clip search
    of :func:`fit`, each group with its own columns' weights.
    """
    r, c = w.shape
    gs = c if config.group_size == -1 else config.group_size
    if c % gs:
        raise ValueError(f"weight of {c} columns is not a multiple of group_size {gs}")
    groups = w.reshape(r, c // gs, gs).transpose(1, 0, 2)  # (G, R, gs)
    if col_weights is None:
        grid = jax.vmap(lambda g: fit(g, config))(groups)
    else:
        grid = jax.vmap(lambda g, d: fit(g, config, d))(groups, col_weights.reshape(c // gs, gs))
    return Grid(grid.scale.T, grid.zero.T)


def round_to_nearest(w: jax.Array, config: QuantConfig):
    """Round-to-nearest baseline: grids from ``w`` itself, no error feedback.

    Args:
      w: float32 (R, C).
    Returns:
      (codes uint8 (R, C), grid with scale/zero (R, G), dequantized float32 (R, C)).
    """
    r, c = w.shape
    grid = fit_groups(w, config)
    gs = c if config.group_size == -1 else config.group_size
    scale = jnp.repeat(grid.scale, gs, axis=1)
    zero = jnp.repeat(grid.zero, gs, axis=1)
    q = quantize(w, scale, zero, config.maxq)
    return q.astype(jnp.uint8), grid, dequantize(q, scale, zero)
