"""The streaming benchmark's smoke run: a tiny DeepSeek-V3-shaped FP8 checkpoint written in shards and streamed
on the CPU under a device budget that puts its MoE layers' routed experts in chunks; its figures are consistent
with the files it wrote."""

import json

import pytest

from benchmarks import stream_model


@pytest.mark.slow     # about a minute: the MLA, dense and MoE shapes each compile their solves
def test_tiny_fp8_checkpoint_streams_and_reports(tmp_path):
    out = tmp_path / "r.json"
    assert stream_model.main(["--tiny", "--shape", "deepseek_v3", "--out", str(out), "--dir", str(tmp_path / "w"),
                              "--sequences", "4", "--length", "16", "--device-budget", "500kB"]) == 0
    r = json.loads(out.read_text())
    assert r["checkpoint"]["files"] > 1
    index = json.loads((tmp_path / "w" / "model" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.endswith("mlp.experts.7.down_proj.weight_scale_inv") for k in index)   # FP8 experts, as released
    assert r["bytes_read"] >= r["checkpoint"]["bytes"]           # every layer once, the embedding twice
    assert r["memory"]["streamed"]["peak_parameters"] < r["checkpoint"]["bytes"]
    assert r["output_bytes"] > 0 and set(r["per_layer_s"]) == {"0", "1", "2"}
    whole = r["whole_model"]
    assert whole["model_s"] == whole["dense_layer_s"] + 2 * whole["moe_layer_s"]   # tiny: 1 dense + 2 MoE layers
    (plan,) = r["expert_chunks"]                                  # the MoE layers, 8 experts in chunks
    assert plan["layers"] == [1, 2] and sum(plan["experts_per_chunk"]) == 8 and plan["chunks"] > 1
    assert r["memory"]["need"]["total"] <= 500_000
