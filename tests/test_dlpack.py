import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jgptq_torch.dlpack import buffer_pointer, to_jax, to_torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_copy_both_ways_on_cpu(dtype):
    t = (torch.arange(48 * 64) % 5).reshape(48, 64).to(dtype)
    a = to_jax(t)
    assert buffer_pointer(a) == t.data_ptr()
    assert a.shape == (48, 64) and str(a.dtype) == str(dtype).replace("torch.", "")
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype
    assert torch.equal(back, t)
    # jax-owned memory to torch
    j = jnp.asarray(np.arange(96).reshape(8, 12) % 3).astype(a.dtype)
    tj = to_torch(j)
    assert tj.data_ptr() == buffer_pointer(j)
    np.testing.assert_array_equal(tj.float().numpy(), np.asarray(j.astype(jnp.float32)))


def test_requires_grad_is_detached_and_shared():
    p = torch.nn.Parameter(torch.randn(16, 16))
    a = to_jax(p)
    assert buffer_pointer(a) == p.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), p.detach().numpy())


def test_non_contiguous_is_made_contiguous_explicitly():
    base = torch.randn(32, 64)
    for view in (base.T, base[:, ::2], base[:1].expand(8, 64)):
        a = to_jax(view)
        np.testing.assert_array_equal(np.asarray(a), view.numpy())
        with pytest.raises(ValueError, match="not contiguous"):
            to_jax(view, strict=True, name="activations")


def test_unaligned_cpu_view_is_cloned_not_silently_copied():
    base = torch.randn(1025)
    view = base[1:]                       # contiguous, 4-byte offset
    assert view.data_ptr() % 64
    a = to_jax(view)
    assert buffer_pointer(a) % 64 == 0
    np.testing.assert_array_equal(np.asarray(a), view.numpy())
    with pytest.raises(ValueError, match="aligned"):
        to_jax(view, strict=True)


def test_int64_indices_become_int32_explicitly():
    idx = torch.tensor([[0, 5, 2**31 - 1]], dtype=torch.int64)
    a = to_jax(idx)
    assert a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(a), idx.numpy())
    with pytest.raises(OverflowError, match="do not fit int32"):
        to_jax(torch.tensor([2**31]), name="token ids")
    with pytest.raises(TypeError, match="float64"):
        to_jax(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        to_jax(np.zeros(3))


def test_sharded_array_to_torch_is_refused():
    if len(jax.devices()) < 2:
        pytest.skip("needs several devices")
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    a = jax.device_put(jnp.zeros((len(jax.devices()) * 2,)), NamedSharding(mesh, PartitionSpec("x")))
    with pytest.raises(ValueError, match="sharded"):
        to_torch(a)


def _gpu_available():
    return torch.cuda.is_available() and any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs a CUDA device visible to torch and JAX")
def test_gpu_zero_copy_and_stream_safety():
    t = torch.randn(1024, 1024, device="cuda")
    a = to_jax(t)
    assert buffer_pointer(a) == t.data_ptr()
    assert to_torch(a).data_ptr() == t.data_ptr()
    # a tensor produced on a side stream, exported inside that stream's context: JAX waits for it
    side = torch.cuda.Stream()
    for trial in range(3):
        with torch.cuda.stream(side):
            x = torch.randn(4096, 4096, device="cuda")
            y = x @ x
            y = y * 0 + trial
            ay = to_jax(y)
        assert float(jnp.max(jnp.abs(ay - trial))) == 0.0
    # a JAX result handed to torch: torch waits for JAX's work
    big = jnp.ones((4096, 4096), jnp.float32) @ jnp.ones((4096, 4096), jnp.float32)
    assert float(to_torch(big)[0, 0]) == 4096.0
