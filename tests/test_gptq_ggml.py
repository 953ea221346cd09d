"""The GGML group update lowers the output error of plain encoding (same format, same importance)."""

import numpy as np
import pytest

from jgptq import QuantConfig, gptq
from jgptq import hessian as hs
from jgptq.ggml import decode, encode
from tests.conftest import correlated_activations


@pytest.mark.parametrize("fmt", ["q4_k", "iq4_xs", "iq2_xxs", "q3_k", "q4_0"])
def test_group_update_beats_plain_encoding_on_weighted_error(fmt):
    rng = np.random.default_rng(7)
    rows, cols = 16, 512
    x = correlated_activations(rng, 2048, cols)
    h = np.array(hs.finalize(hs.from_activations(x)))
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    imatrix = (x.astype(np.float64) ** 2).mean(0).astype(np.float32)      # llama.cpp's value: sum x^2 / count
    res = gptq.solve(w, h, QuantConfig(format=fmt), importance=imatrix)
    plain = np.asarray(decode(encode(w, fmt, imatrix), fmt))
    # the kept bytes are the solver's weight
    np.testing.assert_array_equal(np.asarray(decode(np.asarray(res.payload).reshape(rows, -1), fmt)),
                                  np.asarray(res.weight))

    def err(q):  # tr((W - Q) H (W - Q)^T) in float64
        d = np.asarray(q, np.float64) - w
        return float(np.sum((d @ h.astype(np.float64)) * d))

    assert err(res.weight) < 0.9 * err(plain), (fmt, err(res.weight), err(plain))
