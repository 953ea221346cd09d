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
