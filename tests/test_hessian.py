import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jgptq import hessian as hs
from tests.conftest import correlated_activations


def reference(batches, masks=None):
    """float64 2/N X^T X over the unmasked tokens of every batch."""
    rows = []
    for i, x in enumerate(batches):
        x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        if masks is not None and masks[i] is not None:
            x = x[np.asarray(masks[i]).reshape(-1).astype(bool)]
        rows.append(x)
    x = np.concatenate(rows)
    return 2.0 / x.shape[0] * x.T @ x, x.shape[0]


def assert_close(h, ref, rtol=2e-6):
    h = np.asarray(h, np.float64)
    assert np.max(np.abs(h - ref)) <= rtol * np.max(np.abs(ref))


def test_one_batch(rng):
    x = correlated_activations(rng, 300, 48)
    st = hs.from_activations(x)
    ref, n = reference([x])
    assert int(st.token_count) == n
    assert_close(hs.finalize(st), ref)


def test_many_mixed_size_batches_with_leading_axes(rng):
    batches = [correlated_activations(rng, n, 40).reshape(-1, 1, 40) for n in (1, 7, 64, 3, 130)]
    batches.append(correlated_activations(rng, 24, 40).reshape(2, 3, 4, 40))
    st = hs.init(40)
    for x in batches:
        st = hs.accumulate(st, x)
    ref, n = reference(batches)
    assert int(st.token_count) == n
    assert_close(hs.finalize(st), ref)


def test_padding_mask_excludes_tokens(rng):
    x = correlated_activations(rng, 2 * 16, 32).reshape(2, 16, 32)
    mask = np.ones((2, 16), bool)
    mask[0, 10:] = False
    mask[1, :3] = False
    x_poisoned = x.copy()
    x_poisoned[~mask] = 1e3  # padding rows carry garbage that must not leak in
    st = hs.from_activations(x_poisoned, mask)
    ref, n = reference([x], [mask])
    assert int(st.token_count) == n == 23
    assert_close(hs.finalize(st), ref)


def test_empty_batch_is_a_noop(rng):
    x = correlated_activations(rng, 20, 16)
    st = hs.from_activations(x)
    before = np.asarray(st.hessian_sum).copy()
    st2 = hs.accumulate(st, np.zeros((0, 16), np.float32))
    assert st2 is st
    assert np.array_equal(np.asarray(st2.hessian_sum), before)
    st3 = hs.accumulate(st2, x[:4], np.zeros(4, bool))
    assert int(st3.token_count) == 20
    assert_close(hs.finalize(st3), reference([x])[0])


def test_finalize_of_empty_state_is_zero():
    assert not np.any(np.asarray(hs.finalize(hs.init(8))))


def test_bfloat16_inputs_accumulate_in_float32(rng):
    x = correlated_activations(rng, 512, 64)
    xb = x.astype(ml_dtypes.bfloat16)
    st = hs.from_activations(jnp.asarray(xb), input_dtype="bfloat16")
    assert st.hessian_sum.dtype == jnp.float32
    ref, _ = reference([xb.astype(np.float64)])
    assert_close(hs.finalize(st), ref, rtol=1e-5)
    # float32 inputs rounded to bf16 inside give the same statistic
    st2 = hs.from_activations(x, input_dtype="bfloat16")
    assert_close(hs.finalize(st2), ref, rtol=1e-5)


@pytest.mark.parametrize("half", [ml_dtypes.bfloat16, np.float16])
def test_half_precision_inputs_under_float32_setting_give_the_exact_products(rng, half):
    # half-precision activations skip the float32 cast: their products are exact in float32, so the statistic is
    # the float64 one of the same numbers up to float32 summation (~2e-6 seen on the H200, whose GEMMs sum in another
    # order); a product rounded to half precision would be ~1e-3 off
    x = correlated_activations(rng, 1024, 64).astype(half)
    ref, _ = reference([x.astype(np.float64)])
    assert_close(hs.finalize(hs.from_activations(jnp.asarray(x))), ref, rtol=4e-6)
    mask = np.ones((2, 512), bool)
    mask[1, 300:] = False
    st = hs.accumulate_slots(hs.init_stacked(3, 64), np.array([2, 0]), jnp.asarray(x.reshape(2, 512, 64)),
                             jnp.asarray(mask))
    for e, rows in ((2, x[:512]), (0, x[512:812])):
        ref_e, n = reference([rows.astype(np.float64)])
        assert int(st.token_count[e]) == n
        assert_close(hs.finalize(st)[e], ref_e, rtol=4e-6)
    assert not np.any(np.asarray(st.hessian_sum[1]))


def test_float32_path_is_exact_float32_not_reduced_precision(rng):
    x = correlated_activations(rng, 256, 64)
    ref, _ = reference([x])
    # bf16-level rounding would give ~1e-3 relative error; HIGHEST float32 stays near 1e-7
    err = np.max(np.abs(np.asarray(hs.finalize(hs.from_activations(x)), np.float64) - ref)) / np.max(np.abs(ref))
    assert err < 1e-6


def test_accumulate_updates_in_place(rng):
    st = hs.init(128)
    old = st.hessian_sum
    st = hs.accumulate(st, correlated_activations(rng, 64, 128))
    assert old.is_deleted()  # the sum was donated
    x = jnp.zeros((64, 128))
    compiled = hs._accumulate.lower(st, x, None, "float32").compile()
    assert compiled.memory_analysis().alias_size_in_bytes >= 128 * 128 * 4


def test_bad_inputs(rng):
    st = hs.init(16)
    with pytest.raises(ValueError, match="do not match a Hessian of 16"):
        hs.accumulate(st, np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        hs.accumulate(st, np.full((4, 16), np.nan, np.float32), name="layer0.q_proj input")
    with pytest.raises(ValueError, match="mask of shape"):
        hs.accumulate(st, np.zeros((2, 4, 16), np.float32), np.ones((2, 5), bool))
    with pytest.raises(ValueError, match="input_dtype"):
        hs.accumulate(st, np.zeros((4, 16), np.float32), input_dtype="float16")


def test_device_partials_single_device(rng):
    parts = hs.DevicePartials(24)
    batches = [correlated_activations(rng, n, 24) for n in (5, 50, 9)]
    for x in batches:
        parts.accumulate(jnp.asarray(x))
    st = parts.merge()
    assert_close(hs.finalize(st), reference(batches)[0])
    assert parts.devices == []


TWO_DEVICES = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jgptq import hessian as hs
    assert len(jax.devices()) == 2, jax.devices()
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((n, 32)).astype(np.float32) for n in (40, 17, 33, 8)]
    parts = hs.DevicePartials(32)
    for i, x in enumerate(xs):
        parts.accumulate(jax.device_put(x, jax.devices()[i % 2]))
    assert len(parts.devices) == 2
    st = parts.merge(jax.devices()[1])
    assert st.hessian_sum.devices() == {jax.devices()[1]}
    X = np.concatenate(xs).astype(np.float64)
    ref = 2 / X.shape[0] * X.T @ X
    h = np.asarray(hs.finalize(st), np.float64)
    assert int(st.token_count) == X.shape[0]
    assert np.max(np.abs(h - ref)) < 2e-6 * np.max(np.abs(ref)), np.max(np.abs(h - ref))
    print("OK")
""")


def test_device_partials_two_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", TWO_DEVICES], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]
