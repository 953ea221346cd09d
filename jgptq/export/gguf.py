"""GGUF files from numpy arrays: float tensors and GGML block payloads (numpy and the ``gguf`` package only).

A GGUF file is an architecture name, typed metadata and an ordered list of tensors. :func:`write_gguf` takes
exactly that and writes it atomically (a temporary file in the same folder, renamed once complete).

Tensors are :class:`GGUFTensor` entries:

- float data (any float dtype) written as ``"f32"``, ``"f16"`` or ``"bf16"``; numpy order (outer ... inner) is
  written reversed as ggml ``ne``, so an (out, in) matrix becomes ne = {in, out};
- GGML blocks: a uint8 payload (..., rows, cols // block_size, type_size), the layout of
  :class:`jgptq.export.GGMLWeight`, written with its GGML type (``"q4_k"``, ``"iq2_xxs"``, ...). A stack of
  experts (n_expert, rows, blocks, type_size) becomes ne = {cols, rows, n_expert}.

The data may be a loader (a function returning the array) with the tensor's shape declared: the header is written
from the declared shapes and each loader is called when its tensor's bytes are written, so a model larger than
memory in float32 is written one tensor at a time.

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
        (..., rows, cols // block_size, type_size). Or a function of no arguments returning that array, called
        when the tensor is written (one tensor in memory at a time); ``shape`` is then required.
      type: the GGML type to write (``"f32"``, ``"f16"``, ``"bf16"`` or a block format such as ``"q8_0"``).
      shape: the logical shape in numpy order (``ne`` reversed), e.g. (rows, cols) for blocks of rows of ``cols``
        values; taken from ``data`` when it is an array.
    """

    name: str
    data: Any
    type: str
    shape: tuple = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GGUF tensor name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "type", ggml_type(self.type).name.lower())
        if callable(self.data):
            if self.shape is None:
                raise ValueError(f"GGUF tensor {self.name}: a loader needs the tensor's shape")
            shape = tuple(int(n) for n in self.shape)
        else:
            object.__setattr__(self, "data", self._check(self.data))
            shape = self._logical(self.data.shape)
            if self.shape is not None and tuple(self.shape) != shape:
                raise ValueError(f"GGUF tensor {self.name}: data of shape {shape} given with shape {self.shape}")
        if not 1 <= len(shape) <= 4 or min(shape) < 1:
            raise ValueError(f"GGUF tensor {self.name}: shape {shape} must have 1 to 4 positive dimensions")
        if self.type not in FLOAT_TYPES and shape[-1] % self.block_size:
            raise ValueError(f"GGUF tensor {self.name}: rows of {shape[-1]} values are not a multiple of the "
                             f"{self.type} block ({self.block_size})")
        object.__setattr__(self, "shape", shape)

    @property
    def block_size(self) -> int:
        return gguf.GGML_QUANT_SIZES[ggml_type(self.type)][0]

    def _logical(self, data_shape) -> tuple:
        if self.type in FLOAT_TYPES:
            return tuple(data_shape)
        return tuple(data_shape[:-2]) + (data_shape[-2] * self.block_size,)

    def _check(self, data) -> np.ndarray:
        data = np.asarray(data)
        if self.type in FLOAT_TYPES:
            if data.dtype.kind != "f" and data.dtype.name != "bfloat16":
                raise ValueError(f"GGUF tensor {self.name}: type {self.type} needs float data, got {data.dtype}")
            return data
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type(self.type)]
        if data.dtype != np.uint8:
            raise ValueError(f"GGUF tensor {self.name}: type {self.type} needs uint8 block bytes, got {data.dtype}")
        if data.ndim < 3 or data.shape[-1] != type_size:
            raise ValueError(f"GGUF tensor {self.name}: {self.type} blocks must have shape "
                             f"(..., rows, cols/{block}, {type_size}), got {data.shape}")
        return data

    def array(self) -> np.ndarray:
        """The data (calling the loader), checked against ``type`` and ``shape``."""
        data = self._check(self.data() if callable(self.data) else self.data)
        if self._logical(data.shape) != self.shape:
            raise ValueError(f"GGUF tensor {self.name}: loaded data of shape {self._logical(data.shape)} differs "
                             f"from its declared shape {self.shape}")
        return data

    def nbytes(self) -> int:
        """Bytes the tensor takes in the file."""
        n = int(np.prod(self.shape))
        if self.type in FLOAT_TYPES:
            return n * (4 if self.type == "f32" else 2)
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type(self.type)]
        return n // block * type_size


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
               overwrite: bool = False, alignment: int | None = None, verify: bool = True) -> Path:
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
      verify: read the file back with the ``gguf`` package's reader before it takes ``path``'s place, and compare
        every tensor's name, type and bytes with what was given (a short or corrupt write raises; the file is
        not put in place).
    Returns:
      The path written.
    Raises:
      FileExistsError: ``path`` exists and ``overwrite`` is False. ValueError: a bad tensor or metadata value,
      a duplicate tensor name, or ``general.architecture`` in ``metadata`` that differs from ``arch``.
      OSError: the file read back does not hold the tensors given (``verify``).
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
            _add_info(writer, t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(_file_bytes(t))
        writer.close()
        if verify:
            _check_written(tmp, path, tensors)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would have made it (mkstemp makes 0600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _check_written(tmp: str, path: Path, tensors: list) -> None:
    """Raises OSError unless the file ``tmp`` (to become ``path``) holds every tensor with its type and bytes."""
    try:
        reader = gguf.GGUFReader(tmp)
        found = {t.name: t for t in reader.tensors}
    except Exception as exc:  # a short file, a header that does not parse
        raise OSError(f"{path}: the GGUF file written cannot be read back ({type(exc).__name__}: {exc}); "
                      f"nothing was put in place") from exc
    problems = []
    for t in tensors:
        got = found.get(t.name)
        if got is None:
            problems.append(f"{t.name} is missing")
            continue
        want_type = (gguf.GGMLQuantizationType.F32 if t.type == "f32" else gguf.GGMLQuantizationType.F16
                     if t.type == "f16" else ggml_type(t.type))
        want = _file_bytes(t).reshape(-1).view(np.uint8)
        data = np.asarray(got.data).reshape(-1).view(np.uint8)
        if got.tensor_type != want_type:
            problems.append(f"{t.name} has type {got.tensor_type.name}, not {want_type.name}")
        elif data.size != want.size or not np.array_equal(data, want):
            problems.append(f"{t.name} holds other bytes than were written")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise OSError(f"{path}: the GGUF file read back differs from what was written: {'; '.join(problems[:5])}"
                      f"{more}; nothing was put in place")


def _add_info(writer: gguf.GGUFWriter, t: GGUFTensor):
    if t.type in ("f32", "f16"):
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32 if t.type == "f32" else np.float16), t.nbytes())
    else:
        qtype = ggml_type(t.type)
        byte_shape = gguf.quant_shape_to_byte_shape(t.shape, qtype)
        writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes(), raw_dtype=qtype)


def _file_bytes(t: GGUFTensor) -> np.ndarray:
    """The tensor's bytes as the file holds them (float32/float16 arrays or uint8 rows)."""
    data = t.array()
    if t.type == "f32":
        return np.ascontiguousarray(data, dtype=np.float32)
    if t.type == "f16":
        data = np.asarray(data, dtype=np.float32)
        if np.any(np.abs(data[np.isfinite(data)]) > 65504.0):
            raise ValueError(f"GGUF tensor {t.name}: values beyond the float16 range; write it as f32")
        return np.ascontiguousarray(data.astype(np.float16))
    if t.type == "bf16":
        return gguf.quants.quantize(np.asarray(data, dtype=np.float32), gguf.GGMLQuantizationType.BF16)
    return np.ascontiguousarray(data.reshape(data.shape[:-2] + (-1,)))
