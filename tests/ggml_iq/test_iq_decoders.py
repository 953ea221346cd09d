"""IQ decoders: float32-identical to the gguf package's numpy dequantizers on random payload bytes."""

import gguf
import numpy as np
import pytest

from tests.ggml_iq.common import FORMATS, float_bits_equal

# gguf's numpy decoders warn on the NaN/Inf scales that random bytes contain
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_random_bytes_match_gguf(name):
    fmt = FORMATS[name]
    rng = np.random.default_rng(fmt.type_id)
    payload = rng.integers(0, 256, size=(2, 3, 16 * fmt.type_size), dtype=np.uint8)
    ref = gguf.dequantize(payload, gguf.GGMLQuantizationType[name])
    out = np.asarray(fmt.decode(payload))
    assert out.dtype == np.float32 and out.shape == (2, 3, 16 * 256)
    assert float_bits_equal(out, ref)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_decoder_special_scales(name):
    """Zero, subnormal, huge, infinite and NaN fp16 super-scales decode like gguf."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(1)
    scales = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x3C00],
                      np.uint16)
    payload = rng.integers(0, 256, size=(len(scales), fmt.type_size), dtype=np.uint8)
    if name == "IQ1_M":  # the scale's four nibbles live in the top nibbles of the last four uint16
        sc = payload[:, -8:].copy().view(np.uint16)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((scales >> (4 * k)) & 0xF) << 12)
        payload[:, -8:] = sc.view(np.uint8)
    else:
        payload[:, :2] = scales[:, None].view(np.uint8)
    ref = gguf.dequantize(payload, gguf.GGMLQuantizationType[name])
    assert float_bits_equal(np.asarray(fmt.decode(payload)), ref)
