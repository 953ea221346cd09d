"""The diagonal shrinkage of the hessian_overfit benchmark against its definition computed entry by entry."""

import numpy as np

from benchmarks.hessian_overfit import shrunk_to_diagonal


def test_intensity_is_the_summed_variance_of_the_off_diagonal_means_over_their_squares():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 4)) @ rng.standard_normal((4, 4))
    n = x.shape[0]
    num = den = 0.0
    for i in range(4):
        for j in range(4):
            if i != j:
                p = x[:, i] * x[:, j]
                num += np.var(p) / n                  # population variance of the products, over n
                den += p.mean() ** 2
    a, shrunk = shrunk_to_diagonal(x)
    assert abs(a - min(1.0, num / den)) < 1e-12
    s = x.T @ x / n
    np.testing.assert_allclose(shrunk, (1 - a) * s + a * np.diag(np.diag(s)), rtol=1e-12)


def test_independent_columns_shrink_fully_and_strongly_correlated_ones_barely():
    rng = np.random.default_rng(1)
    a_iid, _ = shrunk_to_diagonal(rng.standard_normal((2000, 64)))
    z = rng.standard_normal((2000, 1))
    a_corr, _ = shrunk_to_diagonal(z + 0.05 * rng.standard_normal((2000, 64)))
    assert a_iid > 0.9 and a_corr < 0.01
