"""jgptq.bucket.quantize_bucket: the one solve path, checked against the solver called directly, closed forms of
its fallbacks (round-to-nearest, the plain GGML encode) and its records' decode."""

import numpy as np
import pytest

from jgptq import gptq
from jgptq.bucket import MatrixPlan, Stack, quantize_bucket
from jgptq.config import QuantConfig
from jgptq.ggml import encode
from jgptq.quantizers import uniform


def _hessian(rng, n, c):
    x = rng.standard_normal((n, 4 * c, c)).astype(np.float32)
    return np.einsum("ntc,ntd->ncd", x, x) / (4 * c)


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 16, 64)).astype(np.float32)
    return w, _hessian(rng, 5, 64)


def test_gptq_bucket_equals_the_solver_and_low_token_matrices_are_round_to_nearest(data):
    w, h = data
    quant = QuantConfig(bits=4, group_size=32)
    stacks = [Stack("a", w[:2], h[0], [100, 100], "shared"), Stack("b", w[2:], h[2:], [100, 3, 100], "own")]
    a, b = quantize_bucket(stacks, MatrixPlan("gptq", quant), threshold=10)
    assert a.method == ("gptq", "gptq") and b.method == ("gptq", "rtn", "gptq")
    assert b.reason == ("", "3 tokens < 10", "")
    want = gptq.solve_experts(w[2:], h[2:], quant)
    np.testing.assert_array_equal(np.asarray(b.codes)[[0, 2]], np.asarray(want.codes)[[0, 2]])
    np.testing.assert_array_equal(np.asarray(b.weight)[[0, 2]], np.asarray(want.weight)[[0, 2]])
    shared = gptq.solve_experts(w[:2], h[0], quant)
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(shared.codes))
    codes, _, deq = uniform.round_to_nearest(w[3], quant)        # the identity Hessian: round-to-nearest
    np.testing.assert_array_equal(np.asarray(b.codes)[1], np.asarray(codes))
    np.testing.assert_allclose(np.asarray(b.weight)[1], np.asarray(deq), rtol=0, atol=0)
    assert np.isnan(b.loss[1]) and np.all(np.isfinite(b.loss[[0, 2]]))
    rec = b.record()
    assert rec.method == "mixed" and b.record(1).method == "rtn"
    np.testing.assert_array_equal(rec.dequantize(), np.asarray(b.weight))
    np.testing.assert_array_equal(b.record(2, slice(4, 8)).dequantize(), np.asarray(b.weight)[2, 4:8])


def test_rtn_method_is_round_to_nearest_everywhere(data):
    w, h = data
    quant = QuantConfig(bits=3, group_size=-1, sym=False)
    (res,) = quantize_bucket([Stack("a", w, None, [0] * 5)], MatrixPlan("rtn", quant))
    assert res.method == ("rtn",) * 5 and res.reason == ("",) * 5
    for e in range(5):
        codes, _, deq = uniform.round_to_nearest(w[e], quant)
        np.testing.assert_array_equal(np.asarray(res.codes)[e], np.asarray(codes))
        np.testing.assert_array_equal(np.asarray(res.weight)[e], np.asarray(deq))


def test_ggml_bucket_keeps_its_bytes_and_low_token_matrices_get_the_plain_encode(data):
    w, h = data
    importance = np.abs(np.diagonal(h, axis1=1, axis2=2)).astype(np.float32)
    quant = QuantConfig(format="q4_0")
    (res,) = quantize_bucket([Stack("a", w, h, [50, 1, 50, 50, 0], importance=importance)],
                             MatrixPlan("gptq", quant), threshold=2)
    assert res.method == ("gptq", "rtn", "gptq", "gptq", "rtn") and res.codes is None
    rec = res.record()
    np.testing.assert_array_equal(rec.dequantize(), np.asarray(res.weight))   # the weight is the bytes' decode
    for e in (1, 4):
        want = np.asarray(encode(w[e], "q4_0", importance[e]))
        np.testing.assert_array_equal(res.record(e).row_bytes().reshape(-1), want.reshape(-1))
    plain = np.asarray(encode(w[0], "q4_0", importance[0]))
    assert not np.array_equal(res.record(0).row_bytes().reshape(-1), plain.reshape(-1))   # GPTQ moved the bytes
    (rtn,) = quantize_bucket([Stack("a", w, None, [0] * 5, importance=importance)], MatrixPlan("rtn", quant))
    for e in range(5):
        np.testing.assert_array_equal(rtn.record(e).row_bytes().reshape(-1),
                                      np.asarray(encode(w[e], "q4_0", importance[e])).reshape(-1))


def test_shapes_that_differ_are_refused(data):
    w, h = data
    with pytest.raises(ValueError, match=r"stacks of different shapes .*\(a, b\)"):
        quantize_bucket([Stack("a", w, h, [9] * 5), Stack("b", w[:, :8], None, [9] * 5)],
                        MatrixPlan("gptq", QuantConfig(group_size=32)))
