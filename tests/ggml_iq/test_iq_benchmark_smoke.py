"""The IQ encoder benchmark runs end to end at its small size and records failures and skips."""

import json

from benchmarks import ggml_iq
from benchmarks.anchors import llama_cpp


def test_small_run_records_figures_and_failures(tmp_path):
    out = tmp_path / "ggml_iq.json"
    assert ggml_iq.main(["--small", "--rows", "8", "--cols", "2048", "--llama-rows", "8",
                         "--formats", "iq3_s,not_a_format", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    case = res["formats"]["iq3_s"]
    assert case["jgptq_weights_per_s"] > 0 and case["group_latency_s"] > 0
    if llama_cpp.available():
        assert case["identical_share"] == 1.0 and case["blocks_compared"] == 64
    assert "error" in res["formats"]["not_a_format"]


def test_budget_skips_formats(tmp_path):
    out = tmp_path / "ggml_iq.json"
    ggml_iq.main(["--small", "--formats", "iq3_s", "--budget", "0", "--out", str(out)])
    assert "skipped" in json.loads(out.read_text())["formats"]["iq3_s"]
