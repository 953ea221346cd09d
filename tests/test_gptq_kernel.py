"""The fused in-block kernel (Pallas, interpret mode on the CPU) against the XLA column loop and the float64
textbook; its batching over experts; its lowering to a Triton call for CUDA; the static choice of the XLA loop
for what the kernel does not implement."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgptq import QuantConfig, gptq
from jgptq.kernels import inblock
from tests import reference_gptq as ref
from tests.test_gptq import problem


def solve_with(monkeypatch, path, *args, experts=False, **kw):
    """A solve traced afresh under ``JGPTQ_SOLVER_KERNEL=path``."""
    monkeypatch.setenv(inblock.MODE_ENV, path)
    jax.clear_caches()
    out = (gptq.solve_experts if experts else gptq.solve)(*args, check=False, **kw)
    return jax.block_until_ready(out)


def first_differences_at_ties(codes_a, codes_b, ratios, perm, tol=1e-3):
    """Rows where the codes differ, and whether each row's first difference in solve order is a near-tie of the
    float64 solve (until then both programs made the same choices)."""
    diff = (codes_a != codes_b)[:, perm]
    rows = np.nonzero(diff.any(axis=1))[0]
    x = ratios[:, perm][rows, np.argmax(diff[rows], axis=1)]
    return rows.size, np.abs(np.abs(x - np.floor(x)) - 0.5) < tol


CONFIGS = [
    dict(group_size=32, bits=4),                                                    # lazy, float16 scales
    dict(group_size=64, bits=3, sym=False, act_order="desc", scale_dtype="float32"),  # lazy, two groups a block
    dict(group_size=128, bits=8, static_groups=True, act_order="group_aware", scale_dtype="bfloat16"),
    dict(group_size=-1, bits=4, sym=False, act_order="desc"),                       # one grid a row
    dict(group_size=32, bits=3, sym=False, act_order="static", block_size=64),       # static, scattered groups
]


@pytest.mark.parametrize("opts", CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_kernel_equals_xla_loop_and_float64_textbook(rng, monkeypatch, opts):
    w, h, _ = problem(rng, rows=40, cols=128, tokens=256)  # 40 rows: the last row tile is padded
    cfg = QuantConfig(**opts)
    xla = solve_with(monkeypatch, "xla", w, h, cfg)
    ker = solve_with(monkeypatch, "pallas", w, h, cfg)
    ck, cx = np.asarray(ker.codes).astype(int), np.asarray(xla.codes).astype(int)
    r = ref.gptq(w, h, cfg.bits, cfg.group_size, cfg.sym, cfg.act_order, cfg.static_groups, cfg.damp,
                 tie_codes=ck, scale_dtype=cfg.scale_dtype)
    # against the XLA loop: the same codes but at rounding near-ties, one step apart there, the same loss
    assert np.mean(ck != cx) <= 1e-3
    assert np.all(np.abs(ck - cx)[ck != cx] == 1)
    n_rows, at_tie = first_differences_at_ties(ck, cx, r["ratios"], np.asarray(ker.perm))
    assert n_rows <= 1 and np.all(at_tie)
    assert float(ker.loss) == pytest.approx(float(xla.loss), rel=1e-5)
    np.testing.assert_array_equal(np.asarray(ker.g_idx), np.asarray(xla.g_idx))
    if n_rows == 0 and (cfg.scale_dtype != "float32" or jax.default_backend() == "cpu"):
        np.testing.assert_array_equal(np.asarray(ker.scales), np.asarray(xla.scales))
    elif n_rows == 0:  # unrounded float32 scales: on the H200 the two compilers round the grid fit apart (5 ulp seen)
        np.testing.assert_array_max_ulp(np.asarray(ker.scales), np.asarray(xla.scales), maxulp=8)
    if n_rows == 0:
        np.testing.assert_array_equal(np.asarray(ker.zeros), np.asarray(xla.zeros))
        np.testing.assert_allclose(np.asarray(ker.weight), np.asarray(xla.weight), rtol=0, atol=1e-6)
    # against the float64 textbook, which follows the kernel only where a weight sits on a near-tie
    assert np.array_equal(ck, r["codes"])
    assert r["ties"] <= 3
    assert np.allclose(np.asarray(ker.scales), r["scales"], rtol=2e-3 if cfg.scale_dtype == "bfloat16" else 1e-5)
    assert np.array_equal(np.asarray(ker.zeros), r["zeros"])
    assert np.allclose(np.asarray(ker.weight), r["weight"], rtol=1e-5, atol=1e-5)
    assert float(ker.loss) == pytest.approx(r["loss"], rel=1e-4)


def test_kernel_vmapped_over_experts_equals_one_at_a_time(rng, monkeypatch):
    ws, hs_ = zip(*(problem(rng, rows=16, cols=64, tokens=256)[:2] for _ in range(3)))
    cfg = QuantConfig(group_size=16, block_size=32, act_order="group_aware", sym=False)
    batch = solve_with(monkeypatch, "pallas", np.stack(ws), np.stack(hs_), cfg, experts=True)
    for e in range(3):
        one = gptq.solve(ws[e], hs_[e], cfg, check=False)
        np.testing.assert_array_equal(np.asarray(batch.codes[e]), np.asarray(one.codes))
        np.testing.assert_array_equal(np.asarray(batch.scales[e]), np.asarray(one.scales))
        np.testing.assert_allclose(np.asarray(batch.weight[e]), np.asarray(one.weight), rtol=0, atol=1e-6)
        assert float(batch.loss[e]) == pytest.approx(float(one.loss), rel=1e-6)


def lowered_for_cuda(cfg, experts=4, rows=64, cols=256):
    """StableHLO text of the vmapped solve lowered for CUDA (no GPU needed: Pallas emits Triton IR)."""
    jax.clear_caches()  # the solver path is chosen when the solve is traced
    w = jax.ShapeDtypeStruct((experts, rows, cols), jnp.float32)
    h = jax.ShapeDtypeStruct((experts, cols, cols), jnp.float32)
    solve = jax.jit(jax.vmap(lambda a, b: gptq.solve(a, b, cfg, check=False)))
    return solve.trace(w, h).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("opts", [dict(), dict(static_groups=True, sym=False, group_size=64)])
def test_kernel_lowers_to_one_triton_call_a_block_on_cuda(monkeypatch, opts):
    monkeypatch.setenv(inblock.MODE_ENV, "pallas")  # "auto" traces the kernel only where CUDA is present
    monkeypatch.setenv(inblock.TILING_ENV, "16,2,1")
    text = lowered_for_cuda(QuantConfig(**opts))
    assert text.count("__gpu$xla.gpu.triton") == 1  # inside the loop over blocks
    grid = dict(re.findall(r"grid_([xyz]) = (\d+)", text))
    assert grid == {"x": "4", "y": "4", "z": "1"}  # 64 rows / 16 a tile, 4 experts
    assert "num_warps = 2" in text and "div.rn.f32" in text and "cvt.rni.f32.f32" in text
    monkeypatch.setenv(inblock.MODE_ENV, "xla")
    assert "__gpu$xla.gpu.triton" not in lowered_for_cuda(QuantConfig(**opts))


@pytest.mark.parametrize("opts, why", [(dict(mse=2.4), "MSE clip search"),
                                        (dict(group_size=96, block_size=128), "192 columns")])
def test_what_the_kernel_lacks_takes_the_xla_loop_and_says_so(monkeypatch, caplog, opts, why):
    monkeypatch.setenv(inblock.MODE_ENV, "pallas")
    with caplog.at_level(logging.INFO, logger="jgptq.kernels"):
        text = lowered_for_cuda(QuantConfig(**opts), cols=192 if "group_size" in opts else 256)
    assert "__gpu$xla.gpu.triton" not in text
    assert any(why in rec.getMessage() for rec in caplog.records)


def test_bad_path_or_tiling_is_refused(monkeypatch):
    monkeypatch.setenv(inblock.MODE_ENV, "triton")
    with pytest.raises(ValueError, match="JGPTQ_SOLVER_KERNEL='triton'"):
        inblock.mode()
    monkeypatch.setenv(inblock.TILING_ENV, "24,4,1")
    with pytest.raises(ValueError, match="row_tile=24"):
        inblock.tiling()
