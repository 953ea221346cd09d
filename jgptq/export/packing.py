"""Dense little-endian bit packing of small unsigned integers into int32 words.

Along the packed axis, a line of ``n`` values of ``bits`` bits each becomes one bit stream: value ``i`` occupies
bits ``bits*i .. bits*i + bits - 1`` (least significant bit first), and word ``k`` of the line holds stream bits
``32k .. 32k + 31`` (bit 0 of the word = stream bit 32k). So every 32 values fill exactly ``bits`` words, values
may straddle two words (3, 5, 6, 7 bits), and a line takes ``ceil(n * bits / 32)`` words, the last one
zero-padded. For 1, 2, 4 and 8 bits this is the familiar "32 / bits values per word, first value in the low bits".
Both GPTQ checkpoints (``qweight`` along the input axis, ``qzeros`` along the output axis) and compressed-tensors
``pack-quantized`` (codes offset to unsigned) use this layout.

Example::

    >>> v = np.array([[1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]], np.uint8)
    >>> w = pack_int32(v, bits=3, axis=1)          # 33 bits -> 2 words
    >>> w.shape, w.dtype
    ((1, 2), dtype('int32'))
    >>> bool((unpack_int32(w, bits=3, length=11, axis=1) == v).all())
    True

Words are int32 (two's complement of the unsigned 32-bit word); the bytes are the same on every host.
"""

from __future__ import annotations

import numpy as np

# Rows packed per step, so the bit-level temporaries stay near this many bytes whatever the matrix size.
_CHUNK_BITS = 1 << 26
# Rows packed per step where bits divide 8 (no bit-level temporaries): this many input bytes, which keeps a step's
# few passes in cache.
_CHUNK_BYTES = 1 << 19


def packed_length(n: int, bits: int) -> int:
    """Words that hold ``n`` values of ``bits`` bits: ``ceil(n * bits / 32)``."""
    _check_bits(bits)
    return -(-n * bits // 32)


def pack_int32(values: np.ndarray, bits: int, axis: int = -1) -> np.ndarray:
    """Packs unsigned integers into int32 words along ``axis``.

    Args:
      values: integer array (..., n, ...) with every value in [0, 2**bits - 1].
      bits: 1..8.
      axis: the axis packed.
    Returns:
      int32 array, the same shape but ``ceil(n * bits / 32)`` along ``axis``.
    """
    _check_bits(bits)
    values = np.asarray(values)
    if values.dtype.kind not in "iub":
        raise ValueError(f"pack_int32: values must be integers, got {values.dtype}")
    if values.size and ((values.dtype.kind == "i" and values.min() < 0) or values.max() >= (1 << bits)):
        raise ValueError(f"pack_int32: values must lie in [0, {(1 << bits) - 1}] for {bits} bits, found "
                         f"[{values.min()}, {values.max()}]")
    moved = np.moveaxis(values, axis, -1)
    lead, n = moved.shape[:-1], moved.shape[-1]
    lines = moved.reshape(-1, n).astype(np.uint8, copy=False)
    words = packed_length(n, bits)
    out = np.empty((lines.shape[0], words), "<i4")                  # little-endian words on every host
    if 8 % bits == 0:
        step = max(1, _CHUNK_BYTES // max(1, n))
        for r0 in range(0, lines.shape[0], step):
            _pack_whole_bytes(lines[r0:r0 + step], bits, words, out[r0:r0 + step])
    else:
        step = max(1, _CHUNK_BITS // max(1, 8 * n * bits))
        for r0 in range(0, lines.shape[0], step):
            out[r0:r0 + step] = _pack_lines(lines[r0:r0 + step], bits, words)
    return np.moveaxis(out.astype(np.int32, copy=False).reshape(lead + (words,)), -1, axis)


def unpack_int32(words: np.ndarray, bits: int, length: int, axis: int = -1) -> np.ndarray:
    """Inverse of :func:`pack_int32`: the first ``length`` values of every packed line, as uint8.

    Args:
      words: int32 array (..., ceil(length * bits / 32), ...).
      bits: 1..8.
      length: values per line.
      axis: the packed axis.
    Returns:
      uint8 array, ``length`` along ``axis``.
    """
    _check_bits(bits)
    words = np.asarray(words)
    if words.dtype != np.int32:
        raise ValueError(f"unpack_int32: words must be int32, got {words.dtype}")
    moved = np.moveaxis(words, axis, -1)
    need = packed_length(length, bits)
    if moved.shape[-1] != need:
        raise ValueError(f"unpack_int32: {length} values of {bits} bits take {need} words, got {moved.shape[-1]}")
    lead = moved.shape[:-1]
    lines = moved.reshape(-1, need)
    out = np.empty((lines.shape[0], length), np.uint8)
    step = max(1, _CHUNK_BITS // max(1, 8 * length * bits))
    for r0 in range(0, lines.shape[0], step):
        out[r0:r0 + step] = _unpack_lines(lines[r0:r0 + step], bits, length)
    return np.moveaxis(out.reshape(lead + (length,)), -1, axis)


def _pack_lines(lines: np.ndarray, bits: int, words: int) -> np.ndarray:
    """uint8 (L, n) -> little-endian int32 (L, words), through a bit stream (any width)."""
    rows, n = lines.shape
    stream = np.unpackbits(lines[..., None], axis=-1, count=bits, bitorder="little")  # (L, n, bits)
    stream = stream.reshape(rows, n * bits)
    stream = np.pad(stream, ((0, 0), (0, 32 * words - n * bits)))
    packed = np.packbits(stream, axis=-1, bitorder="little")                            # (L, 4 * words)
    return np.ascontiguousarray(packed).view("<i4")


def _pack_whole_bytes(lines: np.ndarray, bits: int, words: int, out: np.ndarray) -> None:
    """:func:`_pack_lines` for widths that divide 8 (1, 2, 4, 8 bits), written into ``out`` (L, words) ``<i4``:
    no value straddles a byte, so the words' little-endian bytes are built directly. For 2 and 4 bits the
    ``per = 8 // bits`` values of a byte are read as one little-endian ``per``-byte integer ``x`` (value ``k`` at
    bit ``8k``) and ``x | x >> (8 - bits) | x >> 2 (8 - bits) | ...`` puts value ``k`` at bit ``bits * k`` of the
    low byte, which is cast into ``out``; the other values land above it or fall off (every value is below
    ``2**bits``). A few passes over the bytes, about 4 times faster than shifting values into uint32 words one at
    a time."""
    rows, n = lines.shape
    per = 32 // bits
    if n != words * per:
        lines = np.pad(lines, ((0, 0), (0, words * per - n)))
    lines = np.ascontiguousarray(lines)
    target = out.view(np.uint8)                                              # (L, 4 * words)
    if bits == 8:
        target[...] = lines
    elif bits == 1:
        target[...] = np.packbits(lines, axis=-1, bitorder="little")
    else:
        values = 8 // bits
        x = lines.view(f"<u{values}")                                       # (L, 4 * words)
        acc = x >> np.array(8 - bits, x.dtype)
        acc |= x
        for k in range(2, values):
            acc |= x >> np.array(k * (8 - bits), x.dtype)
        np.copyto(target, acc, casting="unsafe")                            # the low byte of each


def _unpack_lines(lines: np.ndarray, bits: int, length: int) -> np.ndarray:
    """int32 (L, words) -> uint8 (L, length)."""
    rows = lines.shape[0]
    raw = np.ascontiguousarray(lines.astype("<i4")).view(np.uint8)                     # (L, 4 * words)
    stream = np.unpackbits(raw, axis=-1, bitorder="little")[:, : length * bits]
    per_value = stream.reshape(rows, length, bits)
    return np.packbits(per_value, axis=-1, bitorder="little")[..., 0]


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"packing: bits={bits!r} must be an integer in 1..8")
