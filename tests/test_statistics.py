"""The statistics of a layer's inputs as init/update/finalize triples (jgptq.statistics): every form of update
against float64 sums, and the split group updates equal to the fused group kernel and the per-expert squares bit for
bit (so that the capture's chain gives the bytes the fused accumulation gave)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgptq import hessian as hs
from jgptq import statistics as st
from jgptq.imatrix import ImatrixEntry


def test_the_pipeline_chain_is_the_hessian_then_the_importance():
    chain = st.calibration("bfloat16", all_experts=True)
    assert list(chain) == ["hessian", "imatrix"]
    assert chain["hessian"].all_experts is True and chain["imatrix"].all_experts is False
    assert st.calibration()["hessian"].all_experts is False
    with pytest.raises(ValueError, match="input_dtype must be one of"):
        st.hessian_sum("float16")


def test_hessian_statistic_forms_equal_float64_sums(rng):
    stat = st.hessian_sum()
    x = rng.standard_normal((10, 8)).astype(np.float32)
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], bool)
    one = stat.update(stat.init(8), x, mask)
    h, n = stat.finalize(one)
    ref = x[mask].astype(np.float64)
    assert n == 8
    np.testing.assert_allclose(np.asarray(h), 2 / 8 * ref.T @ ref, rtol=1e-5, atol=1e-6)
    # a stack of 3: rows of expert 2, then a group of slots (experts 0 and 2, padded rows masked out)
    stack = stat.update(stat.init(8, 3), x[:4], np.ones(4, bool), 2)
    group = rng.standard_normal((2, 5, 8)).astype(np.float32)
    gmask = np.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], bool)
    stack = stat.update(stack, group, gmask, [0, 2])
    h, n = stat.finalize(stack)
    assert n == [3, 0, 5]
    r0 = group[0, :3].astype(np.float64)
    r2 = np.concatenate([x[:4], group[1, :1]]).astype(np.float64)
    np.testing.assert_allclose(np.asarray(h[0]), 2 / 3 * r0.T @ r0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(h[2]), 2 / 5 * r2.T @ r2, rtol=1e-5, atol=1e-6)
    assert not np.asarray(h[1]).any()
    with pytest.raises(ValueError, match="does not fit a stack of 3 experts"):
        stat.update(stack, group, gmask, [0, 3])


def test_importance_statistic_sums_squares_of_the_rows_it_sees(rng):
    stat = st.importance()
    x = rng.standard_normal((6, 4)).astype(np.float32)
    mask = np.array([1, 0, 1, 1, 0, 1], bool)
    entry = stat.finalize(stat.update(stat.init(4), x, mask))
    assert isinstance(entry, ImatrixEntry) and entry.sums.dtype == entry.counts.dtype == np.float32
    np.testing.assert_allclose(entry.sums, (x[mask].astype(np.float64) ** 2).sum(0)[None], rtol=1e-6)
    assert entry.counts.tolist() == [4.0]
    state = stat.update(stat.init(4, 3), x, np.ones(6, bool), 1)
    group = rng.standard_normal((2, 3, 4)).astype(np.float32)
    gmask = np.array([[1, 1, 0], [0, 0, 0]], bool)                    # the second slot is padding
    entry = stat.finalize(stat.update(state, group, gmask, [2, 2]))
    assert entry.counts.tolist() == [0.0, 6.0, 2.0]
    np.testing.assert_allclose(entry.sums[2], (group[0, :2].astype(np.float64) ** 2).sum(0), rtol=1e-6)
    np.testing.assert_allclose(entry.sums[1], (x.astype(np.float64) ** 2).sum(0), rtol=1e-6)
    assert not entry.sums[0].any()
    with pytest.raises(ValueError, match="do not match sums of 4 columns"):
        stat.update(state, x[:, :3], mask)


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_split_group_updates_equal_the_fused_group_kernel_bit_for_bit(rng, input_dtype):
    e, c = 6, 32
    x = rng.standard_normal((3, 4, 16, c)).astype(np.float32)
    mask = rng.random((3, 4, 16)) < 0.6
    slots = ([0, 3, 5, 3], [1, 2, 4, 0], [5, 5, 2, 1])
    fused, sums = hs.init_stacked(e, c), jnp.zeros((e, c), jnp.float32)
    hess, imp = st.hessian_sum(input_dtype), st.importance()
    h_state, i_state = hess.init(c, e), imp.init(c, e)
    for g in range(3):
        fused, sums = hs.accumulate_group(fused, sums, slots[g], x[g], mask[g], input_dtype=input_dtype)
        h_state = hess.update(h_state, x[g], mask[g], slots[g])
        i_state = imp.update(i_state, x[g], mask[g], slots[g])
    assert np.array_equal(np.asarray(h_state.token_count), np.asarray(fused.token_count))
    assert np.array_equal(np.asarray(i_state.token_count), np.asarray(fused.token_count))
    if jax.default_backend() == "cpu":
        assert np.array_equal(np.asarray(h_state.hessian_sum), np.asarray(fused.hessian_sum))
        assert np.array_equal(np.asarray(i_state.sums), np.asarray(sums))
    else:  # an accelerator compiles the split and the fused programs to other kernels: float32 rounding apart
        np.testing.assert_allclose(np.asarray(h_state.hessian_sum), np.asarray(fused.hessian_sum), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(np.asarray(i_state.sums), np.asarray(sums), rtol=1e-5, atol=1e-5)
    # rows of one expert at a time: the per-expert squares of jgptq.hessian, bit for bit
    rows, keep = x[0, 0], mask[0, 0]
    alone = hs.accumulate_squares(jnp.zeros((e, c), jnp.float32), 4, rows, keep)
    assert np.array_equal(np.asarray(imp.update(imp.init(c, e), rows, keep, 4).sums), np.asarray(alone))


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_a_chain_group_update_in_one_program_equals_the_updates_one_by_one(rng, input_dtype):
    chain = list(st.calibration(input_dtype).values())
    x = jnp.asarray(rng.standard_normal((4, 16, 8)).astype(np.float32))
    mask = jnp.asarray(rng.random((4, 16)) < 0.7)
    index = [3, 0, 5, 0]
    one = [s.update(s.init(8, 6), x, mask, index) for s in chain]
    fused = st.update_group(chain, [s.init(8, 6) for s in chain], index, x, mask)
    for a, b in zip(one, fused):
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            assert np.array_equal(np.asarray(u), np.asarray(v))
    # a statistic without a group form makes the chain take the one-by-one updates
    plain = st.Statistic(*chain[1][:4])
    again = st.update_group([chain[0], plain], [s.init(8, 6) for s in chain], index, x, mask)
    assert np.array_equal(np.asarray(again[1].sums), np.asarray(one[1].sums))
    with pytest.raises(ValueError, match="does not fit a stack of 6 experts"):
        st.update_group(chain, [s.init(8, 6) for s in chain], [3, 0, 6, 0], x, mask)
    with pytest.raises(ValueError, match="do not match a state of 9 columns"):
        st.update_group(chain, [s.init(9, 6) for s in chain], index, x, mask)


def test_group_programs_compiled_side_by_side_are_the_ones_the_updates_run(rng):
    from jax._src import monitoring

    chain = list(st.calibration("bfloat16").values())
    device = jax.devices()[0]
    shapes = [(2, 8), (4, 16), (2, 8), (8, 4)]
    x0 = jax.device_put(jnp.zeros((1, 1, 24), jnp.bfloat16), device)
    m0 = jax.device_put(jnp.zeros((1, 1), bool), device)
    states = [s.init(24, 6, device) for s in chain]
    assert st.compile_groups(chain, states, shapes, x0, m0, workers=2) == 3     # the repeated shape once
    assert st.compile_groups(chain, states, shapes, x0, m0) == 0                # known now
    cases = []
    for g, p in dict.fromkeys(shapes):   # references first: the one-by-one updates compile programs of their own
        x = jax.device_put(jnp.asarray(rng.standard_normal((g, p, 24)), jnp.bfloat16), device)
        mask = jax.device_put(jnp.asarray(rng.random((g, p)) < 0.8), device)
        index = [int(e) for e in rng.choice(6, g, replace=False)] if g <= 6 else [int(e) for e in rng.integers(0, 6, g)]
        want = [s.update(s.init(24, 6, device), x, mask, index) for s in chain]
        cases.append((index, x, mask, want, [s.init(24, 6, device) for s in chain]))
    compiles = []

    def listener(event, seconds, **kw):
        if "backend_compile" in event:
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        got = [st.update_group(chain, fresh, index, x, mask) for index, x, mask, _, fresh in cases]
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert compiles == []                        # every group program was ready
    for (_, _, _, want, _), out in zip(cases, got):
        for a, b in zip(want, out):
            for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
                assert np.array_equal(np.asarray(u), np.asarray(v))
