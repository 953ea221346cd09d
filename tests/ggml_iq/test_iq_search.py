"""The CPU neighbour search of the IQ encoders (visiting each group's list only to its end, groups sorted by list
length, in tiles) chooses what the padded search over every list entry chooses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgptq.ggml import iq_search
from jgptq.ggml.iq_grids import get_grid


@pytest.mark.parametrize("name", ["iq2xxs", "iq2s", "iq3xxs"])
def test_tiled_search_equals_padded_search(name, monkeypatch):
    grid = get_grid(name)
    t = iq_search.tables(grid)
    rng = np.random.default_rng(1)
    m, g = 300, grid.dim
    ng = 32 // g
    code = rng.integers(0, grid.kmap.shape[0], (m, ng)).astype(np.int32)
    code[:40] = np.argmax(grid.n_neighbours)                     # the longest list, several tiles of it
    xg = np.abs(rng.standard_normal((m, ng, g))).astype(np.float32)
    wg = rng.uniform(0.0, 2.0, (m, ng, g)).astype(np.float32)
    xg[40:80], wg[40:80] = 1.0, 1.0                               # equal distances: the first in list order wins
    wg[80:100] = 0.0                                              # all distances zero
    scale = rng.uniform(0.05, 0.5, m).astype(np.float32)
    active = (grid.kmap[code] < 0) & (rng.random((m, ng)) < 0.9)
    monkeypatch.setattr(iq_search, "SEARCH_TILE", 64)             # several tiles, the last one partial
    padded = np.asarray(jax.jit(lambda *a: iq_search.nearest_neighbour(*a, t))(code, xg, wg, scale))
    tiled = np.asarray(jax.jit(lambda *a: iq_search._nearest_tiled(*a, t))(code, xg, wg, scale, active))
    assert active.sum() > 100
    np.testing.assert_array_equal(tiled[active], padded[active])
    # the whole list is searched: a brute-force float64 argmin over each active group's list agrees where it
    # has a unique minimum
    nb = grid.neighbours[code]
    q = (2.0 * grid.levels + 1.0)[np.maximum(nb, 0)]
    d2 = (wg[:, :, None, :] * (scale[:, None, None, None] * q - xg[:, :, None, :]) ** 2).sum(-1)
    d2 = np.where(nb >= 0, d2, np.inf)
    best = np.take_along_axis(nb, d2.argmin(-1)[..., None], -1)[..., 0]
    srt = np.sort(d2, -1)
    with np.errstate(invalid="ignore"):      # lists of one entry: inf - inf
        gap = np.where(np.isinf(srt[..., 1]), np.inf, srt[..., 1] - srt[..., 0])
    clear = active & (gap > 1e-4 * np.maximum(srt[..., 0], 1e-6))
    np.testing.assert_array_equal(tiled[clear], best[clear])


def test_longest_first_is_a_stable_descending_order():
    rng = np.random.default_rng(2)
    length = rng.integers(0, 151, 5000).astype(np.int32)
    got = np.asarray(jax.jit(lambda v: iq_search._longest_first(v, 150))(jnp.asarray(length)))
    np.testing.assert_array_equal(got, np.argsort(-length, kind="stable"))
