"""Quantizing Flax models end to end: GPTQ beats RTN on output KL; sequential mode propagates quantized inputs."""

import numpy as np
import pytest

flax = pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jgptq import QuantConfig  # noqa: E402
from jgptq.flax import capture, decode, matrix_of, quantize  # noqa: E402
from jgptq.quantizers import uniform  # noqa: E402
from tests.flax.models import DIM, EXPERTS, LinenLM, TinyLM, mean_kl, token_batches  # noqa: E402
from tests.flax.test_capture_fn import close, ref_hessian  # noqa: E402

CONFIG = QuantConfig(bits=3, group_size=32)


@pytest.fixture(scope="module")
def data():
    return token_batches(1, 8), jnp.concatenate(token_batches(2, 4))


def kl_after(base, calib, eval_ids, **kw):
    model = nnx.clone(base)
    result = quantize(model, calib, CONFIG, **kw)
    return mean_kl(base(eval_ids), model(eval_ids)), model, result


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gptq_beats_rtn_on_output_kl(data, moe):
    calib, eval_ids = data
    base = TinyLM(moe=moe)
    rtn, _, _ = kl_after(base, calib, eval_ids, method="rtn", mode="all_at_once")
    seq, model, result = kl_after(base, calib, eval_ids, mode="sequential")
    once, _, _ = kl_after(base, calib, eval_ids, mode="all_at_once")
    # measured (sequential / all at once vs RTN): dense 0.104 / 0.110 vs 0.198; MoE 0.121 / 0.107 vs 0.202
    assert seq < 0.75 * rtn and once < 0.75 * rtn, (seq, once, rtn)
    report = result.report
    assert len(report["weights"]) == 12 and report["skipped"] == {}
    assert [w["order"] for w in report["weights"].values()] == list(range(12))
    for name, fig in report["weights"].items():
        assert not np.any(fig["fallback"]) and np.all(np.asarray(fig["loss"]) > 0), name
    # the written weights are what the payloads decode to
    _, state = nnx.split(model, nnx.Param)
    leaves = jax.tree.leaves(state)
    for name, payload in result.payloads.items():
        info = payload["info"]
        want = matrix_of(leaves[info.leaf], info)
        np.testing.assert_allclose(np.asarray(decode(payload)).reshape(want.shape), want, rtol=1e-6, atol=1e-7)


def test_sequential_sees_quantized_inputs(data):
    """Later weights' Hessians come from inputs computed by the already-quantized earlier weights."""
    calib = data[0][:3]
    base = TinyLM(moe=True)
    float_h = capture(base, calib)
    model = nnx.clone(base)
    result = quantize(model, calib, CONFIG, mode="sequential", keep_hessians=True)
    b0, b1 = model.blocks
    moe = b0.ffn
    q1, down_rows = [], [[] for _ in range(EXPERTS)]
    for ids in calib:
        x0 = model.embed(ids)
        x1 = x0 + b0.attn(b0.norm1(x0))
        rows, sizes, _, _ = moe.route(b0.norm2(x1).reshape(-1, DIM))
        ends = np.cumsum(np.asarray(sizes))
        for e in range(EXPERTS):
            z = np.asarray(rows, np.float64)[ends[e] - sizes[e]:ends[e]] @ np.asarray(moe.up[...][e], np.float64)
            down_rows[e].append(z / (1 + np.exp(-z)))
        q1.append(b1.norm1(b0(x0)))
    got = result.hessians
    close(got["blocks/1/attn/q/kernel"][0], ref_hessian(*q1))
    for e in range(EXPERTS):
        close(got["blocks/0/ffn/down"][e], ref_hessian(*down_rows[e]))
    for name in ("blocks/1/attn/q/kernel", "blocks/0/ffn/down"):
        h_float, h_seq = np.asarray(float_h[name].hessian).reshape(-1), np.asarray(got[name]).reshape(-1)
        assert np.abs(h_seq - h_float).max() > 1e-3 * np.abs(h_float).max(), name


def test_linen_gptq_beats_rtn(data):
    calib, eval_ids = data
    model = LinenLM()
    variables = model.init(jax.random.key(1), calib[0])
    ref = model.apply(variables, eval_ids)
    kls = {}
    for method in ("rtn", "gptq"):
        result = quantize(model, calib, CONFIG, variables=variables, method=method)
        kls[method] = mean_kl(ref, model.apply(result.model, eval_ids))
        assert sorted(result.report["weights"]) == ["down0/kernel", "down1/kernel", "up0/kernel", "up1/kernel"]
        assert not np.array_equal(result.model["params"]["up0"]["kernel"], variables["params"]["up0"]["kernel"])
    assert kls["gptq"] < 0.8 * kls["rtn"], kls


def test_expert_without_tokens_is_rounded_to_nearest():
    module = nnx.Param(jnp.asarray(np.random.default_rng(0).standard_normal((EXPERTS, 64, 64)), jnp.float32))

    class Experts(nnx.Module):
        def __init__(self):
            self.w = module

        def __call__(self, rows, sizes):
            return jax.lax.ragged_dot(rows, self.w[...], sizes)

    m = Experts()
    w = m.w[...]
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((80, 64)), jnp.float32)
    result = quantize(m, [(rows, jnp.asarray([40, 0, 20, 20], jnp.int32))], CONFIG)
    assert result.report["weights"]["w"]["no_token_experts"] == [1]
    codes, _, _ = uniform.round_to_nearest(w[1].T, CONFIG)
    np.testing.assert_array_equal(result.payloads["w"]["codes"][1], codes)


def test_module_docs_example_runs(capsys):
    """The example in jgptq.flax's docs (pasted into the README) runs as written."""
    import textwrap

    import jgptq.flax

    source = textwrap.dedent(jgptq.flax.__doc__.split("::\n", 1)[1].split("\nA Linen model")[0])
    exec(compile(source, "jgptq.flax example", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 12 and lines[4].startswith("blocks/0/moe/up (4, 128, 64) [")
