import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgptq import QuantConfig
from jgptq.quantizers import uniform
from tests import reference_gptq as ref


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_grid_fit_and_codes_match_float64(rng, bits, sym):
    w = rng.standard_normal((32, 64)).astype(np.float32) * np.exp(rng.uniform(-2, 2, (32, 1))).astype(np.float32)
    w[3] = np.abs(w[3])  # all non-negative row
    w[5] = 0.0  # empty range
    cfg = QuantConfig(bits=bits, sym=sym, group_size=16, scale_dtype="float32")
    grid = uniform.fit(jnp.asarray(w), cfg)
    s, z = ref.grid_fit(w.astype(np.float64), bits, sym)
    np.testing.assert_allclose(np.asarray(grid.scale), s, rtol=1e-6)
    # the empty row's asymmetric zero sits on a rounding tie (maxq / 2): float32 and float64 may differ there
    rows = np.arange(32) != 5
    assert np.array_equal(np.asarray(grid.zero)[rows], z[rows])
    q = np.asarray(uniform.quantize(jnp.asarray(w), grid.scale[:, None], grid.zero[:, None], cfg.maxq))
    assert q.min() >= 0 and q.max() <= 2 ** bits - 1
    assert np.all(q == np.round(q))
    # zero is exactly representable on every grid
    zero_code = np.asarray(uniform.quantize(jnp.zeros((32, 1)), grid.scale[:, None], grid.zero[:, None], cfg.maxq))
    assert np.all(np.asarray(uniform.dequantize(zero_code, grid.scale[:, None], grid.zero[:, None])) == 0)
    # the empty row gets the [-1, 1] range
    assert np.isclose(float(grid.scale[5]), 2.0 / (2 ** bits - 1))


def test_symmetric_grid_is_centered(rng):
    cfg = QuantConfig(bits=4, sym=True)
    grid = uniform.fit(jnp.asarray(rng.standard_normal((4, 32)), jnp.float32), cfg)
    assert np.all(np.asarray(grid.zero) == 8)


def test_mse_search_never_worse_than_minmax_and_matches_reference(rng):
    w = rng.standard_normal((64, 128)).astype(np.float32)
    w[:, 0] *= 8  # outliers make clipping worthwhile
    base = QuantConfig(bits=3, sym=False, group_size=-1, scale_dtype="float32")
    mse = base.replace(mse=2.4)
    g0, g1 = uniform.fit(jnp.asarray(w), base), uniform.fit(jnp.asarray(w), mse)

    def err(g):
        d = np.asarray(uniform.fake_quantize(jnp.asarray(w), g.scale[:, None], g.zero[:, None], 7)) - w
        return np.sum(np.abs(d) ** 2.4, axis=1)

    assert np.all(err(g1) <= err(g0) * (1 + 1e-6))
    assert np.mean(err(g1)) < 0.9 * np.mean(err(g0))
    s, z = ref.grid_fit(w.astype(np.float64), 3, False, mse=2.4)
    assert np.mean(np.isclose(np.asarray(g1.scale), s, rtol=1e-5)) > 0.95  # near-equal errors may pick neighbours


def test_round_to_nearest_groups(rng):
    w = rng.standard_normal((8, 64)).astype(np.float32)
    cfg = QuantConfig(bits=4, group_size=16, sym=False)
    codes, grid, deq = uniform.round_to_nearest(jnp.asarray(w), cfg)
    assert np.array_equal(np.asarray(grid.scale).astype(np.float16).astype(np.float32), np.asarray(grid.scale))
    assert codes.dtype == jnp.uint8 and grid.scale.shape == (8, 4)
    for g in range(4):
        s, z = ref.grid_fit(w[:, 16 * g:16 * (g + 1)].astype(np.float64), 4, False, scale_dtype="float16")
        q, dq, _ = ref.quant(w[:, 16 * g:16 * (g + 1)].astype(np.float64), s[:, None], z[:, None], 4)
        assert np.array_equal(np.asarray(codes)[:, 16 * g:16 * (g + 1)], q)
        np.testing.assert_allclose(np.asarray(deq)[:, 16 * g:16 * (g + 1)], dq, rtol=1e-5, atol=1e-6)


def test_float16_scales_never_underflow_to_zero():
    w = jnp.asarray(np.full((2, 8), 1e-9, np.float32))
    grid = uniform.fit(w, QuantConfig(bits=4, sym=False))
    assert np.all(np.asarray(grid.scale) > 0)
    assert np.all(np.isfinite(np.asarray(uniform.fake_quantize(w, grid.scale[:, None], grid.zero[:, None], 15))))


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_solve_has_no_float_conversion_chains(scale_dtype):
    # XLA:GPU collapses a chain of float converts into one (dropping the inner rounding): a scale rounded to
    # float16 by two converts would come back unrounded on GPU and fail the storage check. The optimized CPU HLO
    # shows such chains before that pass would run.
    from jgptq import gptq
    from tests.ggml.hlo_chains import convert_chains

    cfg = QuantConfig(bits=4, group_size=32, scale_dtype=scale_dtype)
    w = jnp.ones((8, 64), jnp.float32)
    h = jnp.eye(64, dtype=jnp.float32)
    text = gptq._solve_jit.lower(w, h, None, cfg, None).compile().as_text()
    assert convert_chains(text) == []
    grid_text = jax.jit(lambda s: uniform.storable_scale(s, scale_dtype)).lower(w).compile().as_text()
    assert convert_chains(grid_text) == []
    s = jnp.asarray([1e-9, 3.14159, 65504.0, 1e5 if scale_dtype == "bfloat16" else 60000.0], jnp.float32)
    got = np.asarray(uniform.storable_scale(s, scale_dtype))
    dt = np.float16 if scale_dtype == "float16" else jnp.bfloat16
    want = np.maximum(np.asarray(s).astype(dt).astype(np.float32), float(jnp.finfo(dt).smallest_subnormal))
    np.testing.assert_array_equal(got, want)
