"""The GPTQ objective: the Hessian-weighted error ``trace((W - Q) H (W - Q)^T)`` of a quantized weight.

With ``H = 2/N sum x x^T`` over the N calibration inputs x of a matrix, the objective is ``2/N`` times the summed
squared output error ``||(W - Q) X^T||^2``. The GGML guard (:mod:`jgptq.bucket`) compares it between the GPTQ solve
and the plain encode; the ``target_bpw`` sensitivity pass (:mod:`jgptq_torch.pipeline.sensitivity`) prices each
candidate format with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def hessian_loss(weight, quantized, hessian, *, fixed_order: bool = True) -> jax.Array:
    """``trace((W - Q) H (W - Q)^T)`` of matrices: float32 (...) of ``weight``, ``quantized`` float (..., R, C)
    and ``hessian`` float32 (C, C) (shared) or (..., C, C). Traceable; the products run at precision HIGHEST.

    ``fixed_order=True`` sums the elements of each matrix in a fixed pairwise order, so the sum's bits do not
    depend on how XLA reduces a vmapped or batched program (a choice made from the value must not depend on the
    devices); ``False`` leaves the sum to XLA (the figures of the ``target_bpw`` measurement).
    """
    weight, quantized, hessian = jnp.asarray(weight), jnp.asarray(quantized), jnp.asarray(hessian)
    with jax.default_matmul_precision("highest"):
        d = quantized.astype(jnp.float32) - weight.astype(jnp.float32)
        h = hessian.astype(jnp.float32)
        if not fixed_order:
            return jnp.sum((d @ h) * d, axis=(-2, -1))
        x = jax.lax.optimization_barrier((d @ h) * d)
    x = x.reshape(x.shape[:-2] + (-1,))
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (1,), x.dtype)], axis=-1)
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]
