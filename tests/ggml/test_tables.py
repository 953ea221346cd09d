"""IQ4 level table: taken from gguf, checked against gguf's own decoder on hand-built blocks."""

import gguf
import numpy as np

from jgptq.ggml.tables import KVALUES_IQ4NL


def test_levels_are_what_gguf_decodes():
    # One IQ4_NL block with d = 1.0 and codes 0..15 then 15..0: decodes to the levels themselves.
    codes = np.concatenate([np.arange(16), np.arange(16)[::-1]])
    qs = (codes[:16] | (codes[16:] << 4)).astype(np.uint8)
    block = np.concatenate([np.float16(1.0).reshape(1).view(np.uint8), qs])[None, :]
    values = gguf.dequantize(block, gguf.GGMLQuantizationType.IQ4_NL)[0]
    assert np.array_equal(values[:16], KVALUES_IQ4NL.astype(np.float32))
    assert np.array_equal(values[16:], KVALUES_IQ4NL[::-1].astype(np.float32))


def test_levels_shape_and_order():
    assert KVALUES_IQ4NL.dtype == np.int8 and KVALUES_IQ4NL.shape == (16,)
    assert np.all(np.diff(KVALUES_IQ4NL.astype(int)) > 0)
    assert KVALUES_IQ4NL[0] == -127  # the encoder's first scale guess divides by this level
    assert not KVALUES_IQ4NL.flags.writeable
