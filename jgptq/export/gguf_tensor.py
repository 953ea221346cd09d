"""What goes into a GGUF file: :class:`GGUFTensor` entries (float data or GGML block payloads, or loaders of
them), their bytes as the file holds them (:func:`file_bytes`), and typed metadata (:func:`typed_metadata`).
:mod:`jgptq.export.gguf` writes them."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

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


def typed_metadata(arch: str, metadata: Mapping[str, Any]) -> list:
    """[(key, value, GGUFValueType, sub type)] of ``metadata`` (checked), ``general.architecture`` left out."""
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
    return typed


def file_bytes(t: GGUFTensor) -> np.ndarray:
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
