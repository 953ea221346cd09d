"""What a run shows: the plan's block fallbacks said before the first layer, a report whose embeddings-and-head row
is named (no layer -1, no nan), and charts whose labels and legend fit the page."""

import re
import warnings
import xml.etree.ElementTree as ET

import pytest

import jgptq
from jgptq.plot import CHAR_WIDTH, line_chart
from jgptq_torch.cli.command import bits_chart, layer_loss_chart
from jgptq_torch.report import ModuleRecord, Report
from tests.tiny_models import build, token_ids

SVG = "{http://www.w3.org/2000/svg}"


def report_with_edges() -> Report:
    rec = dict(kind="linear", shape=(64, 64), tokens=128)
    return Report(config={}, model="M", calibration_tokens=128, records=[
        ModuleRecord("model.layers.0.self_attn.q_proj.weight", 0, method="gptq", loss=0.5, format="q8_0", **rec),
        ModuleRecord("model.layers.1.self_attn.q_proj.weight", 1, method="gptq", loss=0.25, format="q8_0", **rec),
        ModuleRecord("model.embed_tokens.weight", -1, method="rtn", format="q8_0", **rec)])


def test_the_summary_names_the_embeddings_and_head_row_and_shows_no_nan():
    text = report_with_edges().summary()
    rows = text.splitlines()
    assert "nan" not in text and not any(r.lstrip().startswith("-1 ") for r in rows)
    assert re.match(r"^edges +1 +0 +1 +0 +0 +- +- +0\.00$", rows[4]), rows
    assert rows[5] == "edges: the token embeddings and output head, encoded without calibration (no GPTQ loss)"


def test_the_loss_chart_has_no_layer_minus_one(tmp_path):
    layer_loss_chart(report_with_edges(), tmp_path / "l.svg", "loss")
    labels = [t.text for t in ET.parse(tmp_path / "l.svg").getroot().iter(f"{SVG}text")]
    assert "-1" not in labels and "0" in labels and "1" in labels


def test_the_bits_chart_labels_every_chosen_width_and_its_legend_fits_the_page(tmp_path):
    names = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj"]
    groups = [{"layer": i, "name": n, "bpw": bpw} for i in range(3) for n, bpw in zip(names, (4.5, 5.5, 8.5, 6, 4.5,
                                                                                              5))]
    report = Report(config={}, allocation={"groups": groups})
    bits_chart(report, tmp_path / "b.svg", "bits")
    root = ET.parse(tmp_path / "b.svg").getroot()
    width, height = float(root.get("width")), float(root.get("height"))
    texts = list(root.iter(f"{SVG}text"))
    for t in texts:      # the worst case of every text's extent, start-anchored or end-anchored
        x, n = float(t.get("x", 0)), len(t.text or "")
        if t.get("text-anchor") is None:
            assert x + CHAR_WIDTH * n <= width, (t.text, x, width)
        assert float(t.get("y", 0)) <= height
    assert {t.text for t in texts} >= set(names) | {"4.5", "5", "5.5", "6", "8.5"}


def test_short_legends_keep_the_default_page():
    svg = line_chart({"mean": [1.0, 2.0], "max": [2.0, 3.0]})
    assert 'width="640" height="400"' in svg


def test_block_fallbacks_are_said_before_the_first_layer(monkeypatch):
    from jgptq_torch.pipeline import layerwise

    class Stop(Exception):
        pass

    seen = []

    def first_layer(*args, **kwargs):
        seen.extend(str(w.message) for w in caught)
        raise Stop

    monkeypatch.setattr(layerwise, "_layer_step", first_layer)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(Stop):
        warnings.simplefilter("always")
        jgptq.quantize_moe(build("qwen3_moe"), token_ids(8, 32, seed=1), batch_size=8, progress=False,
                           format="q4_k", block_fallback="llama.cpp", method="rtn")
    assert ("model.layers.0.self_attn.q_proj.weight: 64 input columns are not a multiple of the q4_k block size "
            "256; q5_0 used instead (block_fallback)") in seen


def test_a_run_shows_no_transformers_progress_bars(tmp_path, capsys, monkeypatch):
    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe
    from jgptq_torch.cli.main import main
    from jgptq_torch.pipeline import layerwise
    from tests.cli.test_cli import CALIB, TINY

    tiny_moe(2, 0, **TINY).save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    capsys.readouterr()

    def stop(*args, **kwargs):
        raise ValueError("stopped after loading")

    monkeypatch.setattr(layerwise, "quantize_moe", stop)
    args = ["quantize", tmp_path / "model", "--calib", CALIB, "--out", tmp_path / "out", "--group-size", 32,
            "--samples", 2, "--seq-len", 32]
    assert main([str(a) for a in args]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "jgptq: error: stopped after loading"
    assert "%|" not in err and "Loading weights" not in err, err
