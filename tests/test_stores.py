"""Host copies of the record thread: the same bytes as numpy's conversion, on CPU and through the CUDA staging."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jgptq_torch.pipeline.stores import _HostCopies


def _arrays(device):
    key = jax.random.PRNGKey(3)
    return [jax.device_put(a, device) for a in (
        jax.random.randint(key, (3, 100, 70), 0, 16).astype(jnp.uint8),
        jax.random.normal(key, (3, 100, 5), jnp.float32),
        jnp.arange(70, dtype=jnp.int32) // 16,
        jax.random.normal(key, (4, 8), jnp.bfloat16))]


def test_cpu_arrays_take_numpy_conversion():
    copies = _HostCopies()
    for a in _arrays(jax.devices("cpu")[0]):
        got = copies(a)
        assert isinstance(got, np.ndarray) and got.dtype == np.asarray(a).dtype
        assert np.array_equal(got, np.asarray(a))
    assert copies(None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_arrays_come_through_the_staging_unchanged():
    gpu = [d for d in jax.devices() if d.platform == "gpu"][0]
    copies = _HostCopies(chunk=4096)
    big = jax.device_put(jnp.arange(5 * 4096 + 123, dtype=jnp.int32).astype(jnp.uint8), gpu)  # several chunks
    for a in _arrays(gpu) + [big]:
        got = copies(a)
        assert got.dtype == np.asarray(a).dtype and np.array_equal(got, np.asarray(a))
    assert copies._staging, "the CUDA arrays did not go through the staging"
