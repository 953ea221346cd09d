"""The golden bytes on an accelerator: encoders must stay byte-identical to llama.cpp off the CPU too.

XLA:GPU contracts multiply-adds and its float32 division and square root are not correctly rounded; the codecs
guard against both by construction, and this test checks it (skipped without a GPU).
"""

import jax
import numpy as np
import pytest

import jgptq.ggml as gg
from tests.ggml.helpers import FORMATS, identical_blocks, load_golden, same_floats


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu() is None, reason="no GPU")]


@pytest.mark.parametrize("name", FORMATS)
def test_golden_bytes_on_gpu(name):
    arrays, _ = load_golden()
    f = gg.get_format(name)
    dev = _gpu()
    x = jax.device_put(arrays["x"], dev)
    for path in ("none", "imp0", "imp1"):
        imp = None if path == "none" else jax.device_put(arrays["importance"][int(path[-1])], dev)
        got = f.encode(x) if imp is None else f.encode(x, imp)
        assert list(got.devices())[0].platform == "gpu"
        same = identical_blocks(np.asarray(got), arrays[f"{name}/{path}"], f.type_size)
        assert same.all(), f"{name}/{path} on GPU: {same.mean():.4%} identical blocks"
        back = f.decode(jax.device_put(arrays[f"{name}/{path}"], dev))
        cpu = f.decode(jax.device_put(arrays[f"{name}/{path}"], jax.devices("cpu")[0]))
        assert same_floats(np.asarray(back), np.asarray(cpu))
