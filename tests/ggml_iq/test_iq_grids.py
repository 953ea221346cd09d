"""IQ grids and encoder tables against llama.cpp's tables and an independent rebuild of its neighbour search."""

import hashlib

import numpy as np
import pytest

from jgptq.ggml.iq_grids import get_grid, ksigns

# sha256 of llama.cpp's encoder code tables (uint16 little-endian) in ggml-quants.c, llama-cpp-python 0.3.36:
# kgrid_2bit_256/512/1024, kgrid_1bit_2048 (iq2xs_init_impl) and kgrid_256/512 (iq3xs_init_impl).
KGRID_SHA256 = {
    "iq2xxs": "915952ebc4af8ddba8113583ca1316fc818843f7b825bbf1a25ae1c39bf0e16d",
    "iq2xs": "f66435966ca8d64e9e4a6e3c91e64afcf9015e700ec85962f527283ebae207b9",
    "iq2s": "e6e75e121b65e8afa5c1f92b71463cfbe217b83893f438acde22fd5db06a43f7",
    "iq1s": "e9ffebfc997ad6023063a667c0bf4eedd8ebf7f56b3da399cbc7d1b1f7ea52c6",
    "iq3xxs": "c9678803c61b2210fbd8cbbb3f965a835409cd7d88a04d086d236261bd221d11",
    "iq3s": "353274c58dd7d8dc5ee960dc8fc54ff9164eaf2b49206b841cd49415cf393f81",
}
SIZES = {"iq2xxs": 256, "iq2xs": 512, "iq2s": 1024, "iq1s": 2048, "iq3xxs": 256, "iq3s": 512}


@pytest.mark.parametrize("name", sorted(KGRID_SHA256))
def test_codes_match_llama_cpp_tables(name):
    g = get_grid(name)
    assert g.size == SIZES[name]
    codes = g.ggml_codes()
    assert hashlib.sha256(codes.astype("<u2").tobytes()).hexdigest() == KGRID_SHA256[name]
    assert len(np.unique(codes)) == g.size


def _reference_lists(g, codes):
    """Neighbour lists the way llama.cpp builds them: sort (distance, index) pairs, keep nwant distance shells."""
    pts = 2 * g.levels + 1
    out = {}
    for c in codes:
        lv = (c // g.nlev ** np.arange(g.dim)) % g.nlev
        d2 = ((pts - (2 * lv + 1)) ** 2).sum(-1)
        pairs = sorted(zip(d2.tolist(), range(g.size)))
        lst, shells, last = [], 1, pairs[0][0]
        for d, j in pairs:
            if d > last:
                if shells == g.nwant:
                    break
                last, shells = d, shells + 1
            lst.append(j)
        out[int(c)] = lst
    return out


@pytest.mark.parametrize("name", sorted(KGRID_SHA256))
def test_kmap_and_neighbour_lists(name):
    g = get_grid(name)
    n_codes = g.nlev ** g.dim
    # kmap: exactly the grid points, at their index
    assert np.array_equal(np.nonzero(g.kmap >= 0)[0], np.sort(g.compact_codes()))
    assert np.array_equal(g.kmap[g.compact_codes()], np.arange(g.size))
    assert np.all(g.n_neighbours[g.kmap >= 0] == 0) and np.all(g.n_neighbours[g.kmap < 0] > 0)
    rng = np.random.default_rng(0)
    off = np.nonzero(g.kmap < 0)[0]
    sample = np.concatenate([off[:50], rng.choice(off, 150, replace=False), [np.argmax(g.n_neighbours)]])
    ref = _reference_lists(g, sample)
    for c, lst in ref.items():
        assert g.n_neighbours[c] == len(lst)
        assert g.neighbours[c, :len(lst)].tolist() == lst
        assert np.all(g.neighbours[c, len(lst):] == -1)
    assert g.neighbours.shape[0] == n_codes


def test_grid_values_match_gguf():
    from gguf import quants

    for name, cls in [("iq2xxs", quants.IQ2_XXS), ("iq2xs", quants.IQ2_XS), ("iq2s", quants.IQ2_S),
                      ("iq3xxs", quants.IQ3_XXS), ("iq3s", quants.IQ3_S), ("iq1s", quants.IQ1_S)]:
        cls.init_grid()
        assert np.array_equal(get_grid(name).values, np.asarray(cls.grid).reshape(cls.grid_shape)), name


def test_ksigns():
    from gguf import quants

    assert np.array_equal(ksigns(), np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8))
    bits = np.unpackbits(ksigns()[:, None], axis=1).sum(1)
    assert np.all(bits % 2 == 0)
