"""Hessian capture on plain JAX functions (no Flax needed): layouts, experts, stacked layers, sharing, skips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgptq import QuantConfig
from jgptq.flax import capture_hessians, default_filter, quantize_fn

ALL = default_filter(exclude=None, min_in_features=1)


def ref_hessian(*xs):
    """float64 2/N X^T X over the rows of every (..., C) array given."""
    x = np.concatenate([np.asarray(a, np.float64).reshape(-1, np.shape(a)[-1]) for a in xs])
    return 2.0 / x.shape[0] * x.T @ x


def close(h, ref):
    np.testing.assert_allclose(np.asarray(h, np.float64), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_dense_layouts_and_shared_input(rng):
    """(in, out) kernels, torch-style (out, in) weights read through a transpose, and two weights on one input."""
    params = {"a": jnp.asarray(rng.standard_normal((24, 16)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((16, 24)), jnp.float32),  # (out, in): x @ b.T
              "c": jnp.asarray(rng.standard_normal((16, 12)), jnp.float32)}

    def fn(p, x):
        h = jnp.tanh(x @ p["a"])
        return h @ p["c"] + jnp.dot(x, p["b"].T)[..., :12]

    batches = [jnp.asarray(rng.standard_normal((3, 5, 24)), jnp.float32) for _ in range(2)]
    got = capture_hessians(fn, params, batches, select=ALL)
    assert list(got) == ["a", "c", "b"]
    assert got["a"].info.layout.inp == (0,) and got["b"].info.layout.inp == (1,)
    close(got["a"].hessian, ref_hessian(*batches))
    np.testing.assert_array_equal(got["a"].hessian, got["b"].hessian)  # one stream, computed once
    hidden = [np.tanh(np.asarray(x, np.float64) @ np.asarray(params["a"], np.float64)) for x in batches]
    close(got["c"].hessian, ref_hessian(*hidden))
    assert got["a"].tokens.tolist() == [30]


def test_weight_read_twice_sums_both_inputs(rng):
    w = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)

    def fn(p, batch):
        x1, x2 = batch
        return (x1 @ p).sum() + (jnp.sin(x2) @ p).sum()

    batches = [(jnp.asarray(rng.standard_normal((6, 8)), jnp.float32),
                jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)) for _ in range(2)]
    got = capture_hessians(fn, w, batches, select=ALL)[""]
    close(got.hessian, ref_hessian(*[b[0] for b in batches], *[np.sin(np.asarray(b[1])) for b in batches]))
    assert got.tokens.tolist() == [20]


def test_stacked_experts_einsum(rng):
    """einsum('ecd,edf->ecf'): the contracted axis is C, the batch axis gives one Hessian per expert."""
    w = jnp.asarray(rng.standard_normal((3, 10, 6)), jnp.float32)
    batches = [jnp.asarray(rng.standard_normal((3, 7, 10)), jnp.float32) for _ in range(2)]
    got = capture_hessians(lambda p, x: jnp.einsum("ecd,edf->ecf", x, p["experts"]), {"experts": w}, batches,
                           select=ALL)["experts"]
    assert got.info.layout == ((0,), (2,), (1,)) and got.hessian.shape == (3, 10, 10)
    for e in range(3):
        close(got.hessian[e], ref_hessian(*[b[e] for b in batches]))
    assert got.tokens.tolist() == [14, 14, 14]


def test_ragged_dot_groups_rows_per_expert(rng):
    w = jnp.asarray(rng.standard_normal((4, 8, 5)), jnp.float32)
    sizes = [np.array([3, 0, 9, 4], np.int32), np.array([5, 2, 2, 6], np.int32)]
    xs = [jnp.asarray(rng.standard_normal((18, 8)), jnp.float32) for _ in sizes]  # rows past the groups: ignored
    got = capture_hessians(lambda p, b: jax.lax.ragged_dot(b[0], p, b[1]), w,
                           [(x, jnp.asarray(s)) for x, s in zip(xs, sizes)], select=ALL)[""]
    assert got.info.layout == ((0,), (2,), (1,)) and got.info.primitive == "ragged_dot_general"
    for e in range(4):
        rows = [np.asarray(x)[s[:e].sum():s[:e + 1].sum()] for x, s in zip(xs, sizes)]
        if sum(len(r) for r in rows):
            close(got.hessian[e], ref_hessian(*rows))
    assert got.tokens.tolist() == [8, 2, 11, 10]


def test_scanned_layers_are_separate_weights(rng):
    layers = jnp.asarray(rng.standard_normal((3, 8, 8)) / 3, jnp.float32)

    def fn(p, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["layers"])[0] @ p["layers"][1]

    x = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
    got = capture_hessians(fn, {"layers": layers}, [x], select=ALL)
    assert list(got) == ["layers[0]", "layers[1]", "layers[2]"]
    h, inputs = np.asarray(x, np.float64), []
    for i in range(3):
        inputs.append(h)
        h = np.tanh(h @ np.asarray(layers[i], np.float64))
    close(got["layers[0]"].hessian, ref_hessian(inputs[0]))
    close(got["layers[1]"].hessian, ref_hessian(inputs[1], h))  # read in the scan and after it
    close(got["layers[2]"].hessian, ref_hessian(inputs[2]))


def test_padding_mask(rng):
    w = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
    mask = np.arange(6)[None, :] < np.array([[4], [6]])
    got = capture_hessians(lambda p, b: b @ p, w, [x], select=ALL, mask_fn=lambda b: jnp.asarray(mask))[""]
    close(got.hessian, ref_hessian(np.asarray(x)[mask]))
    assert got.tokens.tolist() == [10]


def test_unsupported_reads_are_reported(rng):
    params = {"merged": jnp.ones((2, 4, 8)), "scaled": jnp.ones((8, 8)), "ok": jnp.ones((8, 8))}

    def fn(p, x):
        return x @ p["merged"].reshape(8, 8) + x @ (2.0 * p["scaled"]) + x @ p["ok"]

    x = jnp.ones((3, 8))
    res = quantize_fn(fn, params, [x], QuantConfig(group_size=-1), select=ALL, mode="all_at_once", method="rtn")
    assert res.report["skipped"] == {"merged": "reaches dot_general through reshape",
                                     "scaled": "reaches dot_general through mul"}
    assert list(res.report["weights"]) == ["ok"]


def test_filter_and_group_size_rule(rng):
    params = {"router": jnp.ones((64, 4)), "small": jnp.ones((16, 64)), "odd": jnp.ones((48, 64)),
              "big": jnp.ones((64, 64))}

    def fn(p, x):
        return (x @ p["router"]).sum() + (x[:, :16] @ p["small"]).sum() + (x[:, :48] @ p["odd"]).sum() + x @ p["big"]

    res = quantize_fn(fn, params, [jnp.ones((4, 64))], QuantConfig(bits=4, group_size=32), method="rtn")
    assert list(res.report["weights"]) == ["big"]
    assert res.report["skipped"] == {"odd": "48 input features are not a multiple of group_size 32"}


def test_weight_read_twice_sequential_uses_first_read(rng):
    """Sequential mode solves a weight at its first read; all-at-once sums both reads (as documented)."""
    w = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 9, 32)), jnp.float32)
    fn = lambda p, b: jnp.tanh(b @ p) @ p  # noqa: E731
    cfg = QuantConfig(bits=4, group_size=-1)
    seq = quantize_fn(fn, w, [x], cfg, select=ALL, mode="sequential", keep_hessians=True)
    once = quantize_fn(fn, w, [x], cfg, select=ALL, mode="all_at_once", keep_hessians=True)
    assert seq.report["weights"][""]["tokens"] == [18] and once.report["weights"][""]["tokens"] == [36]
    close(seq.hessians[""][0], ref_hessian(x))
    close(once.hessians[""][0], ref_hessian(x, np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64))))


def test_mask_not_applicable_to_routed_rows_is_reported(rng):
    w = jnp.asarray(rng.standard_normal((2, 8, 8)), jnp.float32)
    dense = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)

    def fn(p, b):
        x = b.reshape(-1, 8) @ p["dense"]
        return jax.lax.ragged_dot(x, p["experts"], jnp.asarray([6, 6], jnp.int32))

    x = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
    res = quantize_fn(fn, {"dense": dense, "experts": w}, [x], QuantConfig(group_size=-1), select=ALL,
                      method="rtn", mask_fn=lambda b: jnp.ones(b.shape[:2], bool))
    assert res.report["weights"]["dense"]["unmasked"] is True  # its input rows were flattened first
    assert res.report["weights"]["experts"]["unmasked"] is True
    res = quantize_fn(lambda p, b: b @ p, dense, [x], QuantConfig(group_size=-1), select=ALL, method="rtn",
                      mask_fn=lambda b: jnp.ones(b.shape[:2], bool))
    assert res.report["weights"][""]["unmasked"] is False
