"""jgptq.export.gguf: GGUF files read back with the gguf package's own reader and decoder."""

import os

import gguf
import numpy as np
import pytest

from jgptq.export.gguf import GGUFTensor, write_gguf
from tests.export.gguf_models import field as _field, read as _reader


def test_float_and_block_tensors_round_trip(tmp_path, rng):
    w32 = rng.standard_normal((6, 64)).astype(np.float32)
    w16 = rng.standard_normal((3, 5, 32)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float32)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 96)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    stack = gguf.quants.quantize(rng.standard_normal((3, 8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    blocks8 = q8.reshape(4, 3, 34)
    blocks4 = stack.reshape(3, 8, 2, 18)
    path = write_gguf(tmp_path / "m.gguf", "llama",
                      {"llama.block_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
                       "general.name": "tiny", "tokenizer.ggml.tokens": ["a", "b"], "ids": [1, 2, 3],
                       "flag": True, "neg": (-3, gguf.GGUFValueType.INT32)},
                      [GGUFTensor("a", w32, "f32"), GGUFTensor("b", w16, "f16"), GGUFTensor("n", norm, "f32"),
                       GGUFTensor("q", blocks8, "q8_0"), GGUFTensor("s", blocks4, "Q4_0")])
    reader, t = _reader(path)
    assert [x.name for x in reader.tensors] == ["a", "b", "n", "q", "s"]
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == 2
    assert reader.fields["llama.block_count"].types == [gguf.GGUFValueType.UINT32]
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert _field(reader, "tokenizer.ggml.tokens") == ["a", "b"]
    assert _field(reader, "ids") == [1, 2, 3] and _field(reader, "flag") is True and _field(reader, "neg") == -3
    # ne order is numpy order reversed
    assert list(t["a"].shape) == [64, 6] and t["a"].tensor_type == gguf.GGMLQuantizationType.F32
    assert list(t["b"].shape) == [32, 5, 3] and t["b"].tensor_type == gguf.GGMLQuantizationType.F16
    assert list(t["q"].shape) == [96, 4] and t["q"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert list(t["s"].shape) == [64, 8, 3] and t["s"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert np.array_equal(np.asarray(t["a"].data).reshape(6, 64), w32)
    assert np.array_equal(np.asarray(t["b"].data).reshape(3, 5, 32), w16.astype(np.float16))
    assert np.array_equal(np.asarray(t["n"].data), norm)
    assert np.array_equal(np.asarray(t["q"].data).reshape(-1), q8.reshape(-1))
    assert np.array_equal(np.asarray(t["s"].data).reshape(-1), stack.reshape(-1))
    got = gguf.quants.dequantize(np.asarray(t["s"].data), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(got.reshape(3, 8, 64), gguf.quants.dequantize(stack, gguf.GGMLQuantizationType.Q4_0))


def test_bf16(tmp_path, rng):
    w = rng.standard_normal((4, 32)).astype(np.float32)
    reader, t = _reader(write_gguf(tmp_path / "b.gguf", "llama", {}, [GGUFTensor("w", w, "bf16")]))
    assert t["w"].tensor_type == gguf.GGMLQuantizationType.BF16 and list(t["w"].shape) == [32, 4]
    got = gguf.quants.dequantize(np.asarray(t["w"].data), gguf.GGMLQuantizationType.BF16).reshape(4, 32)
    bits = w.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)  # round to nearest even
    assert np.array_equal(got, rounded)


def test_overwrite_and_atomicity(tmp_path, rng):
    path = tmp_path / "m.gguf"
    w = rng.standard_normal((2, 32)).astype(np.float32)
    write_gguf(path, "llama", {}, [GGUFTensor("w", w, "f32")])
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        write_gguf(path, "llama", {}, [GGUFTensor("w", w, "f32")])
    # a failure while writing leaves the old file and no temporary file
    with pytest.raises(ValueError, match="float16 range"):
        write_gguf(path, "llama", {}, [GGUFTensor("w", w * 1e6, "f16")], overwrite=True)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]
    write_gguf(path, "llama", {}, [GGUFTensor("w", 2 * w, "f32")], overwrite=True)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
    _, t = _reader(path)
    assert np.array_equal(np.asarray(t["w"].data).reshape(2, 32), 2 * w)


def test_errors(tmp_path, rng):
    q = np.zeros((4, 3, 34), np.uint8)
    with pytest.raises(ValueError, match="unknown GGML type"):
        GGUFTensor("w", q, "q9_9")
    with pytest.raises(ValueError, match=r"q4_k blocks must have shape \(\.\.\., rows, cols/256, 144\)"):
        GGUFTensor("w", q, "q4_k")
    with pytest.raises(ValueError, match="uint8 block bytes"):
        GGUFTensor("w", q.astype(np.int32), "q8_0")
    with pytest.raises(ValueError, match="needs float data"):
        GGUFTensor("w", q, "f32")
    with pytest.raises(ValueError, match="appears twice"):
        write_gguf(tmp_path / "d.gguf", "llama", {}, [GGUFTensor("w", q, "q8_0"), GGUFTensor("w", q, "q8_0")])
    with pytest.raises(ValueError, match="negative integer"):
        write_gguf(tmp_path / "d.gguf", "llama", {"x": -1}, [])
    with pytest.raises(ValueError, match="differs from arch"):
        write_gguf(tmp_path / "d.gguf", "llama", {"general.architecture": "qwen3moe"}, [])
    assert not (tmp_path / "d.gguf").exists()


def test_loaders_are_called_when_written(tmp_path, rng):
    w = rng.standard_normal((4, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).reshape(4, 2, 34)
    calls = []

    def load(x):
        def f():
            calls.append(x.shape)
            return x
        return f

    tensors = [GGUFTensor("w", load(w), "f16", shape=(4, 64)), GGUFTensor("q", load(blocks), "q8_0", shape=(4, 64))]
    assert calls == []
    _, t = _reader(write_gguf(tmp_path / "l.gguf", "llama", {}, tensors))
    assert calls == [(4, 64), (4, 2, 34)]          # once each: the check reads the file, not the loader
    assert np.array_equal(np.asarray(t["w"].data).reshape(4, 64), w.astype(np.float16))
    assert np.array_equal(np.asarray(t["q"].data).reshape(-1), blocks.reshape(-1))
    with pytest.raises(ValueError, match="needs the tensor's shape"):
        GGUFTensor("w", load(w), "f32")
    with pytest.raises(ValueError, match=r"rows of 48 values are not a multiple of the q4_k block \(256\)"):
        GGUFTensor("w", load(w), "q4_k", shape=(4, 48))
    with pytest.raises(ValueError, match="differs from its declared shape"):
        write_gguf(tmp_path / "m.gguf", "llama", {}, [GGUFTensor("q", load(blocks), "q8_0", shape=(4, 96))])
    assert not (tmp_path / "m.gguf").exists() and sorted(os.listdir(tmp_path)) == ["l.gguf"]


def test_a_file_that_reads_back_differently_is_not_put_in_place(tmp_path, monkeypatch):
    import jgptq.export.gguf as writer_module

    blocks = np.zeros((2, 1, 18), np.uint8)             # two rows of one q4_0 block
    blocks[1, 0, 2] = 7
    tensors = [GGUFTensor("blk.0.attn_q.weight", blocks, "q4_0", (2, 32))]
    original = writer_module._read_back

    def flipped(fd, at, n):           # pretend the disk returned other bytes than were written
        data = original(fd, at, n)
        data[5] ^= 1
        return data

    monkeypatch.setattr(writer_module, "_read_back", flipped)
    path = tmp_path / "m.gguf"
    with pytest.raises(OSError) as info:
        write_gguf(path, "llama", {}, tensors)
    assert str(info.value) == (f"{path}: the GGUF file read back differs from what was written: blk.0.attn_q.weight "
                               f"holds other bytes than were written; nothing was put in place")
    assert not path.exists() and list(tmp_path.iterdir()) == []
    write_gguf(path, "llama", {}, tensors, verify=False)       # the check can be turned off
    assert path.exists()


def test_a_header_that_places_a_tensor_elsewhere_is_caught(tmp_path, monkeypatch):
    import jgptq.export.gguf as writer_module

    tensors = [GGUFTensor("a", np.ones((2, 32), np.float32), "f32"), GGUFTensor("b", np.ones((3, 32), np.float32),
                                                                              "f16")]
    original = writer_module._pad
    monkeypatch.setattr(writer_module, "_pad", lambda n, a: original(n, a) + (64 if n == 256 else 0))
    path = tmp_path / "m.gguf"
    with pytest.raises(OSError, match="b is not where or as large as it was written; nothing was put in place"):
        write_gguf(path, "llama", {}, tensors)
    assert list(tmp_path.iterdir()) == []


def test_stream_writes_tensors_as_they_come_and_the_header_last(tmp_path):
    from jgptq.export.gguf import GGUFStream

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).reshape(4, 2, 34)
    path = tmp_path / "s.gguf"
    meta = {"general.file_type": 0, "general.name": "abc"}
    with GGUFStream(path, "llama", meta, [("q", (4, 64)), ("w", (4, 64))]) as stream:
        assert stream.next_name == "q" and not path.exists()
        with pytest.raises(ValueError, match=r"tensor 0 is declared as q \(4, 64\), given w \(4, 64\)"):
            stream.write(GGUFTensor("w", w, "f32"))
        stream.write(GGUFTensor("q", blocks, "q8_0"))     # its type was not declared: only the header holds it
        stream.write(GGUFTensor("w", w, "f16"))
        assert stream.next_name is None
        with pytest.raises(ValueError, match="values changed size"):
            stream.finish({"general.file_type": 7, "general.name": "abcd"})
    assert list(tmp_path.iterdir()) == []              # a failed finish removes the file
    with GGUFStream(path, "llama", meta, [("q", (4, 64)), ("w", (4, 64))]) as stream:
        stream.write(GGUFTensor("q", blocks, "q8_0"))
        stream.write(GGUFTensor("w", w, "f16"))
        stream.finish({"general.file_type": 7, "general.name": "xyz"})
    reader, t = _reader(path)
    assert reader.fields["general.file_type"].contents() == 7
    assert reader.fields["general.name"].contents() == "xyz"
    assert t["q"].tensor_type == gguf.GGMLQuantizationType.Q8_0 and t["w"].tensor_type == gguf.GGMLQuantizationType.F16
    assert np.array_equal(np.asarray(t["q"].data).reshape(-1), blocks.reshape(-1))
    assert np.array_equal(np.asarray(t["w"].data).reshape(4, 64), w.astype(np.float16))
    # the same tensors through write_gguf give the same file, byte for byte
    again = write_gguf(tmp_path / "again.gguf", "llama", {"general.file_type": 7, "general.name": "xyz"},
                       [GGUFTensor("q", blocks, "q8_0"), GGUFTensor("w", w, "f16")])
    assert again.read_bytes() == path.read_bytes()
    with pytest.raises(ValueError, match="1 of 2 tensors written; next w"):
        with GGUFStream(tmp_path / "t.gguf", "llama", {}, [("q", (4, 64)), ("w", (4, 64))]) as stream:
            stream.write(GGUFTensor("q", blocks, "q8_0"))
            stream.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.gguf", "s.gguf"]
