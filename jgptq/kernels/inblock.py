"""The in-block column loop of the GPTQ solve (integer grids) as one fused Pallas kernel.

Inside a block of ``block`` solve-order columns, rows are independent given the block's factor ``U_bb`` and each
row's grid. One program takes a tile of ``row_tile`` rows, keeps its (row_tile x block) slice of the weight in
registers and runs the block's column steps there, keeping each step's error and code in two more register
tiles; the block is read from memory once, and errors, codes (and lazy grids) written once. Per column ``j``:

    q = clamp(round(w_j / s) + z, 0, maxq);  dq = s (q - z);  err = (w_j - dq) / U_jj;  W -= U[j, :]^T err

and, with lazy grids, at the first column of each group the group's grid is fitted from the current (already
error-updated) columns of the group, exactly as :func:`jgptq.quantizers.uniform.fit` without clip search. Static
grids come in per column. The lazy update of the columns right of the block stays an XLA matrix product.

The arithmetic is the XLA loop's, operation for operation: rounding half to even and IEEE division (on the GPU
through the PTX instructions ``cvt.rni.f32.f32`` and ``div.rn.f32``: Triton has no rounding primitive and
lowers ``/`` to an approximate division), scales rounded to their storage dtype (``cvt.rn.f16.f32``).
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
``JGPTQ_SOLVER_TILING=rows,warps,stages`` (e.g. ``8,1,1``) sets the kernel's tiling (:class:`Tiling`).
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
      row_tile: weight rows per program for blocks of up to 128 columns (a power of two; halved for each
        doubling of the block past 128, and lowered to the row count's next power of two for short matrices).
      num_warps: warps per program. One warp keeps every reduction over the block's columns inside the warp
        (shuffles); with more, Triton splits the columns over warps and each step waits on shared memory.
      num_stages: Triton software-pipelining stages of the column loop's loads.
    """

    row_tile: int = 8
    num_warps: int = 1
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
      dequantized: float32 (block, R), ``scale * (code - zero)`` (computed outside the kernel from its codes).
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


class _Exact(NamedTuple):
    divide: Callable      # IEEE float32 x / y
    rint: Callable        # round half to even
    storable: Callable    # a scale rounded to its storage dtype, as uniform.storable_scale


def _exact_ops(compiled: bool, scale_dtype: str) -> _Exact:
    """Arithmetic with the XLA loop's float32 results: PTX instructions in a compiled kernel (Triton lowers
    ``/`` to an approximate division, has no rounding primitive, and cannot lower the bit tricks that keep XLA
    from dropping a float16 round trip), jnp and :mod:`jgptq.quantizers.uniform` otherwise."""
    if not compiled:
        return _Exact(jnp.divide, jnp.round, lambda s: uniform.storable_scale(s, scale_dtype))

    def storable(s):
        if scale_dtype == "float32":
            return s
        short = {"float16": "f16", "bfloat16": "bf16"}[scale_dtype]
        rounded = _ptx(f"{{ .reg .b16 t; cvt.rn.{short}.f32 t, $1; cvt.f32.{short} $0, t; }}", s)
        return jnp.maximum(rounded, np.float32(jnp.finfo(jnp.dtype(scale_dtype)).smallest_subnormal))

    return _Exact(lambda x, y: _ptx("div.rn.f32 $0, $1, $2;", x, y), lambda x: _ptx("cvt.rni.f32.f32 $0, $1;", x),
                  storable)


def _kernel(*refs, block, group, lazy, maxq, sym, scale_dtype, compiled):
    if lazy:
        w_ref, u_ref, err_ref, code_ref, scale_ref, zero_ref = refs
    else:
        w_ref, u_ref, scale_ref, zero_ref, err_ref, code_ref = refs
    div, rint, storable = _exact_ops(compiled, scale_dtype)
    # The tile is (rows, block), the block's columns contiguous in memory and in the tile. Everything inside the
    # column loop keeps the tile's shape (column j is taken by a masked reduction, errors and codes are merged
    # in by selects and stored once at the end), so Triton keeps one register layout throughout.
    col_id = lax.broadcasted_iota(jnp.int32, (1, block), 1)

    def column(j, carry, scale, zero):
        tile, errs, codes = carry
        at_j = col_id == j
        col = jnp.sum(jnp.where(at_j, tile, 0.0), axis=1)
        q = jnp.clip(rint(div(col, scale)) + zero, 0.0, float(maxq))
        err = div(col - scale * (q - zero), jnp.broadcast_to(u_ref[j, j], col.shape))
        errs = jnp.where(at_j, err[:, None], errs)
        codes = jnp.where(at_j, q[:, None], codes)
        return tile - err[:, None] * u_ref[pl.ds(j, 1), :], errs, codes  # U[j, :] is zero left of j

    tile = w_ref[...]
    carry = (tile, jnp.zeros_like(tile), jnp.zeros_like(tile))
    if lazy:
        def group_step(k, carry):
            g0 = k * group
            inside = (col_id >= g0) & (col_id < g0 + group)
            wmin = jnp.min(jnp.where(inside, carry[0], jnp.inf), axis=1)
            wmax = jnp.max(jnp.where(inside, carry[0], -jnp.inf), axis=1)
            xmin, xmax = uniform.range_from_extremes(wmin, wmax, sym)
            scale = storable((xmax - xmin) * np.float32(1.0 / maxq))
            zero = jnp.full_like(scale, (maxq + 1) / 2) if sym else rint(div(-xmin, scale))
            scale_ref[:, pl.ds(k, 1)] = scale[:, None]
            zero_ref[:, pl.ds(k, 1)] = zero[:, None]
            return lax.fori_loop(0, group, lambda i, c: column(g0 + i, c, scale, zero), carry)

        _, errs, codes = lax.fori_loop(0, block // group, group_step, carry)
    else:
        _, errs, codes = lax.fori_loop(0, block, lambda j, c: column(j, c, scale_ref[:, j], zero_ref[:, j]), carry)
    err_ref[...] = errs
    code_ref[...] = codes.astype(jnp.uint8)


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
    # the register tiles hold row_tile x 128 values; wider blocks take proportionally fewer rows
    rt = min(max(1, tiles.row_tile * 128 // max(block, 128)), _next_pow2(rows))
    padded = -(-rows // rt) * rt
    pad = ((0, padded - rows), (0, 0))

    def rows_first(a, fill=0.0):  # (block, R) -> (padded R, block); XLA transposes, once a block
        return jnp.pad(a.astype(jnp.float32).T, pad, constant_values=fill)

    args = [rows_first(wb), ub.astype(jnp.float32)]
    tile = pl.BlockSpec((rt, block), lambda i: (i, 0))
    in_specs = [tile, pl.BlockSpec((block, block), lambda i: (0, 0))]
    out_shape = [jax.ShapeDtypeStruct((padded, block), jnp.float32), jax.ShapeDtypeStruct((padded, block), jnp.uint8)]
    out_specs = [tile] * 2
    if lazy:
        n_groups = block // group
        out_shape += [jax.ShapeDtypeStruct((padded, n_groups), jnp.float32)] * 2
        out_specs += [pl.BlockSpec((rt, n_groups), lambda i: (i, 0))] * 2
    else:
        args += [rows_first(scale_cols, 1.0), rows_first(zero_cols)]
        in_specs += [tile, tile]
    kernel = functools.partial(_kernel, block=block, group=group if lazy else block, lazy=lazy, maxq=config.maxq,
                               sym=config.sym, scale_dtype=config.scale_dtype, compiled=not interpret)
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        extra["compiler_params"] = plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(padded // rt,), in_specs=in_specs,
                          out_specs=out_specs, interpret=interpret, name="gptq_inblock", **extra)(*args)
    errors, codes, *grids = [o[:rows].T for o in outs]
    if lazy:
        scale_cols, zero_cols = (jnp.repeat(g, group, axis=0) for g in grids)
    # the kernel's own dequantization, in XLA: the same product, on the codes it chose
    dequantized = uniform.dequantize(codes.astype(jnp.float32), scale_cols, zero_cols)
    return BlockOutput(dequantized, errors, codes, *(grids if lazy else (None, None)))


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
