"""jgptq_torch.export.gguf.export.export_imatrix: an imatrix keyed by parameter name, written under GGUF tensor names."""

import gguf
import numpy as np
import pytest

from jgptq_torch.export.gguf.export import export_imatrix, gguf_names
from tests.tiny_models import build

imatrix = pytest.importorskip("jgptq.imatrix")


def test_names_and_values(tmp_path):
    model = build("qwen3_moe")
    rng = np.random.default_rng(0)
    sd = model.state_dict()
    entries = {}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
                 "model.layers.1.mlp.experts.down_proj"):
        p = sd[name]
        experts = p.shape[0] if p.ndim == 3 else 1
        entries[name] = imatrix.ImatrixEntry(rng.uniform(0, 5, (experts, p.shape[-1])).astype(np.float32),
                                             rng.integers(0, 9, experts).astype(np.float32))
    path = export_imatrix(model, entries, tmp_path / "imatrix.gguf", datasets=["calib"], chunk_count=3,
                          chunk_size=16)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    names = gguf_names(model)
    expected = {}
    for param, entry in entries.items():
        for gname, _ in names[param]:
            expected[gname] = entry
    assert set(tensors) == {g + s for g in expected for s in (".in_sum2", ".counts")}
    assert {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.0.attn_q.weight"} <= set(expected)
    for gname, entry in expected.items():
        assert np.array_equal(tensors[gname + ".in_sum2"].reshape(entry.sums.shape), entry.sums)
        assert np.array_equal(tensors[gname + ".counts"].reshape(-1), entry.counts)


def test_errors(tmp_path):
    model = build("qwen3_moe")
    good = imatrix.ImatrixEntry(np.ones((8, 64), np.float32), np.ones(8, np.float32))
    with pytest.raises(ValueError, match="not a parameter"):
        export_imatrix(model, {"model.layers.0.mlp.experts.nope": good}, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match=r"do not match the parameter"):
        export_imatrix(model, {"model.layers.0.mlp.experts.down_proj": good}, tmp_path / "x.gguf")  # in = 32
    with pytest.raises(ValueError, match="norm or router"):
        export_imatrix(model, {"model.layers.0.mlp.gate.weight": imatrix.ImatrixEntry(
            np.ones((1, 64), np.float32), np.ones(1, np.float32))}, tmp_path / "x.gguf")


def test_entries_fit_the_model_tensors(tmp_path):
    """Every entry names a tensor of the model's GGUF file, with one row of sums per expert of its input width
    (what llama-quantize checks: size == ne0 * ne2)."""
    from jgptq_torch.export.gguf.export import export_gguf

    model = build("mixtral")
    sd = model.state_dict()
    entries = {}
    for name, p in sd.items():
        if p.ndim < 2 or ".mlp.gate." in name or "embed" in name or "lm_head" in name:
            continue
        experts = p.shape[0] if p.ndim == 3 else 1
        entries[name] = imatrix.ImatrixEntry(np.ones((experts, p.shape[-1]), np.float32), np.ones(experts, np.float32))
    imx = gguf.GGUFReader(str(export_imatrix(model, entries, tmp_path / "i.gguf")))
    weights = {t.name: t for t in gguf.GGUFReader(str(export_gguf(model, None, tmp_path / "m.gguf"))).tensors}
    sums = {t.name[: -len(".in_sum2")]: t for t in imx.tensors if t.name.endswith(".in_sum2")}
    assert len(sums) == len(entries) + 2  # gate_up gives two entries per layer
    for name, t in sums.items():
        ne = list(weights[name].shape) + [1]
        assert list(t.shape) == [ne[0], ne[2]], name
