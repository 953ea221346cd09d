"""Round-to-nearest (``method="rtn"``): each group rounded on its own grid, or with a GGML format the plain encode
with importance (llama.cpp's imatrix-only quantization). No calibration solve: the baseline every other method is
measured against, and the fallback of the ones that need tokens."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jgptq import parallel
from jgptq.config import QuantConfig
from jgptq.methods.registry import BucketInputs, BucketOutput, register
from jgptq.quantizers import uniform


class RoundToNearest:
    name = "rtn"
    statistics = ()
    token_threshold = False

    def solve(self, bucket: BucketInputs) -> BucketOutput:
        return BucketOutput(nearest(bucket.weights, bucket.importance, bucket.plan.quant))


def nearest(weights, importance, quant: QuantConfig) -> dict:
    """Round-to-nearest of (N, R, C) ``weights``: the fields of :class:`BucketOutput` (integer grids: weight, codes,
    scales, zeros, g_idx, perm; GGML formats: payload and its decode as weight)."""
    if quant.is_ggml:
        from jgptq.bucket import plain_encoder

        payload, weight = parallel.encode_experts(plain_encoder(quant.format), weights, importance)
        return {"payload": payload, "weight": weight}
    return _grid_nearest(weights, quant)


@functools.partial(jax.jit, static_argnames=("config",))
def _grid_nearest(weights, config):
    codes, grid, deq = jax.vmap(lambda w: uniform.round_to_nearest(w.astype(jnp.float32), config))(weights)
    n, _, c = weights.shape
    gs = c if config.group_size == -1 else config.group_size
    g_idx = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32) // gs, (n, c))
    perm = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (n, c))
    return {"weight": deq, "codes": codes, "scales": grid.scale, "zeros": grid.zero, "g_idx": g_idx, "perm": perm}


register(RoundToNearest())
