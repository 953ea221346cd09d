"""Flax NNX/Linen capture: Hessians equal float64 2/N X^T X of inputs computed by hand; codes equal plain solves."""

import numpy as np
import pytest

flax = pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jgptq import QuantConfig, gptq, hessian  # noqa: E402
from jgptq.flax import capture, quantize  # noqa: E402
from tests.flax.models import DIM, EXPERTS, LinenLM, TinyLM, token_batches  # noqa: E402
from tests.flax.test_capture_fn import close, ref_hessian  # noqa: E402

CONFIG = QuantConfig(bits=3, group_size=32)


@pytest.fixture(scope="module")
def calib():
    return token_batches(1, 3)


def block_inputs(model, ids):
    """By hand: (input of blocks[0], input of blocks[0].ffn, input of blocks[1])."""
    b0 = model.blocks[0]
    x0 = model.embed(ids)
    x1 = x0 + b0.attn(b0.norm1(x0))
    return x0, x1, b0(x0)


def test_dense_hessians_match_inputs_by_hand(calib):
    model = TinyLM(moe=False)
    got = capture(model, calib)
    assert len(got) == 12 and "lm_head/kernel" not in got and "embed/embedding" not in got
    b0, b1 = model.blocks[0], model.blocks[1]
    q0, up0, down0, q1 = [], [], [], []
    for ids in calib:
        x0, x1, x2 = block_inputs(model, ids)
        q0.append(b0.norm1(x0))
        up0.append(b0.norm2(x1))
        down0.append(jax.nn.gelu(b0.ffn.up(b0.norm2(x1))))
        q1.append(b1.norm1(x2))
    close(got["blocks/0/attn/q/kernel"].hessian, ref_hessian(*q0))
    close(got["blocks/0/ffn/up/kernel"].hessian, ref_hessian(*up0))
    close(got["blocks/0/ffn/down/kernel"].hessian, ref_hessian(*down0))
    close(got["blocks/1/attn/q/kernel"].hessian, ref_hessian(*q1))
    assert got["blocks/0/attn/q/kernel"].tokens.tolist() == [3 * 4 * 32]


def test_moe_expert_hessians_match_routed_rows(calib):
    model = TinyLM(moe=True)
    got = capture(model, calib)
    moe = model.blocks[0].ffn
    up_rows, down_rows = [[] for _ in range(EXPERTS)], [[] for _ in range(EXPERTS)]
    for ids in calib:
        _, x1, _ = block_inputs(model, ids)
        rows, sizes, _, _ = moe.route(model.blocks[0].norm2(x1).reshape(-1, DIM))
        rows, ends = np.asarray(rows, np.float64), np.cumsum(np.asarray(sizes))
        for e in range(EXPERTS):
            r = rows[ends[e] - sizes[e]:ends[e]]
            up_rows[e].append(r)
            z = r @ np.asarray(moe.up[...][e], np.float64)
            down_rows[e].append(z / (1 + np.exp(-z)))
    up, down = got["blocks/0/ffn/up"], got["blocks/0/ffn/down"]
    assert up.info.layout == ((0,), (2,), (1,)) and up.hessian.shape == (EXPERTS, DIM, DIM)
    assert up.tokens.tolist() == [sum(len(r) for r in rows) for rows in up_rows]
    assert sum(up.tokens) == 3 * 4 * 32 * 2  # top-2
    for e in range(EXPERTS):
        close(up.hessian[e], ref_hessian(*up_rows[e]))
        close(down.hessian[e], ref_hessian(*down_rows[e]))
    assert "blocks/0/ffn/router/kernel" not in got


def test_linen_hessian_matches_captured_intermediates(calib):
    model = LinenLM()
    variables = model.init(jax.random.key(0), calib[0])
    got = capture(model, calib, variables=variables)
    assert list(got) == ["up0/kernel", "down0/kernel", "up1/kernel", "down1/kernel"]
    norm_out = []
    for ids in calib:
        _, state = model.apply(variables, ids, capture_intermediates=True, mutable=["intermediates"])
        norm_out.append(state["intermediates"]["norm1"]["__call__"][0])
    close(got["up1/kernel"].hessian, ref_hessian(*norm_out))


def test_dense_codes_equal_plain_solve():
    """The same weight and activations through the NNX path and through jgptq.gptq.solve: identical codes."""
    rng = np.random.default_rng(3)
    layer = nnx.Linear(64, 64, rngs=nnx.Rngs(5))
    batches = [jnp.asarray(rng.standard_normal((4, 16, 64)) * np.exp(rng.uniform(-1, 1, 64)), jnp.float32)
               for _ in range(3)]
    kernel = layer.kernel[...]
    result = quantize(layer, batches, CONFIG)
    state = hessian.init(64)
    for x in batches:
        state = hessian.accumulate(state, x)
    plain = gptq.solve(kernel.T, hessian.finalize(state), CONFIG)
    got = result.payloads["kernel"]
    np.testing.assert_array_equal(got["codes"], plain.codes)
    np.testing.assert_array_equal(got["scales"], plain.scales)
    np.testing.assert_array_equal(layer.kernel[...], plain.weight.T)


class Experts(nnx.Module):
    def __init__(self):
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
        self.w = nnx.Param(init(jax.random.key(2), (EXPERTS, 64, 64)))

    def __call__(self, rows, sizes):
        return jax.lax.ragged_dot(rows, self.w[...], sizes)


def test_expert_codes_equal_plain_solve_experts():
    """ragged_dot experts: per-expert rows accumulated by hand and solved by solve_experts give the same codes.

    Group sizes are powers of two of at least 16: the pipeline pads each expert's rows to such a size, and
    padding would change the float32 summation order of X^T X.
    """
    rng = np.random.default_rng(4)
    sizes = [np.array([32, 64, 16, 128], np.int32), np.array([64, 16, 128, 32], np.int32)]
    rows = [jnp.asarray(rng.standard_normal((240, 64)) * np.exp(rng.uniform(-1, 1, 64)), jnp.float32)
            for _ in sizes]
    module = Experts()
    w = module.w[...]
    result = quantize(module, [(r, jnp.asarray(s)) for r, s in zip(rows, sizes)], CONFIG)
    hs = []
    for e in range(EXPERTS):
        state = hessian.init(64)
        for r, s in zip(rows, sizes):
            state = hessian.accumulate(state, r[s[:e].sum():s[:e + 1].sum()])
        hs.append(hessian.finalize(state))
    plain = gptq.solve_experts(jnp.transpose(w, (0, 2, 1)), jnp.stack(hs), CONFIG)
    np.testing.assert_array_equal(result.payloads["w"]["codes"], plain.codes)
    np.testing.assert_array_equal(module.w[...], jnp.transpose(plain.weight, (0, 2, 1)))
    assert result.report["weights"]["w"]["tokens"] == [96, 80, 144, 160]


class ScanLayer(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(64, 64, rngs=rngs, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
        self.ein = nnx.Einsum("bsd,dhk->bshk", (64, 4, 16), rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.ein(self.lin(x)).reshape(x.shape)).astype(x.dtype)


class ScanStack(nnx.Module):
    """Three layers stacked by nnx.vmap and run by nnx.scan; bfloat16 Linear, multi-axis Einsum."""

    def __init__(self):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return ScanLayer(rngs)

        self.layers = make(nnx.Rngs(0))

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, layer):
            return layer(x)

        return step(x, self.layers)


def test_nnx_scan_stack_gives_one_weight_per_layer():
    rng = np.random.default_rng(8)
    xs = [jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32) for _ in range(2)]
    model = ScanStack()
    got = capture(model, xs)
    assert list(got) == [f"layers/{n}/kernel[{i}]" for i in range(3) for n in ("lin", "ein")]
    assert got["layers/ein/kernel[1]"].info.layout == ((), (2, 3), (1,))
    # the Linear computes in bfloat16: its matmul reads the bfloat16 cast of x
    cast = [np.asarray(x.astype(jnp.bfloat16), np.float32) for x in xs]
    close(got["layers/lin/kernel[0]"].hessian, ref_hessian(*cast))
    before = model.layers.lin.kernel[...]
    result = quantize(model, xs, CONFIG)
    assert result.report["skipped"] == {} and len(result.report["weights"]) == 6
    after = model.layers.lin.kernel[...]
    assert after.dtype == jnp.bfloat16 and all(not np.array_equal(after[i], before[i]) for i in range(3))
