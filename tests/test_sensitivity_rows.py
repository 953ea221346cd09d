"""The first pass of ``target_bpw`` estimates experts' costs from a sample of their rows
(:mod:`jgptq_torch.pipeline.measure`); checked against float64 numpy sums over the whole solve's rows."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from jgptq import PipelineConfig
from jgptq.bucket import MatrixPlan, Stack, quantize_bucket
from jgptq_torch.pipeline import measure
from jgptq_torch.pipeline.sensitivity import Candidate, Free

ROWS, COLS, EXPERTS = 4 * measure.CHUNK_ROWS + 40, 64, 3   # 40: a last chunk padded with repeats


def _problem(seed=0):
    """A fused experts stack (3 experts, their own Hessians and token counts) and a linear module with one
    integer-grid candidate, as the pass sees a calibrated layer."""
    rng = np.random.default_rng(seed)
    quant = PipelineConfig.build(None, bits=3, group_size=32).quant
    plan = MatrixPlan("gptq", quant, True)

    def hessian():
        x = rng.standard_normal((400, COLS)) * rng.uniform(0.2, 3.0, COLS)
        return (2 * x.T @ x / 400).astype(np.float32)

    experts = types.SimpleNamespace(name="mlp.experts.down_proj", module_name="mlp.experts", layout=object(),
                                    rows=ROWS, cols=COLS, count=EXPERTS)
    linear = types.SimpleNamespace(name="self_attn.o_proj", module_name="self_attn.o_proj", layout=None,
                                   rows=ROWS, cols=COLS, count=1)
    stacks = [(experts, "L.mlp.experts.down_proj",
               Stack("e", jnp.asarray(rng.standard_normal((EXPERTS, ROWS, COLS)), jnp.float32),
                     jnp.asarray(np.stack([hessian() for _ in range(EXPERTS)])), [300, 120, 80], "e", None)),
              (linear, "L.self_attn.o_proj",
               Stack("o", jnp.asarray(rng.standard_normal((1, ROWS, COLS)), jnp.float32), jnp.asarray(hessian()),
                     [500], "o", None))]
    free = {p: Free(0, m.name, m, {"int3": Candidate(0, plan)}) for m, p, _ in stacks}
    collector = types.SimpleNamespace(batch_tokens=500, routed={"mlp.experts": [300, 120, 80]})
    gains = {"L.mlp.experts.down_proj": np.array([2.0, 0.5, 1.5]), "L.self_attn.o_proj": np.array([3.0])}
    return collector, stacks, free, gains, plan


def _row_errors64(stack, plan):
    """float64 (n, R) ``(W - Q) H (W - Q)^T / 2`` per row of every matrix of ``stack`` solved whole."""
    solved = quantize_bucket([stack], plan, threshold=1)[0].weight
    d = np.asarray(solved, np.float64) - np.asarray(stack.weight, np.float64)
    h = np.asarray(stack.hessian, np.float64)
    h = np.broadcast_to(h, (d.shape[0],) + h.shape[-2:])
    return np.einsum("nrc,ncd,nrd->nr", d, h, d) / 2


def test_row_strides_sample_experts_only_and_cover_every_row_once_over_offsets():
    e = types.SimpleNamespace(name="mlp.experts.down_proj", layout=object(), rows=8 * measure.CHUNK_ROWS)
    per_expert = types.SimpleNamespace(name="mlp.experts.3.down_proj", layout=None, rows=3 * measure.CHUNK_ROWS)
    attn = types.SimpleNamespace(name="self_attn.q_proj", layout=None, rows=64 * measure.CHUNK_ROWS)
    assert measure.row_stride(e, e.name) == min(measure.EXPERT_ROW_STRIDE, 8)
    assert measure.row_stride(per_expert, "mlp.experts.*.down_proj") == 3   # its sample fills one chunk
    assert measure.row_stride(attn, attn.name) == 1
    rows = np.concatenate([measure.measured_rows(1000, k, 8) for k in range(8)])
    assert np.array_equal(np.sort(rows), np.arange(1000))


@pytest.mark.parametrize("stride", [1, 2])
def test_sampled_costs_are_stride_times_the_float64_sum_over_the_chosen_rows(stride):
    collector, stacks, free, gains, plan = _problem()
    costs = measure.layer_costs(collector, stacks, free, gains, threshold=1, devices=None, stride=stride)
    for m, param, stack in stacks:
        errors = _row_errors64(stack, plan)
        step = measure.row_stride(m, m.name, stride)
        seen = np.asarray(collector.routed["mlp.experts"] if m.layout is not None else stack.tokens, np.float64)
        for e in range(m.count):
            rows = measure.measured_rows(ROWS, e, step)
            assert step == 1 or len(rows) < ROWS
            want = 0.5 * gains[param][e] * seen[e] / 500 * ROWS / len(rows) * errors[e, rows].sum()
            np.testing.assert_allclose(costs[param]["int3"][e], want, rtol=2e-4)


def test_with_stride_one_the_estimate_is_the_exhaustive_figure():
    collector, stacks, free, gains, _ = _problem(1)
    sampled = measure.layer_costs(collector, stacks, free, gains, threshold=1, devices=None, stride=1)
    whole = measure.whole_costs(collector, stacks, free, gains, threshold=1, devices=None)
    for param in whole:
        np.testing.assert_allclose(sampled[param]["int3"], whole[param]["int3"], rtol=2e-4)


def test_a_sample_of_one_row_in_two_estimates_the_exhaustive_figure():
    collector, stacks, free, gains, _ = _problem(2)
    sampled = measure.layer_costs(collector, stacks, free, gains, threshold=1, devices=None, stride=2)
    whole = measure.whole_costs(collector, stacks, free, gains, threshold=1, devices=None)
    param = "L.mlp.experts.down_proj"
    ratio = sampled[param]["int3"] / whole[param]["int3"]
    assert np.all(np.abs(ratio - 1) < 0.1) and not np.allclose(ratio, 1, rtol=1e-6)


@pytest.mark.parametrize("share", [2, 3])
def test_a_grid_search_candidate_is_its_reference_scaled_by_their_ratio_on_the_most_costly_experts(
        monkeypatch, share):
    """int2 stands for a grid-search format here: solved only on the most costly experts (by the reference's
    costs), on their thinned rows (the linear module's 552 at one in 4), its costs the reference's (int3: the
    cheaper of int3 and int4) times the ratio of the two formats' float64 errors over those rows."""
    collector, stacks, free, gains, _ = _problem(3)
    plans = {f"int{b}": MatrixPlan("gptq", PipelineConfig.build(None, bits=b, group_size=32).quant, True)
             for b in (2, 3, 4)}
    cands = {f: Candidate(b * ROWS * COLS, plans[f]) for f, b in (("int2", 2), ("int3", 3), ("int4", 4))}
    free = {p: f._replace(candidates=cands) for p, f in free.items()}
    monkeypatch.setattr(measure, "GRID_SEARCH", frozenset({"int2"}))
    assert measure.scaled_by("int2", cands) == "int3" and measure.scaled_by("int3", cands) is None
    solved = []
    real = measure._solve_chunks
    monkeypatch.setattr(measure, "_solve_chunks", lambda chunks, plan, *a: solved.append(
        (plan.quant.bits, [(c.param, c.expert, tuple(c.rows)) for c in chunks])) or real(chunks, plan, *a))
    costs = measure.layer_costs(collector, stacks, free, gains, threshold=1, devices=None, share=share)
    for m, param, stack in stacks:
        err = {f: _row_errors64(stack, plans[f]) for f in plans}
        step = measure.row_stride(m, m.name)
        seen = np.asarray(collector.routed["mlp.experts"] if m.layout is not None else stack.tokens, np.float64)
        s = 0.5 * gains[param] * seen / 500
        samples = [measure.measured_rows(ROWS, e, step) for e in range(m.count)]
        ref = np.array([s[e] * ROWS / len(r) * err["int3"][e, r].sum() for e, r in enumerate(samples)])
        for f in ("int3", "int4"):
            want = [s[e] * ROWS / len(r) * err[f][e, r].sum() for e, r in enumerate(samples)]
            np.testing.assert_allclose(costs[param][f], want, rtol=2e-4)
        chosen = np.argsort(-ref)[:-(-m.count // share)]
        thin = {e: samples[e][::max(1, len(samples[e]) // measure.CHUNK_ROWS)] for e in chosen}
        w = {e: s[e] * ROWS / len(thin[e]) for e in chosen}
        ratio = (sum(w[e] * err["int2"][e, thin[e]].sum() for e in chosen)
                 / sum(w[e] * err["int3"][e, thin[e]].sum() for e in chosen))
        np.testing.assert_allclose(costs[param]["int2"], ratio * ref, rtol=5e-4)
        rows_solved = sorted((e, r) for bits, chunks in solved if bits == 2 for p, e, rows in chunks
                             if p == param for r in rows)
        assert rows_solved == sorted((e, r) for e in chosen for r in thin[e])
        assert len(chosen) < m.count or m.count == 1
    whole = {b: sum(len(c) for _, c in (x for x in solved if x[0] == b)) for b in (2, 3)}
    assert whole[2] < whole[3]   # the grid-search candidate solves fewer chunks
