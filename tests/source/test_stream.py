"""Streaming a model from its checkpoint folder: the skeleton on meta, each decoder layer read from the safetensors
shards (transformers' own conversions) when its turn comes. The streamed run must give exactly the records of the
run on the model loaded whole with ``from_pretrained``."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import jgptq
from jgptq_torch.source.checkpoint import CheckpointSource, SourceError
from jgptq_torch.source.stream import quantize_folder
from tests.tiny_models import build, token_ids

CALIB = token_ids(8, 32, seed=1)
OPTS = dict(bits=3, group_size=16, batch_size=4, progress=False)


def saved(tmp_path, family, layers=3, shard="100KB", **overrides):
    """A tiny model of ``family`` saved as a sharded safetensors folder; returns the folder."""
    folder = tmp_path / family
    build(family, num_hidden_layers=layers, **overrides).save_pretrained(folder, max_shard_size=shard)
    return folder


def assert_same_records(a, b):
    assert list(a.weights) == list(b.weights)
    for k, rec in a.weights.items():
        other = b.weights[k]
        for f in ("codes", "scales", "zeros", "g_idx"):
            assert np.array_equal(getattr(rec, f), getattr(other, f)), (k, f)
        assert (rec.method, rec.transposed, rec.act_order) == (other.method, other.transposed, other.act_order)
    assert [r.loss for r in a.report.records] == [r.loss for r in b.report.records]
    assert a.report.coverage == b.report.coverage


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_layers_read_from_the_folder_equal_from_pretrained(tmp_path, family):
    folder = saved(tmp_path, family)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    source = CheckpointSource(folder, dtype=torch.float32)
    skeleton = source.skeleton()
    assert all(t.device.type == "meta" for t in skeleton.parameters())
    for part in list(range(3)) + ["embedding", "outside"]:
        source.load(f"part {part}", part, "cpu")
    want = loaded.state_dict()
    got = skeleton.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for k, buf in loaded.named_buffers():        # non-persistent buffers too (rotary frequencies)
        assert torch.equal(dict(skeleton.named_buffers())[k], buf), k


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_streamed_run_gives_the_loaded_runs_records(tmp_path, family):
    folder = saved(tmp_path, family)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = jgptq.quantize_moe(loaded, CALIB, device="cpu", **OPTS)
    got = quantize_folder(folder, CALIB, device="cpu", **OPTS)
    assert_same_records(want, got)
    assert got.report.memory["offload"] == "stream"
    assert all(t.device.type == "meta" for t in got.model.parameters())   # everything released


def test_a_missing_layer_tensor_is_named(tmp_path):
    folder = saved(tmp_path, "qwen3_moe", layers=2, shard="10MB")
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    gone = "model.layers.1.self_attn.o_proj.weight"
    del tensors[gone]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SourceError, match=r"decoder layer 1 .*missing from the checkpoint.*o_proj"):
        quantize_folder(folder, CALIB, device="cpu", **OPTS)


def test_a_folder_without_weights_is_refused(tmp_path):
    build("qwen3_moe").config.save_pretrained(tmp_path)
    with pytest.raises(SourceError, match="no model.safetensors.index.json and no model.safetensors"):
        CheckpointSource(tmp_path)


def test_an_fp8_folder_streams_as_its_dequantized_weights(tmp_path):
    """FP8 block scales, 2 shards: a weight and its scales may sit in different files."""
    from tests.source.quantized_folders import read_checkpoint, write_fp8_folder

    folder = tmp_path / "fp8"
    write_fp8_folder(build("qwen3_moe", num_hidden_layers=2), str(folder), block=16, shards=2)
    assert any(t.dtype == torch.float8_e4m3fn for t in read_checkpoint(str(folder))[1].values())
    want = dequantized_reference(tmp_path, folder)
    got = quantize_folder(folder, CALIB, device="cpu", dtype=torch.float32, **OPTS)
    assert_same_records(want, got)


def test_host_memory_holds_a_layer_not_the_model(tmp_path):
    """A 12-layer folder and a 1-layer folder of the same width stream with the same most bytes of tensors
    materialized at once (counted after every read from the checkpoint, the export's reads of the embedding and
    head included): one decoder layer plus what lives outside the layers, far under the 12-layer model."""
    for result in assert_streams_one_layer(tmp_path, lambda layers: f"out{layers}",
                                           **dict(OPTS, bits=4, scale_dtype="float32", method="rtn")):
        assert result.report.memory["peak_host_parameters"] <= result.report.memory["streamed"]["peak_parameters"]


def assert_streams_one_layer(tmp_path, out, **options) -> list:
    """Streams a 1-layer and a 12-layer Qwen3-MoE folder of the same width through quantize_folder (output
    ``tmp_path / out(layers)``, ``options`` passed on) and asserts that both peak at the same most bytes of tensors
    materialized at once: one decoder layer plus what lives outside the layers, far under the 12-layer model, with
    every tensor read. Returns the two results."""
    peaks, results = {}, []
    for layers in (1, 12):
        folder = saved(tmp_path / str(layers), "qwen3_moe", layers=layers, shard="1MB")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        result = quantize_folder(folder, CALIB, tmp_path / out(layers), device="cpu", **options)
        streamed = result.report.memory["streamed"]
        peaks[layers] = streamed["peak_parameters"]
        assert streamed["bytes_read"] >= whole            # every layer read once, the embedding twice
        results.append(result)
    assert peaks[12] == peaks[1]
    assert peaks[12] < layer + (whole - 12 * layer) + 4096     # one layer, embeddings/norm/head, rotary buffers
    assert peaks[12] < whole / 6
    return results


def test_nan_in_a_streamed_layer_is_named_when_the_layer_is_read(tmp_path):
    from safetensors.torch import load_file, save_file

    from jgptq_torch.pipeline.weight_checks import CorruptWeightsError

    folder = saved(tmp_path, "qwen3_moe", layers=2, shard="10MB")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.experts.3.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CorruptWeightsError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj: expert 3 "
                                                  r"\(up rows\) holds 1 NaN value"):
        quantize_folder(folder, CALIB, device="cpu", **OPTS)


def dequantized_reference(tmp_path, quantized):
    """The run on the float model whose weights are the dequantized ones of the folder ``quantized``
    (dequantize_tensors on the whole checkpoint, saved as a float folder with the same config less its
    quantization_config, loaded with from_pretrained)."""
    from safetensors.torch import save_file

    from jgptq_torch.source import dequantize_tensors, source_format
    from tests.source.quantized_folders import read_checkpoint

    config, tensors = read_checkpoint(str(quantized))
    plain = dequantize_tensors(tensors, source_format(config), torch.float32)
    float_dir = tmp_path / "dequantized"
    float_dir.mkdir()
    config.pop("quantization_config")
    (float_dir / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in plain.items()}, float_dir / "model.safetensors",
              metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    return jgptq.quantize_moe(loaded, CALIB, device="cpu", **OPTS)


def test_an_mxfp4_folder_streams_as_its_dequantized_weights(tmp_path):
    from tests.source.quantized_folders import write_mxfp4_folder

    folder = tmp_path / "mxfp4"
    write_mxfp4_folder(build("gpt_oss", num_hidden_layers=2), str(folder), shards=2)
    want = dequantized_reference(tmp_path, folder)
    got = quantize_folder(folder, CALIB, device="cpu", dtype=torch.float32, **OPTS)
    assert_same_records(want, got)


def test_tensors_of_no_layer_are_said_and_left_out(tmp_path):
    """A release's extra layer (DeepSeek-V3's multi-token prediction layer is ``model.layers.61`` of a 61-layer
    model) belongs to no part: named in a warning, never read."""
    from safetensors.torch import load_file, save_file

    folder = saved(tmp_path, "qwen3_moe", layers=2, shard="10MB")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    source = CheckpointSource(folder, dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"1 checkpoint tensors belong to no part .*model\.layers\.2\.eh_proj"):
        source.skeleton()
    assert all("layers.2." not in k for part in (0, 1, "embedding", "outside") for k in source.part_of(part))


def test_a_layer_read_onto_cuda_gives_torch_s_cached_blocks_back(monkeypatch):
    # reading, dequantizing and fusing a layer caches about as much again as the layer in torch's allocator; on
    # CUDA that goes back to the device once the layer is in place (the solves' room), never on the CPU
    import types

    from jgptq_torch.source.stream import StreamedLayers

    loads, emptied = [], []
    layers = StreamedLayers.__new__(StreamedLayers)
    layers.prefix = "model.layers"
    layers.source = types.SimpleNamespace(load=lambda names, i, device: loads.append((i, str(device))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(len(loads)))
    layers.arrive(0, "cpu")
    layers.arrive(1, torch.device("cuda:0"))
    assert loads == [(0, "cpu"), (1, "cuda:0")] and emptied == [2]       # after the CUDA read, not before
