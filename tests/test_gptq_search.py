"""GPTQ with grids searched on the Hessian-weighted error (``gptq_search``): the weighted clip search against a
float64 numpy reference of the same search, the solver's grids against that reference where GPTQ has nothing to
compensate (a diagonal Hessian), the method through quantize_bucket and the torch pipeline, and its export."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgptq import gptq, methods
from jgptq.bucket import MatrixPlan, Stack, hessian_loss, quantize_bucket
from jgptq.config import QuantConfig
from jgptq.quantizers import uniform
from tests.conftest import correlated_activations

GRID, SHRINK = 100, 0.8


def _candidate(w, i, bits, sym):
    """The i-th clip candidate, (scale, zero) float64 per row of w (R, n): the range shrunk by
    ``1 - i / GRID`` and the scale stored as float16, computed in float32 as a stored grid is (the candidates
    are the grids a file can hold; their errors are then compared in float64)."""
    f32 = np.float32
    maxq = 2 ** bits - 1
    w = w.astype(f32)
    xmin, xmax = np.minimum(w.min(1), f32(0)), np.maximum(w.max(1), f32(0))
    if sym:
        xmax = np.maximum(np.abs(xmin), xmax)
        xmin = np.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin, xmax = np.where(empty, f32(-1), xmin), np.where(empty, f32(1), xmax)
    p = f32(1) - f32(i) / f32(GRID)
    xmin, xmax = p * xmin, p * xmax
    scale = ((xmax - xmin) * f32(1.0 / maxq)).astype(np.float16).astype(f32)
    zero = np.full_like(scale, (maxq + 1) / 2) if sym else np.round(-xmin / scale)
    return scale.astype(np.float64), zero.astype(np.float64)


def _error(w, d, scale, zero, bits):
    """float64 ``sum_j d_j (dequant - w)_ij^2`` per row for grids (scale, zero) (R,)."""
    q = np.clip(np.round(w / scale[:, None]) + zero[:, None], 0, 2 ** bits - 1)
    return ((scale[:, None] * (q - zero[:, None]) - w) ** 2 * d).sum(1)


def _reference_search(w, d, bits, sym):
    """float64 weighted clip search: per row, the first factor ``1 - i / GRID`` with the least error."""
    best = np.full(w.shape[0], np.inf)
    scale = zero = None
    for i in range(int(SHRINK * GRID)):
        s, z = _candidate(w, i, bits, sym)
        err = _error(w, d, s, z, bits)
        better = err < best
        best = np.where(better, err, best)
        scale = s if scale is None else np.where(better, s, scale)
        zero = z if zero is None else np.where(better, z, zero)
    return scale, zero, best


@pytest.mark.parametrize("bits, sym", [(4, True), (3, True), (4, False), (2, False)])
def test_weighted_search_never_loses_to_min_max_and_matches_the_float64_search(bits, sym):
    rng = np.random.default_rng(bits * 10 + sym)
    rows, n = 256, 32
    w = rng.standard_normal((rows, n)) * np.exp(rng.uniform(-1, 1, (rows, 1)))
    w[:8] = np.abs(w[:8])          # rows of one sign: the range keeps 0
    w[8] = 0.0                     # an empty row
    d = np.exp(rng.uniform(-3, 3, n))
    d[:3] = 0.0                    # columns without weight
    cfg = QuantConfig(bits=bits, sym=sym, group_size=n)
    grid = jax.jit(uniform.fit, static_argnums=1)(jnp.asarray(w, jnp.float32), cfg, jnp.asarray(d, jnp.float32))
    scale, zero = np.asarray(grid.scale, np.float64), np.asarray(grid.zero, np.float64)
    w32 = w.astype(np.float32).astype(np.float64)
    got = _error(w32, d, scale, zero, bits)
    minmax = _error(w32, d, *_candidate(w32, 0, bits, sym), bits)
    ref_scale, ref_zero, ref_best = _reference_search(w32, d, bits, sym)
    assert np.all(got <= minmax * (1 + 1e-6) + 1e-12)
    assert np.all(got <= ref_best * (1 + 1e-5) + 1e-12)
    same = (scale == ref_scale) & (zero == ref_zero)
    assert same.mean() >= 0.98, f"{(~same).sum()} rows chose another grid than the float64 search"
    assert np.mean(got < minmax * (1 - 1e-6)) > 0.3   # the search does find better grids
    # without weights the fit is the plain min/max (or the unweighted search) as before
    plain = uniform.fit(jnp.asarray(w, jnp.float32), cfg)
    np.testing.assert_array_equal(np.asarray(plain.scale, np.float64), _candidate(w32, 0, bits, sym)[0])


_solve = jax.jit(gptq.solve_unchecked, static_argnames=("config", "codec", "grid_weights"))


@pytest.mark.parametrize("weighting, static_groups", [("factor", False), ("diagonal", True)])
def test_with_a_diagonal_hessian_the_solve_rounds_on_the_searched_grids(weighting, static_groups):
    """A diagonal Hessian leaves GPTQ nothing to compensate with: every group is rounded to nearest on its grid,
    which must be the weighted search of the group's original weights (damped diagonal for "factor")."""
    rng = np.random.default_rng(3)
    rows, cols, gs = 32, 64, 16
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    h = np.exp(rng.uniform(-2, 2, cols))
    cfg = QuantConfig(bits=3, group_size=gs, block_size=32, static_groups=static_groups)
    res = _solve(jnp.asarray(w), jnp.asarray(np.diag(h), jnp.float32), None, cfg, grid_weights=weighting)
    d = h + cfg.damp * h.mean() if weighting == "factor" else h
    w64 = w.astype(np.float64)
    for g in range(cols // gs):
        cs = slice(g * gs, (g + 1) * gs)
        scale, zero, _ = _reference_search(w64[:, cs], d[cs], 3, True)
        assert np.mean(np.asarray(res.scales[:, g], np.float64) == scale) >= 0.95
        got = _error(w64[:, cs], d[cs], np.asarray(res.scales[:, g], np.float64), zero, 3)
        q = np.clip(np.round(w64[:, cs] / scale[:, None]) + zero[:, None], 0, 7)
        np.testing.assert_allclose(got, _error(w64[:, cs], d[cs], scale, zero, 3), rtol=1e-5, atol=1e-9)
        ok = np.asarray(res.scales[:, g], np.float64) == scale
        np.testing.assert_array_equal(np.asarray(res.codes[:, cs])[ok], q[ok])


@functools.lru_cache(maxsize=None)
def _stacks(tokens=(500, 500, 3, 500)):
    rng = np.random.default_rng(0)
    cols = 64
    w = jnp.asarray(rng.standard_normal((len(tokens), 16, cols)), jnp.float32)
    x = correlated_activations(rng, 4 * cols, cols)
    h = np.broadcast_to(x.T @ x / x.shape[0], (len(tokens), cols, cols))
    return [Stack("experts.down_proj", w, jnp.asarray(h, jnp.float32), tokens)]


def test_the_method_solves_a_bucket_with_the_shared_fallbacks_and_beats_min_max_on_the_layer_loss():
    quant = QuantConfig(bits=3, group_size=32, block_size=32)
    stacks = _stacks()
    (solved,) = quantize_bucket(stacks, MatrixPlan("gptq_search", quant), threshold=10)
    assert solved.method == ("gptq_search", "gptq_search", "rtn", "gptq_search")
    assert solved.reason[2] == "3 tokens < 10"
    (nearest,) = quantize_bucket(stacks, MatrixPlan("rtn", quant))
    np.testing.assert_array_equal(np.asarray(solved.weight[2]), np.asarray(nearest.weight[2]))
    np.testing.assert_array_equal(np.asarray(solved.codes[2]), np.asarray(nearest.codes[2]))
    assert np.isnan(solved.loss[2])
    w, h = stacks[0].weight, stacks[0].hessian
    for i in (0, 1, 3):   # the solved matrices are the solver's own result with the searched grids
        direct = _solve(w[i], h[i], None, quant, grid_weights="factor")
        np.testing.assert_array_equal(np.asarray(solved.weight[i]), np.asarray(direct.weight))
        np.testing.assert_array_equal(np.asarray(solved.scales[i]), np.asarray(direct.scales))
    (plain,) = quantize_bucket(stacks, MatrixPlan("gptq", quant), threshold=10)
    loss = {name: sum(float(hessian_loss(w[i], r.weight[i], h[i])) for i in (0, 1, 3))
            for name, r in (("search", solved), ("gptq", plain))}
    assert loss["search"] < 0.9 * loss["gptq"], loss
    deq = np.asarray(solved.scales).repeat(32, -1) * (np.asarray(solved.codes, np.float32)
                                                       - np.asarray(solved.zeros).repeat(32, -1))
    np.testing.assert_array_equal(deq, np.asarray(solved.weight))


def test_the_method_refuses_ggml_formats_by_name():
    with pytest.raises(ValueError, match=r"down_proj.*'gptq_search' searches integer grids.*q4_0.*use method"):
        quantize_bucket(_stacks(), MatrixPlan("gptq_search", QuantConfig(format="q4_0")), threshold=10)


def test_the_method_runs_through_the_torch_pipeline():
    torch = pytest.importorskip("torch")
    import jgptq
    from tests.tiny_models import build

    model = build("qwen3_moe")
    calib = torch.randint(0, model.config.vocab_size, (4, 32))
    result = jgptq.quantize_moe(model, calib, method="gptq_search", bits=4, group_size=32, progress=False)
    labels = {r.method for r in result.report.records}
    assert "gptq_search" in labels and labels <= {"gptq_search", "rtn"}
    assert {rec.method for rec in result.weights.values()} <= {"gptq_search", "rtn", "mixed"}
    assert methods.get("gptq_search").weighting == "factor"
    assert methods.get("gptq_search_diag").weighting == "diagonal"


def test_the_export_decodes_to_exactly_the_solved_weights(tmp_path, bits=3, sym=False):
    pytest.importorskip("compressed_tensors")
    from jgptq.export import QuantizedWeight, export_compressed_tensors
    from tests.export.conftest import COLS, _hessian, _weight, config
    from tests.export.test_compressed_tensors import NAME, package_decompress, scheme_of
    from tests.export.test_gptq_v1 import MODEL_CONFIG, read_checkpoint

    cfg = config(bits=bits, sym=sym)
    result = _solve(jnp.asarray(_weight(48, COLS, 0)), jnp.asarray(_hessian(COLS)), None, cfg,
                    grid_weights="factor")
    rec = QuantizedWeight.from_result(result, cfg)
    export_compressed_tensors(tmp_path / "m", {NAME: rec}, model_config=MODEL_CONFIG, quant_config=cfg)
    t = read_checkpoint(tmp_path / "m")
    got = package_decompress(t, NAME, scheme_of(tmp_path / "m"), upcast=True)
    assert np.array_equal(got.numpy(), np.asarray(result.weight))
