"""Code grids of the IQ1/IQ2/IQ3 formats and the encoder-side search tables built from them.

The decoder grids come from the ``gguf`` package (``gguf.quants``, where each grid point is stored as packed level
indices). Every grid point is a short vector (8 values for IQ1/IQ2, 4 for IQ3) of *levels* ``l``:

- IQ2_XXS/IQ2_XS/IQ2_S: l in {0, 1, 2}, decoded as bytes {8, 25, 43}; the encoder models them as 2l + 1.
- IQ3_XXS: l in 0..7, decoded as {4, 12, 20, 28, 36, 44, 52, 62}; the encoder models 2l + 1.
- IQ3_S: l in 0..7, decoded as 2l + 1 (1, 3, ..., 15).
- IQ1_S/IQ1_M: l in {0, 1, 2}, decoded as l - 1 (-1, 0, 1).

The encoder works on level codes ``u = sum_i l_i << (bits * i)`` (bits = 2 for IQ1/IQ2, 3 for IQ3). A code that is a
grid point maps to its index. A code off the grid maps to a neighbour list: all grid points whose squared distance
(in the 2l + 1 coordinates) to the code is among the ``nwant`` smallest distinct distances, ordered by
(distance, index). Those lists are what llama.cpp's encoder searches, in that order.

Here codes are addressed compactly by ``c = sum_i l_i * nlev**i`` over the levels the encoders can produce
(3**8 = 6561 codes for 8-vectors of levels 0..2, 8**4 = 4096 for 4-vectors of levels 0..7).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class IQGrid:
    """A code grid and its encoder tables (numpy arrays; read-only by convention).

    Attributes:
      name: grid name (``"iq2xxs"``, ``"iq2xs"``, ``"iq2s"``, ``"iq3xxs"``, ``"iq3s"``, ``"iq1s"``).
      levels: int32 (n_grid, dim) level index of every element of every grid point.
      values: float32 (n_grid, dim) the values the decoder reads for each grid point.
      nlev: number of levels per element (3 or 8).
      bits: bits per level in llama.cpp's code ``u``.
      nwant: number of distance shells in a neighbour list.
      kmap: int32 (nlev**dim,) grid index of each compact code, or -1 when the code is off the grid.
      neighbours: int32 (nlev**dim, max_neighbours) neighbour lists of off-grid codes, padded with -1 (rows of
        on-grid codes are all -1).
      n_neighbours: int32 (nlev**dim,) length of each neighbour list (0 for on-grid codes).
    """

    name: str
    levels: np.ndarray
    values: np.ndarray
    nlev: int
    bits: int
    nwant: int
    kmap: np.ndarray
    neighbours: np.ndarray
    n_neighbours: np.ndarray

    @property
    def dim(self) -> int:
        return int(self.levels.shape[1])

    @property
    def size(self) -> int:
        return int(self.levels.shape[0])

    def ggml_codes(self) -> np.ndarray:
        """uint16 (n_grid,) llama.cpp's code of each grid point: sum_i l_i << (bits * i)."""
        shifts = self.bits * np.arange(self.dim)
        return (self.levels.astype(np.uint32) << shifts).sum(-1).astype(np.uint16)

    def compact_codes(self) -> np.ndarray:
        """int32 (n_grid,) compact code of each grid point: sum_i l_i * nlev**i."""
        return (self.levels * (self.nlev ** np.arange(self.dim))).sum(-1).astype(np.int32)


# name -> (gguf class name, number of levels, bits per level, nwant, decoded value of each level)
_SPECS = {
    "iq2xxs": ("IQ2_XXS", 3, 2, 2, (8.0, 25.0, 43.0)),
    "iq2xs": ("IQ2_XS", 3, 2, 2, (8.0, 25.0, 43.0)),
    "iq2s": ("IQ2_S", 3, 2, 1, (8.0, 25.0, 43.0)),
    "iq3xxs": ("IQ3_XXS", 8, 3, 2, (4.0, 12.0, 20.0, 28.0, 36.0, 44.0, 52.0, 62.0)),
    "iq3s": ("IQ3_S", 8, 3, 3, tuple(float(2 * l + 1) for l in range(8))),
    "iq1s": ("IQ1_S", 3, 2, 3, (-1.0, 0.0, 1.0)),
}


def _gguf_levels(cls_name: str, level_values) -> np.ndarray:
    """Level indices (n_grid, dim) of the grid gguf's dequantizer uses for ``cls_name``."""
    from gguf import quants

    cls = getattr(quants, cls_name)
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    table = np.asarray(cls.grid_map, dtype=np.float32)
    if not np.array_equal(table, np.asarray(level_values, dtype=np.float32)):
        raise RuntimeError(f"gguf's {cls_name} grid levels {table} differ from the expected {level_values}")
    match = grid[..., None] == table
    if not np.all(match.sum(-1) == 1):
        raise RuntimeError(f"gguf's {cls_name} grid has values outside its level table")
    return np.argmax(match, axis=-1).astype(np.int32)


def _neighbour_lists(levels: np.ndarray, nlev: int, nwant: int):
    """kmap and (distance, index)-ordered neighbour lists over all compact codes; see the module docstring."""
    n_grid, dim = levels.shape
    n_codes = nlev ** dim
    code_levels = (np.arange(n_codes)[:, None] // (nlev ** np.arange(dim))) % nlev  # (n_codes, dim)
    kmap = np.full(n_codes, -1, np.int32)
    compact = (levels * (nlev ** np.arange(dim))).sum(-1)
    kmap[compact] = np.arange(n_grid, dtype=np.int32)
    d2 = np.zeros((n_codes, n_grid), np.int16)  # squared distances in 2l+1 coordinates
    cl, gl = code_levels.astype(np.int16), np.ascontiguousarray(levels.T.astype(np.int16))
    for i in range(dim):
        diff = cl[:, i:i + 1] - gl[i][None, :]
        d2 += 4 * diff * diff
    d2 = d2.astype(np.int32)
    # the nwant-th smallest distinct distance of each code
    limit = d2.min(axis=1)
    for _ in range(nwant - 1):
        limit = np.where(d2 > limit[:, None], d2, np.iinfo(np.int32).max).min(axis=1)
    inside = d2 <= limit[:, None]
    counts = np.where(kmap < 0, inside.sum(1), 0).astype(np.int32)
    key = np.where(inside, d2 * n_grid + np.arange(n_grid)[None, :], np.iinfo(np.int32).max)
    width = max(1, int(counts.max()))
    key = np.sort(np.partition(key, width - 1, axis=1)[:, :width], axis=1)  # by distance, then grid index
    table = np.where(np.arange(width)[None, :] < counts[:, None], key % n_grid, -1).astype(np.int32)
    return kmap, table, counts


@functools.lru_cache(maxsize=None)
def get_grid(name: str) -> IQGrid:
    """The :class:`IQGrid` ``name`` (built once per process from the gguf package's decoder grids)."""
    if name not in _SPECS:
        raise ValueError(f"unknown IQ grid {name!r}; known: {sorted(_SPECS)}")
    cls_name, nlev, bits, nwant, level_values = _SPECS[name]
    levels = _gguf_levels(cls_name, level_values)
    values = np.asarray(level_values, np.float32)[levels]
    kmap, table, counts = _neighbour_lists(levels, nlev, nwant)
    for arr in (levels, values, kmap, table, counts):
        arr.setflags(write=False)
    return IQGrid(name=name, levels=levels, values=values, nlev=nlev, bits=bits, nwant=nwant, kmap=kmap,
                  neighbours=table, n_neighbours=counts)


def ksigns() -> np.ndarray:
    """uint8 (128,) sign byte of each 7-bit sign code: the code plus an 8th bit making the count of set bits even."""
    codes = np.arange(128, dtype=np.uint32)
    parity = np.zeros(128, np.uint32)
    for b in range(7):
        parity ^= (codes >> b) & 1
    return (codes | (parity << 7)).astype(np.uint8)
