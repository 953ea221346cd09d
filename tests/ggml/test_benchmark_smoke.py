"""The codec benchmark runs end to end at its small size and records every case, failures included."""

import json

from benchmarks import ggml_codecs
from benchmarks.anchors import llama_cpp


def test_small_run_writes_figures_and_failures(tmp_path):
    out = tmp_path / "ggml_codecs.json"
    rc = ggml_codecs.main(["--small", "--formats", "q8_0,not_a_format", "--min-seconds", "0", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["shape"] == [64, 1024] and res["small"] is True
    for label in ("none", "importance"):
        case = res["formats"]["q8_0"][label]
        assert case["jax_encode_values_per_s"] > 0 and case["jax_decode_values_per_s"] > 0
        if llama_cpp.available():
            assert case["identical_blocks_share"] == 1.0 and case["decode_identical_values_share"] == 1.0
        assert "error" in res["formats"]["not_a_format"][label]


def test_budget_skips_cases(tmp_path):
    out = tmp_path / "ggml_codecs.json"
    ggml_codecs.main(["--small", "--formats", "q4_0", "--budget-s", "0", "--out", str(out)])
    res = json.loads(out.read_text())
    assert "skipped" in res["formats"]["q4_0"]["none"]


def test_shape_options_and_cpu_check(tmp_path):
    out = tmp_path / "ggml_codecs.json"
    rc = ggml_codecs.main(["--rows", "8", "--cols", "512", "--formats", "q4_k", "--cpu-check", "--min-seconds", "0",
                           "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["shape"] == [8, 512]
    for label in ("none", "importance"):
        case = res["formats"]["q4_k"][label]
        assert case["identical_blocks_vs_cpu_share"] == 1.0 and case["differing_blocks_vs_cpu"] == 0
        if llama_cpp.available():
            assert case["identical_blocks_share"] == 1.0
    assert res["summary"]["q4_k/none"]["identical_blocks_vs_cpu_share"] == 1.0
