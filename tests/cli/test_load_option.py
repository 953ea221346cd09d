"""``jgptq quantize --load``: the default streams the model folder and writes the same folder, byte for byte, as
loading the whole model first (``--load all``); runs that need the whole model say so or are refused."""

import gguf
import pytest

from jgptq_torch.cli.main import main
from jgptq_torch.pipeline import layerwise
from tests.cli.test_cli import model_dir, quantize_args, tree  # noqa: F401 - model_dir is a fixture


@pytest.fixture
def sources(monkeypatch):
    """Whether each quantize_moe call of the test streamed (got a ``source``), in order."""
    streamed = []
    original = layerwise.quantize_moe

    def recording(*args, source=None, **kwargs):
        streamed.append(source is not None)
        return original(*args, source=source, **kwargs)

    monkeypatch.setattr(layerwise, "quantize_moe", recording)
    return streamed


def test_streamed_and_loaded_runs_write_the_same_folder(model_dir, tmp_path, sources):  # noqa: F811
    extra = ("--method", "rtn", "--export", "gptq")
    assert main([str(a) for a in quantize_args(model_dir, tmp_path / "s", *extra)]) == 0
    assert main([str(a) for a in quantize_args(model_dir, tmp_path / "a", *extra, "--load", "all")]) == 0
    assert sources == [True, False]
    assert tree(tmp_path / "s") == tree(tmp_path / "a")


def test_a_gguf_export_streams_and_writes_the_loaded_runs_file(model_dir, tmp_path, sources,  # noqa: F811
                                                               capsys):
    extra = ("--export", "gguf", "--format", "q8_0")
    assert main([str(a) for a in quantize_args(model_dir, tmp_path / "s.gguf", *extra)]) == 0
    assert "needs the whole model" not in capsys.readouterr().err
    assert main([str(a) for a in quantize_args(model_dir, tmp_path / "a.gguf", *extra, "--load", "all")]) == 0
    assert main([str(a) for a in quantize_args(model_dir, tmp_path / "f.gguf", *extra, "--float-embeddings")]) == 0
    assert sources == [True, False, True]
    assert (tmp_path / "s.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "f.gguf")).tensors}
    assert types["token_embd.weight"] == "F16" and types["blk.0.attn_q.weight"] == "Q8_0"   # the option reached it


def test_a_run_that_needs_the_whole_model_refuses_load_stream(model_dir, tmp_path, capsys):  # noqa: F811
    args = quantize_args(model_dir, tmp_path / "g", "--export", "gguf", "--format", "q4_k", "--target-bpw", "4.5",
                         "--load", "stream")
    assert main([str(a) for a in args]) == 1
    assert ("--load stream cannot serve --target-bpw/--target-size, which needs the whole model"
            in capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []
