"""The GGML GPTQ bucket keeps, per matrix, the lower of two Hessian-weighted losses: its GPTQ solve's or the plain
encode's. Checked against float64 numpy losses of the solver's result and of the plain encode computed apart, and
on a constructed matrix where GPTQ's error feedback makes it lose."""

import numpy as np
import pytest

from jgptq import gptq
from jgptq.bucket import PLAIN_KEPT, MatrixPlan, Stack, hessian_loss, quantize_bucket
from jgptq.config import QuantConfig
from jgptq.ggml import decode, encode


def _loss64(w, q, h):
    d = np.asarray(q, np.float64) - np.asarray(w, np.float64)
    return float(np.einsum("rc,cd,rd->", d, np.asarray(h, np.float64), d))


def _plain_wins_q8_0():
    """One row of two Q8_0 blocks and a Hessian under which GPTQ loses to the plain encode.

    Block 1 lies exactly on the Q8_0 grid of step 2^-7 (its maximum 127 * 2^-7 is at column 32), so its plain
    encode is exact. The Hessian couples column 32 to every column of block 0, with the sign of that column's
    plain-encode error, so GPTQ's error feedback raises column 32 past the block's maximum: block 1's scale
    coarsens and its other 31 values leave the grid, an error that outweighs what the feedback saves.
    """
    rng = np.random.default_rng(3)
    w = np.empty((1, 64), np.float32)
    w[0, :32] = rng.uniform(-1, 1, 32)
    codes = rng.integers(-120, 121, 32)
    codes[0] = 127
    w[0, 32:] = codes * 2.0 ** -7
    err0 = w[0, :32] - np.asarray(decode(encode(w, "q8_0"), "q8_0"))[0, :32]
    h = np.eye(64)
    h[:32, 32] = h[32, :32] = 0.1 * np.sign(err0)
    return w, h.astype(np.float32)


def test_constructed_case_keeps_the_plain_encode_and_reports_it():
    w, h = _plain_wins_q8_0()
    quant = QuantConfig(format="q8_0")
    solo = gptq.solve(w, h, quant)
    plain = np.asarray(decode(encode(w, "q8_0"), "q8_0"))
    np.testing.assert_array_equal(plain[:, 32:], w[:, 32:])                  # block 1 is exact in the plain encode
    assert np.abs(np.asarray(solo.weight)[0, 32:]).max() > np.abs(w[0, 32:]).max()   # GPTQ raised its maximum
    loss_gptq, loss_plain = _loss64(w, solo.weight, h), _loss64(w, plain, h)
    assert loss_plain < 0.8 * loss_gptq

    (res,) = quantize_bucket([Stack("m", w[None], h, [1000])], MatrixPlan("gptq", quant))
    assert res.method == ("rtn",)
    assert res.reason == (f"{PLAIN_KEPT}: plain {loss_plain:.4g} < gptq {loss_gptq:.4g}",)
    assert np.isnan(res.loss[0])
    np.testing.assert_array_equal(res.record(0).row_bytes().reshape(-1), np.asarray(encode(w, "q8_0")).reshape(-1))
    np.testing.assert_array_equal(np.asarray(res.weight)[0], plain)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_kept_result_has_the_lower_float64_loss_per_matrix(fmt):
    rng = np.random.default_rng(7)
    n, rows, cols = 5, 8, 256
    w = rng.standard_normal((n, rows, cols)).astype(np.float32)
    mix = rng.standard_normal((n, cols, cols)) * 0.3 + np.eye(cols)
    x = np.einsum("ntc,ncd->ntd", rng.standard_normal((n, 2 * cols, cols)), mix)
    h = (np.einsum("ntc,ntd->ncd", x, x) / x.shape[1]).astype(np.float32)
    # expert 4: the constructed case (for Q8_0), widened to the bucket's shape (a block-diagonal Hessian)
    w4, h4 = _plain_wins_q8_0()
    w[4] = np.tile(w4, (rows, cols // 64))
    h[4] = np.kron(np.eye(cols // 64), h4)
    importance = np.abs(np.diagonal(h, axis1=1, axis2=2)).astype(np.float32)
    imp = importance if fmt != "q8_0" else None
    quant = QuantConfig(format=fmt)
    (res,) = quantize_bucket([Stack("m", w, h, [1000] * n, importance=imp)], MatrixPlan("gptq", quant))
    solo = gptq.solve_experts(w, h, quant, importance=imp)
    kept = np.asarray(res.weight)
    for e in range(n):
        plain = np.asarray(decode(encode(w[e], fmt, None if imp is None else imp[e]), fmt))
        lg, lp = _loss64(w[e], solo.weight[e], h[e]), _loss64(w[e], plain, h[e])
        chosen = plain if res.method[e] == "rtn" else np.asarray(solo.weight[e])
        np.testing.assert_array_equal(kept[e], chosen)
        assert _loss64(w[e], kept[e], h[e]) == pytest.approx(min(lg, lp), rel=1e-12)
        if abs(lg - lp) > 1e-5 * max(lg, lp):            # beyond float32 scoring: the choice is the lower
            assert (res.method[e] == "rtn") == (lp < lg)
    if fmt == "q8_0":                                    # the construction is made for Q8_0's grid
        assert res.method[4] == "rtn" and res.reason[4].startswith(PLAIN_KEPT)
    assert sum(m == "gptq" for m in res.method) >= 3


def test_hessian_loss_matches_float64_and_is_the_same_vmapped():
    import jax

    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 16, 64)).astype(np.float32)
    q = w + 0.01 * rng.standard_normal(w.shape).astype(np.float32)
    x = rng.standard_normal((3, 256, 64))
    h = (np.einsum("ntc,ntd->ncd", x, x) / 256).astype(np.float32)
    one = [float(hessian_loss(w[e], q[e], h[e])) for e in range(3)]
    batched = np.asarray(jax.jit(jax.vmap(hessian_loss))(w, q, h))
    np.testing.assert_allclose(np.asarray(one, np.float32), batched, rtol=1e-6)  # a float32 ulp apart at most
    for e in range(3):
        assert one[e] == pytest.approx(_loss64(w[e], q[e], h[e]), rel=1e-5)
