"""Lookup tables of the non-linear GGML formats handled here (IQ4_NL, IQ4_XS, MXFP4).

The values come from the ``gguf`` package (the same numbers as llama.cpp's ``kvalues_iq4nl`` and ``kvalues_mxfp4``),
never typed in by hand; tests check them against ``gguf.dequantize`` of hand-built blocks.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from gguf.quants import MXFP4 as _GGUF_MXFP4

#: The 16 signed levels of IQ4_NL / IQ4_XS codes, int8 (16,), strictly increasing.
KVALUES_IQ4NL: np.ndarray = np.array(_GGUF_IQ4_NL.kvalues, dtype=np.int8)
KVALUES_IQ4NL.setflags(write=False)

if KVALUES_IQ4NL.shape != (16,) or not np.all(np.diff(KVALUES_IQ4NL.astype(np.int32)) > 0):
    raise ImportError("gguf's IQ4_NL table is not 16 increasing levels: unsupported gguf version")

# The 16 signed levels of MXFP4 codes: twice the E2M1 values (llama.cpp's ``kvalues_mxfp4``), int8 (16,); index 8
# is a second zero (E2M1's -0) that decodes to +0.
KVALUES_MXFP4: np.ndarray = np.array(_GGUF_MXFP4.kvalues, dtype=np.int8)
KVALUES_MXFP4.setflags(write=False)

if KVALUES_MXFP4.shape != (16,) or not (np.all(KVALUES_MXFP4[:8] == -KVALUES_MXFP4[8:])
                                        and np.all(np.diff(KVALUES_MXFP4[:8].astype(np.int32)) > 0)):
    raise ImportError("gguf's MXFP4 table is not 8 increasing levels and their negatives: unsupported gguf version")
