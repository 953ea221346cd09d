"""An importance-weighted choice of MXFP4's scale byte: a jgptq extension, not llama.cpp's encoder.

llama.cpp's MXFP4 encoder ignores the importance matrix and always takes the scale ``e`` of
``floor(log2(max |x|)) - 2`` (:mod:`jgptq.ggml.mxfp4`), which maps the block max into [8 d, 16 d) while the top
level is 12 d, so a max above 14 d is clipped. Given importance weights, :func:`encode_mxfp4_searched` also tries
``e + 1`` and ``e - 1`` per block and keeps the scale of least importance-weighted squared error
``sum_j imp_j (q_j - x_j)**2`` (float32; ties keep llama.cpp's scale, then ``e + 1``). The bytes are ordinary MXFP4
blocks that llama.cpp and ``gguf`` decode; they differ from ``ggml_quantize_chunk``'s where the search moved a
scale. Without importance it is exactly llama.cpp's encoder.

The registered ``"mxfp4"`` format (``jgptq.ggml.encode(x, "mxfp4", importance)``) stays llama.cpp's, with or
without importance, so a plain encode and ``method="rtn"`` keep llama-quantize's bytes; the search is used by
passing :func:`searched_codec` to :func:`jgptq.gptq.solve` (``codec=``) or by calling the encoder directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jgptq.ggml.common import F32, blocks, pack_nibbles, unblock
from jgptq.ggml.mxfp4 import (QK, block_exponent, decode_mxfp4, encode_mxfp4, level_values, mxfp4_codes,
                              scaled_values)

#: Scale offsets tried after llama.cpp's own (offset 0), in order of preference on ties.
OFFSETS = (1, -1)


def _weighted_error(xb, e, codes, w):
    """sum_j w_j (q_j - x_j)**2 per block, float32 (...,)."""
    d = level_values(e, codes) - xb
    return jnp.sum(w * d * d, axis=-1)


def _encode_searched(x, importance=None):
    """MXFP4 with an importance-weighted scale per block: x float32 (..., n), importance float32 (n,) (>= 0) or
    None -> uint8 (..., n // 32 * 17). None gives llama.cpp's bytes (:func:`jgptq.ggml.mxfp4.encode_mxfp4`)."""
    if importance is None:
        return encode_mxfp4(x)
    xb = blocks(jnp.asarray(x, F32), QK)
    w = jnp.asarray(importance, F32).reshape(xb.shape[-2:])
    e0 = block_exponent(xb)
    # Blocks whose max is below 2**-125 have a wrapped scale byte (see jgptq.ggml.mxfp4): left as llama.cpp has them.
    amax_bits = jnp.max(jax.lax.bitcast_convert_type(xb, jnp.int32) & 0x7FFFFFFF, axis=-1)
    unwrapped = amax_bits >= 0x01000000
    codes = mxfp4_codes(scaled_values(xb, e0), e0)
    best_e, best_codes, best_err = e0, codes, _weighted_error(xb, e0, codes, w)
    for off in OFFSETS:
        ok = unwrapped & (e0 + off >= 0) & (e0 + off <= 254)  # 255 is no valid scale byte for llama.cpp
        e = jnp.where(ok, e0 + off, e0)
        c = mxfp4_codes(scaled_values(xb, e), e)
        err = _weighted_error(xb, e, c, w)
        take = ok & (err < best_err)
        best_e = jnp.where(take, e, best_e)
        best_codes = jnp.where(take[..., None], c, best_codes)
        best_err = jnp.where(take, err, best_err)
    qs = pack_nibbles(best_codes[..., :16], best_codes[..., 16:])
    return unblock(jnp.concatenate([best_e.astype(jnp.uint8)[..., None], qs], axis=-1))


encode_mxfp4_searched = jax.jit(_encode_searched)
encode_mxfp4_searched.__doc__ = _encode_searched.__doc__


@functools.lru_cache(maxsize=None)
def searched_codec():
    """A :class:`jgptq.gptq.GroupCodec` of MXFP4 with the importance-weighted scale choice, for
    ``jgptq.gptq.solve(..., codec=searched_codec())`` (32-column groups; 17 bytes a block). One object for every
    call, so solves reuse their compilations."""
    from jgptq.gptq import GroupCodec

    def encode_group(w, importance):
        payload = _encode_searched(w, importance)
        return payload, decode_mxfp4(payload)

    return GroupCodec(encode_group, QK, 17)
