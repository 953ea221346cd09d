"""The streaming benchmark's smoke run: a tiny DeepSeek-V3-shaped FP8 checkpoint written in shards and streamed
on the CPU under a device budget that puts its MoE layers' routed experts in chunks; its figures are consistent
with the files it wrote."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import stream_model


@pytest.mark.slow     # about a minute: the MLA, dense and MoE shapes each compile their solves
def test_tiny_fp8_checkpoint_streams_and_reports(tmp_path):
    out = tmp_path / "r.json"
    assert stream_model.main(["--tiny", "--shape", "deepseek_v3", "--out", str(out), "--dir", str(tmp_path / "w"),
                              "--sequences", "4", "--length", "16", "--device-budget", "800kB"]) == 0
    r = json.loads(out.read_text())
    assert r["checkpoint"]["files"] > 1
    index = json.loads((tmp_path / "w" / "model" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.endswith("mlp.experts.7.down_proj.weight_scale_inv") for k in index)   # FP8 experts, as released
    assert r["bytes_read"] >= r["checkpoint"]["bytes"]           # every layer once, the embedding twice
    assert r["memory"]["streamed"]["peak_parameters"] < r["checkpoint"]["bytes"]
    assert r["output_bytes"] > 0 and set(r["per_layer_s"]) == {"0", "1", "2"}
    whole = r["whole_model"]
    assert whole["model_s"] == r["quantize_total_s"]          # tiny: every layer of the shape measured
    assert 0 < r["memory"]["writer_busy_s"] < r["quantize_total_s"]
    (plan,) = r["expert_chunks"]                                  # the MoE layers, 8 experts in chunks
    assert plan["layers"] == [1, 2] and sum(plan["experts_per_chunk"]) == 8 and plan["chunks"] > 1
    assert r["memory"]["need"]["total"] <= 800_000


def test_extrapolation_adds_unmeasured_layers_at_the_steady_cost():
    shape = {"layers": 10, "dense": 2}
    timings = {0: {"calibrate": 5.0, "solve": 3.0}, 1: {"calibrate": 1.0, "solve": 1.0},      # dense: 2.0 steady
               2: {"calibrate": 9.0, "solve": 6.0}, 3: {"calibrate": 2.0, "solve": 1.0},      # MoE: 3.0 and 5.0
               4: {"calibrate": 4.0, "solve": 1.0, "export": 30.0}}                           # export not per layer
    w = stream_model.extrapolate(timings, shape, 5, total=70.0)
    assert (w["dense_layer_s"], w["moe_layer_s"]) == (2.0, 4.0)
    assert w["model_s"] == 70.0 + 0 * 2.0 + 5 * 4.0                  # 3 of 8 MoE layers measured
    slow_writer = stream_model.extrapolate(timings, shape, 5, total=70.0, writer_busy_s=30.0)   # 6 s a layer
    assert slow_writer["moe_layer_steady_s"] == 6.0 and slow_writer["model_s"] == 70.0 + 5 * 6.0


def test_the_median_extrapolation_leaves_out_a_one_off_layer():
    """With three MoE layers between the first and the last, one of them holding a 10 s one-off compile, the mean
    spreads it over every unmeasured layer and the median does not (the last layer, with the stores' end, is left
    out of the median); with fewer the median takes the layers after the first; never below the writer."""
    shape = {"layers": 20, "dense": 0}
    timings = {0: {"solve": 30.0}, 1: {"calibrate": 1.0, "solve": 11.0}, 2: {"solve": 2.0}, 3: {"solve": 2.5},
               4: {"solve": 2.0, "store": 5.0}}
    w = stream_model.extrapolate(timings, shape, 5, total=50.0)
    assert w["moe_layer_s"] == 5.875 and w["model_s"] == 50.0 + 15 * 5.875     # the last layer's store counts here
    assert w["moe_layer_median_s"] == 2.5 and w["model_median_s"] == 50.0 + 15 * 2.5
    two = stream_model.extrapolate({0: {"solve": 30.0}, 1: {"solve": 2.0}, 2: {"solve": 4.0}}, shape, 3, total=9.0)
    assert two["moe_layer_median_s"] == 3.0 and two["model_median_s"] == 9.0 + 17 * 3.0
    slow = stream_model.extrapolate(timings, shape, 5, total=50.0, writer_busy_s=20.0)    # 4 s a layer
    assert slow["model_median_s"] == 50.0 + 15 * 4.0


def test_the_planner_log_keeps_the_planners_messages_and_puts_the_level_back():
    import logging

    logger = logging.getLogger("jgptq.parallel")
    before = logger.level
    with stream_model._planner_log(0.0, most=2) as lines:
        logger.info("37 experts in %d chunks", 2)
        logging.getLogger("jgptq.other").warning("not the planner's")
        logger.info("second")
        logger.info("past the most kept")
    assert [line.split(" ", 1)[1] for line in lines] == ["37 experts in 2 chunks", "second"]
    assert all(float(line.split(" ", 1)[0]) > 0 for line in lines)
    assert logger.level == before and not any(type(h).__name__ == "Keep" for h in logger.handlers)


@pytest.mark.slow     # about 30 s: both shapes streamed, tiny
def test_gpu_stream_script_runs_both_shapes_and_summarizes(tmp_path):
    """``benchmarks/gpu_stream.sh``, the two frontier runs as they are made on a GPU, smoke-run on the CPU."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(["bash", "benchmarks/gpu_stream.sh", str(tmp_path), "t", "--tiny", "--sequences", "4",
                           "--length", "16"], cwd=root, env=dict(os.environ, PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for shape, layers in (("deepseek_v3", 5), ("qwen3_235b", 6)):
        r = json.loads((tmp_path / f"stream_model_{shape}_t.json").read_text())
        assert (r["shape_name"], r["layers"], r["tiny"]) == (shape, layers, True)
        assert (tmp_path / f"stream_model_{shape}_t.log").stat().st_size > 0
        line = next(x for x in proc.stdout.splitlines() if x.startswith(shape + ":"))
        assert f"{layers} layers in" in line and "extrapolated to" in line
