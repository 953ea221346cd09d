"""GPTQ (``method="gptq"``): the blockwise solve of :mod:`jgptq.gptq` on every matrix of a bucket at once.

- Integer grids: one batched solve (:func:`jgptq.parallel.solve_experts`, spread over the devices). A Hessian
  shared by every matrix of the bucket (q/k/v, or gate/up of a dense MLP) is passed once, as (C, C), so its
  factorization is shared too.
- GGML formats: each matrix is also given the plain encode (with the same importance) in the same program, both
  are scored by :func:`jgptq.objective.hessian_loss` on the matrix's own Hessian, and the lower is kept; a matrix
  whose plain encode wins falls back (reported as ``rtn``, reason ``lower loss: plain ... < gptq ...``). The guard
  costs one plain encode and two (R, C) x (C, C) products per matrix.
- A matrix below the token threshold gets the identity as its Hessian, for which GPTQ is exactly round-to-nearest;
  with a GGML format it gets the plain encode (an identity Hessian is not quite that for formats whose importance
  weighting looks at the whole row).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgptq import gptq, parallel
from jgptq.bucket import PLAIN_KEPT, plain_encoder
from jgptq.objective import hessian_loss
from jgptq.config import QuantConfig
from jgptq.methods.registry import BucketInputs, BucketOutput, register

_FIELDS = ("weight", "loss", "damp_used", "damp_stage", "fallback", "dead_columns",
           "codes", "scales", "zeros", "g_idx", "perm", "payload")


class GPTQ:
    name = "gptq"
    statistics = ("hessian",)
    token_threshold = True

    def solve(self, bucket: BucketInputs) -> BucketOutput:
        quant, low = bucket.plan.quant, bucket.low
        hessians = bucket.hessians()
        fell_back = {}
        if not quant.is_ggml:
            res = parallel.solve_experts(bucket.weights, hessians, quant, name=bucket.name, devices=bucket.devices,
                                         importance=bucket.importance)
            return BucketOutput({k: getattr(res, k) for k in _FIELDS})
        res, losses = gptq_or_plain(bucket.weights, hessians, bucket.importance, quant, bucket.name, bucket.devices)
        plain_won = np.asarray(losses.plain < losses.gptq) & ~np.asarray(low)
        for i in np.flatnonzero(plain_won):
            fell_back[int(i)] = f"{PLAIN_KEPT}: plain {float(losses.plain[i]):.4g} < gptq {float(losses.gptq[i]):.4g}"
        fields = {k: getattr(res, k) for k in _FIELDS}
        if any(low):  # too few tokens: the plain encode (the kept plain encodes are already in place)
            plain, _ = parallel.encode_experts(plain_encoder(quant.format), bucket.weights, bucket.importance)
            mask = jnp.asarray(low)[:, None, None, None]
            fields["payload"] = jnp.where(mask, jax.device_put(plain, _device(res.payload)), res.payload)
        return BucketOutput(fields, fell_back)


def _device(x):
    return next(iter(x.devices()))


class Losses(NamedTuple):
    """float32 (N,) Hessian-weighted losses ``trace((W - Q) H (W - Q)^T)`` of the GPTQ result and of the plain
    encode of every matrix of a GGML bucket."""

    gptq: np.ndarray
    plain: np.ndarray


@dataclasses.dataclass(frozen=True)
class GPTQOrPlain:
    """The per-matrix program of a GGML GPTQ bucket: the GPTQ solve and the plain encode, each scored by
    :func:`jgptq.objective.hessian_loss` on the matrix's Hessian; the GPTQ result with the plain encode's bytes and
    weight where those score strictly lower, and both losses (hashable: compiled programs are cached per
    config)."""

    config: QuantConfig

    def __call__(self, weight, hessian, importance):
        res = gptq.solve_unchecked(weight, hessian, importance, self.config)
        payload, decoded = plain_encoder(self.config.format)(weight, importance)
        loss_gptq = hessian_loss(weight, res.weight, hessian)
        loss_plain = hessian_loss(weight, decoded, hessian)
        plain = loss_plain < loss_gptq
        return res._replace(payload=jnp.where(plain, payload, res.payload),
                            weight=jnp.where(plain, decoded, res.weight)), loss_gptq, loss_plain


def _axes(hessians, importance) -> tuple:
    return (0, None if hessians.ndim == 2 else 0, None if importance is None or importance.ndim == 1 else 0)


def plan_guarded(weights, hessians, importance, quant: QuantConfig, devices):
    """The engine's plan (its programs compiled) of :func:`gptq_or_plain` for these arguments, which may be
    ``jax.ShapeDtypeStruct`` s: weights (N, R, C), hessians (C, C) or (N, C, C) float32, importance (N, C) / (C,)
    float32 or None."""
    return parallel.engine.plan_map(GPTQOrPlain(quant), (weights, hessians, importance), _axes(hessians, importance),
                                    devices=devices)


def gptq_or_plain(weights, hessians, importance, quant: QuantConfig, name: str, devices):
    """The GGML GPTQ solve of a bucket with the plain-encode guard, over the devices: (GPTQResult with the kept
    bytes, :class:`Losses`)."""
    gptq.check_inputs(weights, hessians, importance, quant, name, batched=True)
    res, loss_gptq, loss_plain = parallel.map_experts(GPTQOrPlain(quant), (weights, hessians, importance),
                                                      _axes(hessians, importance), devices=devices)
    return res, Losses(np.asarray(loss_gptq), np.asarray(loss_plain))


register(GPTQ())
