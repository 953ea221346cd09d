"""The importance-weighted MXFP4 scale choice (jgptq.ggml.mxfp4_search): llama.cpp's bytes without importance,
never a worse weighted error per block than llama.cpp's scale (float64 check), valid blocks that gguf decodes,
and a lower Hessian objective under GPTQ than the default codec."""

import gguf
import numpy as np

from jgptq import QuantConfig, gptq
from jgptq import hessian as hs
from jgptq.ggml import decode, encode
from jgptq.ggml.mxfp4_search import encode_mxfp4_searched, searched_codec
from tests.conftest import correlated_activations
from tests.ggml_mx.common import edge_rows, importance


def _block_error(x, payload, imp):
    """float64 (rows, blocks): sum of imp * (decode - x)**2 per block, the decode by gguf."""
    q = gguf.dequantize(np.asarray(payload), gguf.GGMLQuantizationType.MXFP4).astype(np.float64)
    d = (q - x.astype(np.float64)) ** 2 * imp.astype(np.float64)
    return d.reshape(x.shape[0], -1, 32).sum(-1)


def test_without_importance_it_is_llama_cpps_encoder():
    x, _ = edge_rows(np.random.default_rng(1))
    assert np.array_equal(np.asarray(encode_mxfp4_searched(x)), np.asarray(encode(x, "mxfp4")))


def test_weighted_error_never_above_llama_cpps_scale():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((32, 512)) * np.exp(rng.uniform(-4, 4, (32, 1)))).astype(np.float32)
    imp = importance(rng)
    plain = np.asarray(encode(x, "mxfp4"))
    searched = np.asarray(encode_mxfp4_searched(x, imp))
    e_plain = plain.reshape(32, -1, 17)[:, :, 0].astype(int)
    e_search = searched.reshape(32, -1, 17)[:, :, 0].astype(int)
    assert set(np.unique(e_search - e_plain)) <= {-1, 0, 1} and (e_search != e_plain).mean() > 0.05
    assert np.all(e_search <= 254)
    err_plain, err_search = _block_error(x, plain, imp), _block_error(x, searched, imp)
    assert np.all(err_search <= err_plain * (1 + 1e-5))
    assert err_search.sum() < 0.97 * err_plain.sum()
    same_scale = e_search == e_plain  # the codes under one scale are llama.cpp's
    assert np.array_equal(searched.reshape(32, -1, 17)[same_scale], plain.reshape(32, -1, 17)[same_scale])


def test_edge_rows_stay_valid_blocks():
    rng = np.random.default_rng(3)
    x, _ = edge_rows(rng)
    searched = np.asarray(encode_mxfp4_searched(x, importance(rng)))
    e = searched.reshape(x.shape[0], -1, 17)[:, :, 0]
    plain_e = np.asarray(encode(x, "mxfp4")).reshape(x.shape[0], -1, 17)[:, :, 0]
    assert np.all((e <= 254) | (plain_e == 255))  # only llama.cpp's own wrapped 255 stays
    np.testing.assert_array_equal(np.asarray(decode(searched, "mxfp4")),
                                  gguf.dequantize(searched, gguf.GGMLQuantizationType.MXFP4))


def test_gptq_with_the_searched_codec_lowers_the_objective():
    rng = np.random.default_rng(7)
    rows, cols = 16, 512
    x = correlated_activations(rng, 2048, cols)
    h = np.array(hs.finalize(hs.from_activations(x)))
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    imatrix = (x.astype(np.float64) ** 2).mean(0).astype(np.float32)
    cfg = QuantConfig(format="mxfp4")
    base = gptq.solve(w, h, cfg, importance=imatrix)
    ext = gptq.solve(w, h, cfg, importance=imatrix, codec=searched_codec())
    np.testing.assert_array_equal(np.asarray(decode(np.asarray(ext.payload).reshape(rows, -1), "mxfp4")),
                                  np.asarray(ext.weight))

    def objective(q):
        d = np.asarray(q, np.float64) - w
        return float(np.sum((d @ h.astype(np.float64)) * d))

    assert objective(ext.weight) < 0.99 * objective(base.weight)
