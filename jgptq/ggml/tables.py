"""Lookup tables of the non-linear GGML formats handled here (IQ4_NL, IQ4_XS).

The values come from the ``gguf`` package (the same numbers as llama.cpp's ``kvalues_iq4nl``), never typed in
by hand; tests check them against ``gguf.dequantize`` of hand-built blocks.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL

#: The 16 signed levels of IQ4_NL / IQ4_XS codes, int8 (16,), strictly increasing.
KVALUES_IQ4NL: np.ndarray = np.array(_GGUF_IQ4_NL.kvalues, dtype=np.int8)
KVALUES_IQ4NL.setflags(write=False)

if KVALUES_IQ4NL.shape != (16,) or not np.all(np.diff(KVALUES_IQ4NL.astype(np.int32)) > 0):
    raise ImportError("gguf's IQ4_NL table is not 16 increasing levels: unsupported gguf version")
