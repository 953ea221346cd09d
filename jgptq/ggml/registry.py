"""Registry of GGML (llama.cpp) quantization formats, keyed by llama.cpp's lower-case type name.

A format is a block codec: weights are cut, along each row, into blocks of ``block_size`` values, and each block
becomes ``type_size`` bytes. Codec functions work on whole rows, vectorized over blocks and leading axes:

- ``encode(x, importance)``: ``x`` float32 ``(..., n)`` with ``n % block_size == 0``, ``importance`` float32 ``(n,)``
  or ``None`` -> payload uint8 ``(..., n // block_size * type_size)``.
- ``decode(payload)``: uint8 ``(..., nb * type_size)`` -> float32 ``(..., nb * block_size)``.

Block geometry comes from the ``gguf`` package (``GGML_QUANT_SIZES``), so it cannot drift from the file format.
Codec modules register their functions with :func:`register`; importing :mod:`jgptq.ggml` imports them all.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import gguf

EncodeFn = Callable[..., object]
DecodeFn = Callable[..., object]


@dataclasses.dataclass(frozen=True)
class GGMLFormat:
    """One GGML block format.

    Attributes:
      name: llama.cpp type name in lower case (``"q4_k"``, ``"iq2_xxs"``).
      type_id: the ``ggml_type`` enum value (= ``gguf.GGMLQuantizationType``).
      block_size: weights per block (QK: 32, 128 or 256).
      type_size: bytes per block.
      decode: payload -> float32 weights (see module docstring), or None if not implemented.
      encode: float32 weights (+ importance) -> payload, or None if not implemented.
      requires_importance: llama.cpp refuses to encode this type without an importance matrix.
    """

    name: str
    type_id: int
    block_size: int
    type_size: int
    decode: Optional[DecodeFn] = None
    encode: Optional[EncodeFn] = None
    requires_importance: bool = False

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    @property
    def qtype(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType(self.type_id)


_FORMATS: dict[str, GGMLFormat] = {}


def register(name: str, *, decode: Optional[DecodeFn] = None, encode: Optional[EncodeFn] = None,
             requires_importance: bool = False) -> GGMLFormat:
    """Registers (or completes) the codec functions of the format ``name``; geometry comes from ``gguf``."""
    key = name.lower()
    try:
        qtype = gguf.GGMLQuantizationType[key.upper()]
    except KeyError:
        raise ValueError(f"{name!r} is not a GGML type known to the gguf package") from None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    old = _FORMATS.get(key)
    fmt = GGMLFormat(
        name=key,
        type_id=int(qtype),
        block_size=block_size,
        type_size=type_size,
        decode=decode if decode is not None else (old.decode if old else None),
        encode=encode if encode is not None else (old.encode if old else None),
        requires_importance=requires_importance or (old.requires_importance if old else False),
    )
    _FORMATS[key] = fmt
    return fmt


def get_format(name: str) -> GGMLFormat:
    """Returns the registered format ``name`` (case-insensitive); a clear ValueError for an unknown one."""
    key = str(name).lower()
    if key not in _FORMATS:
        known = ", ".join(sorted(_FORMATS)) or "(none registered)"
        raise ValueError(f"unknown GGML format {name!r}; known formats: {known}")
    return _FORMATS[key]


def format_names() -> list[str]:
    """Names of every registered format, sorted."""
    return sorted(_FORMATS)
