"""IQ formats in the registry; encoders traceable under jit and vmap (the GPTQ solver's use)."""

from jgptq.ggml import registry  # noqa: I001  (jgptq before jax: it sets the allocator defaults)
from tests.ggml_iq.common import COLS, FORMATS, ROWS, importances, weights

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# ggml_quantize_requires_imatrix of llama.cpp (ggml.c): IQ2_XXS, IQ2_XS and IQ1_S; IQ1_M is commented out there.
REQUIRED = {"IQ2_XXS", "IQ2_XS", "IQ1_S"}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_registered(name):
    fmt = registry.get_format(name)
    assert fmt.encode is not None and fmt.decode is not None
    assert fmt.requires_importance == (name in REQUIRED)
    assert (fmt.block_size, fmt.type_size) == (256, FORMATS[name].type_size)


@pytest.mark.parametrize("name", ["IQ2_XS", "IQ1_M"])
def test_vmap_and_jit_give_the_same_bytes(name):
    """vmap over a leading expert axis inside an outer jit equals encoding each expert alone."""
    rng = np.random.default_rng(3)
    x = weights(rng)
    imp = importances(rng)["rand"]
    fmt = registry.get_format(name)
    experts = np.stack([x, -x[::-1]])  # (2, ROWS, COLS)

    @jax.jit
    def both(w, i):
        payload = jax.vmap(fmt.encode, in_axes=(0, None))(w, i)
        return payload, jax.vmap(fmt.decode)(payload)

    payload, y = both(jnp.asarray(experts), jnp.asarray(imp))
    assert payload.shape == (2, ROWS, COLS // 256 * fmt.type_size)
    for e in range(2):
        assert np.array_equal(np.asarray(payload[e]), np.asarray(fmt.encode(experts[e], imp)))
    assert np.array_equal(np.asarray(y), np.asarray(fmt.decode(payload)))


def test_chunked_encoding_matches_golden():
    """Encoding in padded chunks (lax.map over 24 super-blocks at a time) gives the unchunked bytes."""
    import os

    from jgptq.ggml import iq3
    from jgptq.ggml.iq_block import encode_rows

    with np.load(os.path.join(os.path.dirname(__file__), "..", "data", "ggml_iq", "golden.npz")) as g:
        x, imp, ref = g["x"], g["imp_rand"], g["payload_IQ3_S_rand"]
    out = jax.jit(lambda a, b: encode_rows(iq3._encode_s_blocks, 110, a, b, chunk=24))(x, imp)
    assert np.array_equal(np.asarray(out), ref)
