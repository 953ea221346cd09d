"""MXFP4's golden bytes on an accelerator (skipped without a GPU): the encoder works on integer bits and the
levels' exact differences, so XLA:GPU must give llama.cpp's bytes too, and the decoder the CPU's floats."""

import os

import jax
import numpy as np
import pytest

import jgptq.ggml as gg
from tests.ggml_mx.common import block_equal


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu() is None, reason="no GPU")]

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "ggml_mx", "golden.npz")


def test_golden_bytes_on_gpu():
    with np.load(GOLDEN) as z:
        golden = {k: z[k] for k in z.files}
    f = gg.get_format("mxfp4")
    dev = _gpu()
    got = f.encode(jax.device_put(golden["x"], dev))
    assert list(got.devices())[0].platform == "gpu"
    assert block_equal(np.asarray(got), golden["payload"]).all()
    back = np.asarray(f.decode(jax.device_put(golden["random_payload"], dev)))
    assert np.array_equal(back.view(np.uint32), golden["random_dequant"].view(np.uint32))
