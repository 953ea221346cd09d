"""Activation-aware pre-scaling (``method="awq"``, ``"awq_rtn"``): each group of matrices that read one input is
quantized as ``W diag(s)``, the inverse scale folded into the input's producer so the float model is unchanged.

A group is every matrix that reads the same activation ``x`` (q/k/v after a norm; all experts' gate/up, a shared
expert's and the router after another). Scaling its input columns by ``s`` and dividing the producer's output by
``s`` leaves the float outputs as they are, ``(W diag(s)) (x / s) = W x``, and moves quantization error away from
the columns that carry large inputs. The scales are AWQ's (Lin et al.): ``s = r ** alpha`` with ``r`` the
per-column root mean square of the input (from the Hessian diagonal, ``diag(H) / 2 = mean x^2``), normalized to a
geometric mean of the extremes of 1, ``alpha`` chosen on a grid (``ALPHAS``; 0 is no scaling) for the least output
error of the round-to-nearest quantized group on the calibration inputs. That error has a closed form in the
Hessian ``H = 2 / N sum x x^T``:

    err(alpha) = sum over the group's matrices of trace(dW H dW^T),  dW = W - Q(W diag(s)) diag(s)^-1

(``Q`` the round-to-nearest of the run's grid), so the search needs no extra forward: :func:`priced_errors`.

Then the method solves the scaled problem: ``awq`` GPTQ on ``W diag(s)`` with the Hessian of the scaled inputs
``diag(s)^-1 H diag(s)^-1`` (:func:`scaled_hessian`), whose loss is the original problem's:
``trace((W s - Q) H_s (W s - Q)^T) = trace((W - Q / s) H (W - Q / s)^T)``; ``awq_rtn`` round-to-nearest of
``W diag(s)``. The stored codes are those of the scaled matrix; the fold (the torch pipeline's, generic:
:mod:`jgptq_torch.pipeline.prescale`) has already put ``1 / s`` into the producer, so exports stay standard.

The torch pipeline runs the search and the fold before a layer's solve for a method with a ``prescale``
attribute (the :class:`PreScale` here); the bucket solve is then GPTQ's or round-to-nearest's on the stacks whose
weights and Hessians are already scaled. Integer grids only (the search prices round-to-nearest of the grid).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgptq.config import QuantConfig
from jgptq.methods.gptq import GPTQ
from jgptq.methods.registry import BucketInputs, BucketOutput, register
from jgptq.methods.rtn import RoundToNearest
from jgptq.quantizers import uniform
from jgptq.statistics import HESSIAN

ALPHAS = tuple(i / 20 for i in range(20))   # AWQ's grid: 0, 0.05, ..., 0.95
FLOOR = 1e-3                                # input RMS floored at this share of the largest (unseen columns)


def candidate_scales(mean_square, alphas: Sequence[float] = ALPHAS):
    """The scales the search tries: float32 (A, C).

    Args:
      mean_square: float (C,) per-column mean of ``x^2`` of the group's input.
      alphas: A exponents.
    Returns:
      ``s_a = r ** alpha_a / sqrt(max(r ** alpha_a) * min(r ** alpha_a))``, ``r = sqrt(mean_square)`` floored at
      ``FLOOR * max(r)`` (and at the smallest positive float32 where every column is zero); alpha 0 gives ones.
    """
    r = jnp.sqrt(jnp.maximum(jnp.asarray(mean_square, jnp.float32), 0.0))
    r = jnp.maximum(r, jnp.maximum(FLOOR * jnp.max(r), jnp.finfo(jnp.float32).tiny))
    a = jnp.asarray(alphas, jnp.float32)[:, None]
    s = jnp.exp(a * jnp.log(r)[None, :])
    return s / jnp.sqrt(jnp.max(s, axis=1, keepdims=True) * jnp.min(s, axis=1, keepdims=True))


def scaled_hessian(hessian, scale):
    """``diag(s)^-1 H diag(s)^-1``: the Hessian of the inputs ``x / s`` (float32, H's shape (C, C) or (n, C, C))."""
    inv = 1.0 / jnp.asarray(scale, jnp.float32)
    return jnp.asarray(hessian, jnp.float32) * inv[:, None] * inv[None, :]


def _nearest(w, config: QuantConfig):
    return uniform.round_to_nearest(w, config)[2]


@functools.partial(jax.jit, static_argnames=("config",))
def _member_errors(weights, hessians, scales, config: QuantConfig):
    """(A,) summed ``trace(dW H dW^T)`` of the n matrices of (n, R, C) ``weights`` under each of (A, C) scales;
    ``hessians`` (C, C) shared or (n, C, C)."""
    w = weights.astype(jnp.float32)
    h = jnp.broadcast_to(hessians.astype(jnp.float32), (w.shape[0],) + hessians.shape[-2:])

    def one(s):
        with jax.default_matmul_precision("highest"):
            deq = jax.vmap(lambda m: _nearest(m * s[None, :], config))(w) / s[None, None, :]
            dw = w - deq
            return jnp.sum(jnp.einsum("nrc,ncd->nrd", dw, h) * dw)

    return jax.lax.map(one, scales)


def priced_errors(members, scales, config: QuantConfig):
    """The group's output error under each candidate scale: float32 (A,).

    Args:
      members: (weights float (n, R, C), hessian float32 (C, C) or (n, C, C)) pairs, every matrix of the group
        (its columns the group's input).
      scales: float32 (A, C) candidates (:func:`candidate_scales`).
      config: the integer grid the group is quantized on.
    Returns:
      ``sum trace(dW H dW^T)`` over the members, ``dW = W - Q(W diag(s)) / s``, ``Q`` round-to-nearest.
    """
    if config.is_ggml:
        raise ValueError(f"awq prices integer grids only, not the GGML format {config.format!r}")
    total = jnp.zeros((scales.shape[0],), jnp.float32)
    for w, h in members:
        total = total + _member_errors(jnp.asarray(w), jnp.asarray(h), jnp.asarray(scales, jnp.float32), config)
    return total


class Choice(NamedTuple):
    """What :func:`search` chose for one group: ``scale`` float32 (C,), ``alpha`` its exponent, ``errors``
    numpy (A,) the priced error of every candidate (``errors[0]`` unscaled when ``alphas[0] == 0``)."""

    scale: jax.Array
    alpha: float
    errors: np.ndarray


def search(members, mean_square, config: QuantConfig, alphas: Sequence[float] = ALPHAS) -> Choice:
    """AWQ's scale search over ``alphas``: the candidate with the least :func:`priced_errors` (the first on ties)."""
    scales = candidate_scales(mean_square, alphas)
    errors = np.asarray(priced_errors(members, scales, config), np.float64)
    if not np.all(np.isfinite(errors)):
        raise ValueError(f"awq: priced errors are not finite ({errors.tolist()})")
    best = int(np.argmin(errors))
    return Choice(scales[best], float(alphas[best]), errors)


def mean_square_of(hessians, tokens) -> jax.Array:
    """Per-column mean ``x^2`` of a group's input from its members' Hessians: float32 (C,).

    Args:
      hessians: float32 (C, C) or (n, C, C) each, ``2 / N sum x x^T``.
      tokens: for each, its token count, or n counts for a stack; the means are weighted by them.
    """
    num, den = 0.0, 0.0
    for h, t in zip(hessians, tokens):
        h = jnp.asarray(h, jnp.float32)
        d = jnp.diagonal(h, axis1=-2, axis2=-1) / 2.0
        t = np.asarray(t, np.float64).reshape(-1)
        if d.ndim == 1:
            num, den = num + d * float(t.sum() / t.size), den + float(t.sum() / t.size)
        else:
            num = num + jnp.sum(d * jnp.asarray(t, jnp.float32)[:, None], axis=0)
            den = den + float(t.sum())
    if den <= 0:
        raise ValueError("awq: the group's input saw no calibration tokens")
    return num / den


@dataclasses.dataclass(frozen=True)
class PreScale:
    """What the pipeline's fold step reads from a pre-scaling method: the exponents of the search."""

    alphas: tuple = ALPHAS


class AWQ:
    """A pre-scaling method: the bucket solve of ``inner`` (GPTQ or round-to-nearest) on weights and Hessians
    the pipeline has already scaled (see the module docstring)."""

    def __init__(self, name: str, inner, prescale: PreScale | None = None):
        self.name, self._inner = name, inner
        self.statistics = (HESSIAN,)
        self.token_threshold = inner.token_threshold
        self.prescale = prescale or PreScale()

    def solve(self, bucket: BucketInputs) -> BucketOutput:
        if bucket.plan.quant.is_ggml:
            raise ValueError(f"{bucket.name}: method {self.name!r} quantizes integer grids only, not "
                             f"{bucket.plan.quant.format!r}")
        return self._inner.solve(bucket)


register(AWQ("awq", GPTQ()))
register(AWQ("awq_rtn", RoundToNearest()))
