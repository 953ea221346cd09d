"""The blockwise GPTQ solver: lazy block updates, column or group updates, act-order, static or lazy grids.

Pure functions of ``(W, H, config)``; vmappable over a leading expert axis (:func:`solve_experts`).

Algorithm (columns in the solve order ``perm``, see :mod:`jgptq.act_order`):

1. dead columns fixed (:func:`jgptq.damping.fix_dead_columns`); ``T`` = upper triangular factor of the damped
   Hessian, ``H = T T^T``, through the damping ladder (:func:`jgptq.damping.hessian_factor`); GPTQ's usual
   ``U`` (``H^-1 = U^T U``) is ``T^-1``, needed only on the diagonal blocks (``U_bb = T_bb^-1``, small triangular
   inverses), so no inverse Hessian is ever formed;
2. columns are visited in blocks of ``block_size``; a block starts from its original columns plus what the
   earlier blocks' rounding asks of it, ``W_b + (sum over earlier blocks of D_a T[a, b]) U_bb`` with
   ``D_a = W_a - Q_a`` (the original weight minus its quantized value); inside a block,
   - scalar grids (``format="int"``), one column at a time: ``q = Q(w)``, ``err = (w - q) / U[j, j]``,
     ``W[:, j:] -= err U[j, j:]`` (restricted to the block); a group's grid is fitted when the solve reaches the
     group's first column, from the error-updated weights (lazy), or once from the original weight (static);
   - block codecs (GGML formats), one format block of G columns at a time: ``Q_g = decode(encode(W_g))`` jointly,
     ``E = (W_g - Q_g) U_gg^-1`` (triangular solve), ``W[:, rest of block] -= E U[g, rest]``; the encoded bytes
     are kept (re-encoding the decoded weight would not give them back);
3. after each block, one product adds ``D_b T[b, :]`` to the running sum of the columns to its right.

This is GPTQ exactly (the same sequence of roundings as the textbook update ``W -= E_block U[block, :]``, by
``U T = I``: the textbook's running weights and these agree on every column when it is quantized), written
with the Hessian's own factor as in the nearest-plane view of GPTQ: one Cholesky instead of a Cholesky, a
triangular inverse, a product and a second Cholesky.

On CUDA GPUs the in-block loop of integer grids is a fused Pallas kernel (:mod:`jgptq.kernels.inblock`;
``JGPTQ_SOLVER_KERNEL=xla|pallas`` forces a path). Every loop is a ``lax.fori_loop``, so compile time does
not grow with the matrix width. Matrix products run at precision HIGHEST (no TF32). Internally the weight is
kept transposed (columns contiguous) and padded to a whole number of blocks with zero columns and an identity
factor, which changes nothing in the real columns.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jgptq import act_order, damping
from jgptq.config import QuantConfig
from jgptq.solve_inputs import check_inputs  # noqa: F401  (jgptq.gptq.check_inputs)
from jgptq.kernels import inblock
from jgptq.quantizers import uniform


class GPTQResult(NamedTuple):
    """Result of one GPTQ solve (add a leading expert axis for :func:`solve_experts`).

    Attributes:
      weight: float32 (R, C), the dequantized weight in the original column order.
      loss: float32 scalar, the GPTQ objective ``sum_j |w_j - q_j|^2 / U_jj^2 / 2`` (group form for codecs).
      perm: int32 (C,), the solve order.
      g_idx: int32 (C,), the grid (group) index of every original column (``format="int"``; zeros for codecs).
      codes: uint8 (R, C) integer codes in the original column order, or None for codecs.
      scales: float32 (R, G) grid scales, or None for codecs.
      zeros: float32 (R, G) grid zero points (integers), or None for codecs.
      payload: uint8 (R, C // block, type_size) GGML blocks, or None for integer grids.
      damp_used: float32 scalar, the relative damping that gave the factor (NaN on fallback).
      damp_stage: int32 scalar, the damping-ladder stage that succeeded (0 = as configured).
      fallback: bool scalar, no damping gave a factor; the result is round-to-nearest on the same grids.
      dead_columns: int32 scalar, columns without calibration signal.
    """

    weight: jax.Array
    loss: jax.Array
    perm: jax.Array
    g_idx: jax.Array
    codes: Optional[jax.Array]
    scales: Optional[jax.Array]
    zeros: Optional[jax.Array]
    payload: Optional[jax.Array]
    damp_used: jax.Array
    damp_stage: jax.Array
    fallback: jax.Array
    dead_columns: jax.Array


class GroupCodec(NamedTuple):
    """A codec that encodes a group of ``block_size`` consecutive columns jointly (GGML formats).

    ``encode(w, importance)`` takes float32 (R, block_size) and float32 (block_size,) or None, and returns
    (payload uint8 (R, type_size), dequantized float32 (R, block_size)). It must be traceable (jit, vmap).
    """

    encode: object
    block_size: int
    type_size: int


def ggml_codec(format_name: str) -> GroupCodec:
    """The :class:`GroupCodec` of a registered GGML format (encode then decode)."""
    from jgptq.ggml import get_format

    fmt = get_format(format_name)
    if fmt.encode is None or fmt.decode is None:
        raise ValueError(f"GGML format {fmt.name!r} has no encoder in jgptq yet")

    def encode_group(w, importance):
        payload = fmt.encode(w, importance)
        return payload, fmt.decode(payload)

    return GroupCodec(encode_group, fmt.block_size, fmt.type_size)


class _Plan(NamedTuple):
    block: int        # columns per block (a multiple of the group/format block)
    group: int        # columns per inner step: grid group (lazy), format block (codec), or the block itself
    padded: int       # padded width, a multiple of ``block``
    num_groups: int   # rows of the grid table (padded groups included)
    lazy: bool        # grids fitted during the solve


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def _plan(num_columns: int, config: QuantConfig, codec: Optional[GroupCodec]) -> _Plan:
    if codec is not None:
        g = codec.block_size
        block = _ceil_to(config.block_size, g)
        padded = _ceil_to(num_columns, block)
        return _Plan(block, g, padded, padded // g, False)
    lazy = not act_order.uses_precomputed_grids(config)
    if config.group_size == -1:
        block = config.block_size
        padded = _ceil_to(num_columns, block)
        return _Plan(block, block, padded, 1, False)
    gs = config.group_size
    block = _ceil_to(config.block_size, gs)
    padded = _ceil_to(num_columns, block)
    return _Plan(block, gs if lazy else block, padded, padded // gs, lazy)


def solve_unchecked(weight: jax.Array, hessian: jax.Array, importance: Optional[jax.Array], config: QuantConfig,
                    codec: Optional[GroupCodec] = None, grid_weights: Optional[str] = None) -> GPTQResult:
    """The GPTQ solve of one weight as :func:`solve` (same arguments and result), traceable (jit, vmap,
    shard_map) and unchecked: inputs :func:`check_inputs` would refuse fail while tracing or give meaningless
    results. ``weight`` float (R, C), ``hessian`` float (C, C), ``importance`` float32 (C,) or None.

    ``grid_weights`` (integer grids): None fits grids as ``config`` says; ``"factor"`` or ``"diagonal"`` fits
    every group's grid by the weighted clip search of :func:`jgptq.quantizers.uniform.fit`, weighting each
    column's squared rounding error by ``T_jj ** 2`` (what the GPTQ objective charges the column's own rounding:
    the diagonal of the damped Hessian's factor in the solve order) or by ``H_jj`` (the Hessian diagonal, the
    imatrix weighting)."""
    if codec is None and config.is_ggml:
        codec = ggml_codec(config.format)
    with jax.default_matmul_precision("highest"):
        return _solve_highest(weight, hessian, importance, config, codec, grid_weights)


def _column_weights(kind, h, upper, perm, cols):
    """Per-column weights of the weighted grid search, float32 (padded,) in the solve order (padding: 1)."""
    if kind == "factor":
        return jnp.square(jnp.diagonal(upper))
    if kind == "diagonal":
        return jnp.pad(jnp.diagonal(h)[perm], (0, upper.shape[0] - cols), constant_values=1.0)
    raise ValueError(f"grid_weights={kind!r}: must be None, 'factor' or 'diagonal'")


def _solve_highest(weight, hessian, importance, config, codec, grid_weights=None):
    rows, cols = weight.shape
    plan = _plan(cols, config, codec)
    w = weight.astype(jnp.float32)
    h, w, dead = damping.fix_dead_columns(hessian.astype(jnp.float32), w, config.zero_dead_columns)

    perm = act_order.column_order(jnp.diagonal(h), config)
    factor = damping.hessian_factor(h[perm][:, perm], config.damp)
    pad = plan.padded - cols
    upper = factor.upper
    if pad:
        upper = jnp.pad(upper, ((0, pad), (0, pad))) + jnp.diag(
            jnp.concatenate([jnp.zeros(cols, jnp.float32), jnp.ones(pad, jnp.float32)]))
    perm_p = jnp.concatenate([perm, jnp.arange(cols, plan.padded, dtype=jnp.int32)])
    # Transposed, permuted, padded original weight: row i of ``wt`` is the i-th column to solve.
    wt = jnp.pad(w[:, perm].T, ((0, pad), (0, 0)))
    u_blocks = damping.diagonal_block_inverses(upper, plan.block)
    colw = None if grid_weights is None or codec is not None else _column_weights(grid_weights, h, upper, perm, cols)

    if codec is not None:
        type_size = codec.type_size
        if importance is not None:
            importance = jnp.pad(importance.astype(jnp.float32)[perm], (0, pad), constant_values=1.0)
        payload_t = jnp.zeros((plan.num_groups, rows, type_size), jnp.uint8)
        state_extra = payload_t
        gid = jnp.zeros(plan.padded, jnp.int32)
    else:
        gid = act_order.solve_group_ids(perm_p, config)
        if plan.lazy:
            scale_t = jnp.ones((plan.num_groups, rows), jnp.float32)
            zero_t = jnp.zeros((plan.num_groups, rows), jnp.float32)
        else:
            # Grids fitted once from the original (dead-column-fixed) weight, in original column order.
            w_orig = jnp.pad(w, ((0, 0), (0, pad)))
            cw = None if colw is None else jnp.pad(colw[:cols][jnp.argsort(perm)], (0, pad), constant_values=1.0)
            grid = uniform.fit_groups(w_orig, config, cw) if config.group_size != -1 else uniform.Grid(
                *(a[:, None] for a in uniform.fit(w, config, None if cw is None else cw[:cols])))
            scale_t, zero_t = grid.scale.T, grid.zero.T
        state_extra = (scale_t, zero_t, jnp.zeros((plan.padded, rows), jnp.uint8))

    maxq = config.maxq
    block, group = plan.block, plan.group

    def column_steps(k, carry, b0):
        """All columns of the k-th inner group of the block starting at b0 (scalar grids)."""
        wb, qb, eb, ub, loss, (scale_t, zero_t, codes_t) = carry
        g0 = k * group
        if plan.lazy:
            cw = None if colw is None else jax.lax.dynamic_slice_in_dim(colw, b0 + g0, group)
            fitted = uniform.fit(jax.lax.dynamic_slice_in_dim(wb, g0, group, axis=0).T, config, cw)
            gi = gid[b0 + g0]
            scale_t = jax.lax.dynamic_update_slice_in_dim(scale_t, fitted.scale[None], gi, axis=0)
            zero_t = jax.lax.dynamic_update_slice_in_dim(zero_t, fitted.zero[None], gi, axis=0)

        def one(j, c2):
            wb, qb, eb, codes_t = c2
            c = g0 + j
            col = wb[c]
            gi = gid[b0 + c]
            s, z = scale_t[gi], zero_t[gi]
            q = uniform.quantize(col, s, z, maxq)
            dq = uniform.dequantize(q, s, z)
            err = (col - dq) / ub[c, c]
            wb = wb - ub[c][:, None] * err[None, :]
            qb = qb.at[c].set(dq)
            eb = eb.at[c].set(err)
            codes_t = codes_t.at[b0 + c].set(q.astype(jnp.uint8))
            return wb, qb, eb, codes_t

        def columns(unroll):
            return lambda *c: jax.lax.fori_loop(0, group, one, c, unroll=unroll)

        wb, qb, eb, codes_t = jax.lax.platform_dependent(wb, qb, eb, codes_t, cpu=columns(_COLUMN_UNROLL_CPU),
                                                         default=columns(_COLUMN_UNROLL))
        return wb, qb, eb, ub, loss, (scale_t, zero_t, codes_t)

    def group_step(k, carry, b0):
        """The k-th format block of the block starting at b0, encoded jointly (codecs)."""
        wb, qb, eb, ub, loss, payload_t = carry
        g0 = k * group
        wg = jax.lax.dynamic_slice_in_dim(wb, g0, group, axis=0)             # (G, R)
        imp = None if importance is None else jax.lax.dynamic_slice_in_dim(importance, b0 + g0, group)
        payload, dq = codec.encode(wg.T, imp)                                       # (R, bytes), (R, G)
        ugg = jax.lax.dynamic_slice(ub, (g0, g0), (group, group))
        et = jax.scipy.linalg.solve_triangular(ugg, wg - dq.T, trans="T", lower=False)
        wb = wb - jax.lax.dynamic_slice_in_dim(ub, g0, group, axis=0).T @ et
        qb = jax.lax.dynamic_update_slice_in_dim(qb, dq.T, g0, axis=0)
        eb = jax.lax.dynamic_update_slice_in_dim(eb, et, g0, axis=0)
        payload_t = jax.lax.dynamic_update_slice_in_dim(payload_t, payload[None], (b0 + g0) // group, axis=0)
        return wb, qb, eb, ub, loss, payload_t

    step = group_step if codec is not None else column_steps
    kernel = None if codec is not None or colw is not None else inblock.in_block_solver(config, block, group,
                                                                                          plan.lazy)

    def block_step(b, carry):
        pull, qt, loss, extra = carry
        b0 = b * block
        ub = u_blocks[b]
        w0 = jax.lax.dynamic_slice_in_dim(wt, b0, block, axis=0)   # the block's original columns
        wb = w0 + ub.T @ jax.lax.dynamic_slice_in_dim(pull, b0, block, axis=0)
        def xla_step(wb, ub, extra):  # the XLA loop; the fused kernel replaces it where it serves
            zeros = jnp.zeros_like(wb)
            _, qb, eb, _, _, extra = jax.lax.fori_loop(0, block // group, functools.partial(_with_b0, step, b0),
                                                       (wb, zeros, zeros, ub, jnp.zeros_like(loss), extra))
            return qb, eb, extra
        qb, eb, extra = xla_step(wb, ub, extra) if kernel is None else kernel(wb, ub, b0, gid, extra, xla_step)
        loss = loss + _exact_order_sum(eb)
        # What this block's rounding asks of every later column (T is upper triangular: earlier columns get 0).
        pull = pull + jax.lax.dynamic_slice_in_dim(upper, b0, block, axis=0).T @ (w0 - qb)
        qt = jax.lax.dynamic_update_slice_in_dim(qt, qb, b0, axis=0)
        return pull, qt, loss, extra

    qt0 = jnp.zeros_like(wt)
    _, qt, loss, extra = jax.lax.fori_loop(0, plan.padded // block, block_step,
                                           (jnp.zeros_like(wt), qt0, jnp.zeros((), jnp.float32), state_extra))

    inv_perm = jnp.argsort(perm).astype(jnp.int32)
    weight_q = qt[:cols].T[:, inv_perm]
    codes = scales = zeros = payload = None
    if codec is not None:
        payload = extra.transpose(1, 0, 2)[:, : cols // group]
        g_idx = jnp.zeros(cols, jnp.int32)
    else:
        scale_t, zero_t, codes_t = extra
        codes = codes_t[:cols].T[:, inv_perm]
        n_real = 1 if config.group_size == -1 else cols // config.group_size
        scales, zeros = scale_t[:n_real].T, zero_t[:n_real].T
        g_idx = gid[:cols][inv_perm]
    return GPTQResult(
        weight=weight_q, loss=loss / 2, perm=perm, g_idx=g_idx, codes=codes, scales=scales, zeros=zeros,
        payload=payload, damp_used=factor.damp_used, damp_stage=factor.stage, fallback=factor.fallback,
        dead_columns=jnp.sum(dead, dtype=jnp.int32))


def _with_b0(step, b0, k, carry):
    return step(k, carry, b0)


# Column steps per loop iteration. Each loop iteration costs the GPU a round of control overhead; unrolling 4
# steps took a 4096 x 4096 solve on an H200 from 58 to 45 ms (8 and 16 gave no more), and the compiled program
# still does not grow with the width. XLA:CPU is the other way round: a 512 x 512 int4 solve took 98 ms unrolled by
# 4, 93 ms by 2 and 26 ms not unrolled (2 cores, the same bytes).
_COLUMN_UNROLL = 4
_COLUMN_UNROLL_CPU = 1


def _exact_order_sum(err: jax.Array) -> jax.Array:
    """Sum of squares of ``err`` (n, R) in one fixed order, the same bits whether or not the solve is vmapped.

    A ``jnp.sum`` lowers to different reduction orders in a batched and an unbatched program (XLA:CPU), which
    made the loss of one expert depend on how many experts were solved together. Here the squares are kept apart
    from the additions (no fused multiply-add) and summed by a fixed pairwise tree of elementwise adds.
    """
    x = jax.lax.optimization_barrier(err * err).reshape(-1)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = jnp.concatenate([x, jnp.zeros((1,), x.dtype)])
        x = x[0::2] + x[1::2]
    return x[0]


_solve_jit = jax.jit(solve_unchecked, static_argnames=("config", "codec"))


def solve(weight, hessian, config: QuantConfig = QuantConfig(), *, importance=None, name: str = "weight",
          check: bool = True, codec: Optional[GroupCodec] = None) -> GPTQResult:
    """GPTQ-quantizes one weight matrix.

    Args:
      weight: float (R, C) = (out_features, in_features).
      hessian: float32 (C, C), e.g. :func:`jgptq.hessian.finalize` of its inputs (any positive scale).
      config: a :class:`QuantConfig`.
      importance: float32 (C,) per-column importance for GGML encoders (None: the format's plain path).
      name: what the weight is, for error messages.
      check: validate shapes and finiteness first (one device sync).
      codec: a custom :class:`GroupCodec` solved with group updates (default: the GGML format's codec when
        ``config.format`` is a GGML format, else scalar-grid column updates).
    Returns:
      A :class:`GPTQResult`.
    """
    weight, hessian = jnp.asarray(weight), jnp.asarray(hessian)
    importance = None if importance is None else jnp.asarray(importance)
    if check:
        check_inputs(weight, hessian, importance, config, name, batched=False)
    return _solve_jit(weight, hessian, importance, config, codec)


@functools.partial(jax.jit, static_argnames=("config", "tied"))
def _solve_experts_jit(weights, hessians, importance, config, tied):
    h_axis = None if tied else 0
    i_axis = None if importance is None or importance.ndim == 1 else 0
    return jax.vmap(lambda w, h, i: solve_unchecked(w, h, i, config), in_axes=(0, h_axis, i_axis))(
        weights, hessians, importance)


def solve_experts(weights, hessians, config: QuantConfig = QuantConfig(), *, importance=None,
                  name: str = "experts", check: bool = True) -> GPTQResult:
    """GPTQ-quantizes a stack of same-shape weights in one vmapped call.

    Args:
      weights: float (E, R, C).
      hessians: float32 (E, C, C), or (C, C) shared by every expert (tied: one factorization for all).
      config: a :class:`QuantConfig`.
      importance: None, (C,) shared, or (E, C).
    Returns:
      A :class:`GPTQResult` whose every field has a leading expert axis E.
    """
    weights, hessians = jnp.asarray(weights), jnp.asarray(hessians)
    importance = None if importance is None else jnp.asarray(importance)
    if check:
        check_inputs(weights, hessians, importance, config, name, batched=True)
    if weights.shape[0] == 1:
        # A vmap of width 1 is compiled differently (XLA:CPU strips the unit batch axis and fuses the block
        # update's matmul with its transposes into another dot emitter): different bits. One expert takes the
        # unbatched program, which gives the same bits as a batch of two or more.
        imp = importance if importance is None or importance.ndim == 1 else importance[0]
        one = _solve_jit(weights[0], hessians if hessians.ndim == 2 else hessians[0], imp, config, None)
        return jax.tree.map(lambda a: a[None], one)
    return _solve_experts_jit(weights, hessians, importance, config, hessians.ndim == 2)


def summarize(result: GPTQResult) -> dict:
    """Plain-Python figures of a (possibly batched) result: loss, damping, fallbacks, dead columns."""
    loss = np.asarray(result.loss)
    return {
        "loss": loss.tolist(),
        "damp_used": np.asarray(result.damp_used).tolist(),
        "damp_stage": np.asarray(result.damp_stage).tolist(),
        "fallback": np.asarray(result.fallback).tolist(),
        "dead_columns": np.asarray(result.dead_columns).tolist(),
    }
