"""Validated entry points of the GGML codecs: :func:`encode` and :func:`decode`.

The registered per-format functions (``get_format(name).encode`` / ``.decode``) are pure and traceable and check
nothing; these wrappers check shapes, dtypes and values first and raise a ValueError that names the tensor and
the rule it broke.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jgptq.finite import all_finite
from jgptq.ggml.registry import GGMLFormat, get_format

FormatLike = Union[str, GGMLFormat]


def _format(fmt: FormatLike) -> GGMLFormat:
    return fmt if isinstance(fmt, GGMLFormat) else get_format(fmt)


def _check_importance(importance, n: int):
    imp = jnp.asarray(importance)
    if not jnp.issubdtype(imp.dtype, jnp.floating) and not jnp.issubdtype(imp.dtype, jnp.integer):
        raise ValueError(f"importance must be a real array, got dtype {imp.dtype}")
    imp = imp.astype(jnp.float32)
    if imp.shape != (n,):
        raise ValueError(f"importance must have shape ({n},) (one weight per column of x), got {imp.shape}")
    if not all_finite(imp):
        raise ValueError("importance contains NaN or Inf values")
    if bool(jax.device_get(jnp.any(imp < 0))):
        raise ValueError("importance contains negative values; importance weights must be >= 0")
    return imp


def encode(x, fmt: FormatLike, importance: Optional[object] = None) -> jax.Array:
    """Quantizes rows of ``x`` into GGML blocks, byte for byte as llama.cpp's ``ggml_quantize_chunk``.

    Args:
      x: float array (..., n); ``n`` must be a multiple of the format's block size (32 or 256). Converted to
        float32. Rows are the trailing axis; leading axes are batch.
      fmt: format name (``"q4_k"``, case-insensitive) or a :class:`GGMLFormat`.
      importance: optional per-column importance, float (n,), finite and >= 0 (llama.cpp's imatrix values, i.e.
        the mean of squared activations of each input column). With it the encoder runs llama.cpp's weighted
        search (a different algorithm, not merely a weighted one); without it the reference path. Where
        llama.cpp's quantizer ignores the imatrix (Q8_0, MXFP4) the encoder ignores it too.
    Returns:
      uint8 jax array (..., n // block_size * type_size).
    Raises:
      ValueError: unknown format, non-float x, NaN/Inf in x, a row length that is not a multiple of the block, a
        bad importance vector, or a missing importance for a format that requires one.
    """
    f = _format(fmt)
    if f.encode is None:
        raise ValueError(f"GGML format {f.name!r} has no encoder")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a float array, got dtype {x.dtype}")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have at least one axis of non-zero length, got shape {x.shape}")
    n = x.shape[-1]
    if n % f.block_size:
        raise ValueError(f"x has shape {x.shape}: its last axis ({n}) is not a multiple of the {f.name} "
                         f"block size {f.block_size}")
    x = x.astype(jnp.float32)
    if not all_finite(x):
        bad = int(jax.device_get(jnp.sum(~jnp.isfinite(x))))
        raise ValueError(f"x contains {bad} NaN or Inf values; GGML encoders need finite weights")
    if importance is None:
        if f.requires_importance:
            raise ValueError(f"GGML format {f.name!r} requires importance weights (an imatrix); none given")
        return f.encode(x)
    return f.encode(x, _check_importance(importance, n))


def decode(payload, fmt: FormatLike) -> jax.Array:
    """Dequantizes GGML blocks to float32, bit for bit as llama.cpp's ``dequantize_row_*``.

    Args:
      payload: uint8 array (..., nbytes); ``nbytes`` a multiple of the format's bytes per block.
      fmt: format name or :class:`GGMLFormat`.
    Returns:
      float32 jax array (..., nbytes // type_size * block_size).
    Raises:
      ValueError: unknown format, non-uint8 payload, or a byte count that is not a whole number of blocks.
    """
    f = _format(fmt)
    if f.decode is None:
        raise ValueError(f"GGML format {f.name!r} has no decoder")
    p = payload if isinstance(payload, jax.Array) else np.asarray(payload)
    if p.dtype != np.uint8:
        raise ValueError(f"payload must be uint8 bytes, got dtype {p.dtype}")
    if p.ndim < 1 or p.shape[-1] == 0:
        raise ValueError(f"payload must have at least one axis of non-zero length, got shape {p.shape}")
    if p.shape[-1] % f.type_size:
        raise ValueError(f"payload has shape {p.shape}: its last axis ({p.shape[-1]}) is not a multiple of the "
                         f"{f.name} block size in bytes ({f.type_size})")
    return f.decode(jnp.asarray(p))
