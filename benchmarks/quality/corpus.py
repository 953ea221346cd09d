"""The benchmark's text: Python's own documentation prose (``pydoc_data.topics``), as bytes.

Every CPython installation carries ``pydoc_data.topics.topics``, a dict of about 80 help topics (~465 KB of English
prose and code examples, the text ``help("assert")`` prints). The corpus is the topics in sorted key order joined by
blank lines, UTF-8 encoded: one deterministic byte string per Python version (its SHA-256 is recorded with every
result, since the text changes between Python releases).

The byte string is cut into consecutive pieces of ``piece`` bytes; piece ``i`` goes to the calibration split when
``i % 10 == 3``, to the held-out split when ``i % 10 == 7`` and to training otherwise. Splits are disjoint byte
ranges that together cover the corpus, so no byte of held-out text is ever trained or calibrated on, and each split
mixes pieces from the whole alphabet of topics.

Tokens are the bytes themselves (ids 0..255): no tokenizer file exists or is needed.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

VOCAB = 256
SPLITS = ("train", "calib", "heldout")


def corpus_bytes() -> bytes:
    """The whole corpus: ``pydoc_data.topics`` in sorted key order joined by ``"\\n\\n"``, UTF-8."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def corpus_digest(data: bytes) -> str:
    """The SHA-256 of the corpus (hex), recorded so that results from different Python versions are told apart."""
    return hashlib.sha256(data).hexdigest()


class Split(NamedTuple):
    """Byte ranges ``[(start, end), ...]`` of each split and the bytes they hold (uint8, concatenated)."""

    ranges: dict
    tokens: dict


def split_of_piece(i: int) -> str:
    """The split piece ``i`` belongs to."""
    return {3: "calib", 7: "heldout"}.get(i % 10, "train")


def split(data: bytes, piece: int = 8192) -> Split:
    """Cuts ``data`` into pieces of ``piece`` bytes (the last may be shorter) and assigns them to the splits.

    Returns:
      ranges[name]: list of (start, end) byte offsets into ``data``, in order;
      tokens[name]: uint8 array of the split's bytes, the pieces concatenated in order.
    """
    if not isinstance(piece, int) or piece < 1:
        raise ValueError(f"piece: {piece!r} must be a positive number of bytes")
    if len(data) < 10 * piece:
        raise ValueError(f"corpus of {len(data)} bytes is too short for pieces of {piece} bytes (needs 10 pieces)")
    ranges = {name: [] for name in SPLITS}
    for i, start in enumerate(range(0, len(data), piece)):
        ranges[split_of_piece(i)].append((start, min(start + piece, len(data))))
    buf = np.frombuffer(data, dtype=np.uint8)
    tokens = {name: np.concatenate([buf[a:b] for a, b in r]) for name, r in ranges.items()}
    return Split(ranges, tokens)


def windows(tokens: np.ndarray, length: int, limit: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows of ``length`` tokens: int64 (n, length); a short tail is dropped.

    On a split's tokens, a window never spans two pieces when the piece size is a multiple of ``length`` and the
    split's pieces are whole (the defaults: pieces of 8192 bytes, windows of 256; only the corpus's last piece is
    shorter, and it falls in the training split).
    """
    if length < 2:
        raise ValueError(f"length: {length} must be at least 2 tokens")
    n = len(tokens) // length
    if limit is not None:
        n = min(n, int(limit))
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens hold no window of {length}")
    return np.asarray(tokens[: n * length], dtype=np.int64).reshape(n, length)
