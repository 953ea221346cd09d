"""Every cell of the README's family table (:mod:`tests.export.family_table`) against a run of the family's tiny
model: quantize_moe (RTN, one short calibration), the compressed-tensors export reloaded by transformers, the GGUF
exporter's architecture or refusal; the families llama.cpp runs are those of the table; the README holds the table
as rendered."""

import re
import warnings
from pathlib import Path

import pytest
import torch

import jgptq
from jgptq_torch.export.checkpoint import ExportError, export_model
from jgptq_torch.export.gguf.arch import arch_of
from jgptq_torch.export.gguf.families import UnsupportedGGUFModel
from jgptq_torch.models import UnsupportedModelError
from tests.export import family_table as table
from tests.export.family_models import MODELS, build
from tests.tiny_models import token_ids

transformers = pytest.importorskip("transformers")
CALIB = token_ids(2, 16, seed=1)
IDS = token_ids(1, 16, seed=5)
README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- family table: tests/export/family_table.py -->", "<!-- end of family table -->"


def test_readme_table_is_the_rendered_one():
    text = README.read_text()
    found = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.DOTALL)
    assert found, "README has no family table between its markers"
    assert found.group(1) == table.render()


def test_every_moe_family_has_a_row():
    assert set(table.ROWS) == set(MODELS) - {"llama"}


def test_llama_cpp_tests_run_every_gguf_family():
    from tests.export import test_gguf_families_llama_cpp as families
    from tests.export import test_gguf_llama_cpp as first

    assert set(families.FAMILIES) | set(first.FAMILIES) >= set(table.gguf_families())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", list(table.ROWS))
def test_row(family, tmp_path):
    row = table.ROWS[family]
    model = build(family)
    run = {"method": "rtn", "bits": 4, "group_size": 16, "batch_size": 2, "progress": False}
    if row.quantize == table.REFUSED:
        with pytest.raises(UnsupportedModelError):
            jgptq.quantize_moe(model, CALIB, **run)
        assert row.compressed_tensors == "—"
    else:
        assert row.quantize == table.YES
        result = jgptq.quantize_moe(model, CALIB, **run)
        assert result.report.coverage and all(sum(c) > 0 for c in result.report.coverage.values())
        kinds = {r.kind for r in result.report.records}   # fused experts' two matrices, or stacks of their own
        assert {"expert_gate_up", "expert_down"} <= kinds or "expert_stack" in kinds
        _check_compressed_tensors(row.compressed_tensors, model, result, tmp_path / "ct")
    if row.gguf == table.REFUSED:
        with pytest.raises(UnsupportedGGUFModel):
            arch_of(model)
    else:
        assert arch_of(model).name == row.gguf


def _check_compressed_tensors(cell, model, result, out):
    if cell == table.REFUSED:
        with pytest.raises(ExportError, match="fused tensor"):
            export_model(model, result, "compressed-tensors", out, scale_dtype="float32")
        return
    export_model(model, result, "compressed-tensors", out, scale_dtype="float32")
    with torch.no_grad():
        want = model(IDS).logits
        if cell == table.FAILS:
            # any failure to load or run, or other logits, is the cell's claim
            with pytest.raises(Exception), warnings.catch_warnings():  # noqa: B017
                warnings.simplefilter("ignore")
                loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
                assert torch.equal(loaded(IDS).logits, want)
            return
        assert cell == table.YES
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert torch.equal(loaded(IDS).logits, want)
    mine, theirs = model.state_dict(), loaded.state_dict()
    for k in mine:     # every weight the solver's, experts fused back from the per-expert tensors
        assert torch.equal(mine[k], theirs[k]), k
