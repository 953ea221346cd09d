"""AWQ's numerics against float64 numpy: the candidate scales, the priced error of each (a brute-force
round-to-nearest and trace in numpy), the chosen exponent the least of them, the scaled Hessian's loss identity,
and the method's solve on scaled stacks."""

import jax.numpy as jnp
import numpy as np
import pytest

from jgptq import methods
from jgptq.bucket import MatrixPlan, Stack, quantize_bucket
from jgptq.config import QuantConfig
from jgptq.methods import awq
from jgptq.objective import hessian_loss


def _nearest64(w, bits, group, sym):
    """Min/max round-to-nearest of (R, C) (the grid of jgptq.quantizers.uniform, written out in numpy). The grid
    and the rounding are float32 as there: a symmetric grid puts a group's extreme exactly on a rounding tie,
    which float64 would break the other way; the result is widened to float64."""
    w = np.asarray(w, np.float32)
    r, c = w.shape
    g = w.reshape(r, c // group, group)
    lo = np.minimum(g.min(-1), np.float32(0))
    hi = np.maximum(g.max(-1), np.float32(0))
    maxq = 2 ** bits - 1
    if sym:
        hi = np.maximum(-lo, hi)
        lo = np.where(lo < 0, -hi, lo)
    empty = (lo == 0) & (hi == 0)
    lo, hi = np.where(empty, np.float32(-1), lo), np.where(empty, np.float32(1), hi)
    scale = (hi - lo) * np.float32(1.0 / maxq)
    zero = np.full_like(scale, (maxq + 1) / 2) if sym else np.round(-lo / scale)
    q = np.clip(np.round(g / scale[..., None]) + zero[..., None], 0, maxq)
    return (scale[..., None] * (q - zero[..., None])).reshape(r, c).astype(np.float64)


def _group(seed, cols=64, n_expert=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((512, cols)) * np.exp(rng.standard_normal(cols) * 1.2)   # uneven columns
    h = 2.0 / len(x) * x.T @ x
    xs = rng.standard_normal((n_expert, 128, cols)) * np.exp(rng.standard_normal(cols))[None, None, :]
    he = 2.0 / 128 * np.einsum("nti,ntj->nij", xs, xs)
    w1 = rng.standard_normal((48, cols))
    w2 = rng.standard_normal((n_expert, 32, cols)) * 0.1
    return x, h, w1, he, w2


def _scales(mean_square, alphas):
    r = np.sqrt(mean_square.astype(np.float64))
    r = np.maximum(r, awq.FLOOR * r.max())
    s = r[None, :] ** np.asarray(alphas)[:, None]
    return s / np.sqrt(s.max(1, keepdims=True) * s.min(1, keepdims=True))


def _priced(members, scales, bits, group, sym):
    """The priced error of each of (A, C) float32 ``scales`` (rounded on the float32 grid; sums in float64)."""
    out = []
    for s in np.asarray(scales, np.float64):
        err = 0.0
        for w, h in members:
            w = np.asarray(w, np.float64).reshape(-1, *np.shape(w)[-2:])
            h = np.broadcast_to(np.asarray(h, np.float64), (w.shape[0],) + np.shape(h)[-2:])
            for m, hm in zip(w, h):
                dw = m - _nearest64(m * s.astype(np.float32), bits, group, sym) / s
                err += np.trace(dw @ hm @ dw.T)
        out.append(err)
    return np.array(out)


def test_candidate_scales_against_numpy():
    rng = np.random.default_rng(0)
    ms = rng.random(32) ** 4
    ms[3] = 0.0                                   # an unseen column: floored
    got = np.asarray(awq.candidate_scales(ms, awq.ALPHAS))
    ref = _scales(ms, awq.ALPHAS)
    np.testing.assert_allclose(got, ref, rtol=2e-5)
    np.testing.assert_array_equal(got[0], np.ones(32))          # alpha 0: no scaling
    np.testing.assert_allclose(got.max(1) * got.min(1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("sym,bits,group", [(True, 4, 16), (False, 3, 32)])
def test_priced_errors_and_choice_against_brute_force(sym, bits, group):
    x, h, w1, he, w2 = _group(1)
    cfg = QuantConfig(bits=bits, group_size=group, sym=sym, mse=0.0, scale_dtype="float32")
    members = [(w1[None].astype(np.float32), h.astype(np.float32)), (w2.astype(np.float32), he.astype(np.float32))]
    ms = np.mean(x * x, axis=0)
    choice = awq.search(members, ms, cfg)
    ref = _priced(members, awq.candidate_scales(ms, awq.ALPHAS), bits, group, sym)
    np.testing.assert_allclose(choice.errors, ref, rtol=2e-3)
    # the chosen exponent is the brute force's least (within float32's ties)
    assert ref[awq.ALPHAS.index(choice.alpha)] <= ref.min() * (1 + 1e-3)
    assert choice.errors.min() == choice.errors[awq.ALPHAS.index(choice.alpha)]
    assert choice.errors.min() < choice.errors[0]       # uneven inputs: scaling helps
    # the priced error is the output error on the calibration inputs: 2 / N sum ||dW x||^2
    s = np.asarray(choice.scale, np.float64)
    dw = w1 - _nearest64(w1 * s, bits, group, sym) / s
    direct = 2.0 / len(x) * np.sum((x @ dw.T) ** 2)
    np.testing.assert_allclose(float(awq.priced_errors(members[:1], choice.scale[None], cfg)[0]), direct,
                               rtol=2e-3)


def test_mean_square_from_hessians():
    x, h, _, he, _ = _group(2)
    np.testing.assert_allclose(np.asarray(awq.mean_square_of([h], [512])), np.mean(x * x, 0), rtol=1e-5)
    tokens = [10, 30, 60]
    want = sum(t * np.diag(m) / 2 for t, m in zip(tokens, he)) / sum(tokens)
    np.testing.assert_allclose(np.asarray(awq.mean_square_of([he], [tokens])), want, rtol=1e-5)
    with pytest.raises(ValueError, match="no calibration tokens"):
        awq.mean_square_of([he], [[0, 0, 0]])


def test_scaled_hessian_keeps_the_loss():
    """trace((W s - Q) H_s (W s - Q)^T) == trace((W - Q / s) H (W - Q / s)^T)."""
    _, h, w1, _, _ = _group(3)
    rng = np.random.default_rng(3)
    s = np.exp(rng.standard_normal(h.shape[0]) * 0.5)
    q = _nearest64(w1 * s, 4, 16, True)
    hs = np.asarray(awq.scaled_hessian(h.astype(np.float32), s.astype(np.float32)), np.float64)
    np.testing.assert_allclose(hs, h / np.outer(s, s), rtol=1e-5)
    lhs = float(hessian_loss(jnp.asarray(w1 * s, jnp.float32), jnp.asarray(q, jnp.float32), jnp.asarray(hs)))
    dw = w1 - q / s
    np.testing.assert_allclose(lhs, np.trace(dw @ h @ dw.T), rtol=1e-3)


def test_methods_solve_scaled_stacks():
    """awq is GPTQ on the scaled stack (its loss the original problem's), awq_rtn round-to-nearest; both are
    registered, declare the Hessian and refuse GGML formats."""
    x, h, w1, _, _ = _group(4)
    cfg = QuantConfig(bits=3, group_size=16, scale_dtype="float32")
    ms = np.mean(x * x, 0)
    choice = awq.search([(w1[None].astype(np.float32), h.astype(np.float32))], ms, cfg)
    s = np.asarray(choice.scale, np.float64)
    ws, hs = (w1 * s)[None].astype(np.float32), awq.scaled_hessian(h.astype(np.float32), choice.scale)
    stack = Stack("w", jnp.asarray(ws), hs, [512], "h")
    got = {}
    for name in ("awq", "awq_rtn", "gptq"):
        m = methods.get(name)
        assert name == "gptq" or m.statistics == ("hessian",) and hasattr(m, "prescale")
        got[name] = quantize_bucket([stack], MatrixPlan(name, cfg), threshold=1)[0]
    np.testing.assert_array_equal(np.asarray(got["awq"].weight), np.asarray(got["gptq"].weight))
    np.testing.assert_allclose(np.asarray(got["awq_rtn"].weight)[0], _nearest64(w1 * s, 3, 16, True), atol=1e-5)

    def out_err(q):
        dw = w1 - np.asarray(q, np.float64)[0] / s
        return np.trace(dw @ h @ dw.T)

    assert out_err(got["awq"].weight) < out_err(got["awq_rtn"].weight) <= choice.errors[0] * (1 + 1e-4)
    with pytest.raises(ValueError, match="integer grids"):
        awq.priced_errors([(ws, hs)], choice.scale[None], QuantConfig(format="q4_k"))


def test_stack_input_scale_is_the_scaled_hessian():
    """A stack with ``input_scale`` s solves as one whose Hessian is diag(s)^-1 H diag(s)^-1 (h / s s^T in
    float64): the same bytes and loss; without a Hessian the scale changes nothing."""
    _, h, w1, _, _ = _group(5)
    s = np.exp(np.random.default_rng(5).standard_normal(h.shape[0]) * 0.5).astype(np.float32)
    ws = jnp.asarray((w1 * s)[None], jnp.float32)
    cfg = MatrixPlan("gptq", QuantConfig(bits=3, group_size=16, scale_dtype="float32"))
    scaled = jnp.asarray(h / np.outer(s.astype(np.float64), s), jnp.float32)
    want = quantize_bucket([Stack("w", ws, scaled, [512], "h")], cfg)[0]
    got = quantize_bucket([Stack("w", ws, jnp.asarray(h, jnp.float32), [512], "h", input_scale=s)], cfg)[0]
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
    np.testing.assert_allclose(np.asarray(got.loss), np.asarray(want.loss), rtol=1e-5)
    plain = quantize_bucket([Stack("w", ws, jnp.asarray(h, jnp.float32), [512], "h")], cfg)[0]
    assert not np.array_equal(np.asarray(plain.codes), np.asarray(want.codes))
    none = quantize_bucket([Stack("w", ws, None, [0], "h", input_scale=s)], MatrixPlan("rtn", cfg.quant))[0]
    np.testing.assert_array_equal(np.asarray(none.codes), np.asarray(
        quantize_bucket([Stack("w", ws, None, [0], "h")], MatrixPlan("rtn", cfg.quant))[0].codes))
