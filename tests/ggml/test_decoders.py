"""Decoders: float32-identical to gguf's numpy decoders (llama.cpp's reference) on any bytes."""

import zlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgptq.ggml as gg
from tests.ggml.helpers import FORMATS, load_golden, same_floats


def _random_payload(fmt, rows, blocks_per_row, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(rows, blocks_per_row * fmt.type_size), dtype=np.uint8)


@pytest.mark.parametrize("name", FORMATS)
def test_decoder_matches_gguf_on_random_bytes(name):
    f = gg.get_format(name)
    payload = _random_payload(f, 16, 512 // f.block_size, seed=zlib.crc32(name.encode()))
    with np.errstate(all="ignore"):
        want = gguf.dequantize(payload, f.qtype)
    got = np.asarray(gg.decode(payload, name))
    assert got.dtype == np.float32 and got.shape == want.shape
    assert same_floats(got, want)  # NaN/Inf fp16 scales included: NaN where gguf has NaN


@pytest.mark.parametrize("name", FORMATS)
def test_decoder_matches_gguf_on_llama_cpp_payloads(name):
    arrays, _ = load_golden()
    f = gg.get_format(name)
    for key in (f"{name}/none", f"{name}/imp0"):
        want = gguf.dequantize(arrays[key], f.qtype)
        assert same_floats(gg.decode(arrays[key], name), want), key


def test_decoders_work_on_any_leading_shape():
    f = gg.get_format("q4_k")
    payload = _random_payload(f, 6, 2, seed=3)
    flat = np.asarray(f.decode(jnp.asarray(payload)))
    stacked = np.asarray(f.decode(jnp.asarray(payload.reshape(2, 3, -1))))
    vmapped = np.asarray(jax.vmap(f.decode)(jnp.asarray(payload.reshape(2, 3, -1))))
    assert same_floats(stacked.reshape(6, -1), flat) and same_floats(vmapped.reshape(6, -1), flat)
