"""Parts of the target_bpw benchmark: rank correlation, sizes of the quantized tensors of a GGUF, files assembled
from several runs, the KL-against-size chart, the deep model's settings and the expert-usage count."""

import xml.etree.ElementTree as ET

import numpy as np
import pytest

from benchmarks.quality import bpw_parts, lm

gguf = pytest.importorskip("gguf")


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.integers(0, 6, 12).astype(float)
        b = a + rng.normal(0, 2, 12)
        assert bpw_parts.spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic, abs=1e-12)
    assert np.isnan(bpw_parts.spearman([1, 1, 1], [1, 2, 3]))


def test_quantized_bits_counts_only_block_types(tmp_path):
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    q8 = gguf.quants.quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = bpw_parts.quantized_bits(path)
    # Q8_0: blocks of 32 weights in 34 bytes (a float16 scale and 32 int8)
    assert got["weights"] == 256 and got["bytes"] == 8 * 34 and got["bits_per_weight"] == 8.5
    assert got["tensors"] == ["blk.0.attn_q.weight"] and got["types"] == {"Q8_0": 1}


def test_assemble_takes_each_parameter_from_its_format():
    runs = {f: type("R", (), {"param_keys": {"a": ["a.0", "a.1"], "b": ["b"]},
                              "weights": {"a.0": (f, 0), "a.1": (f, 1), "b": (f, 2)}})() for f in ("x", "y")}
    got = bpw_parts.assemble(runs, {"a": "y", "b": "x"})
    assert got.weights == {"a.0": ("y", 0), "a.1": ("y", 1), "b": ("x", 2)}
    assert got.param_keys == {"a": ["a.0", "a.1"], "b": ["b"]}


def test_chart_is_svg_with_one_line_per_series():
    svg = bpw_parts.kl_size_chart({"llama.cpp": [(10.0, 0.01, "q2_k_s"), (20.0, 0.001, "q4_k_m")],
                                   "jgptq": [(10.5, 0.005, "a"), (19.0, 0.0007, "b")]},
                                  title="t", xlabel="MB")
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}polyline")) == 2 and len(root.findall(f"{ns}circle")) == 4
    with pytest.raises(ValueError):
        bpw_parts.kl_size_chart({"a": [(1.0, 0.0, "")]}, title="", xlabel="")


def test_deep_model_settings():
    arch = lm.DEEP_ARCH
    assert arch["num_experts"] >= 8 and arch["num_experts_per_tok"] == 2 and arch["num_hidden_layers"] >= 4
    assert arch["router_aux_loss_coef"] == 0.0
    # every quantized row at least two 256-weight super-blocks long
    assert arch["hidden_size"] % 512 == 0 and arch["moe_intermediate_size"] % 512 == 0
    assert lm.cache_key(arch, lm.DEEP_TRAIN, "x") != lm.cache_key(lm.ARCH, lm.TRAIN, "x")


def test_expert_usage_counts_topk_choices():
    torch = pytest.importorskip("torch")
    arch = dict(lm.DEEP_ARCH, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                moe_intermediate_size=32, num_hidden_layers=2)
    model = lm.build(arch).eval()
    windows = np.random.default_rng(0).integers(0, 256, (3, 10))
    got = lm.expert_usage(model, windows, batch=2)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(windows), output_router_logits=True)
    for layer, logits in enumerate(out.router_logits):
        top = torch.topk(logits.float(), 2, dim=-1).indices.reshape(-1).numpy()
        assert got["counts"][layer] == np.bincount(top, minlength=arch["num_experts"]).tolist()
    assert all(0 < e <= 1 for e in got["normalised_entropy"])
