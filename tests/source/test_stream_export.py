"""A streamed run writes its checkpoint folder layer by layer (CheckpointSink): the folder must be, byte for byte,
what export_model writes for the same run on the model loaded whole; a run stopped after a layer and started
again writes the same bytes."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import jgptq
from jgptq.export import pool
from jgptq_torch.export.checkpoint import export_model
from jgptq_torch.pipeline import resume
from jgptq_torch.source.stream import quantize_folder
from tests.source.test_stream import CALIB, saved
from tests.cli.test_resume import Stop, stop_after

OPTS = dict(bits=4, group_size=16, batch_size=4, progress=False, scale_dtype="float16")
SHARD = 50_000    # bytes: several output shards


def files_of(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def loaded_export(folder, kind, out, **options):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    result = jgptq.quantize_moe(model, CALIB, device="cpu", **OPTS)
    export_model(model, result, kind, out, source_dir=folder, max_shard_bytes=SHARD, **options)
    return files_of(out)


@pytest.mark.parametrize("family,kind", [("qwen3_moe", "compressed-tensors"), ("mixtral", "gptq")])
def test_streamed_folder_is_the_loaded_export_byte_for_byte(tmp_path, monkeypatch, family, kind):
    folder = saved(tmp_path, family)
    want = loaded_export(folder, kind, tmp_path / "loaded", workers=1)      # records packed one at a time
    monkeypatch.setattr(pool, "default_workers", lambda: 3)                # the streamed writer: on 3 threads
    result = quantize_folder(folder, CALIB, tmp_path / "streamed", export=kind, device="cpu",
                             max_shard_bytes=SHARD, **OPTS)
    got = files_of(tmp_path / "streamed")
    assert sorted(got) == sorted(want)
    assert sum(n.endswith(".safetensors") for n in got) > 1
    for name in want:
        assert got[name] == want[name], name
    assert result.weights == {}          # written layer by layer, then released


def test_a_stopped_streamed_run_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    folder = saved(tmp_path, "qwen3_moe")
    state = tmp_path / "state"
    whole = files_of_run(folder, tmp_path / "whole", tmp_path / "state-whole")
    original = stop_after(monkeypatch, 1)
    with pytest.raises(Stop):
        quantize_folder(folder, CALIB, tmp_path / "out", device="cpu", checkpoint_dir=state,
                        max_shard_bytes=SHARD, **OPTS)
    assert not (tmp_path / "out").exists()          # an unfinished folder is never put in place
    monkeypatch.setattr(resume.Checkpoint, "save_layer", original)
    loaded = []
    real = resume.restore_layer
    monkeypatch.setattr(resume, "restore_layer", lambda ckpt, i, *a: (loaded.append(i), real(ckpt, i, *a))[1])
    quantize_folder(folder, CALIB, tmp_path / "out", device="cpu", checkpoint_dir=state, max_shard_bytes=SHARD,
                    **OPTS)
    assert loaded == [0, 1]
    assert files_of(tmp_path / "out") == whole


def test_a_non_empty_output_is_refused_before_any_layer_is_read(tmp_path, monkeypatch):
    from jgptq_torch.source import stream

    folder, out = saved(tmp_path, "qwen3_moe"), tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    read = []
    real = stream.StreamedLayers.arrive
    monkeypatch.setattr(stream.StreamedLayers, "arrive", lambda self, *a, **k: (read.append(a), real(self, *a, **k))[1])
    with pytest.raises(FileExistsError, match="not empty; pass overwrite=True"):
        quantize_folder(folder, CALIB, out, device="cpu", **OPTS)
    assert read == [] and files_of(out) == {"keep.txt": b"mine"}


def files_of_run(folder, out, state):
    quantize_folder(folder, CALIB, out, device="cpu", checkpoint_dir=state, max_shard_bytes=SHARD, **OPTS)
    return files_of(out)
