"""The shared safetensors writer: shard sizes, index, and all-or-nothing output."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from jgptq.export.shards import write_checkpoint


def arrays():
    rng = np.random.default_rng(0)
    return [(f"t{i}", rng.standard_normal((10, 10)).astype(np.float32)) for i in range(7)] + [
        ("big", np.zeros((30, 30), np.float32)), ("bf", np.ones((3, 5), ml_dtypes.bfloat16)),
        ("ids", np.arange(4, dtype=np.int64))]


def test_shards_index_and_contents(tmp_path):
    data = arrays()
    index = write_checkpoint(tmp_path / "m", iter(data), max_shard_bytes=1000,
                             json_files={"config.json": {"model_type": "llama"}})
    files = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert index == json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(a.nbytes for _, a in data)
    loaded = {}
    for f in files:
        part = load_file(str(tmp_path / "m" / f))
        size = sum(a.nbytes for a in part.values())
        assert size <= 1000 or len(part) == 1  # a tensor over the limit sits alone
        loaded.update(part)
    for name, a in data:
        assert index["weight_map"][name] in files
        assert loaded[name].dtype == a.dtype and np.array_equal(loaded[name], a)
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == {"model_type": "llama"}


def test_single_shard_is_model_safetensors(tmp_path):
    write_checkpoint(tmp_path / "m", [("a", np.zeros(3, np.float16))])
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["model.safetensors", "model.safetensors.index.json"]


def test_interrupted_export_leaves_nothing(tmp_path):
    def stream():
        yield from arrays()[:3]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path / "m", stream(), max_shard_bytes=500)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_the_old_folder(tmp_path):
    write_checkpoint(tmp_path / "m", [("old", np.ones(2, np.float32))])
    before = sorted(p.name for p in (tmp_path / "m").iterdir())

    def stream():
        yield "new", np.zeros(2, np.float32)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_checkpoint(tmp_path / "m", stream(), overwrite=True)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before
    assert np.array_equal(load_file(str(tmp_path / "m" / "model.safetensors"))["old"], np.ones(2, np.float32))
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


@pytest.mark.parametrize("tensors, kwargs, rule", [
    ([("a", np.zeros(1)), ("a", np.zeros(1))], {}, "written twice"),
    ([], {}, "at least one tensor"),
    ([("a", np.zeros(1))], {"max_shard_bytes": 0}, "max_shard_bytes"),
    ([("a", np.zeros(1))], {"extra_files": {"../x": b""}}, "plain name"),
    ([("a", np.zeros(1))], {"extra_files": {"model.safetensors": b""}}, "would replace"),
])
def test_bad_input(tmp_path, tensors, kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        write_checkpoint(tmp_path / "m", tensors, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_existing_paths(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        write_checkpoint(tmp_path / "file", [("a", np.zeros(1))])
    (tmp_path / "empty").mkdir()
    write_checkpoint(tmp_path / "empty", [("a", np.zeros(1))])  # an empty folder is filled
    assert (tmp_path / "empty" / "model.safetensors").exists()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_checkpoint(tmp_path / "empty", [("a", np.zeros(1))])
