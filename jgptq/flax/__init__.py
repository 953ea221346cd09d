"""GPTQ for JAX and Flax models, with no torch in the process.

The model is traced to a jaxpr and interpreted on calibration batches (:mod:`jgptq.flax.interpret`); every
``dot_general``/``einsum`` and ``ragged_dot`` that reads a parameter is seen with its activation operand, which
feeds that weight's Hessian (:mod:`jgptq.flax.capture`). Contracted parameter axes are the input features C;
axes paired with activation batch axes (``einsum('ecd,edf->ecf')``) and the group axis of ``ragged_dot`` are
experts, each with its own Hessian over its routed rows; the rest are output features R. Weights are solved with
:func:`jgptq.gptq.solve_experts` and written back dequantized (:mod:`jgptq.flax.quantize`).

- :func:`quantize` (Flax NNX or Linen), :func:`quantize_fn` (any ``fn(params, batch)``);
- :func:`capture` (Flax) and :func:`capture_hessians` (any function): the Hessians alone, on the float model;
- default weight filter: every matmul weight with at least 32 input features whose path has no component named
  ``router``, ``gate``, ``lm_head``, ``embed*``, ``wte`` or ``wpe`` (embedding lookups are gathers, never
  captured); pass ``exclude=``, ``min_in_features=`` or ``select=`` to change it.

Example: a small Flax NNX MoE transformer whose experts run as ``jax.lax.ragged_dot``::

    import jax, jax.numpy as jnp
    from flax import nnx
    import jgptq
    from jgptq.flax import quantize

    class MoE(nnx.Module):
        def __init__(self, d, f, experts, k, rngs):
            self.router = nnx.Linear(d, experts, use_bias=False, rngs=rngs)
            init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
            self.up = nnx.Param(init(rngs.params(), (experts, d, f)))
            self.down = nnx.Param(init(rngs.params(), (experts, f, d)))
            self.k = k

        def __call__(self, x):                                   # x: (tokens, d)
            top, expert = jax.lax.top_k(self.router(x), self.k)
            order = jnp.argsort(expert.reshape(-1), stable=True)  # token copies grouped by expert
            sizes = jnp.bincount(expert.reshape(-1), length=self.up.shape[0])
            rows = x[order // self.k]
            h = jax.nn.silu(jax.lax.ragged_dot(rows, self.up[...], sizes))
            y = jax.lax.ragged_dot(h, self.down[...], sizes)
            y = jnp.zeros_like(y).at[order].set(y).reshape(x.shape[0], self.k, -1)
            return jnp.einsum("tkd,tk->td", y, jax.nn.softmax(top, axis=-1))

    class Block(nnx.Module):
        def __init__(self, d, heads, rngs):
            self.norm1, self.norm2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
            self.moe = MoE(d, 2 * d, experts=4, k=2, rngs=rngs)

        def __call__(self, x):                                   # x: (batch, seq, d)
            h = self.norm1(x)
            x = x + self.attn(h, mask=nnx.make_causal_mask(x[..., 0]))
            return x + self.moe(self.norm2(x).reshape(-1, x.shape[-1])).reshape(x.shape)

    class TinyMoELM(nnx.Module):
        def __init__(self, vocab=128, d=64, layers=2, rngs=nnx.Rngs(0)):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.blocks = nnx.List([Block(d, 4, rngs) for _ in range(layers)])
            self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

        def __call__(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.lm_head(x)

    model = TinyMoELM()
    calib = [jax.random.randint(jax.random.key(i), (4, 32), 0, 128) for i in range(8)]
    result = quantize(model, calib, jgptq.QuantConfig(bits=4, group_size=32), mode="sequential")
    # model now holds dequantized weights; result.payloads["blocks/0/moe/up"]["codes"]: uint8 (4, 128, 64)
    for name, figures in result.report["weights"].items():
        print(name, figures["shape"], figures["loss"])

A Linen model goes the same way with ``quantize(module, calib, config, variables=variables)``, which returns the
new variables in ``result.model``.
"""

from jgptq.flax.capture import (DEFAULT_EXCLUDE, CapturedHessian, WeightInfo, capture_hessians,
                                default_filter)
from jgptq.flax.interpret import Layout
from jgptq.flax.quantize import (QuantizeResult, as_function, capture, decode, matrix_of, quantize, quantize_fn,
                                 solve_weight, write_matrix)

__all__ = ["DEFAULT_EXCLUDE", "CapturedHessian", "Layout", "QuantizeResult", "WeightInfo", "as_function", "capture",
           "capture_hessians", "decode", "default_filter", "matrix_of", "quantize", "quantize_fn", "solve_weight",
           "write_matrix"]
