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


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_grouped_accumulation_equals_float64_sums_per_expert(rng, input_dtype):
    import jax.numpy as jnp

    state, sums = hs.init_stacked(5, 16), jnp.zeros((5, 16), jnp.float32)
    x = rng.standard_normal((2, 2, 6, 16)).astype(np.float32)  # two groups of two experts: (1, 2) and (4, 3)
    mask = rng.random((2, 2, 6)) < 0.7
    groups = ([1, 2], [4, 3])
    for g in range(2):
        state, sums = hs.accumulate_group(state, sums, groups[g], x[g], mask[g], input_dtype=input_dtype)
    state, sums = hs.accumulate_group(state, sums, groups[0], x[1], mask[1], input_dtype=input_dtype)  # adds up
    ops = x.astype(np.float64)
    if input_dtype == "bfloat16":
        ops = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    want_h, want_sq, want_n = np.zeros((5, 16, 16)), np.zeros((5, 16)), np.zeros(5, int)
    for g, experts in ((0, groups[0]), (1, groups[1]), (1, groups[0])):
        for j, e in enumerate(experts):
            rows = ops[g, j][mask[g, j]]
            want_h[e] += rows.T @ rows
            want_sq[e] += (x[g, j][mask[g, j]].astype(np.float64) ** 2).sum(0)
            want_n[e] += len(rows)
    assert state.token_count.tolist() == want_n.tolist()
    np.testing.assert_allclose(np.asarray(state.hessian_sum), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sums), want_sq, rtol=1e-5, atol=1e-5)
    assert not np.asarray(state.hessian_sum)[0].any()
    with pytest.raises(ValueError, match="does not fit a stack of 5"):
        hs.accumulate_group(state, sums, [4, 5], x[0], mask[0])
