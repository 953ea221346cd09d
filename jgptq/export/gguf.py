"""GGUF files from numpy arrays: float tensors and GGML block payloads (numpy and the ``gguf`` package only).

A GGUF file is an architecture name, typed metadata and an ordered list of tensors. :func:`write_gguf` takes
exactly that and writes it atomically (a temporary file in the same folder, renamed once complete).

Tensors are :class:`GGUFTensor` entries:

- float data (any float dtype) written as ``"f32"``, ``"f16"`` or ``"bf16"``; numpy order (outer ... inner) is
  written reversed as ggml ``ne``, so an (out, in) matrix becomes ne = {in, out};
- GGML blocks: a uint8 payload (..., rows, cols // block_size, type_size), the layout of
  :class:`jgptq.export.GGMLWeight`, written with its GGML type (``"q4_k"``, ``"iq2_xxs"``, ...). A stack of
  experts (n_expert, rows, blocks, type_size) becomes ne = {cols, rows, n_expert}.

Example::

    from jgptq.export.gguf import GGUFTensor, write_gguf

    write_gguf("tiny.gguf", "llama", {"llama.block_count": 2, ...},
               [GGUFTensor("token_embd.weight", embed, "f16"),
                GGUFTensor("blk.0.attn_q.weight", record.payload, record.format), ...])
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import gguf
import numpy as np

FLOAT_TYPES = ("f32", "f16", "bf16")


def ggml_type(name: str) -> gguf.GGMLQuantizationType:
    """The :class:`gguf.GGMLQuantizationType` of a type name (``"f16"``, ``"q4_k"``, case-insensitive)."""
    try:
        return gguf.GGMLQuantizationType[str(name).upper()]
    except KeyError:
        raise ValueError(f"unknown GGML type {name!r}; known: "
                         f"{sorted(t.name.lower() for t in gguf.GGMLQuantizationType)}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
      name: the GGUF tensor name (``"blk.0.attn_q.weight"``).
      data: float array in numpy order, for ``type`` ``"f32"``/``"f16"``/``"bf16"``; otherwise uint8 GGML blocks
        (..., rows, cols // block_size, type_size).
      type: the GGML type to write (``"f32"``, ``"f16"``, ``"bf16"`` or a block format such as ``"q8_0"``).
    """

    name: str
    data: np.ndarray
    type: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GGUF tensor name must be a non-empty string, got {self.name!r}")
        qtype = ggml_type(self.type)
        object.__setattr__(self, "type", qtype.name.lower())
        data = np.asarray(self.data)
        if self.type in FLOAT_TYPES:
            if data.dtype.kind != "f" and data.dtype.name != "bfloat16":
                raise ValueError(f"GGUF tensor {self.name}: type {self.type} needs float data, got {data.dtype}")
            if data.ndim < 1:
                raise ValueError(f"GGUF tensor {self.name}: a scalar is not a tensor")
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if data.dtype != np.uint8:
                raise ValueError(f"GGUF tensor {self.name}: type {self.type} needs uint8 block bytes, got {data.dtype}")
            if data.ndim < 3 or data.shape[-1] != type_size:
                raise ValueError(f"GGUF tensor {self.name}: {self.type} blocks must have shape "
                                 f"(..., rows, cols/{block}, {type_size}), got {data.shape}")
            if data.ndim > 5:
                raise ValueError(f"GGUF tensor {self.name}: at most 4 dimensions, got {data.ndim - 1}")
        if (data.ndim if self.type in FLOAT_TYPES else data.ndim - 1) > 4:
            raise ValueError(f"GGUF tensor {self.name}: at most 4 dimensions, got shape {data.shape}")
        object.__setattr__(self, "data", data)

    @property
    def shape(self) -> tuple:
        """The logical shape in numpy order (``ne`` reversed)."""
        if self.type in FLOAT_TYPES:
            return tuple(self.data.shape)
        block, _ = gguf.GGML_QUANT_SIZES[ggml_type(self.type)]
        return tuple(self.data.shape[:-2]) + (self.data.shape[-2] * block,)

    def nbytes(self) -> int:
        """Bytes the tensor takes in the file."""
        if self.type in FLOAT_TYPES:
            return int(np.prod(self.shape)) * (4 if self.type == "f32" else 2)
        return int(self.data.nbytes)


def _value_type(key: str, value) -> tuple:
    """(GGUFValueType, sub type or None) of a metadata value (bool, int >= 0, float, str, or a list of one)."""
    v = gguf.GGUFValueType
    if isinstance(value, (bool, np.bool_)):
        return v.BOOL, None
    if isinstance(value, (int, np.integer)):
        if value < 0:
            raise ValueError(f"GGUF metadata {key}: negative integer {value} needs an explicit type "
                             f"(pass (value, gguf.GGUFValueType.INT32))")
        return v.UINT32, None
    if isinstance(value, (float, np.floating)):
        return v.FLOAT32, None
    if isinstance(value, str):
        return v.STRING, None
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"GGUF metadata {key}: an empty list needs an explicit type")
        kinds = {type(x) for x in value}
        if kinds <= {str}:
            return v.ARRAY, v.STRING
        if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in value):
            return v.ARRAY, v.INT32
        if all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) for x in value):
            return v.ARRAY, v.FLOAT32
        raise ValueError(f"GGUF metadata {key}: a list must hold only strings, only integers or only numbers")
    raise ValueError(f"GGUF metadata {key}: unsupported value {value!r} of type {type(value).__name__}")


def write_gguf(path, arch: str, metadata: Mapping[str, Any], tensors: Iterable[GGUFTensor], *,
               overwrite: bool = False, alignment: int | None = None) -> Path:
    """Writes a GGUF v3 file, atomically.

    Args:
      path: the file to write.
      arch: ``general.architecture`` (``"llama"``, ``"qwen3moe"``, ...).
      metadata: key -> value, in the order to write. A value is a bool, an int >= 0 (UINT32), a float (FLOAT32),
        a str, a list of str / int (INT32) / float (FLOAT32), or a ``(value, gguf.GGUFValueType)`` pair for any
        other type (``(value, GGUFValueType.ARRAY, sub_type)`` for arrays). ``general.architecture`` is written
        from ``arch``.
      tensors: :class:`GGUFTensor` entries in file order (names unique).
      overwrite: replace an existing file.
      alignment: ``general.alignment`` (default 32).
    Returns:
      The path written.
    Raises:
      FileExistsError: ``path`` exists and ``overwrite`` is False. ValueError: a bad tensor or metadata value,
      a duplicate tensor name, or ``general.architecture`` in ``metadata`` that differs from ``arch``.
    """
    path = Path(os.fspath(path))
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    if path.exists() and path.is_dir():
        raise IsADirectoryError(f"{path} is a folder, not a GGUF file path")
    tensors = list(tensors)
    seen = set()
    for t in tensors:
        if not isinstance(t, GGUFTensor):
            raise ValueError(f"write_gguf: tensors must be GGUFTensor entries, got {type(t).__name__}")
        if t.name in seen:
            raise ValueError(f"write_gguf: tensor name {t.name!r} appears twice")
        seen.add(t.name)
    metadata = dict(metadata)
    given_arch = metadata.pop(gguf.Keys.General.ARCHITECTURE, arch)
    if given_arch != arch:
        raise ValueError(f"write_gguf: metadata general.architecture {given_arch!r} differs from arch {arch!r}")
    typed = []
    for key, value in metadata.items():
        if isinstance(value, tuple) and len(value) in (2, 3) and isinstance(value[1], gguf.GGUFValueType):
            typed.append((key, value[0], value[1], value[2] if len(value) == 3 else None))
        else:
            vtype, sub = _value_type(key, value)
            typed.append((key, list(value) if sub is not None else value, vtype, sub))

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        if alignment is not None:
            writer.add_custom_alignment(int(alignment))
        for key, value, vtype, sub in typed:
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for t in tensors:
            _add_tensor(writer, t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _add_tensor(writer: gguf.GGUFWriter, t: GGUFTensor):
    if t.type == "f32":
        writer.add_tensor(t.name, np.ascontiguousarray(t.data, dtype=np.float32))
    elif t.type == "f16":
        data = np.asarray(t.data, dtype=np.float32)
        if np.any(np.abs(data[np.isfinite(data)]) > 65504.0):
            raise ValueError(f"GGUF tensor {t.name}: values beyond the float16 range; write it as f32")
        writer.add_tensor(t.name, np.ascontiguousarray(data.astype(np.float16)))
    elif t.type == "bf16":
        raw = gguf.quants.quantize(np.asarray(t.data, dtype=np.float32), gguf.GGMLQuantizationType.BF16)
        writer.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.BF16)  # byte shape -> logical shape
    else:
        raw = np.ascontiguousarray(t.data.reshape(t.data.shape[:-2] + (-1,)))
        writer.add_tensor(t.name, raw, raw_dtype=ggml_type(t.type))  # byte shape -> logical shape
