"""Dense int32 bit packing: byte-identical to compressed-tensors' packer, and the documented bit layout."""

import numpy as np
import pytest

from jgptq.export.packing import pack_int32, packed_length, unpack_int32

torch = pytest.importorskip("torch")
ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", [(5, 77), (33, 64), (1, 3)])
def test_matches_compressed_tensors_packer(bits, shape):
    rng = np.random.default_rng(bits * 100 + shape[1])
    codes = rng.integers(0, 1 << bits, shape).astype(np.uint8)
    signed = torch.from_numpy(codes.astype(np.int16) - (1 << (bits - 1))).to(torch.int8)
    for axis in (0, 1):
        theirs = ct_helpers.pack_to_int32(signed, bits, packed_dim=axis).numpy()
        ours = pack_int32(codes, bits, axis=axis)
        assert ours.dtype == np.int32 and ours.shape == theirs.shape
        assert ours.tobytes() == theirs.tobytes()
        back = ct_helpers.unpack_from_int32(torch.from_numpy(ours), bits, torch.Size(shape), packed_dim=axis)
        assert np.array_equal(back.numpy().astype(np.int16) + (1 << (bits - 1)), codes)
        assert np.array_equal(unpack_int32(ours, bits, shape[axis], axis=axis), codes)


def test_bit_layout_by_hand():
    # 4-bit: word r holds inputs 8r..8r+7, input k at bits 4k.
    v = np.arange(8, dtype=np.uint8)[None]
    assert pack_int32(v, 4)[0, 0] == 0x76543210
    # symmetric 4-bit zero 8, stored 7 in GPTQ: 0x77777777
    assert pack_int32(np.full((1, 8), 7, np.uint8), 4)[0, 0] == 0x77777777
    # 3-bit: 11 values of 0b111 = 33 ones -> word 0 all ones (-1 as int32), word 1 = 1
    w = pack_int32(np.full((1, 11), 7, np.uint8), 3)
    assert w.tolist() == [[-1, 1]]
    # value 10 (bits 30..32) straddles: value 5 = 0b101 -> bit 30 of word 0 and bit 0 of word 1
    v = np.zeros((1, 11), np.uint8)
    v[0, 10] = 5
    assert pack_int32(v, 3).view(np.uint32).tolist() == [[1 << 30, 1]]


def test_lengths_and_leading_axes():
    assert [packed_length(n, 3) for n in (1, 10, 11, 32, 33)] == [1, 1, 2, 3, 4]
    rng = np.random.default_rng(0)
    v = rng.integers(0, 32, (2, 3, 40)).astype(np.uint8)
    w = pack_int32(v, 5, axis=-1)
    assert w.shape == (2, 3, packed_length(40, 5))
    assert np.array_equal(w[1], pack_int32(v[1], 5, axis=-1))
    assert np.array_equal(unpack_int32(w, 5, 40), v)


def test_large_lines_are_chunked_consistently(monkeypatch):
    from jgptq.export import packing

    rng = np.random.default_rng(1)
    v = rng.integers(0, 8, (37, 50)).astype(np.uint8)
    whole = pack_int32(v, 3, axis=1)
    monkeypatch.setattr(packing, "_CHUNK_BITS", 1)  # one line per step
    assert np.array_equal(pack_int32(v, 3, axis=1), whole)
    for bits in (1, 2, 4, 8):                          # the whole-byte path steps by input bytes
        u = rng.integers(0, 1 << bits, (37, 50)).astype(np.uint8)
        one_step = pack_int32(u, bits, axis=1)
        monkeypatch.setattr(packing, "_CHUNK_BYTES", 1)
        assert np.array_equal(pack_int32(u, bits, axis=1), one_step)
        assert np.array_equal(unpack_int32(one_step, bits, 50, axis=1), u)
        monkeypatch.undo()
    monkeypatch.setattr(packing, "_CHUNK_BITS", 1)
    assert np.array_equal(unpack_int32(whole, 3, 50, axis=1), v)


@pytest.mark.parametrize("bad, rule", [
    (dict(values=np.array([[16]]), bits=4), "must lie in"),
    (dict(values=np.array([[-1]]), bits=4), "must lie in"),
    (dict(values=np.array([[1]]), bits=9), "1..8"),
    (dict(values=np.array([[1.0]]), bits=4), "integers"),
])
def test_bad_input(bad, rule):
    with pytest.raises(ValueError, match=rule):
        pack_int32(**bad)
    with pytest.raises(ValueError, match="take 2 words"):
        unpack_int32(np.zeros((1, 1), np.int32), 3, 11)
