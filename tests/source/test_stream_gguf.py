"""A streamed run writes its GGUF file layer by layer (StreamedGGUFSink): the file must be, byte for byte, the one
GGUFSink writes for the same run on the model loaded whole (from_pretrained); a run stopped after a layer and
started again writes the same bytes; the tensors materialized at once stay one layer plus the outside ones."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import jgptq
from jgptq_torch.export.gguf.stream import GGUFSink
from jgptq_torch.pipeline import resume
from jgptq_torch.source.stream import StreamedLayers, quantize_folder
from tests.cli.test_resume import Stop, stop_after
from tests.source.test_stream import CALIB, assert_streams_one_layer, saved

SLOW = pytest.mark.slow   # 20-60 s each on 2 cores

OPTS = dict(batch_size=4, progress=False)


def loaded_gguf(folder, out, fmt, run=None, **options):
    """The GGUF file of the run (``run``: more quantize_moe options) on the model loaded whole (from_pretrained),
    written by GGUFSink."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sink = GGUFSink(out, **options)
    jgptq.quantize_moe(model, CALIB, format=fmt, device="cpu", sink=sink, **(run or {}), **OPTS)
    return out.read_bytes()


@pytest.mark.parametrize("family,fmt,sizes,run,options", [
    ("qwen3_moe", "q8_0", {}, {}, {}),
    # kv_b's blocks split into attn_k_b / attn_v_b; a correction bias; a dense first layer
    pytest.param("deepseek_v3", "q4_0", {"kv_lora_rank": 32}, {}, {}, marks=SLOW),
    # kv_b left in float: its split read from the streamed layer's kept tensor
    pytest.param("deepseek_v3", "q8_0", {}, {"exclude": [r"kv_b_proj"]}, {}, marks=SLOW),
    ("gpt_oss", "q8_0", {}, {}, {"float_embeddings": True}),  # sinks, expert biases; embedding and head in f16
    # a llama.cpp mix (its own formats per tensor, the edges' types) with the float model's importance statistic
    pytest.param("qwen3_moe", "q4_k", {}, {"mix": "q4_k_m", "block_fallback": "llama.cpp", "imatrix_source": "float"},
                 {}, marks=SLOW),
])
def test_streamed_gguf_is_the_loaded_runs_file_byte_for_byte(tmp_path, family, fmt, sizes, run, options):
    folder = saved(tmp_path, family, **sizes)
    want = loaded_gguf(folder, tmp_path / "loaded.gguf", fmt, run, **options)
    result = quantize_folder(folder, CALIB, tmp_path / "streamed.gguf", export="gguf", device="cpu",
                             dtype=torch.float32, format=fmt, export_options=options, **run, **OPTS)
    assert (tmp_path / "streamed.gguf").read_bytes() == want
    assert result.weights == {}                       # written layer by layer, then released
    assert all(t.device.type == "meta" for t in result.model.parameters())
    if not options:
        assert {r.kind for r in result.report.records if r.layer == -1} == {"token_embd", "output"}


def test_an_fp8_folder_streams_to_the_gguf_of_its_dequantized_model(tmp_path):
    from jgptq_torch.source import dequantize_tensors, source_format
    from safetensors.torch import save_file
    from tests.source.quantized_folders import read_checkpoint, write_fp8_folder
    from tests.tiny_models import build

    folder = tmp_path / "fp8"
    write_fp8_folder(build("qwen3_moe", num_hidden_layers=2), str(folder), block=16, shards=2)
    config, tensors = read_checkpoint(str(folder))
    plain = tmp_path / "dequantized"
    plain.mkdir()
    floats = dequantize_tensors(tensors, source_format(config), torch.float32)
    config.pop("quantization_config")
    (plain / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in floats.items()}, plain / "model.safetensors", metadata={"format": "pt"})
    name = {"name": "fp8"}                            # general.name: the folder names differ
    want = loaded_gguf(plain, tmp_path / "loaded.gguf", "q8_0", **name)
    quantize_folder(folder, CALIB, tmp_path / "streamed.gguf", export="gguf", device="cpu", dtype=torch.float32,
                    format="q8_0", export_options=name, **OPTS)
    assert (tmp_path / "streamed.gguf").read_bytes() == want


def test_a_stopped_streamed_gguf_run_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    folder = saved(tmp_path, "qwen3_moe")
    run = dict(export="gguf", device="cpu", dtype=torch.float32, format="q8_0", **OPTS)
    quantize_folder(folder, CALIB, tmp_path / "whole.gguf", checkpoint_dir=tmp_path / "state-whole", **run)
    state = tmp_path / "state"
    original = stop_after(monkeypatch, 1)
    with pytest.raises(Stop):
        quantize_folder(folder, CALIB, tmp_path / "out.gguf", checkpoint_dir=state, **run)
    assert not (tmp_path / "out.gguf").exists()          # an unfinished file is never put in place
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.gguf")]
    monkeypatch.setattr(resume.Checkpoint, "save_layer", original)
    restored = []
    real = resume.restore_layer
    monkeypatch.setattr(resume, "restore_layer", lambda ckpt, i, *a: (restored.append(i), real(ckpt, i, *a))[1])
    arrived = []
    arrive = StreamedLayers.arrive
    monkeypatch.setattr(StreamedLayers, "arrive", lambda self, i, device: (arrived.append(i), arrive(self, i, device)))
    quantize_folder(folder, CALIB, tmp_path / "out.gguf", checkpoint_dir=state, **run)
    assert restored == [0, 1]
    assert arrived == [0, 1, 2]      # the restored layers' float tensors read when the run starts, before layer 2
    assert (tmp_path / "out.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()


def test_a_streamed_gguf_run_holds_a_layer_not_the_model(tmp_path):
    """A 12-layer and a 1-layer folder of the same width write their GGUF files with the same most bytes of
    tensors materialized at once: one decoder layer plus what lives outside the layers (read at the end for the
    embedding and head), far under the 12-layer model."""
    assert_streams_one_layer(tmp_path, lambda layers: f"out{layers}.gguf", export="gguf", dtype=torch.float32,
                             format="q8_0", method="rtn", **OPTS)
