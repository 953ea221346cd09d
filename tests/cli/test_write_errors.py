"""A full disk (or another failed write) while a run writes its work state, its checkpoint or its report: one line
naming the file, the work state kept, and the same command run again continues from it."""

import errno
import json

import pytest
import safetensors.numpy
import safetensors.torch

from jgptq_torch.cli.main import main
from tests.cli.test_cli import CALIB

TINY = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, intermediate_size=128)


@pytest.fixture
def model_dir(tmp_path):
    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe

    d = tmp_path / "model"
    tiny_moe(2, 0, **TINY).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


def quantize(model_dir, out, capsys):
    args = ["quantize", model_dir, "--calib", CALIB, "--out", out, "--samples", 8, "--seq-len", 32, "--group-size",
            32, "--quiet"]
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.err


def full_disk_on(monkeypatch, module, part: str, error=None):
    """Makes ``module.save_file`` fail as a full disk does when the path it writes contains ``part``."""
    original = module.save_file

    def save_file(tensors, filename, *args, **kwargs):
        if part in str(filename):
            raise error or OSError(errno.ENOSPC, "No space left on device")
        return original(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(module, "save_file", save_file)


def layers_run(monkeypatch) -> list:
    """The decoder layers the pipeline processes from now on (in order)."""
    from jgptq_torch.pipeline import layerwise

    seen, step = [], layerwise._layer_step

    def counted(run, i, *args, **kwargs):
        seen.append(i)
        return step(run, i, *args, **kwargs)

    monkeypatch.setattr(layerwise, "_layer_step", counted)
    return seen


def test_full_disk_while_writing_the_work_state_then_resume(model_dir, tmp_path, monkeypatch, capsys):
    out, work = tmp_path / "out", tmp_path / "out.jgptq-work"
    with monkeypatch.context() as patch:
        full_disk_on(patch, safetensors.numpy, "layer-00001.safetensors")
        assert quantize(model_dir, out, capsys) == (1, (
            f"jgptq: error: no space left on device while writing {work / 'layer-00001.safetensors'}; the work state "
            f"up to the last finished layer (1 layer done) is kept in {work}: free space and run the same command "
            f"again to continue after layer 0\n"))
    assert json.loads((work / "state.json").read_text())["layers_done"] == 1
    assert sorted(p.name for p in work.iterdir()) == [
        "inputs-00001.safetensors", "layer-00000.json", "layer-00000.safetensors", "state.json"]
    seen = layers_run(monkeypatch)
    status, err = quantize(model_dir, out, capsys)
    assert status == 0 and seen == [1], err
    assert (out / "model.safetensors").is_file() and not work.exists()


def test_full_disk_while_exporting_keeps_every_layer(model_dir, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    out, work = tmp_path / "out", tmp_path / "out.jgptq-work"
    rust_error = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with monkeypatch.context() as patch:   # safetensors' own error, as its writer raises it
        full_disk_on(patch, safetensors.numpy, ".out.partial-", rust_error)
        assert quantize(model_dir, out, capsys) == (1, (
            f"jgptq: error: no space left on device while writing {out}; the work state of all 2 layers is kept in "
            f"{work}: free space and run the same command again to export without quantizing again\n"))
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    seen = layers_run(monkeypatch)
    status, err = quantize(model_dir, out, capsys)
    assert status == 0 and seen == [], err
    assert (out / "model.safetensors").is_file() and not work.exists()


def test_a_report_that_cannot_be_written(model_dir, tmp_path, monkeypatch, capsys):
    from jgptq_torch.report import Report

    out, work = tmp_path / "out", tmp_path / "out.jgptq-work"

    def denied(self, path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    with monkeypatch.context() as patch:
        patch.setattr(Report, "to_json", denied)
        assert quantize(model_dir, out, capsys) == (1, (
            f"jgptq: error: could not write {tmp_path / 'out.report.json'} (Permission denied); the checkpoint {out} "
            f"is complete and the work state of all 2 layers is kept in {work}: fix that and run the same command "
            f"again with --overwrite to write it without quantizing again\n"))
    assert (out / "model.safetensors").is_file() and (work / "state.json").is_file()


def test_the_writers_name_the_file_for_either_kind_of_error(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from jgptq_torch.pipeline.layer_files import write_layer
    from jgptq_torch.write_errors import WriteError, failure_message
    from tests.tiny_models import build

    layer = build("llama").model.layers[0]
    path = tmp_path / "offload-layer-00000.safetensors"
    full_disk_on(monkeypatch, safetensors.torch, "offload-layer", SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"))
    with pytest.raises(WriteError) as caught:
        write_layer(layer, path)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    assert str(caught.value) == f"could not write {path}: No space left on device"
    assert list(tmp_path.iterdir()) == []        # no temporary file left behind
    assert failure_message(caught.value, tmp_path / "none") == (
        f"no space left on device while writing {path}; no layer had finished, so there is no work state to keep: "
        f"free space and run the same command again")
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(
        SafetensorError("Error while serializing: header too large")))   # not an OS failure: left as it is
    with pytest.raises(SafetensorError, match="header too large"):
        write_layer(layer, path)
