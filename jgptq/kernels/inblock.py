"""The in-block column loop of the GPTQ solve (integer grids) as one fused Pallas kernel.

Inside a block of ``block`` solve-order columns, rows are independent given the block's factor ``U_bb`` and each
row's grid. One program takes a tile of ``row_tile`` rows, keeps its (block x row_tile) slice of the weight in
registers and runs the block's column steps there, writing each step's dequantized values, error and code as
it goes; the weight block is read from memory once and never written back. Per column ``j``:

    q = clamp(round(w_j / s) + z, 0, maxq);  dq = s (q - z);  err = (w_j - dq) / U_jj;  W -= U[j, :]^T err

and, with lazy grids, at the first column of each group the group's grid is fitted from the current (already
error-updated) columns of the group, exactly as :func:`jgptq.quantizers.uniform.fit` without clip search. Static
grids come in per column. The lazy update of the columns right of the block stays an XLA matrix product.

The arithmetic is the XLA loop's, operation for operation: rounding half to even and IEEE division (on the GPU
through the PTX instructions ``cvt.rni.f32.f32`` and ``div.rn.f32``: Triton has no rounding primitive and
lowers ``/`` to an approximate division).
Codes can still differ where ``w / s`` sits within float32 noise of a half-integer, since the compilers order
and contract the rank-1 updates differently.

Which path solves (read when a solve is traced; call ``jax.clear_caches()`` after changing it):

- ``JGPTQ_SOLVER_KERNEL=auto`` (default): the kernel on CUDA GPUs, the XLA loop elsewhere (a process without a
  CUDA backend traces the XLA loop alone);
- ``JGPTQ_SOLVER_KERNEL=pallas``: the kernel everywhere, in Pallas' interpret mode off the GPU (slow; tests);
- ``JGPTQ_SOLVER_KERNEL=xla``: the XLA loop everywhere.

Configurations the kernel does not implement take the XLA loop, decided when the solve is traced and logged at
INFO on ``jgptq.kernels``: the MSE clip search (``mse > 0``), and blocks that are not a power of two from 16 to
256 columns (e.g. ``group_size=96``). Act-order is transparent: the columns arrive already permuted.
``JGPTQ_SOLVER_TILING=rows,warps,stages`` (e.g. ``32,4,1``) sets the kernel's tiling (:class:`Tiling`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jgptq.config import QuantConfig
from jgptq.quantizers import uniform

log = logging.getLogger("jgptq.kernels")

MODE_ENV = "JGPTQ_SOLVER_KERNEL"
TILING_ENV = "JGPTQ_SOLVER_TILING"
MODES = ("auto", "pallas", "xla")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the kernel is laid out on the GPU.

    Attributes:
      row_tile: weight rows per program (a power of two; lowered to the next power of two above the row count
        when the matrix has fewer rows).
      num_warps: warps per program.
      num_stages: Triton software-pipelining stages of the column loop's loads.
    """

    row_tile: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for name in ("row_tile", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"Tiling.{name}={v!r} must be a positive power of two")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"Tiling.num_stages={self.num_stages!r} must be a positive integer")


def mode() -> str:
    """The solver path asked for by ``JGPTQ_SOLVER_KERNEL`` (``auto`` when unset)."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r} must be one of {MODES}")
    return value


def tiling() -> Tiling:
    """The kernel tiling asked for by ``JGPTQ_SOLVER_TILING`` (``rows,warps,stages``), else :class:`Tiling`()."""
    value = os.environ.get(TILING_ENV, "").strip()
    if not value:
        return Tiling()
    try:
        rows, warps, stages = (int(v) for v in value.split(","))
    except ValueError:
        raise ValueError(f"{TILING_ENV}={value!r} must be three integers 'rows,warps,stages'") from None
    return Tiling(rows, warps, stages)


def unsupported(config: QuantConfig, block: int) -> Optional[str]:
    """Why the kernel cannot solve blocks of ``block`` columns under ``config`` (None: it can)."""
    if config.is_ggml:
        return f"format {config.format!r} is a group codec, not an integer grid"
    if config.mse > 0:
        return "the MSE clip search (mse > 0) is not implemented in the kernel"
    if block & (block - 1) or not 16 <= block <= 256:
        return f"a block of {block} columns is not a power of two from 16 to 256"
    return None


class BlockOutput(NamedTuple):
    """What the kernel returns for one block (transposed: one row per solved column).

    Attributes:
      dequantized: float32 (block, R).
      errors: float32 (block, R), ``(w_j - dq_j) / U_jj``.
      codes: uint8 (block, R).
      scales, zeros: float32 (block // group, R), the grids fitted at each group's first column (lazy grids),
        or None (static grids).
    """

    dequantized: jax.Array
    errors: jax.Array
    codes: jax.Array
    scales: Optional[jax.Array]
    zeros: Optional[jax.Array]


def _ptx(asm: str, *args):
    """One PTX instruction applied elementwise to float32 arrays of one shape (compiled kernels only)."""
    from jax.experimental.pallas import triton as plgpu

    constraints = ",".join(["=f"] + ["f"] * len(args))
    return plgpu.elementwise_inline_asm(asm, args=list(args), constraints=constraints, pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])[0]


def _exact_ops(compiled: bool):
    """(divide, round half to even) with IEEE float32 results: PTX instructions in a compiled kernel (Triton
    lowers ``/`` to an approximate division and has no rounding primitive), jnp otherwise."""
    if not compiled:
        return jnp.divide, jnp.round
    return (lambda x, y: _ptx("div.rn.f32 $0, $1, $2;", x, y)), (lambda x: _ptx("cvt.rni.f32.f32 $0, $1;", x))


def _kernel(*refs, block, group, lazy, maxq, sym, scale_dtype, compiled):
    if lazy:
        w_ref, ut_ref, dq_ref, err_ref, code_ref, scale_ref, zero_ref = refs
    else:
        w_ref, ut_ref, scale_ref, zero_ref, dq_ref, err_ref, code_ref = refs
    div, rint = _exact_ops(compiled)
    row = lax.broadcasted_iota(jnp.int32, (block, 1), 0)

    def column(j, tile, scale, zero):
        # Column j of the register tile by a masked reduction (registers cannot be indexed dynamically).
        col = jnp.sum(jnp.where(row == j, tile, 0.0), axis=0)
        q = jnp.clip(rint(div(col, scale)) + zero, 0.0, float(maxq))
        dq = scale * (q - zero)
        err = div(col - dq, jnp.broadcast_to(ut_ref[j, j], col.shape))
        dq_ref[j, :] = dq
        err_ref[j, :] = err
        code_ref[j, :] = q.astype(jnp.uint8)
        return tile - ut_ref[:, pl.ds(j, 1)] * err[None, :]  # ut[:, j] = U[j, :]: zero left of j

    tile = w_ref[...]
    if not lazy:
        lax.fori_loop(0, block, lambda j, t: column(j, t, scale_ref[j, :], zero_ref[j, :]), tile)
        return

    def group_step(k, tile):
        g0 = k * group
        inside = (row >= g0) & (row < g0 + group)
        wmin = jnp.min(jnp.where(inside, tile, jnp.inf), axis=0)
        wmax = jnp.max(jnp.where(inside, tile, -jnp.inf), axis=0)
        xmin, xmax = uniform.range_from_extremes(wmin, wmax, sym)
        scale = uniform.storable_scale((xmax - xmin) * np.float32(1.0 / maxq), scale_dtype)
        zero = jnp.full_like(scale, (maxq + 1) / 2) if sym else rint(div(-xmin, scale))
        scale_ref[k, :] = scale
        zero_ref[k, :] = zero
        return lax.fori_loop(0, group, lambda i, t: column(g0 + i, t, scale, zero), tile)

    lax.fori_loop(0, block // group, group_step, tile)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def solve_block(wb: jax.Array, ub: jax.Array, scale_cols: Optional[jax.Array] = None,
                zero_cols: Optional[jax.Array] = None, *, config: QuantConfig, group: int, lazy: bool,
                interpret: bool = False, tiles: Optional[Tiling] = None) -> BlockOutput:
    """Runs the column steps of one block in the kernel.

    Args:
      wb: float32 (block, R), the block's weights transposed (row j = solve column j), lazy updates applied.
      ub: float32 (block, block), the block's upper factor ``U_bb``.
      scale_cols, zero_cols: float32 (block, R), every column's grid (static grids), or None (lazy grids).
      config: the :class:`QuantConfig` (bits, sym, scale_dtype are read).
      group: columns per lazy grid (divides ``block``); ignored for static grids.
      lazy: fit grids at each group's first column.
      interpret: run in Pallas' interpret mode (any backend) instead of compiling for the GPU.
      tiles: the :class:`Tiling` (default: :func:`tiling`).
    Returns:
      A :class:`BlockOutput`. Vmappable (a batch axis becomes a grid axis of the kernel).
    """
    block, rows = wb.shape
    if lazy and (block % group or group & (group - 1)):
        raise ValueError(f"lazy groups of {group} columns do not tile a block of {block} power-of-two columns")
    tiles = tiles or tiling()
    rt = min(tiles.row_tile, _next_pow2(rows))
    padded = -(-rows // rt) * rt
    pad = ((0, 0), (0, padded - rows))
    args = [jnp.pad(wb.astype(jnp.float32), pad), ub.astype(jnp.float32).T]
    tile = pl.BlockSpec((block, rt), lambda i: (0, i))
    in_specs = [tile, pl.BlockSpec((block, block), lambda i: (0, 0))]
    out_shape = [jax.ShapeDtypeStruct((block, padded), jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct((block, padded), jnp.uint8)]
    out_specs = [tile] * 3
    if lazy:
        n_groups = block // group
        out_shape += [jax.ShapeDtypeStruct((n_groups, padded), jnp.float32)] * 2
        out_specs += [pl.BlockSpec((n_groups, rt), lambda i: (0, i))] * 2
    else:
        args += [jnp.pad(scale_cols.astype(jnp.float32), pad, constant_values=1.0),
                 jnp.pad(zero_cols.astype(jnp.float32), pad)]
        in_specs += [tile, tile]
    kernel = functools.partial(_kernel, block=block, group=group if lazy else block, lazy=lazy, maxq=config.maxq,
                               sym=config.sym, scale_dtype=config.scale_dtype, compiled=not interpret)
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        extra["compiler_params"] = plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(padded // rt,), in_specs=in_specs,
                          out_specs=out_specs, interpret=interpret, name="gptq_inblock", **extra)(*args)
    outs = [o[:, :rows] for o in outs]
    return BlockOutput(*outs[:3], *(outs[3:] if lazy else (None, None)))


def _has_cuda() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def in_block_solver(config: QuantConfig, block: int, group: int, lazy: bool) -> Optional[Callable]:
    """The kernel path of the solver's in-block loop, or None where the XLA loop is to be used everywhere.

    The returned ``step(wb, ub, b0, gid, tables, xla_step) -> (qb, eb, tables)`` solves the block starting at
    solve column ``b0``: ``wb``, ``ub`` as in :func:`solve_block`; ``gid`` int32 (padded C,) the grid index of
    every solve column; ``tables`` = (scale_t, zero_t (groups, R) float32, codes_t (padded C, R) uint8), updated
    and returned; ``xla_step(wb, ub, tables)`` the XLA loop, taken on the platforms the kernel does not serve.
    ``qb``, ``eb``: float32 (block, R) dequantized values and errors.
    """
    chosen = mode()
    if chosen == "xla" or (chosen == "auto" and not _has_cuda()):
        return None
    reason = unsupported(config, block)
    if reason is not None:
        log.info("in-block kernel not used: %s; the XLA column loop solves", reason)
        return None
    tiles = tiling()

    def kernel_step(interpret):
        def step(wb, ub, b0, gid, tables):
            scale_t, zero_t, codes_t = tables
            gid_block = lax.dynamic_slice_in_dim(gid, b0, block)
            if lazy:
                out = solve_block(wb, ub, config=config, group=group, lazy=True, interpret=interpret, tiles=tiles)
                first = gid_block[::group]  # the grid of each group, written where the XLA loop writes it
                scale_t, zero_t = scale_t.at[first].set(out.scales), zero_t.at[first].set(out.zeros)
            else:
                out = solve_block(wb, ub, scale_t[gid_block], zero_t[gid_block], config=config, group=block,
                                  lazy=False, interpret=interpret, tiles=tiles)
            codes_t = lax.dynamic_update_slice_in_dim(codes_t, out.codes, b0, axis=0)
            return out.dequantized, out.errors, (scale_t, zero_t, codes_t)

        return step

    def solve(wb, ub, b0, gid, tables, xla_step):
        if chosen == "pallas":
            other = kernel_step(True)
        else:
            def other(wb, ub, b0, gid, tables):
                return xla_step(wb, ub, tables)
        return lax.platform_dependent(wb, ub, b0, gid, tables, cuda=kernel_step(False), default=other)

    return solve
