"""jgptq.objective.hessian_loss: trace((W - Q) H (W - Q)^T) against float64 numpy, batched with a shared or an own
Hessian per matrix, in both summation orders; the fixed order gives the same bits batched or vmapped."""

import jax
import numpy as np
import pytest

from jgptq.objective import hessian_loss


def _loss64(w, q, h):
    d = q.astype(np.float64) - w.astype(np.float64)
    return float(np.trace(d @ h.astype(np.float64) @ d.T))


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("fixed_order", [True, False])
def test_batched_loss_matches_float64(shared, fixed_order):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 24, 40)).astype(np.float32)   # 960 elements: the pairwise sum pads odd lengths
    q = w + 0.02 * rng.standard_normal(w.shape).astype(np.float32)
    x = rng.standard_normal((3, 200, 40))
    h = (np.einsum("ntc,ntd->ncd", x, x) / 100).astype(np.float32)
    h = h[0] if shared else h
    got = np.asarray(jax.jit(lambda *a: hessian_loss(*a, fixed_order=fixed_order))(w, q, h))
    assert got.shape == (3,) and got.dtype == np.float32
    for e in range(3):
        assert got[e] == pytest.approx(_loss64(w[e], q[e], h if shared else h[e]), rel=1e-5)
    if fixed_order:
        alone = [np.asarray(hessian_loss(w[e], q[e], h if shared else h[e])) for e in range(3)]
        mapped = np.asarray(jax.jit(jax.vmap(hessian_loss, (0, 0, None if shared else 0)))(w, q, h))
        assert got.tobytes() == mapped.tobytes()
        np.testing.assert_allclose(np.asarray(alone), got, rtol=1e-6)   # the products: an ulp apart at most


def test_zero_for_an_exact_weight():
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert float(hessian_loss(w, w, np.eye(4, dtype=np.float32))) == 0.0
