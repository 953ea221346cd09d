"""The grid-constrained scale search shared by the IQ2 and IQ3 encoders (llama.cpp's algorithm, bit-exact).

A sub-block of ``B`` non-negative values ``xval`` (signs are stored apart) is cut into groups of ``G`` (8 or 4). For
each trial inverse scale ``id`` the encoder rounds every value to a level ``l = round((id * xval - 1) / 2)`` in
``0..kmax-1``; a group whose level code is not a grid point is replaced by the neighbour (from the code's
neighbour list) closest in ``sqrt(weight)``-weighted distance at the trial scale. The trial whose least-squares
scale gives the largest ``sumqx**2 / sumq2`` wins; llama.cpp then requantizes with the winning scale and refits it.

Everything works on ``m`` sub-blocks at once: arrays are ``(m, B)`` float32; grid choices are ``(m, B // G)``
int32 grid indices. Sequential C loops (over trials) are ``lax.fori_loop``; per-trial work is vectorized.

The neighbour search is most of an encoder's work. Neighbour lists are padded to the longest (150 entries for
IQ2_XXS, whose off-grid codes have 33 on average), so on the CPU the search (:func:`nearest_off_grid`) visits
only the off-grid groups, each only up to its own list's end: groups sorted by list length, in tiles that stop
at their longest list. Every distance is the same float32 expression in the same order and the first minimum in
list order still wins, so the choice is the same as the padded search, which accelerators keep (there the
sequential tiles would cost more than the padding).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from jgptq.ggml.common import div, mul, nearest_int, ordered_sum, seq_max, where
from jgptq.ggml.iq_grids import IQGrid


class GridTables(NamedTuple):
    """jnp views of an :class:`IQGrid` for the encoders."""

    levels: jnp.ndarray  # int32 (n_grid, G)
    qvals: jnp.ndarray  # float32 (n_grid, G): the encoder's model 2l + 1
    kmap: jnp.ndarray  # int32 (n_codes,)
    neighbours: jnp.ndarray  # int32 (n_codes, max_nb), -1 padded
    nlev: int
    lengths: jnp.ndarray = None  # int32 (n_codes,): entries of each neighbour list


def tables(grid: IQGrid) -> GridTables:
    """Builds the jnp tables of ``grid``."""
    return GridTables(levels=jnp.asarray(grid.levels), qvals=jnp.asarray(2.0 * grid.levels + 1.0, jnp.float32),
                      kmap=jnp.asarray(grid.kmap), neighbours=jnp.asarray(grid.neighbours), nlev=grid.nlev,
                      lengths=jnp.asarray(grid.n_neighbours, jnp.int32))


def _grouped(a, g):
    return a.reshape(*a.shape[:-1], a.shape[-1] // g, g)


def compact_code(levels, nlev: int):
    """int32 (..., ngroups): compact code sum_i l_i * nlev**i of level groups (..., ngroups, G)."""
    code = levels[..., 0]
    for i in range(1, levels.shape[-1]):
        code = code + levels[..., i] * (nlev ** i)
    return code


def nearest_neighbour(code, xg, wg, scale, t: GridTables, qvals=None):
    """Grid index minimizing sum_i wg_i * (scale * q_i - xg_i)**2 over the neighbour list of each code.

    The first minimum in list order wins (llama.cpp's strict ``<`` scan).

    Args:
      code: int32 (m, ngroups) compact codes (off-grid ones are meaningful; others give some list).
      xg, wg: float32 (m, ngroups, G).
      scale: float32 (m,).
      t: grid tables.
      qvals: float32 (n_grid, G) candidate values (default: t.qvals).
    Returns:
      int32 (m, ngroups) grid indices.
    """
    qvals = t.qvals if qvals is None else qvals
    nb = t.neighbours[code]  # (m, ngroups, K)
    valid = nb >= 0
    idx = jnp.maximum(nb, 0)
    s = scale[:, None, None]
    d2 = None
    for i in range(xg.shape[-1]):
        q = qvals[:, i][idx]
        diff = mul(s, q) - xg[..., i:i + 1]
        term = mul(mul(wg[..., i:i + 1], diff), diff)
        d2 = term if d2 is None else d2 + term
    d2 = jnp.where(valid, d2, jnp.inf)
    j = jnp.argmin(d2, axis=-1)
    return jnp.take_along_axis(nb, j[..., None], axis=-1)[..., 0]


# Groups per tile of the CPU neighbour search: large enough that the loop overhead stays small, small enough that
# a tile's rows stay in cache (2048-16384 measured within 10% of each other on IQ2_XXS).
SEARCH_TILE = 4096


def _distance(xg, wg, scale, q):
    """sum_i wg_i * (scale * q_i - xg_i)**2 in order over the last axis, each term rounded (the search's
    distance); all arguments broadcast against each other."""
    d2 = None
    for i in range(xg.shape[-1]):
        diff = mul(scale, q[..., i]) - xg[..., i]
        term = mul(mul(wg[..., i], diff), diff)
        d2 = term if d2 is None else d2 + term
    return d2


def _longest_first(length, most: int):
    """int32 (n,) indices ordering ``length`` (int32 (n,), values in 0..most) from the longest down, equal lengths
    in index order: one sort of packed 32-bit keys (several times faster on the CPU than a stable argsort)."""
    n = length.shape[0]
    shift = max(1, (n - 1).bit_length())
    if (most + 1) << shift >= 1 << 32:
        return jnp.argsort(-length, stable=True).astype(jnp.int32)
    key = ((most - length).astype(jnp.uint32) << shift) | jnp.arange(n, dtype=jnp.uint32)
    return (jnp.sort(key) & jnp.uint32((1 << shift) - 1)).astype(jnp.int32)


def _nearest_tiled(code, xg, wg, scale, active, t: GridTables):
    """:func:`nearest_neighbour` of the ``active`` groups (others: any index), visiting each group's list only
    to its end (module docstring)."""
    m, ng, g = xg.shape
    n = m * ng
    c = code.reshape(n)
    length = jnp.where(active.reshape(n), t.lengths[c], 0)
    order = _longest_first(length, int(t.neighbours.shape[1]))
    tile = min(SEARCH_TILE, n)
    tiles = -(-n // tile)

    def tiled(a):
        a = a[order]
        a = jnp.pad(a, [(0, tiles * tile - n)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(tiles, tile, *a.shape[1:])

    cs, xs, ws, lens = tiled(c), tiled(xg.reshape(n, g)), tiled(wg.reshape(n, g)), tiled(length)
    ss = tiled(jnp.broadcast_to(scale[:, None], (m, ng)).reshape(n))
    lists = t.neighbours.T  # (max_nb, n_codes)

    def one_tile(j, out):
        cj, xj, wj, sj = cs[j], xs[j], ws[j], ss[j]

        def step(state):
            k, best, arg = state
            nb = lists[k][cj]
            d2 = _distance(xj, wj, sj, t.qvals[jnp.maximum(nb, 0)])
            better = (nb >= 0) & (d2 < best)   # strict: the first minimum in list order stays
            return k + 1, where(better, d2, best), where(better, k, arg)

        init = (jnp.int32(0), jnp.full((tile,), jnp.inf, jnp.float32), jnp.zeros((tile,), jnp.int32))
        _, _, arg = lax.while_loop(lambda st: st[0] < lens[j, 0], step, init)
        return out.at[j].set(arg)

    arg = lax.fori_loop(0, tiles, one_tile, jnp.zeros((tiles, tile), jnp.int32)).reshape(-1)[:n]
    arg = jnp.zeros((n,), jnp.int32).at[order].set(arg)
    return t.neighbours[c, arg].reshape(m, ng)


def nearest_off_grid(code, xg, wg, scale, active, t: GridTables):
    """:func:`nearest_neighbour` for the groups where ``active`` (bool (m, ngroups)); the other groups' entries are
    unspecified. On the CPU the search of :func:`_nearest_tiled` (module docstring), elsewhere the padded one."""
    if t.lengths is None:
        return nearest_neighbour(code, xg, wg, scale, t)
    return lax.platform_dependent(code, xg, wg, scale, active,
                                  cpu=lambda *a: _nearest_tiled(*a, t),
                                  default=lambda c, x, w, s, _: nearest_neighbour(c, x, w, s, t))


def round_to_grid(xval, waux, id_, scale, t: GridTables, g: int, kmax: int):
    """Levels of ``xval`` at inverse scale ``id_``; off-grid groups go to their nearest neighbour at ``scale``.

    Returns (grid index int32 (m, ngroups), on_grid bool (m, ngroups)).
    """
    t1 = mul(id_[:, None], xval) - np.float32(1.0)
    lev = jnp.clip(nearest_int(mul(np.float32(0.5), t1)), 0, kmax - 1)
    code = compact_code(_grouped(lev, g), t.nlev)
    gi = t.kmap[code]
    on_grid = gi >= 0
    nb = nearest_off_grid(code, _grouped(xval, g), _grouped(waux, g), scale, ~on_grid, t)
    return jnp.where(on_grid, gi, nb), on_grid


def fit_sums(xval, weight, gidx, t: GridTables):
    """(sumqx, sumq2) of the levels of grid choices ``gidx`` (m, ngroups) against ``xval``, as llama.cpp sums them."""
    q = t.qvals[gidx].reshape(xval.shape)
    sumqx = ordered_sum(mul(mul(weight, xval), q))
    sumq2 = ordered_sum(mul(mul(weight, q), q))
    return sumqx, sumq2


def trial_numerators(kmax: int, step: float, lo: int, hi: int) -> np.ndarray:
    """float32 numerators ``(2*kmax - 1) + is*step`` for is = lo..hi, rounded as the C expression rounds them."""
    return np.array([np.float32(2 * kmax - 1) + np.float32(is_) * np.float32(step) for is_ in range(lo, hi + 1)],
                    np.float32)


def scale_search(xval, weight, waux, base, scale0, t: GridTables, *, g: int, kmax: int, numerators: np.ndarray,
                 on_grid_init: bool, requant: str):
    """llama.cpp's trial loop, requantization and refit for one sub-block per row.

    Args:
      xval, weight, waux: float32 (m, B).
      base: float32 (m,) the value the trial numerators are divided by (max or eff_max).
      scale0: float32 (m,) scale kept when no trial is accepted.
      t, g, kmax: grid tables, group size, number of levels.
      numerators: float32 numpy (n_trials,).
      on_grid_init: initial "group was on the grid" flags (the requant decision when no trial is accepted).
      requant: "all" (requantize every group if scale > 0), "offgrid" (only off-grid groups, if any and
        scale > 0) or "all_if_offgrid" (every group, if any is off grid and scale > 0).
    Returns:
      (scale float32 (m,) — may be negative, grid index int32 (m, B // g)).
    """
    m, b = xval.shape
    ng = b // g
    nums = jnp.asarray(numerators)

    def trial(k, carry):
        best, scale, gidx, on_grid = carry
        id_ = div(nums[k], base)
        this_scale = div(np.float32(1.0), id_)
        gi, og = round_to_grid(xval, waux, id_, this_scale, t, g, kmax)
        sumqx, sumq2 = fit_sums(xval, weight, gi, t)
        accept = (sumq2 > 0) & (mul(sumqx, sumqx) > mul(best, sumq2))
        new_scale = div(sumqx, sumq2)
        new_best = mul(new_scale, sumqx)
        a1 = accept[:, None]
        return (jnp.where(accept, new_best, best), jnp.where(accept, new_scale, scale),
                jnp.where(a1, gi, gidx), jnp.where(a1, og, on_grid))

    init = (jnp.zeros((m,), jnp.float32), scale0, jnp.zeros((m, ng), jnp.int32),
            jnp.full((m, ng), on_grid_init, bool))
    _, scale, gidx, on_grid = lax.fori_loop(0, len(numerators), trial, init)

    any_off = jnp.any(~on_grid, axis=-1)
    if requant == "all":
        do = scale > 0
        groups = jnp.ones_like(on_grid)
    elif requant == "offgrid":
        do = any_off & (scale > 0)
        groups = ~on_grid
    elif requant == "all_if_offgrid":
        do = any_off & (scale > 0)
        groups = jnp.ones_like(on_grid)
    else:
        raise ValueError(f"unknown requant mode {requant!r}")
    safe = jnp.where(do, scale, np.float32(1.0))
    gi, _ = round_to_grid(xval, waux, div(np.float32(1.0), safe), safe, t, g, kmax)
    gidx = jnp.where(do[:, None] & groups, gi, gidx)
    sumqx, sumq2 = fit_sums(xval, weight, gidx, t)
    scale = jnp.where(do & (sumq2 > 0), div(sumqx, sumq2), scale)
    return scale, gidx


def make_qp_quants(x, w, nmax: int):
    """llama.cpp's ``make_qp_quants`` scale for rows of ``x`` (m, n) with weights ``w`` (m, n) -> float32 (m,).

    Quantizes non-negative values to 0..nmax: a 9-trial scale search by weighted squared error, then up to five
    coordinate-descent passes. Levels are kept modulo 256 like the C ``uint8_t`` array they live in.
    """
    n = x.shape[-1]
    fmax = jnp.maximum(seq_max(x), np.float32(0.0))
    small = fmax < np.float32(1e-15)
    fmax = jnp.where(small, np.float32(1.0), fmax)
    iscale = div(np.float32(nmax), fmax)
    l0 = nearest_int(mul(iscale[:, None], x)) & 255
    scale = div(np.float32(1.0), iscale)
    diff = x - mul(scale[:, None], l0.astype(jnp.float32))
    best_mse = ordered_sum(mul(mul(w, diff), diff))
    for is_ in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_is = div(np.float32(0.1) * np.float32(is_) + np.float32(nmax), fmax)
        scale_is = div(np.float32(1.0), iscale_is)
        lq = jnp.minimum(nmax, nearest_int(mul(iscale_is[:, None], x)))
        diff = x - mul(scale_is[:, None], lq.astype(jnp.float32))
        mse = ordered_sum(mul(mul(w, diff), diff))
        better = mse < best_mse
        best_mse = jnp.where(better, mse, best_mse)
        iscale = jnp.where(better, iscale_is, iscale)
    lq = jnp.minimum(nmax, nearest_int(mul(iscale[:, None], x)))
    lf = lq.astype(jnp.float32)
    sumlx = ordered_sum(mul(mul(w, x), lf))
    suml2 = ordered_sum(mul(mul(w, lf), lf))
    # Coordinate descent: element by element, five passes (a pass that changes nothing leaves every later pass
    # unchanged too, so running all five equals llama.cpp's early exit). Columns lead for cheap dynamic indexing.
    xt, wt, wxt = x.T, w.T, mul(w, x).T
    lt = (lq & 255).T

    def step(k, carry):
        lt, sumlx, suml2 = carry
        i = k % n
        xi, wi, wxi = xt[i], wt[i], wxt[i]
        li_int = lt[i]
        li = li_int.astype(jnp.float32)
        slx = sumlx - mul(wxi, li)
        sl2 = suml2 - mul(mul(wi, li), li)
        ok = (slx > 0) & (sl2 > 0)
        new_l = jnp.minimum(nmax, nearest_int(div(mul(xi, sl2), slx)))
        nf = new_l.astype(jnp.float32)
        slx2 = slx + mul(wxi, nf)
        sl22 = sl2 + mul(mul(wi, nf), nf)
        accept = ok & (new_l != li_int) & (mul(mul(slx2, slx2), suml2) > mul(mul(sumlx, sumlx), sl22))
        lt = lt.at[i].set(jnp.where(accept, new_l & 255, li_int))
        return lt, jnp.where(accept, slx2, sumlx), jnp.where(accept, sl22, suml2)

    _, sumlx, suml2 = lax.fori_loop(0, 5 * n, step, (lt, sumlx, suml2))
    out = jnp.where(suml2 > 0, div(sumlx, jnp.where(suml2 > 0, suml2, np.float32(1.0))), np.float32(0.0))
    return jnp.where(small, np.float32(0.0), out)
