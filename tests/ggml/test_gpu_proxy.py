"""CPU-side evidence that the codecs keep llama.cpp's bytes on XLA:GPU.

Two XLA:GPU rewrites change float32 results that the CPU backend leaves alone or also performs:

- multiply-add contraction: XLA:CPU contracts too (see ``test_common.test_cpu_backend_contracts_multiply_adds``),
  so the golden tests on CPU prove the guard; the test below checks that they would notice a missing guard;
- ``SimplifyFPConversions`` (GPU only): a chain of float conversions collapses to one, skipping the rounding of
  the inner links. The tests below check the optimized HLO of every encoder and decoder for such chains.

These tests reuse the compilations of ``test_golden.py`` / ``test_decoders.py`` (same shapes) when they run in
the same session.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jgptq.ggml as gg
from jgptq.ggml import common
from tests.ggml.helpers import FORMATS, identical_blocks, load_golden
from tests.ggml.hlo_chains import convert_chains


@pytest.fixture(scope="module")
def golden():
    return load_golden()[0]


def _hlo(fn, *args):
    return fn.lower(*args).compile().as_text()


def test_chain_finder_sees_a_half_precision_round_trip():
    def round_trip(v):  # what the K-quant encoders once did to read back their fp16 scales
        bits = lax.bitcast_convert_type(v.astype(jnp.float16), jnp.uint16)
        return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32) * v

    v = jnp.ones((4,), jnp.float32)
    assert len(convert_chains(_hlo(jax.jit(round_trip), v))) == 1
    assert convert_chains(_hlo(jax.jit(lambda t: common.f16_round(t)[1] * t), v)) == []
    with common.x64_scope():
        via_f32 = jax.jit(lambda t: t.astype(jnp.float32).astype(jnp.float16))
        assert len(convert_chains(_hlo(via_f32, jnp.ones((4,), jnp.float64)))) == 1
    assert convert_chains(_hlo(jax.jit(lambda a, b: common.f16_bits(common.div(a, b))), v, v)) == []


@pytest.mark.parametrize("path", ["none", "imp0"])
@pytest.mark.parametrize("name", FORMATS)
def test_encoders_have_no_float_conversion_chains(golden, name, path):
    f = gg.get_format(name)
    args = [jnp.asarray(golden["x"], jnp.float32)]
    if path != "none":
        args.append(jnp.asarray(golden["importance"][0], jnp.float32))
    assert convert_chains(_hlo(f.encode, *args)) == []


@pytest.mark.parametrize("name", FORMATS)
def test_decoders_have_no_float_conversion_chains(golden, name):
    f = gg.get_format(name)
    assert convert_chains(_hlo(jax.jit(f.decode), jnp.asarray(golden[f"{name}/none"]))) == []


def test_golden_bytes_notice_a_missing_contraction_guard(golden, monkeypatch):
    # With the guard made a no-op, XLA:CPU fuses the Q4_K search's products into its sums, and the golden bytes
    # must then differ somewhere: the CPU golden tests do exercise the guard.
    from jgptq.ggml import k_quants

    monkeypatch.setattr(common, "settle", lambda v: v)
    got = np.asarray(jax.jit(lambda v: k_quants.encode_q4_k(v))(golden["x"]))  # a new function: a fresh trace
    same = identical_blocks(got, golden["q4_k/none"], gg.get_format("q4_k").type_size)
    assert not same.all()
