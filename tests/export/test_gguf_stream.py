"""jgptq_torch.export.gguf.stream: the GGUF file written while quantize_moe runs is the file export_gguf writes afterwards."""

import copy
import threading

import pytest

import jgptq
from jgptq_torch.pipeline import layerwise
from jgptq_torch.export.gguf.export import export_gguf
from jgptq_torch.export.gguf.stream import GGUFSink
from jgptq.export import gguf as writer_module
from tests.export.gguf_models import tiny
from tests.tiny_models import token_ids

CALIB = token_ids(8, 32, seed=1)
OPTS = dict(batch_size=8, progress=False)


@pytest.mark.parametrize("family,fmt", [pytest.param("qwen3_moe", "q4_0", marks=pytest.mark.slow),
                                        ("mixtral", "q8_0")])
def test_streamed_file_is_the_exported_file(family, fmt, tmp_path):
    model = tiny(family)
    sink = GGUFSink(tmp_path / "streamed.gguf")
    result = jgptq.quantize_moe(model, CALIB, format=fmt, sink=sink, **OPTS)
    assert sink.written == tmp_path / "streamed.gguf"
    with pytest.raises(ValueError, match="this GGUFSink already took a run"):
        jgptq.quantize_moe(copy.deepcopy(model), CALIB, format=fmt, sink=sink, **OPTS)
    assert "export" in result.report.timings[model.config.num_hidden_layers - 1]
    edges = [r for r in result.report.records if r.layer == -1]
    assert {r.kind for r in edges} == {"token_embd", "output"}     # llama.cpp's types for the run, reported once
    after = export_gguf(model, result, tmp_path / "after.gguf")
    assert [r for r in result.report.records if r.layer == -1] == edges
    assert sink.written.read_bytes() == after.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after.gguf", "streamed.gguf"]


def test_a_layer_is_in_the_file_before_the_run_ends(tmp_path, monkeypatch):
    """The last layer waits until the first layer's tensors are written: only a writer that runs beside the
    layers lets it go on."""
    model = tiny("qwen3_moe")
    n = model.config.num_hidden_layers
    first_layer_written = threading.Event()
    write = writer_module.GGUFStream.write

    def watched_write(self, t):
        write(self, t)
        if t.name.startswith("blk.0.") and self.next_name is not None and not self.next_name.startswith("blk.0."):
            first_layer_written.set()

    step = layerwise._layer_step

    def waiting_step(run, i, *a, **kw):
        if i == n - 1:
            assert first_layer_written.wait(timeout=120), "layer 0 was not written while the run went on"
        return step(run, i, *a, **kw)

    monkeypatch.setattr(writer_module.GGUFStream, "write", watched_write)
    monkeypatch.setattr(layerwise, "_layer_step", waiting_step)
    sink = GGUFSink(tmp_path / "m.gguf")
    jgptq.quantize_moe(model, CALIB, format="q8_0", sink=sink, **OPTS)
    assert first_layer_written.is_set() and sink.written.exists()


def test_a_failed_run_leaves_no_file(tmp_path, monkeypatch):
    model = tiny("qwen3_moe")
    step = layerwise._layer_step

    def failing_step(run, i, *a, **kw):
        if i == 1:
            raise RuntimeError("stopped in layer 1")
        return step(run, i, *a, **kw)

    monkeypatch.setattr(layerwise, "_layer_step", failing_step)
    with pytest.raises(RuntimeError, match="stopped in layer 1"):
        jgptq.quantize_moe(copy.deepcopy(model), CALIB, format="q8_0", sink=GGUFSink(tmp_path / "m.gguf"), **OPTS)
    assert list(tmp_path.iterdir()) == []


def test_refusals(tmp_path):
    (tmp_path / "there.gguf").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="there.gguf exists; pass overwrite=True"):
        GGUFSink(tmp_path / "there.gguf")
    model = tiny("qwen3_moe")
    with pytest.raises(ValueError, match=r"GGUF export needs a GGML format, not 'int' \(integer grids\)"):
        jgptq.quantize_moe(model, CALIB, bits=4, group_size=64, sink=GGUFSink(tmp_path / "int.gguf"), **OPTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there.gguf"]


def test_edges_encoded_early_are_kept_only_when_the_run_chose_the_same(tmp_path, monkeypatch):
    from jgptq_torch.export.gguf import stream as gguf_stream

    encoded = []
    encode = gguf_stream.encode_edges

    def counting_encode(state, choices):
        encoded.append(sorted((p, c.format) for p, c in choices.items()))
        return encode(state, choices)

    monkeypatch.setattr(gguf_stream, "encode_edges", counting_encode)
    model = tiny("qwen3_moe")
    sink = GGUFSink(tmp_path / "kept.gguf")
    result = jgptq.quantize_moe(copy.deepcopy(model), CALIB, format="q8_0", sink=sink, **OPTS)
    assert encoded == [[("lm_head.weight", "q8_0"), ("model.embed_tokens.weight", "q8_0")], []]   # early, then none

    choose = gguf_stream.edge_choices
    calls = []

    def wrong_first_guess(result, plan, state, records, formats):
        calls.append(1)
        out = choose(result, plan, state, records, formats)
        return {p: c._replace(format="q4_0") for p, c in out.items()} if len(calls) == 1 else out

    monkeypatch.setattr(gguf_stream, "edge_choices", wrong_first_guess)
    encoded.clear()
    sink = GGUFSink(tmp_path / "again.gguf")
    again = jgptq.quantize_moe(copy.deepcopy(model), CALIB, format="q8_0", sink=sink, **OPTS)
    assert encoded == [[("lm_head.weight", "q4_0"), ("model.embed_tokens.weight", "q4_0")],
                       [("lm_head.weight", "q8_0"), ("model.embed_tokens.weight", "q8_0")]]
    assert sink.written.read_bytes() == (tmp_path / "kept.gguf").read_bytes()
    assert [r.format for r in again.report.records if r.layer == -1] == ["q8_0", "q8_0"]
    assert [r.format for r in result.report.records if r.layer == -1] == ["q8_0", "q8_0"]


def test_a_resumed_run_writes_the_restored_layers_too(tmp_path, monkeypatch):
    model = tiny("qwen3_moe")
    step = layerwise._layer_step
    work = tmp_path / "state"

    def failing_step(run, i, *a, **kw):
        if i == 1:
            raise RuntimeError("stopped in layer 1")
        return step(run, i, *a, **kw)

    monkeypatch.setattr(layerwise, "_layer_step", failing_step)
    first = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="stopped in layer 1"):
        jgptq.quantize_moe(first, CALIB, format="q8_0", checkpoint_dir=work, sink=GGUFSink(tmp_path / "m.gguf"),
                           **OPTS)
    assert not (tmp_path / "m.gguf").exists()
    ran = []

    def recording_step(run, i, *a, **kw):
        ran.append(i)
        return step(run, i, *a, **kw)

    monkeypatch.setattr(layerwise, "_layer_step", recording_step)
    sink = GGUFSink(tmp_path / "m.gguf")
    again = copy.deepcopy(model)                    # the model as loaded again for the second run
    result = jgptq.quantize_moe(again, CALIB, format="q8_0", checkpoint_dir=work, sink=sink, **OPTS)
    assert ran == list(range(1, model.config.num_hidden_layers))   # layer 0's records came from the saved state
    after = export_gguf(again, result, tmp_path / "after.gguf")
    assert sink.written.read_bytes() == after.read_bytes()
