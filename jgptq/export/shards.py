"""Sharded safetensors checkpoints, written all at once or not at all.

:func:`write_checkpoint` streams named numpy arrays into ``model-0000k-of-0000n.safetensors`` files of at most
``max_shard_bytes`` each (a larger tensor gets a file of its own), writes ``model.safetensors.index.json``
(``metadata.total_size`` = the tensors' bytes, ``weight_map`` = tensor -> file) and any JSON or extra files, all in
a temporary folder beside the output, which is renamed into place only when everything is written. An error or
an interruption leaves the output path as it was. An existing non-empty output folder is refused unless
``overwrite=True``; it is then replaced as a whole, never merged with.

A checkpoint with one shard names it ``model.safetensors`` (the index is written all the same).

Example::

    write_checkpoint("out", [("a.weight", np.zeros((4, 4), np.float16))],
                     json_files={"config.json": {"model_type": "llama"}}, max_shard_bytes=2 << 30)
"""

from __future__ import annotations

from jgptq.surface import option

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Mapping, Optional

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1000**3


def check_output_dir(out_dir, overwrite: bool) -> Path:
    """The output path, after refusing a file or a non-empty folder that ``overwrite`` does not allow replacing."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"output path {str(out)!r} exists and is not a folder")
        if any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"output folder {str(out)!r} exists and is not empty; pass "
                                  f"{option('overwrite')} to replace it (it is replaced whole, only once the new checkpoint is complete)")
    return out


def write_checkpoint(out_dir, tensors: Iterable[tuple[str, np.ndarray]], *,
                     json_files: Optional[Mapping[str, object]] = None,
                     extra_files: Optional[Mapping[str, object]] = None,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                     metadata: Optional[Mapping[str, str]] = None) -> dict:
    """Writes a safetensors checkpoint folder atomically.

    Args:
      out_dir: the folder to create (its parent must exist or is created).
      tensors: (name, numpy array) pairs, consumed once, in order; names must be unique. Any numpy dtype that
        safetensors stores (bool, integers, float16/32/64, ml_dtypes bfloat16).
      json_files: file name -> JSON-serializable object (``config.json``, ``quantize_config.json``, ...). A
        callable value is called after every tensor was written (so it can report what the tensors held).
      extra_files: file name -> bytes or str (written as is) or a path to copy (tokenizer files, ...).
      max_shard_bytes: most tensor bytes per shard file.
      overwrite: replace an existing non-empty folder.
      metadata: string metadata stored in every shard header (``{"format": "pt"}`` is always added, as the
        transformers loader requires).
    Returns:
      The index dict written to ``model.safetensors.index.json``.
    """
    from safetensors.numpy import save_file

    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} must be a positive integer")
    out = check_output_dir(out_dir, overwrite).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    header = {"format": "pt", **dict(metadata or {})}
    try:
        shards: list[list[str]] = []
        weight_map: dict[str, int] = {}
        total = 0
        pending: dict[str, np.ndarray] = {}
        pending_bytes = 0

        def flush():
            nonlocal pending, pending_bytes
            if pending:
                save_file(pending, str(tmp / f"shard-{len(shards):05d}.tmp"), metadata=header)
                shards.append(list(pending))
                pending, pending_bytes = {}, 0

        for name, array in tensors:
            if not isinstance(name, str) or not name:
                raise ValueError(f"tensor name {name!r} must be a non-empty string")
            if name in weight_map or name in pending:
                raise ValueError(f"tensor {name!r} is written twice")
            array = np.ascontiguousarray(array)
            if array.dtype == object:
                raise ValueError(f"tensor {name!r}: dtype object cannot be stored")
            if pending and pending_bytes + array.nbytes > max_shard_bytes:
                flush()
            pending[name] = array
            pending_bytes += array.nbytes
            weight_map[name] = len(shards)
            total += array.nbytes
        flush()
        if not shards:
            raise ValueError("a checkpoint needs at least one tensor")

        n = len(shards)
        files = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for k, final in enumerate(files):
            os.replace(tmp / f"shard-{k:05d}.tmp", tmp / final)
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: files[k] for name, k in sorted(weight_map.items())}}
        _write_json(tmp / INDEX_NAME, index)
        for fname, obj in (json_files or {}).items():
            _write_json(tmp / _plain_name(fname), obj() if callable(obj) else obj)
        for fname, content in (extra_files or {}).items():
            target = tmp / _plain_name(fname)
            if target.exists():
                raise ValueError(f"extra file {fname!r} would replace a file the exporter writes")
            if isinstance(content, bytes):
                target.write_bytes(content)
            elif isinstance(content, str):
                target.write_text(content)
            elif isinstance(content, os.PathLike):
                shutil.copyfile(content, target)
            else:
                raise ValueError(f"extra file {fname!r}: content must be bytes, str or a path")
        _move_into_place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Renames the finished folder to ``out``; an old ``out`` is moved aside first and removed after."""
    check_output_dir(out, overwrite)  # the folder may have appeared while we wrote
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _plain_name(fname: str) -> str:
    if not fname or os.path.basename(fname) != fname or fname.startswith("."):
        raise ValueError(f"file name {fname!r} must be a plain name inside the output folder")
    return fname


def _write_json(path: Path, obj) -> None:
    if path.exists():
        raise ValueError(f"{path.name} is written twice")
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
