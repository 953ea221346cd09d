"""torch <-> JAX without copies (DLPack), on CPU and GPU.

Usage::

    from jgptq_torch.dlpack import to_jax, to_torch

    a = to_jax(torch_tensor)        # jax.Array on the matching device, sharing the tensor's memory
    t = to_torch(jax_array)         # torch.Tensor sharing the array's memory

Rules (each one is enforced, none is silent):

- Zero-copy dtypes: float32, bfloat16, float16, int8, uint8, int32, bool (both ways).
- ``requires_grad`` tensors are detached (the autograd graph never crosses over).
- Non-contiguous tensors (transposes, column slices, stride-0 expands) are made contiguous explicitly first: a
  copy, since DLPack only carries compact strides. On CPU a tensor whose data pointer is not 64-byte aligned (a
  view at an odd offset) would be copied silently by JAX; it is cloned explicitly instead (torch allocations are
  aligned, so the clone is then shared). ``strict=True`` turns both copies into errors.
- int64 (index) tensors are converted to int32 explicitly, after checking that every value fits; values that do
  not fit raise. float64 raises unless JAX runs with ``jax_enable_x64`` (JAX would otherwise down-cast it
  silently); in that mode int64/float64 cross unchanged.
- GPU streams: JAX's import makes its stream wait on torch's *current* stream. Call :func:`to_jax` inside the
  ``torch.cuda.stream(...)`` context that produced the tensor, or pass ``sync=True`` to synchronize torch's
  current stream first. :func:`to_torch` is safe as is (torch waits on JAX's work).
- The two views alias one buffer: do not write into the tensor while the JAX array is alive (JAX assumes its
  arrays are immutable), and do not write into a tensor obtained from :func:`to_torch` while the array is used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

ZERO_COPY_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32, torch.bool)
_ALIGN = 64


def _x64() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def _prepare(t: torch.Tensor, strict: bool, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if t.dtype in (torch.int64, torch.float64) and _x64():
        pass
    elif t.dtype == torch.int64:
        if t.numel():
            lo, hi = int(t.min()), int(t.max())
            info = torch.iinfo(torch.int32)
            if lo < info.min or hi > info.max:
                raise OverflowError(f"{name}: int64 values in [{lo}, {hi}] do not fit int32; enable jax_enable_x64 "
                                    f"to pass them unchanged")
        t = t.to(torch.int32)
    elif t.dtype == torch.float64:
        raise TypeError(f"{name}: float64 would be down-cast to float32 by JAX (jax_enable_x64 is off); convert it "
                        f"explicitly with .float() or enable x64")
    elif t.dtype not in ZERO_COPY_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} has no zero-copy DLPack path; supported: "
                        f"{', '.join(str(d).replace('torch.', '') for d in ZERO_COPY_DTYPES)} (int64 -> int32)")
    if not t.is_contiguous():
        if strict:
            raise ValueError(f"{name}: tensor of shape {tuple(t.shape)} with strides {t.stride()} is not "
                             f"contiguous (a copy would be needed)")
        t = t.contiguous()
    if t.device.type == "cpu" and t.numel() and t.data_ptr() % _ALIGN:
        if strict:
            raise ValueError(f"{name}: CPU data pointer is not {_ALIGN}-byte aligned (a copy would be needed)")
        t = t.clone()
    return t


def to_jax(t: torch.Tensor, *, sync: bool = False, strict: bool = False, name: str = "tensor") -> jax.Array:
    """A jax.Array sharing ``t``'s memory (see the module rules for dtypes, strides and streams).

    Args:
      t: a torch tensor of any shape on CPU or CUDA.
      sync: synchronize torch's current CUDA stream first (when the tensor was produced on another stream and
        the call is made outside that stream's context).
      strict: raise instead of copying non-contiguous or unaligned tensors.
      name: what the tensor is, for error messages.
    Returns:
      A jax.Array of the same shape, on the JAX device of ``t``'s device; dtype unchanged except int64 -> int32.
    """
    t = _prepare(t, strict, name)
    if sync and t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
    return jax.dlpack.from_dlpack(t)


def to_torch(a: jax.Array, *, name: str = "array") -> torch.Tensor:
    """A torch.Tensor sharing ``a``'s memory (``a`` must be a single-device array).

    JAX types without a DLPack equivalent (int4, ...) raise: pack them into uint8 first.
    """
    if not isinstance(a, jax.Array):
        a = jnp.asarray(a)
    if len(a.devices()) != 1:
        raise ValueError(f"{name}: array is sharded over {len(a.devices())} devices; gather it onto one first")
    return torch.from_dlpack(a)


def buffer_pointer(a: jax.Array) -> int:
    """The address of a single-device array's buffer (to check that a transfer shared memory)."""
    return a.addressable_data(0).unsafe_buffer_pointer()


def jax_device_of(t: torch.Tensor):
    """The JAX device holding data of a torch tensor on ``t.device`` (CPU -> first CPU device)."""
    return jax_device_for(t.device)


def jax_device_for(device: torch.device):
    """The JAX device of torch device ``device`` (CPU -> first CPU device; ``cuda:k`` -> the GPU of that
    hardware id)."""
    if device.type == "cpu":
        return jax.devices("cpu")[0]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        for d in jax.devices():
            if d.platform == "gpu" and d.local_hardware_id == index:
                return d
    raise ValueError(f"no JAX device matches torch device {device}")
