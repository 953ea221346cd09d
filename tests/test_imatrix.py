"""The imatrix statistic (per column sums of squared inputs and token counts, routed tokens only for experts) as
quantize_moe collects it, and its GGUF / legacy .dat files against the gguf package's reader and writer."""

import struct

import gguf
import numpy as np
import pytest
import torch

import jgptq
from jgptq.imatrix import ImatrixEntry, read_imatrix, write_imatrix
from tests.tiny_models import build, token_ids

# -- the statistic ---------------------------------------------------------------------------------------------


def _calib():
    ids = token_ids(6, 24, seed=3)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0          # padding rows must not count
    mask[4, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}, mask


def _independent_statistic(model, calib, mask, calibration):
    """float64 sums of squares per expert over the tokens the router sent it, seen by torch hooks on the experts
    module (its inputs and routing) and on q_proj, from the first forward of each layer (the calibration one)."""
    seen = {}
    handles = []
    keep = mask.reshape(-1).bool()
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts

        def pre(module, args, i=i):
            if ("e", i) in seen:
                return
            x, idx = args[0].detach().double(), args[1]
            e_count = module.gate_up_proj.shape[0]
            inter = module.down_proj.shape[-1]
            up = np.zeros((e_count, x.shape[1])), np.zeros(e_count)
            down = np.zeros((e_count, inter))
            for e in range(e_count):
                rows = (idx == e).any(-1) & keep
                xe = x[rows]
                g, u = (xe @ module.gate_up_proj[e].detach().double().T).chunk(2, dim=-1)
                he = torch.nn.functional.silu(g) * u
                up[0][e] = (xe ** 2).sum(0).numpy()
                up[1][e] = int(rows.sum())
                down[e] = (he ** 2).sum(0).numpy()
            seen[("e", i)] = (up[0], down, up[1])

        def q_hook(module, args, i=i):
            if ("q", i) in seen:
                return
            x = args[0].detach().double().reshape(-1, args[0].shape[-1])[keep]
            seen[("q", i)] = ((x ** 2).sum(0).numpy(), x.shape[0])

        handles.append(experts.register_forward_pre_hook(pre))
        handles.append(layer.self_attn.q_proj.register_forward_pre_hook(q_hook))
    try:
        result = jgptq.quantize_moe(model, calib, method="rtn", bits=4, group_size=16, batch_size=8,
                                    calibration=calibration, progress=False)
    finally:
        for h in handles:
            h.remove()
    return result, seen


@pytest.mark.parametrize("calibration", ["routed", "all_experts"])
def test_statistic_equals_float64_sums_over_routed_tokens(calibration):
    model = build("qwen3_moe")
    calib, mask = _calib()
    result, seen = _independent_statistic(model, calib, mask, calibration)
    tokens = int(mask.sum())
    for i in range(len(model.model.layers)):
        base = f"model.layers.{i}"
        up_sums, down_sums, counts = seen[("e", i)]
        up, down = result.imatrix[f"{base}.mlp.experts.gate_up_proj"], result.imatrix[f"{base}.mlp.experts.down_proj"]
        assert up.sums.dtype == np.float32 and up.sums.shape == up_sums.shape and up.counts.shape == (8,)
        np.testing.assert_array_equal(up.counts, counts)
        np.testing.assert_array_equal(down.counts, counts)
        assert up.counts.sum() == 2 * tokens          # top-2 routing: every real token twice
        np.testing.assert_allclose(up.sums, up_sums, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(down.sums, down_sums, rtol=2e-4, atol=1e-6)
        q_sums, q_count = seen[("q", i)]
        for name in ("q_proj", "k_proj", "v_proj"):   # one input: one statistic
            entry = result.imatrix[f"{base}.self_attn.{name}.weight"]
            assert entry.sums.shape == (1, 64) and entry.counts.tolist() == [q_count] == [tokens]
            np.testing.assert_allclose(entry.sums[0], q_sums, rtol=2e-5)
        o = result.imatrix[f"{base}.self_attn.o_proj.weight"]
        assert o.counts.tolist() == [tokens] and o.sums.shape == (1, 64)
    assert set(result.imatrix) == set(result.param_keys)


def test_values_follow_llama_quantize():
    e = ImatrixEntry(np.array([[2.0, 4.0], [0.0, 0.0], [3.0, 0.3]], np.float32), np.array([2, 0, 3], np.float32))
    v = e.values()
    assert v.dtype == np.float32
    np.testing.assert_array_equal(v, np.array([[1.0, 2.0], [1.0, 1.0], [np.float32(3.0) / np.float32(3.0),
                                                                          np.float32(0.3) / np.float32(3.0)]],
                                              np.float32))


# -- files -----------------------------------------------------------------------------------------------------

def _entries(rng):
    return {"blk.0.ffn_up_exps.weight": ImatrixEntry(rng.random((4, 32), dtype=np.float32) * 10,
                                                     np.array([5, 0, 17, 3], np.float32)),
            "blk.0.attn_q.weight": ImatrixEntry(rng.random((1, 64), dtype=np.float32), np.array([40], np.float32))}


def test_write_then_gguf_reader_sees_llama_cpp_layout(tmp_path):
    rng = np.random.default_rng(0)
    entries = _entries(rng)
    path = write_imatrix(tmp_path / "m.imatrix.gguf", entries, datasets=["calib.txt"], chunk_count=7,
                         chunk_size=512)
    reader = gguf.GGUFReader(path)
    fields = reader.fields
    assert bytes(fields["general.type"].parts[-1]).decode() == "imatrix"
    assert "general.architecture" not in fields
    ds = fields["imatrix.datasets"]
    assert [bytes(ds.parts[i]).decode() for i in ds.data] == ["calib.txt"]
    assert int(fields["imatrix.chunk_count"].parts[-1][0]) == 7
    assert int(fields["imatrix.chunk_size"].parts[-1][0]) == 512
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {f"{n}{s}" for n in entries for s in (".in_sum2", ".counts")}
    for name, e in entries.items():
        s, c = tensors[name + ".in_sum2"], tensors[name + ".counts"]
        assert s.tensor_type == gguf.GGMLQuantizationType.F32 and c.tensor_type == gguf.GGMLQuantizationType.F32
        assert s.shape.tolist() == [e.sums.shape[1], e.sums.shape[0]]      # GGML {ne0, n_mat}
        assert c.shape.tolist() == [1, e.sums.shape[0]]
        np.testing.assert_array_equal(np.asarray(s.data).reshape(e.sums.shape), e.sums)
        np.testing.assert_array_equal(np.asarray(c.data).reshape(-1), e.counts)
    back, meta = read_imatrix(path)
    assert meta == {"datasets": ["calib.txt"], "chunk_count": 7, "chunk_size": 512, "legacy": False,
                    "type": "imatrix"}
    for name, e in entries.items():
        np.testing.assert_array_equal(back[name].sums, e.sums)
        np.testing.assert_array_equal(back[name].counts, e.counts)
    with pytest.raises(FileExistsError):
        write_imatrix(path, entries)


def test_read_a_file_written_as_llama_imatrix_does(tmp_path):
    rng = np.random.default_rng(1)
    sums = rng.random((3, 16), dtype=np.float32)
    path = str(tmp_path / "llama.gguf")
    w = gguf.GGUFWriter(path, arch="imatrix-test")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["a.txt", "b.txt"])
    w.add_uint32("imatrix.chunk_count", 12)
    w.add_uint32("imatrix.chunk_size", 256)
    w.add_tensor("blk.1.ffn_down_exps.weight.in_sum2", sums)
    w.add_tensor("blk.1.ffn_down_exps.weight.counts", np.array([[10.0], [0.0], [2.9999]], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got, meta = read_imatrix(path)
    assert meta["datasets"] == ["a.txt", "b.txt"] and meta["chunk_count"] == 12 and meta["chunk_size"] == 256
    e = got["blk.1.ffn_down_exps.weight"]
    np.testing.assert_array_equal(e.sums, sums)
    assert e.counts.tolist() == [10.0, 0.0, 3.0]                 # lround, as llama.cpp reads counts
    np.testing.assert_array_equal(e.values()[1], np.ones(16, np.float32))
    np.testing.assert_array_equal(e.values()[0], sums[0] / np.float32(10))


def test_read_legacy_dat(tmp_path):
    vals = np.arange(1, 9, dtype=np.float32) * 0.5
    name = b"blk.0.attn_k.weight"
    blob = struct.pack("<i", 1) + struct.pack("<i", len(name)) + name + struct.pack("<ii", 4, 8) + vals.tobytes()
    blob += struct.pack("<ii", 9, 5) + b"wiki1"
    path = tmp_path / "old.dat"
    path.write_bytes(blob)
    got, meta = read_imatrix(path)
    assert meta == {"datasets": ["wiki1"], "chunk_count": 9, "chunk_size": 0, "legacy": True}
    np.testing.assert_array_equal(got["blk.0.attn_k.weight"].values()[0], vals / np.float32(4))
    path.write_bytes(b"\x00\x00\x00\x00")
    with pytest.raises(ValueError, match="not an imatrix"):
        read_imatrix(path)
