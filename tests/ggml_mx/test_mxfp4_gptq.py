"""MXFP4 through jgptq's solve paths: the GPTQ block-codec update, the expert bucket with its plain-encode guard,
and a GGUF file read back with the gguf package."""

import gguf
import numpy as np

from jgptq import QuantConfig, gptq
from jgptq import hessian as hs
from jgptq.bucket import MatrixPlan, Stack, quantize_bucket
from jgptq.export.gguf import GGUFTensor, write_gguf
from jgptq.ggml import decode, encode
from tests.conftest import correlated_activations


def _objective(q, w, h):
    """tr((W - Q) H (W - Q)^T) in float64."""
    d = np.asarray(q, np.float64) - w
    return float(np.sum((d @ h.astype(np.float64)) * d))


def test_group_update_beats_plain_encoding_on_the_hessian_objective():
    rng = np.random.default_rng(7)
    rows, cols = 16, 512
    x = correlated_activations(rng, 2048, cols)
    h = np.array(hs.finalize(hs.from_activations(x)))
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    imatrix = (x.astype(np.float64) ** 2).mean(0).astype(np.float32)
    res = gptq.solve(w, h, QuantConfig(format="mxfp4"), importance=imatrix)
    payload = np.asarray(res.payload).reshape(rows, -1)
    np.testing.assert_array_equal(np.asarray(decode(payload, "mxfp4")), np.asarray(res.weight))
    plain = np.asarray(decode(encode(w, "mxfp4", imatrix), "mxfp4"))
    assert _objective(res.weight, w, h) < 0.8 * _objective(plain, w, h)


def test_expert_bucket_keeps_the_better_bytes_per_expert():
    rng = np.random.default_rng(1)
    n, rows, cols = 3, 8, 128
    xs = [correlated_activations(rng, 512, cols) for _ in range(n)]
    h = np.stack([np.array(hs.finalize(hs.from_activations(x))) for x in xs])
    w = rng.standard_normal((n, rows, cols)).astype(np.float32)
    (res,) = quantize_bucket([Stack("experts", w, h, [512, 512, 1])], MatrixPlan("gptq", QuantConfig(format="mxfp4")),
                             threshold=2)
    assert res.method == ("gptq", "gptq", "rtn")
    np.testing.assert_array_equal(res.record().dequantize(), np.asarray(res.weight))
    np.testing.assert_array_equal(res.record(2).row_bytes().reshape(-1), np.asarray(encode(w[2], "mxfp4")).reshape(-1))
    for e in range(2):
        plain = np.asarray(decode(encode(w[e], "mxfp4"), "mxfp4"))
        assert _objective(np.asarray(res.weight)[e], w[e], h[e]) < _objective(plain, w[e], h[e])


def test_gguf_file_holds_the_blocks(tmp_path):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((2, 8, 64)).astype(np.float32)
    payload = np.asarray(encode(w, "mxfp4"))
    path = write_gguf(tmp_path / "m.gguf", "llama", {},
                      [GGUFTensor("blk.0.ffn_down_exps.weight", payload.reshape(2, 8, 2, 17), "mxfp4")])
    (t,) = gguf.GGUFReader(str(path)).tensors
    assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4 and list(t.shape) == [64, 8, 2]
    got = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.MXFP4).reshape(2, 8, 64)
    np.testing.assert_array_equal(got, np.asarray(decode(payload, "mxfp4")))
