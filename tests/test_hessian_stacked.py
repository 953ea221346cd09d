import numpy as np
import pytest

from jgptq import hessian as hs


def test_stacked_states_accumulate_each_entry_like_a_float64_sum(rng):
    state = hs.init_stacked(3, 16)
    xs = [rng.standard_normal((n, 16)).astype(np.float32) for n in (5, 7, 9)]
    state = hs.accumulate_at(state, 1, xs[0])
    state = hs.accumulate_at(state, 1, xs[1])
    mask = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0], bool)
    state = hs.accumulate_at(state, 2, xs[2], mask)
    h = np.asarray(hs.finalize(state))
    assert state.token_count.tolist() == [0, 12, 6]
    x1 = np.concatenate(xs[:2]).astype(np.float64)
    x2 = xs[2][mask].astype(np.float64)
    np.testing.assert_allclose(h[1], 2 / 12 * x1.T @ x1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h[2], 2 / 6 * x2.T @ x2, rtol=1e-5, atol=1e-6)
    assert not h[0].any()
    # one entry equals the plain statistic of the same rows
    np.testing.assert_allclose(h[1], np.asarray(hs.finalize(hs.from_activations(np.concatenate(xs[:2])))),
                               rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="index 3 outside a stack of 3"):
        hs.accumulate_at(state, 3, xs[0])
    with pytest.raises(ValueError, match="do not match a Hessian of 16 columns"):
        hs.accumulate_at(state, 0, xs[0][:, :8])
