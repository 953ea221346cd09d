"""MXFP4 codec against independent references: gguf's numpy decoder and encoder, float64 closed forms, the C
library's ``log2f``; and against llama.cpp's bytes recorded in tests/data/ggml_mx/golden.npz (no llama.cpp
needed; tests/ggml_mx/make_golden.py regenerates the file)."""

import json
import os

import gguf
import jax
import numpy as np
import pytest

import jgptq.ggml as gg
from jgptq.ggml import mxfp4
from tests.ggml_mx.common import (TYPE_ID, block_equal, below_power_of_two, edge_rows, libm_log2f,
                                  reference_encode)

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "ggml_mx", "golden.npz")
QT = gguf.GGMLQuantizationType.MXFP4


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def test_registered_with_gguf_geometry():
    f = gg.get_format("MXFP4")
    assert (f.name, f.type_id, f.block_size, f.type_size) == ("mxfp4", TYPE_ID, 32, 17)
    assert f.bits_per_weight == 4.25 and not f.requires_importance


def test_levels_are_what_gguf_decodes():
    """One block per code at scale byte 128 (d = 1) decodes to the table's level."""
    p = np.zeros((16, 17), np.uint8)
    p[:, 0] = 128
    p[:, 1] = np.arange(16)
    want = gguf.dequantize(p, QT)[:, 0]
    np.testing.assert_array_equal(want, mxfp4.KVALUES_MXFP4.astype(np.float32))
    assert bits_equal(gg.decode(p, "mxfp4"), gguf.dequantize(p, QT))


def test_decoder_matches_gguf_for_every_scale_byte():
    """Random codes under every scale byte 0..255: subnormal (e < 2 and small codes), normal and Inf products."""
    rng = np.random.default_rng(3)
    p = rng.integers(0, 256, (32, 8, 17), dtype=np.uint8)
    p[:, :, 0] = np.arange(256, dtype=np.uint8).reshape(32, 8)
    p = p.reshape(32, -1)
    with np.errstate(over="ignore"):
        want = gguf.dequantize(p, QT)
    got = np.asarray(gg.decode(p, "mxfp4"))
    assert bits_equal(got, want)
    assert np.isinf(got).any() and ((got != 0) & (np.abs(got) < np.finfo(np.float32).tiny)).any()


def test_decoder_matches_llama_cpp_golden(golden):
    assert bits_equal(gg.decode(golden["random_payload"], "mxfp4"), golden["random_dequant"])


def test_log2f_table_matches_the_c_library():
    """Every float that C's log2f rounds up to the next integer, for every power of two, is where the table says."""
    log2f = libm_log2f()
    if log2f is None:
        pytest.skip("no C math library found")
    starts = mxfp4.LOG2F_FLOOR_STARTS.astype(np.int64)
    for k in range(-148, 129):
        cand = below_power_of_two(k, np.arange(0 if k < 128 else 1, 80))
        cand = cand[cand > 0]
        floor_c = np.array([np.floor(log2f(float(v))) for v in cand])
        floor_table = np.searchsorted(starts, cand.view(np.uint32).astype(np.int64), side="right") - 150
        np.testing.assert_array_equal(floor_table, floor_c, err_msg=f"below 2**{k}")
    powers = {int(below_power_of_two(k, [0]).view(np.uint32)[0]) for k in range(-149, 129)}
    assert sum(int(s) not in powers for s in starts) > 200  # most results start below their power of two


def test_encoder_matches_float64_reference_with_c_log2f():
    log2f = libm_log2f()
    if log2f is None:
        pytest.skip("no C math library found")
    x, labels = edge_rows(np.random.default_rng(11))
    got = np.asarray(gg.encode(x, "mxfp4"))
    same = block_equal(got, reference_encode(x, log2f))
    bad = sorted({labels[r] for r in np.nonzero(~same.all(axis=1))[0]})
    assert same.all(), f"{same.mean():.4%} identical blocks; differing rows: {bad}"


def test_encoder_matches_gguf_on_ordinary_rows():
    """gguf's numpy encoder (float32 numpy log2) agrees wherever no block max sits just below a power of two."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 512)) * np.exp(rng.uniform(-8, 8, (16, 1)))).astype(np.float32)
    x[3] = np.round(x[3] * 4) / 4
    x[4, :64] = 0.0
    assert np.array_equal(np.asarray(gg.encode(x, "mxfp4")), gguf.quantize(x, QT))


@pytest.mark.parametrize("path", ["payload", "payload_imp"])
def test_encoder_matches_llama_cpp_golden(golden, path):
    meta = json.loads(str(golden["meta"]))
    assert meta["ggml_version"] == "0.25.3" and meta["machine"] == "x86_64"
    imp = golden["importance"] if path == "payload_imp" else None
    got = np.asarray(gg.encode(golden["x"], "mxfp4", imp))
    same = block_equal(got, golden[path])
    bad = sorted({str(golden["labels"][r]) for r in np.nonzero(~same.all(axis=1))[0]})
    assert same.all(), f"{path}: {same.mean():.4%} identical blocks; differing rows: {bad}"


def test_golden_reaches_the_encoder_edges(golden):
    """The golden rows include wrapped scale bytes (maxima below 2**-125), 255, and rounded-up log2f maxima."""
    e = golden["payload"].reshape(len(golden["x"]), -1, 17)[:, :, 0]
    xb = golden["x"].reshape(e.shape + (32,))
    amax = np.abs(xb).max(-1)
    exact = np.floor(np.log2(amax.astype(np.float64), where=amax > 0, out=np.zeros_like(amax, np.float64)))
    assert ((amax > 0) & (amax < 2.0**-125)).any() and (e == 255).any() and (e >= 250).any()
    assert ((amax > 0) & (e != (exact.astype(int) + 125) % 256)).any()  # log2f rounded up to the next power


def test_importance_is_ignored_like_llama_cpp():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    plain = np.asarray(gg.encode(x, "mxfp4"))
    assert np.array_equal(np.asarray(gg.encode(x, "mxfp4", rng.exponential(1.0, 256))), plain)


def test_round_trip_keeps_levels_and_bounds_the_error():
    """Values on the level grid of their block come back exactly; otherwise the error is at most half a level
    step (or, above the top level 12 d, the distance to 12 d)."""
    rng = np.random.default_rng(9)
    d = np.exp2(rng.integers(-20, 20, (8, 16, 1)).astype(np.float64))
    codes = rng.integers(0, 16, (8, 16, 32))
    codes[:, :, 0] = 6  # level 8: the block max lands on 8 d, so the scale byte gives d back
    x = (mxfp4.KVALUES_MXFP4[codes] * d).reshape(8, -1).astype(np.float32)
    assert np.array_equal(np.asarray(gg.decode(gg.encode(x, "mxfp4"), "mxfp4")), x)
    y = (rng.standard_normal((8, 512)) * 3).astype(np.float32)
    back = np.asarray(gg.decode(gg.encode(y, "mxfp4"), "mxfp4")).astype(np.float64)
    e = np.asarray(gg.encode(y, "mxfp4")).reshape(8, 16, 17)[:, :, 0].astype(np.float64)
    step = np.repeat(np.exp2(e - 128), 32, axis=1)  # d of each value's block
    levels = np.sort(np.unique(np.abs(mxfp4.KVALUES_MXFP4.astype(np.float64))))
    a = np.abs(y) / step
    gap = np.diff(levels)[np.clip(np.searchsorted(levels, a) - 1, 0, len(levels) - 2)]
    bound = np.where(a > 12, a - 12, gap / 2) * step
    assert np.all(np.abs(back - y) <= bound * (1 + 1e-6))


def test_jit_vmap_and_chunks_give_the_same_bytes(golden):
    x = golden["x"]
    f = gg.get_format("mxfp4")
    whole = np.asarray(f.encode(x))
    assert np.array_equal(np.asarray(jax.vmap(f.encode)(x)), whole)
    assert np.array_equal(np.asarray(f.encode(x.reshape(-1, 64))).reshape(whole.shape), whole)
    assert np.array_equal(np.asarray(jax.jit(mxfp4.encode_mxfp4)(x[None]))[0], whole)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of the mxfp4 block size 32"):
        gg.encode(np.zeros((2, 48), np.float32), "mxfp4")
    with pytest.raises(ValueError, match="NaN or Inf"):
        gg.encode(np.full((1, 32), np.inf, np.float32), "mxfp4")
    with pytest.raises(ValueError, match="block size in bytes \\(17\\)"):
        gg.decode(np.zeros((1, 32), np.uint8), "mxfp4")


def test_no_float_conversion_chains(golden):
    """XLA:GPU would collapse a chain of float conversions (see tests/ggml/hlo_chains.py); the codec has none."""
    from tests.ggml.hlo_chains import convert_chains

    f = gg.get_format("mxfp4")
    assert convert_chains(f.encode.lower(golden["x"]).compile().as_text()) == []
    assert convert_chains(f.decode.lower(golden["payload"]).compile().as_text()) == []


def _ocp_fp4(code, scale):
    """OCP MX: E2M1 code (sign, 2 exponent bits, 1 mantissa bit) times 2**(scale - 127), float64."""
    sign = np.where(code & 8, -1.0, 1.0)
    e, m = (code >> 1) & 3, code & 1
    mag = np.where(e == 0, 0.5 * m, np.exp2(e - 1.0) * (1 + 0.5 * m))
    return sign * mag * np.exp2(scale.astype(np.float64) - 127)


def test_from_packed_is_lossless_against_the_ocp_definition():
    rng = np.random.default_rng(12)
    packed = rng.integers(0, 256, (3, 4, 8, 16), dtype=np.uint8)  # (experts, rows, blocks, 16) as gpt-oss stores
    scales = rng.integers(0, 255, (3, 4, 8), dtype=np.uint8)  # 255 is NaN in OCP MX
    scales[0, 0, :3] = [0, 1, 254]
    payload = mxfp4.from_packed(packed, scales)
    assert payload.shape == (3, 4, 8 * 17)
    assert np.array_equal(mxfp4.from_packed(packed.reshape(3, 4, -1), scales), payload)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(3, 4, 8, 32)
    with np.errstate(over="ignore"):
        want = _ocp_fp4(codes, scales[..., None]).astype(np.float32).reshape(3, 4, 256)
    assert bits_equal(gg.decode(payload, "mxfp4"), np.where(want == 0, np.float32(0), want))  # -0 decodes to +0
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.from_packed(packed, scales[..., :4])
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.from_packed(packed.astype(np.int32), scales)
