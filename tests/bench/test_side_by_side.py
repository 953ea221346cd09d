"""The scoring shared by the peer-library benchmarks: the float64 loss against a numpy closed form, code agreement
counts, routed-token counts and the random Hessians."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks.anchors import side_by_side as sbs  # noqa: E402


def test_loss64_is_the_output_space_error_in_float64():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 7))
    q = w + 1e-3 * rng.standard_normal((5, 7))
    x = rng.standard_normal((40, 7))
    h = x.T @ x
    expected = float(np.sum(((q - w) @ x.T) ** 2))  # ||(Q - W) X^T||^2 = trace((Q - W) H (Q - W)^T)
    got = sbs.loss64(torch.tensor(q, dtype=torch.float32), torch.tensor(w, dtype=torch.float32),
                     torch.tensor(h, dtype=torch.float32))
    # float32 inputs: the difference of two float32 matrices, then float64 from there
    q32, w32, h32 = (a.astype(np.float32).astype(np.float64) for a in (q, w, h))
    assert got == pytest.approx(float(np.sum(((q32 - w32) @ h32) * (q32 - w32))), rel=1e-12)
    assert got == pytest.approx(expected, rel=1e-3)


def test_agreement_counts_codes_and_whole_rows():
    a = torch.zeros(2, 3, 4, dtype=torch.uint8)
    b = a.clone()
    b[0, 1, 2] = 5
    b[1, 2, 0] = 1
    r = sbs.agreement(a, b)
    assert r["codes_compared"] == 24
    assert r["codes_equal"] == pytest.approx(22 / 24)
    assert r["rows_identical"] == pytest.approx(4 / 6)


def test_routed_counts_spread_every_routed_token():
    counts = sbs.routed_counts(np.random.default_rng(0), 16, 16 * 4000, min_tokens=1)
    assert len(counts) == 16 and sum(counts) == 16 * 4000
    assert max(counts) > min(counts)  # unequal popularity, as a router gives


def test_hessian_is_symmetric_positive_definite_with_a_spread_diagonal():
    gen = torch.Generator().manual_seed(0)
    h = sbs.hessian(gen, 300, 16, "cpu", chunk=128).double()
    assert torch.allclose(h, h.T)
    eig = torch.linalg.eigvalsh(h)
    assert eig.min() > 0
    # per-column scales e^-1.5..e^1.5 spread the diagonal
    assert h.diagonal().max() / h.diagonal().min() > 3
