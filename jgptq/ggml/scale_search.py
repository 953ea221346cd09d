"""Scale searches of llama.cpp's quantizers, bit-exact, vectorized over groups.

Each function takes groups along the last axis (``x``: float32 (..., n)) and searches every group at once; the
tries of a search run in a ``lax.fori_loop``, the sums over a group run left to right (:func:`ordered_sum`), and
sequential coordinate-descent passes are unrolled over the n elements of a group (never over groups).

- :func:`symmetric_search` (llama.cpp ``make_qx_quants``, rmse_type 1): symmetric codes in [-nmax, nmax-1].
- :func:`cubic_refine_search` (``make_q3_quants`` with rmse): symmetric codes refined by coordinate descent.
- :func:`affine_search` (``make_qkx2_quants`` / ``make_qkx3_quants``): codes in [0, nmax] with a min.
- :func:`positive_search` (``make_qp_quants``): codes of non-negative values (sub-block scales), refined.

Integer codes are returned as int32; where C stores them in a ``uint8_t`` array the wrap-around is kept.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jgptq.ggml.common import (
    F32,
    GROUP_MAX_EPS,
    as_f32,
    div,
    first_absmax,
    mul,
    nearest_int,
    ordered_sum,
    scan_min_max,
    where,
)


def _bcast(v):
    return v[..., None]


def symmetric_search(x, nmax: int, w):
    """``make_qx_quants(n, nmax, x, L, 1, w)``.

    Args:
      x: float32 (..., n) values.
      nmax: codes are ``l + nmax`` with ``l`` in [-nmax, nmax-1].
      w: float32 (..., n) weights (C passes ``x*x`` when it has no importance).
    Returns:
      (scale float32 (...,), L int32 (..., n) in [0, 2*nmax-1]); groups with max |x| < 1e-15 give (0, 0).
    """
    amax, mx = first_absmax(x)
    wx = mul(w, x)

    def quantize(iscale):
        lv = jnp.clip(nearest_int(mul(_bcast(iscale), x)), -nmax, nmax - 1)
        lf = as_f32(lv)
        return lv, ordered_sum(mul(wx, lf), 0.0), ordered_sum(mul(mul(w, lf), lf), 0.0)

    iscale = div(np.float32(-nmax), mx)
    _, sumlx, suml2 = quantize(iscale)
    scale = where(suml2 != 0, div(sumlx, suml2), 0.0)
    best = mul(scale, sumlx)
    tries = np.array([np.float32(nmax) + np.float32(np.float32(0.1) * np.float32(i))
                      for i in range(-9, 10) if i != 0], np.float32)
    tries = jnp.asarray(-tries)

    # The loop carries per-group numbers only: the codes of the best try are rebuilt once from its inverse scale
    # (the same float32 operations, so the same codes), instead of a (..., n) copy written at every try.
    def body(k, carry):
        ibest, scale, best = carry
        isc = div(tries[k], mx)
        _, sumlx, suml2 = quantize(isc)
        take = (suml2 > 0) & (mul(sumlx, sumlx) > mul(best, suml2))
        new_scale = div(sumlx, suml2)
        return (where(take, isc, ibest), where(take, new_scale, scale),
                where(take, mul(new_scale, sumlx), best))

    iscale, scale, _ = lax.fori_loop(0, len(tries), body, (iscale, scale, best))
    lv = quantize(iscale)[0]
    zero = amax < GROUP_MAX_EPS
    return where(zero, 0.0, scale), where(_bcast(zero), 0, lv + nmax)


def cubic_refine_search(x, nmax: int):
    """``make_q3_quants(n, nmax, x, L, true)``: weights ``x*x``, up to 5 coordinate-descent passes.

    Returns (scale float32 (...,), L int32 (..., n) in [0, 2*nmax-1]); zero groups give (0, 0).
    """
    amax, mx = first_absmax(x)
    iscale = div(np.float32(-nmax), mx)
    lv = jnp.clip(nearest_int(mul(_bcast(iscale), x)), -nmax, nmax - 1)
    w = mul(x, x)
    wx = mul(w, x)
    lf = as_f32(lv)
    sumlx = ordered_sum(mul(wx, lf), 0.0)
    suml2 = ordered_sum(mul(mul(w, lf), lf), 0.0)

    lv, sumlx, suml2 = _coordinate_descent(x, w, wx, lv, sumlx, suml2,
                                           lambda v: jnp.clip(v, -nmax, nmax - 1), positive=False)
    scale = where(suml2 > 0, div(sumlx, suml2), 0.0)
    zero = amax < GROUP_MAX_EPS
    return where(zero, 0.0, scale), where(_bcast(zero), 0, lv + nmax)


def affine_search(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """``make_qkx2_quants`` / ``make_qkx3_quants`` (they agree when weights are given).

    Args:
      x: float32 (..., n); w: float32 (..., n) weights.
      nmax: codes in [0, nmax]; rmin, rdelta, nstep: the tries ``iscale = (rmin + rdelta*is + nmax)/(max-min)``
        for ``is`` in 0..nstep; use_mad: absolute instead of squared error.
    Returns:
      (scale float32 (...,), the_min float32 (...,) (= -min >= 0), L int32 (..., n)); value = scale*L - the_min.
    """
    lo, hi = scan_min_max(x)
    sum_w = ordered_sum(w)
    sum_x = ordered_sum(mul(w, x))
    mn = where(lo > 0, 0.0, lo)
    flat = hi == mn

    def codes(iscale, mn):
        return jnp.clip(nearest_int(mul(_bcast(iscale), x - _bcast(mn))), 0, nmax)

    def error(scale, mn, lv):
        diff = mul(_bcast(scale), as_f32(lv)) + _bcast(mn) - x
        diff = jnp.abs(diff) if use_mad else mul(diff, diff)
        return ordered_sum(mul(w, diff), 0.0)

    iscale = div(np.float32(nmax), hi - mn)
    scale = div(np.float32(1), iscale)
    best = error(scale, mn, codes(iscale, mn))
    tries = np.array([np.float32(np.float32(np.float32(rmin) + np.float32(np.float32(rdelta) * np.float32(i)))
                                 + np.float32(nmax)) for i in range(nstep + 1)], np.float32)
    tries = jnp.asarray(tries)

    # The loop carries per-group numbers only: the best try's codes are rebuilt once after it from the inverse
    # scale and min that made them (the same float32 operations, so the same codes), instead of a (..., n) copy
    # written at every try (on a GPU that copy was most of the encoder's memory traffic).
    def body(k, carry):
        (ibest, mbest), best, scale, mn_cur = carry
        # C keeps updating ``min`` inside the loop: later tries measure the range from the accepted min.
        isc = div(tries[k], hi - mn_cur)
        la = codes(isc, mn_cur)
        lf = as_f32(la)
        wl = mul(w, lf)
        sum_l = ordered_sum(wl, 0.0)
        sum_l2 = ordered_sum(mul(wl, lf), 0.0)
        sum_xl = ordered_sum(mul(wl, x), 0.0)
        d = mul(sum_w, sum_l2) - mul(sum_l, sum_l)
        this_scale = div(mul(sum_w, sum_xl) - mul(sum_x, sum_l), d)
        this_min = div(mul(sum_l2, sum_x) - mul(sum_l, sum_xl), d)
        clamp = this_min > 0
        this_min = where(clamp, 0.0, this_min)
        this_scale = where(clamp, div(sum_xl, sum_l2), this_scale)
        cur = error(this_scale, this_min, la)
        take = (d > 0) & (cur < best)
        return ((where(take, isc, ibest), where(take, mn_cur, mbest)), where(take, cur, best),
                where(take, this_scale, scale), where(take, this_min, mn_cur))

    made = (iscale, mn)
    if nstep >= 1:
        made, best, scale, mn = lax.fori_loop(0, nstep + 1, body, (made, best, scale, mn))
    lv = codes(*made)
    return (where(flat, 0.0, scale), -mn, where(_bcast(flat), 0, lv))


def positive_search(x, w, nmax: int):
    """``make_qp_quants(n, nmax, x, L, w)`` for non-negative ``x`` (sub-block scales or mins).

    Returns (scale float32 (...,), L int32 (..., n)); L keeps C's ``uint8_t`` storage (values mod 256).
    """
    n = x.shape[-1]
    mx = jnp.zeros(x.shape[:-1], F32)
    for i in range(n):
        mx = where(mx > x[..., i], mx, x[..., i])
    iscale = div(np.float32(nmax), mx)
    l0 = nearest_int(mul(_bcast(iscale), x)) & 0xFF
    scale = div(np.float32(1), iscale)

    def mse(scale, lv):
        diff = x - mul(_bcast(scale), as_f32(lv))
        return ordered_sum(mul(mul(w, diff), diff), 0.0)

    best = mse(scale, l0)
    tries = jnp.asarray(np.array([np.float32(np.float32(np.float32(0.1) * np.float32(i)) + np.float32(nmax))
                                  for i in range(-4, 5) if i != 0], np.float32))

    def body(k, carry):
        best, iscale = carry
        isc = div(tries[k], mx)
        sc = div(np.float32(1), isc)
        lv = jnp.minimum(nmax, nearest_int(mul(_bcast(isc), x)))
        cur = mse(sc, lv)
        take = cur < best
        return where(take, cur, best), where(take, isc, iscale)

    _, iscale = lax.fori_loop(0, len(tries), body, (best, iscale))
    lv = jnp.minimum(nmax, nearest_int(mul(_bcast(iscale), x)))
    lf = as_f32(lv)
    wx = mul(w, x)
    sumlx = ordered_sum(mul(wx, lf), 0.0)
    suml2 = ordered_sum(mul(mul(w, lf), lf), 0.0)
    lv = lv & 0xFF

    lv, sumlx, suml2 = _coordinate_descent(x, w, wx, lv, sumlx, suml2,
                                           lambda v: jnp.minimum(nmax, v), positive=True)
    scale = where(suml2 > 0, div(sumlx, suml2), 0.0)
    zero = mx < GROUP_MAX_EPS
    return where(zero, 0.0, scale), where(_bcast(zero), 0, lv)


def _coordinate_descent(x, w, wx, lv, sumlx, suml2, clamp, positive: bool):
    """Up to 5 passes over the elements of each group, moving code i to ``nearest_int(x_i * sl2 / slx)``.

    A move is kept when it raises ``sumlx**2 / suml2`` (the weighted least-squares fit). C stops after a pass
    without moves; such a pass leaves the state unchanged, so always running 5 passes gives the same result. The
    steps run in a ``fori_loop`` over (pass, element), each step vectorized over all groups.
    ``positive`` selects ``make_qp_quants`` (codes >= 0 stored as ``uint8_t``, both partial sums must be > 0)
    over ``make_q3_quants`` (only the partial ``sumlx`` must be > 0; the new ``suml2`` must be > 0).
    """
    n = x.shape[-1]

    def step(s, carry):
        lv, sumlx, suml2 = carry
        i = s % n
        xi, wi, wxi = (lax.dynamic_index_in_dim(a, i, axis=-1, keepdims=False) for a in (x, w, wx))
        old = lax.dynamic_index_in_dim(lv, i, axis=-1, keepdims=False)
        li = as_f32(old)
        slx = sumlx - mul(wxi, li)
        sl2 = suml2 - mul(mul(wi, li), li)
        new_l = clamp(nearest_int(div(mul(xi, sl2), slx)))
        nf = as_f32(new_l)
        slx2 = slx + mul(wxi, nf)
        sl2b = sl2 + mul(mul(wi, nf), nf)
        take = (slx > 0) & (new_l != old) & (mul(mul(slx2, slx2), suml2) > mul(mul(sumlx, sumlx), sl2b))
        take = take & ((sl2 > 0) if positive else (sl2b > 0))
        if positive:
            new_l = new_l & 0xFF
        col = where(take, new_l, old)
        lv = lax.dynamic_update_index_in_dim(lv, col, i, axis=-1)
        return lv, where(take, slx2, sumlx), where(take, sl2b, suml2)

    return lax.fori_loop(0, 5 * n, step, (lv, sumlx, suml2))
